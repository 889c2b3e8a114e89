"""Step time with MLflow tracking on and off, and through an outage (prints JSON lines).

Every configuration runs `unmask train` on the same shards, logging every step, and reads
``train/step_time`` from the run's metrics.jsonl (the median over the steps after the
first ``--warmup``):

- off: ``logging.mlflow false`` (metrics.jsonl only), the baseline;
- sqlite: the default store in the run directory;
- server: a real ``mlflow server`` on 127.0.0.1;
- outage: the same server, stopped once the run has taken its first step; only the steps
  logged after it is down count (its shutdown takes CPU from the run).

Also the cost the loop would pay per step if it logged synchronously (one ``log_batch``
round trip to the server) next to what it pays now (putting the record on the queue).

With ``--system-metrics``: only the cost of MLflow's system metrics (``logging.system_metrics_interval``):
off, then the server without them, with them at the default 10 s, and at 1 s (10x as often).
The other configurations run without them.

    .venv/bin/unmask prep --input ../shared/data/corpora/tinyshakespeare/input.txt \
        --out /tmp/ts --seq-len 64 --vocab-size 384
    .venv/bin/python bench/tracking_overhead.py --data /tmp/ts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.mlflow_server import free_port, running_mlflow_server  # noqa: E402

CALLS = 200  # per-call timing of the logging calls themselves


def _config(args: argparse.Namespace, root: Path, mlflow: bool, interval: float = 0.0) -> Path:
    config = {"model": {"preset": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 2},
              "train": {"max_steps": args.steps, "global_batch_size": 8, "micro_batch_size": 8},
              "optim": {"lr": 1.0e-3, "warmup_steps": 2}, "eval": {"every": 0, "batches": 1},
              "checkpoint": {"every": 10**6}, "data": {"num_workers": 0},
              "logging": {"every": 1, "progress": False, "mlflow": mlflow, "system_metrics_interval": interval}}
    path = root / f"config-{mlflow}-{interval}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _command(args: argparse.Namespace, config: Path, run_dir: Path, uri: str | None) -> list[str]:
    command = [sys.executable, "-m", "orchestration.cli", "train", "--config", str(config), "--data", args.data,
               "--run-dir", str(run_dir)]
    return command + (["--mlflow-uri", uri] if uri else [])


def _step_times(run_dir: Path, after: int) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/step_time"] for r in records if "train/step_time" in r and r["step"] > after]


def _step_of(line: str) -> int | None:
    marker = "unmask.train: step "
    if marker not in line or "/" not in line.split(marker, 1)[1].split()[0]:
        return None
    return int(line.split(marker, 1)[1].split("/", 1)[0])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run(args: argparse.Namespace, root: Path, name: str, uri: str | None, *, stop_server=None,
        interval: float = 0.0) -> dict:
    run_dir = root / name
    config = _config(args, root, mlflow=name != "off", interval=interval)
    process = subprocess.Popen(_command(args, config, run_dir, uri), cwd=REPO, env=_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, stopped, down_at = [], threading.Event(), args.warmup
    for line in process.stdout:
        output.append(line)
        step = _step_of(line)
        if stop_server is not None and step == 1:
            threading.Thread(target=lambda stop=stop_server: (stop(), stopped.set()), daemon=True).start()
            stop_server = None
        if stopped.is_set() and step is not None and down_at == args.warmup:
            down_at = max(step, args.warmup)
    if process.wait() != 0:
        raise RuntimeError(f"{name} failed:\n{''.join(output[-30:])}")
    times = _step_times(run_dir, down_at)
    return {"config": name, "steps": len(times), "median_step_s": statistics.median(times),
            "mean_step_s": statistics.fmean(times)}


def logging_call_cost(uri: str, root: Path) -> dict:
    """Seconds per call: a synchronous log_batch round trip vs putting a record on the queue."""
    from pipeline.tracking.background import BackgroundTracker
    from pipeline.tracking.tracker import Tracker

    tracker = Tracker.open(root / "calls", tracking_uri=uri, experiment="bench-calls")
    metrics = {f"train/m{i}": float(i) for i in range(9)}  # what the loop logs per step
    start = time.perf_counter()
    for step in range(CALLS):
        tracker.log_metrics(metrics, step)
    synchronous = (time.perf_counter() - start) / CALLS
    background = BackgroundTracker(tracker)
    start = time.perf_counter()
    for step in range(CALLS, 2 * CALLS):
        background.log_metrics(metrics, step)
    queued = (time.perf_counter() - start) / CALLS
    background.close("FINISHED")
    return {"config": "logging call", "synchronous_s": synchronous, "queued_s": queued}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="shards from `unmask prep`")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--system-metrics", action="store_true", help="only the cost of MLflow's system metrics")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.system_metrics:
            _print(system_metrics_runs(args, root))
            return
        results = [run(args, root, "off", None), run(args, root, "sqlite", None)]
        with running_mlflow_server(root / "server") as uri:
            results.append(run(args, root, "server", uri))
            results.append(logging_call_cost(uri, root))
        server_root, port = root / "outage-server", free_port()
        server = running_mlflow_server(server_root, port)
        uri = server.__enter__()
        results.append(run(args, root, "outage", uri, stop_server=lambda: server.__exit__(None, None, None)))
    _print(results)


def system_metrics_runs(args: argparse.Namespace, root: Path) -> list[dict]:
    """Off, then the server without system metrics, with them every 10 s and every 1 s; then
    the monitor's own CPU time per sample."""
    results = [run(args, root, "off", None)]
    with running_mlflow_server(root / "mlflow-server") as uri:
        for name, interval in (("server", 0.0), ("server+system-10s", 10.0), ("server+system-1s", 1.0)):
            results.append(run(args, root, name, uri, interval=interval))
        results.append(monitor_cpu_cost(uri, root))
    return results


def monitor_cpu_cost(uri: str, root: Path, seconds: float = 20.0, interval: float = 0.2) -> dict:
    """CPU seconds the monitor's thread takes per sample (psutil, NVML, the run's status, the
    batch sent), measured in a process that does nothing else: what it takes from the loop's
    cores, whatever else the machine runs. At the default 10 s interval, the share of one core
    is this over 10."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.system_metrics import SystemMetrics
    from pipeline.tracking.tracker import Tracker

    tracker = Tracker.open(root / "monitor", tracking_uri=uri, experiment="bench-system-metrics")
    idle = time.process_time()
    threading.Event().wait(1.0)
    idle = time.process_time() - idle  # this process's own background CPU in 1 s, without the monitor
    metrics = SystemMetrics.start(uri, tracker.run_id, interval)
    start = time.process_time()
    threading.Event().wait(seconds)
    metrics.stop()
    cpu = time.process_time() - start - idle * seconds
    samples = len(MlflowClient(uri).get_metric_history(tracker.run_id, "system/cpu_utilization_percentage"))
    tracker.finish()
    return {"config": "monitor alone", "samples": samples, "cpu_s_per_sample": cpu / samples,
            "core_share_at_10s": cpu / samples / 10.0}


def _print(results: list[dict]) -> None:
    base = results[0]["median_step_s"]
    for result in results:
        if "median_step_s" in result:
            result["vs_off"] = result["median_step_s"] / base
        print(json.dumps(result))


if __name__ == "__main__":
    main()
