"""Adapting an autoregressive source into a diffusion run (``pipeline.training.adaptation``):
the adapted network, at the start of its annealing, computes the source's next-token logits
(transformers' own, within 1e-5 in float32) for MDLM and block diffusion; its new rows are
recorded; the objective anneals before ``anneal_steps`` and never after; bad configs get one line."""

from __future__ import annotations

import dataclasses
import math
import signal

import pytest
import torch

from common.errors import UserError
from model.absorbing import AbsorbingDiffusion
from model.annealing import AttentionAnnealing
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig, preset
from pipeline.config import AdaptSection, Config, ModelSection
from pipeline.run_dir.checkpoint import read_state, resolve_checkpoint
from pipeline.training.adaptation import MASK_INIT, check_not_adapting
from pipeline.training.init_from import InitFrom, adapted_source, load_source, read_source, source_network
from pipeline.training.objective import DiffusionObjective, MicroBatchSlot
from tests.support.causal_lm_fixtures import VOCAB_SIZE, hf_logits, write_causal_lm
from tests.support.paths import needs_shared
from tests.support.train_helpers import MICRO_RUN, run_train, run_until_stall, write_config

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_shared("corpora/tinyshakespeare/input.txt")]

LENGTH = 8
START_OF_ANNEALING = AttentionAnnealing(0.0, seed=0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {family: write_causal_lm(root / family, family, seed=5) for family in ("gpt2", "llama")}


def _config(block_size=None, **adapt) -> Config:
    return Config(model=ModelSection(block_size=block_size, vocab_multiple=64), adapt=AdaptSection(**adapt))


def _adapted(directory, config: Config, max_seq_len: int = LENGTH):
    source = read_source(InitFrom(directory))
    run = dataclasses.replace(preset("tiny", VOCAB_SIZE), max_seq_len=max_seq_len, vocab_multiple=64)
    network = source_network(run, source.record, config)
    adapted = adapted_source(source, network, config)
    model = Transformer(network).eval()
    load_source(model, adapted, network)
    return model, adapted, source


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_the_adapted_network_starts_as_its_source(sources, family, block_size):
    """Clean input, attention not yet opened: each position's logits are the source's next-token
    logits there (the shift and the start row: x_0 is predicted from BOS alone)."""
    model, _, source = _adapted(sources[family], _config(block_size))
    x = torch.randint(0, VOCAB_SIZE, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    bos = source.record.start_token
    theirs = hf_logits(sources[family], torch.cat([torch.full((2, 1), bos), x], dim=1))[:, :LENGTH]
    with torch.no_grad():
        clean = {} if block_size is None else {"clean": x, "block_size": block_size}
        ours = model(x, annealing=START_OF_ANNEALING, **clean)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        # Opened, the network is bidirectional: no longer the source's.
        assert not torch.allclose(model(x, **clean), theirs, atol=1e-3)


def test_the_new_rows_and_the_record(sources):
    model, adapted, source = _adapted(sources["gpt2"], _config(4, anneal_steps=100), max_seq_len=64)
    embed = adapted.tensors["embed.weight"]
    token_rows = source.tensors["embed.weight"][:VOCAB_SIZE]
    torch.testing.assert_close(embed[VOCAB_SIZE], token_rows.mean(0))                  # the mask: the mean row
    torch.testing.assert_close(embed[VOCAB_SIZE + 1], token_rows[source.record.start_token])  # the start: BOS's
    table = adapted.tensors["positions.weight"]
    assert table.shape[0] == 65 and torch.equal(table[64], table[63])                   # 64 + the start row
    assert adapted.record.adaptation == {
        "target": "BD3 (block size 4)", "shift": True, "anneal_steps": 100, "mask_id": VOCAB_SIZE,
        "mask_init": MASK_INIT, "start": f"the embedding of token {source.record.start_token} (row {VOCAB_SIZE + 1})",
        "positions": [64, 65]}
    assert model.config.shift and not model.config.causal and not model.config.time_conditioning
    assert source.record.kind == "hf" and source.record.family == "gpt2"


def test_unshifted_adaptation(sources):
    model, adapted, _ = _adapted(sources["gpt2"], _config(shift=False))
    assert not model.config.shift and adapted.tensors["embed.weight"].shape[0] == VOCAB_SIZE + 1
    assert adapted.record.adaptation["start"] == "none: unshifted"


@pytest.mark.parametrize(("model", "message"), [
    (ModelSection(process="uniform"), "config field model.process = 'uniform': an autoregressive model"),
    (ModelSection(time_conditioning=True), "config field model.time_conditioning = true: an adapted model"),
    (ModelSection(d_model=64), "config field model.d_model = 64: the run takes its network from"),
    (ModelSection(document_mask=True), "config field model.document_mask = true: an adapted model"),
])
def test_configs_an_adaptation_cannot_run_are_refused(sources, model, message):
    source = read_source(InitFrom(sources["gpt2"]))
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
        source_network(preset("tiny", VOCAB_SIZE), source.record, Config(model=model))


def test_an_adapt_section_without_an_autoregressive_source_is_refused():
    check_not_adapting(AdaptSection())
    with pytest.raises(UserError, match="^config section adapt: .* starts from none"):
        check_not_adapting(AdaptSection(anneal_steps=10))


def test_the_objective_anneals_before_anneal_steps_only():
    """Step 0 trains the causal network; from anneal_steps on, the bidirectional one; between, neither."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=16)
    network = Transformer(config).double().eval()
    causal = Transformer(dataclasses.replace(config, causal=True)).double().eval()
    causal.load_state_dict(network.state_dict())
    plain = DiffusionObjective(AbsorbingDiffusion(make_schedule("linear"), 11))
    annealed = dataclasses.replace(plain, anneal_steps=10)
    x = torch.randint(0, 11, (4, 16), generator=torch.Generator().manual_seed(1))

    def bound(objective, model, step):
        return objective.nelbo(model, x, MicroBatchSlot(seed=7, step=step, rank=0, world_size=1, micro=0,
                                                        micro_batches=1))

    with torch.no_grad():
        torch.testing.assert_close(bound(annealed, network, 0), bound(plain, causal, 0), rtol=0, atol=1e-10)
        torch.testing.assert_close(bound(annealed, network, 10), bound(plain, network, 10), rtol=0, atol=0)
        middle = bound(annealed, network, 5)
        assert not torch.allclose(middle, bound(plain, network, 5)) and not torch.allclose(middle,
                                                                                            bound(plain, causal, 5))


# ------------------------------------------------------------------ training, from an unmask autoregressive run
ADAPT_RUN = {"model": {"block_size": 8}, "adapt": {"anneal_steps": 4}, "train": {"zero_stage": 1}}


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory, tinyshakespeare_shards):
    """A finished 2-step run of the causal baseline (unmask's own autoregressive network)."""
    root = tmp_path_factory.mktemp("ar")
    config = write_config(root / "ar.yaml", {**MICRO_RUN, "model": {"objective": "autoregressive"}})
    return run_train(root / "run", tinyshakespeare_shards, config).run_dir


@pytest.fixture(scope="module")
def adapted_run(tmp_path_factory, tinyshakespeare_shards, ar_run):
    """That run adapted to block diffusion (blocks of 8), its attention opening over 4 of its 6 steps."""
    root = tmp_path_factory.mktemp("adapted")
    config = write_config(root / "adapt.yaml", ADAPT_RUN)
    return run_train(root / "run", tinyshakespeare_shards, config, extra=["--init-from", str(ar_run)])


def _deterministic(run) -> dict[tuple[int, str], float]:
    return {(record["step"], key): value for record in run.metrics() for key, value in record.items()
            if key.startswith(("train/loss", "train/attention_opened", "val/"))}


@pytest.mark.slow
def test_an_autoregressive_run_adapts_and_records_it(adapted_run, ar_run):
    opened = {m["step"]: m["train/attention_opened"] for m in adapted_run.metrics() if "train/attention_opened" in m}
    assert opened == {1: 0.25, 2: 0.5, 3: 0.75, 4: 1.0, 5: 1.0, 6: 1.0}
    assert all(math.isfinite(v) for v in adapted_run.losses().values())
    meta = read_state(resolve_checkpoint(adapted_run.run_dir))
    record = meta.init_from
    assert record["kind"] == "run" and record["network"]["causal"]
    assert record["adaptation"]["target"] == "BD3 (block size 8)" and record["adaptation"]["anneal_steps"] == 4
    assert meta.network["shift"] and not meta.network["causal"]


@pytest.mark.slow
def test_an_adapted_run_resumes_mid_annealing_bit_equal(tmp_path, tinyshakespeare_shards, ar_run, adapted_run):
    """Killed after step 5 (checkpoint at step 3, the attention a quarter shut), resumed: every loss
    and validation equal to the uninterrupted run's."""
    config = write_config(tmp_path / "adapt.yaml", ADAPT_RUN)
    run_dir = tmp_path / "run"
    killed = run_until_stall(run_dir, tinyshakespeare_shards, config, stall_after=5, stop=signal.SIGKILL,
                             extra=["--init-from", str(ar_run)])
    assert killed.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000003"
    resumed = run_train(run_dir, tinyshakespeare_shards, config, extra=["--init-from", str(ar_run)])
    assert "resumed from" in resumed.output
    assert _deterministic(resumed) == _deterministic(adapted_run)  # equal floats, not close


@pytest.mark.parametrize(("anneal_steps", "masked"), [(0, False), (10, True)])
def test_annealing_asks_for_an_attention_kernel_that_takes_a_mask(monkeypatch, anneal_steps, masked):
    """Annealed steps pass SDPA a boolean mask: the run's kernel must take one (flash on GPU does not)."""
    from pipeline.training import engine

    asked = {}

    def resolve(setting, device, dtype, head_dim, **options):
        asked.update(options)
        return "math"

    monkeypatch.setattr(engine, "resolve_attention", resolve)
    network = dataclasses.replace(preset("tiny", VOCAB_SIZE), max_seq_len=LENGTH, shift=True)
    engine.plan_training(_config(anneal_steps=anneal_steps), network, 1, torch.device("cpu"))
    assert asked["masked"] is masked
