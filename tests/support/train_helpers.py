"""Helpers for training tests: real shards of tinyshakespeare and real training processes.

Training runs in subprocesses exactly as users start it (``tests.support.cli_runner``): ``python -m
orchestration.cli train`` for one process, ``torch.distributed.run`` (torchrun) for two,
rendezvousing on 127.0.0.1.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.cli_runner import run_unmask, start_unmask
from tests.support.paths import TINY, require_shared
from tests.support.stall import ANNOUNCEMENT

# A run longer than this is stuck: fail instead of hanging the suite.
RUN_TIMEOUT_S = 300

# A network small enough that a step takes well under a second on two cores.
MICRO_CONFIG = {
    "model": {"preset": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 2},
    "train": {"max_steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "ema_decay": 0.9},
    "optim": {"lr": 1.0e-3, "warmup_steps": 2},
    "eval": {"every": 3, "batches": 2},
    "checkpoint": {"every": 3, "keep_last": 2},
    "logging": {"every": 1, "progress": False},
    "data": {"num_workers": 0},
}


# MICRO_CONFIG cut to 2 steps, each checkpointed: a finished run to copy (conftest's micro_run).
MICRO_RUN = {"train": {"max_steps": 2}, "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 1}}


def make_tinyshakespeare_shards(root: Path, seq_len: int = 64, vocab_size: int = 384,
                           max_bytes: int | None = 400_000) -> Path:
    """Tokenizer + shards of (the start of) tinyshakespeare, made by the real prep."""
    require_shared(TINY)
    from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs
    from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
    from data_prep.write_shards import PrepConfig, write_shards

    text = TINY.read_text(encoding="utf-8")
    source = root / "input.txt"
    source.write_text(text[:max_bytes] if max_bytes else text, encoding="utf-8")
    options = ReadOptions()
    documents = (piece.text for unit in plan_units(resolve_inputs([str(source)]), options)
                 for piece in read_unit(unit, options, ReadCounters()))
    tokenizer = train_sentencepiece(documents, root / "tokenizer", vocab_size)
    out = root / "shards"
    write_shards(PrepConfig(inputs=(str(source),), seq_len=seq_len, val_fraction=0.1, read=options), tokenizer, out,
                 workers=1, progress=False)
    return out


def checkpoint_meta(config: dict, **network: int):
    """A ``CheckpointMeta`` of ``config`` (``Config.to_dict()``) on a small network of 37 tokens
    (``network`` overrides its fields), for tests of what a resume accepts."""
    from dataclasses import asdict

    from model.transformer import TransformerConfig
    from pipeline.run_dir.checkpoint import CheckpointMeta, TrainState

    shape = TransformerConfig(**{"vocab_size": 37, "n_layers": 1, "d_model": 32, "n_heads": 4, "max_seq_len": 64,
                                 **network})
    return CheckpointMeta(state=TrainState(), config=config, config_sha256="c", data_sha256="d", tokenizer_sha256="t",
                          network=asdict(shape), zero_stage=1, precision="fp32", batch_plan={}, world_size=1)


def write_config(path: Path, overrides: dict | None = None) -> Path:
    config = json.loads(json.dumps(MICRO_CONFIG))
    for section, values in (overrides or {}).items():
        config.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Run:
    returncode: int
    output: str
    run_dir: Path

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def losses(self) -> dict[int, float]:
        """Training loss per step (a resumed step's last record wins)."""
        return {m["step"]: m["train/loss"] for m in self.metrics() if "train/loss" in m}

    def validations(self) -> dict[int, float]:
        return {m["step"]: m["val/nelbo_per_token"] for m in self.metrics() if "val/nelbo_per_token" in m}


def run_train(run_dir: Path, data: Path, config: Path, *, world_size: int = 1, extra: list[str] = (),
              env: dict[str, str] | None = None, check: bool = True, log_batches: bool = False,
              command: tuple[str, ...] = ("train",)) -> Run:
    """Train to completion in a subprocess; with ``log_batches`` every micro-batch's sequences
    are logged in the run directory (``tests.support.batch_log``). ``command``: the subcommand
    and its positional arguments (``("distill", TEACHER)``)."""
    args = ["--config", str(config), "--data", str(data), "--run-dir", str(run_dir), *extra]
    proc = run_unmask([*command, *args], world_size=world_size, env=env, timeout=RUN_TIMEOUT_S,
                      log_batches=log_batches)
    run = Run(proc.returncode, proc.stdout + proc.stderr, run_dir)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{run.output[-4000:]}")
    return run


def _signal_tree(pid: int, stop: signal.Signals) -> None:
    """Signal a process and all its descendants (torchrun starts each worker in its own
    session, so a process-group signal would miss them)."""
    import psutil

    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.send_signal(stop)
        except psutil.NoSuchProcess:
            pass


def run_until_stall(run_dir: Path, data: Path, config: Path, stall_after: int, *, world_size: int = 1,
                    stop: signal.Signals = signal.SIGKILL, extra: list[str] = (),
                    env: dict[str, str] | None = None, command: tuple[str, ...] = ("train",)) -> Run:
    """Train until the stall hook fires after ``stall_after`` steps, then send ``stop`` to the
    whole process group (SIGKILL: a crash; SIGTERM: a preemption) and wait for the end (``env``:
    ``tests.support.stall.IN_WRITE_ENV`` stalls in the write of checkpoint ``stall_after`` instead)."""
    args = ["--config", str(config), "--data", str(data), "--run-dir", str(run_dir), *extra]
    proc = start_unmask([*command, *args], world_size=world_size, stall_after=stall_after, start_new_session=True,
                        env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if ANNOUNCEMENT in line:
                _signal_tree(proc.pid, stop)
                break
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        lines.append(rest or "")
    finally:
        if proc.poll() is None:
            _signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()
    output = "".join(lines)
    if ANNOUNCEMENT not in output:
        raise AssertionError(f"the run never reached step {stall_after}:\n{output[-4000:]}")
    return Run(proc.returncode, output, run_dir)
