"""`unmask import mdlm`: MDLM's checkpoints, in both its layouts, become exports whose logits are
MDLM's DiT's (held against the independent reference of ``tests.support.mdlm_reference``), and nothing
a ``.ckpt`` pickles runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import UserError
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.report.write import MISSING
from model.spec import build_process
from pipeline.interchange.export import load_export
from pipeline.interchange.mdlm_import import import_mdlm
from tests.support.cli_runner import unmask_in_process
from tests.support.mdlm_reference import (
    DiTShape,
    mdlm_config,
    random_weights,
    reference_log_probs,
    reference_logits,
    sigma_of,
    write_hugging_face,
    write_lightning,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE = 300
TOLERANCE = 1e-5  # float32 logits of O(10): the two computations differ in rounding only
TIMES = torch.tensor([0.02, 0.5, 0.97])
LENGTH = 24


def _lines() -> list[str]:
    animals = ["cat", "dog", "fox", "owl"]
    return [f"the {animals[i % 4]} sat on mat {i} at {i * 7 % 60} past {i % 13}" for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mdlm-tokenizer")
    assert train_sentencepiece(_lines(), root / "tok", vocab_size=VOCAB_SIZE).vocab_size == VOCAB_SIZE
    return root / "tok"


def _tokens(shape: DiTShape) -> torch.Tensor:
    """Clean tokens and masks (id V), a third of them masked."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, shape.vocab_size, (len(TIMES), LENGTH), generator=g)
    return torch.where(torch.rand(tokens.shape, generator=g) < 1 / 3, shape.vocab_size, tokens)


def _assert_mdlm_logits(export_dir: Path, weights: dict, shape: DiTShape) -> None:
    """The export's logits and SUBS log-probabilities are the reference DiT's, at every position."""
    exported = load_export(export_dir)
    z = _tokens(shape)
    with torch.no_grad():
        ours = exported.network(z, TIMES)
        expected = reference_logits(weights, shape, z, sigma_of(TIMES))
        expected_log_probs = reference_log_probs(weights, shape, z, sigma_of(TIMES))
    v = shape.vocab_size
    assert ours.shape == (len(TIMES), LENGTH, v)
    torch.testing.assert_close(ours, expected[..., :v], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(ours.log_softmax(-1), expected_log_probs[..., :v], rtol=0, atol=TOLERANCE)
    assert bool((expected_log_probs[..., v] < -1e5).all()), "the reference never predicts the mask"


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_the_hugging_face_directory_imports_with_mdlm_s_logits(tokenizer_dir, tmp_path, time_conditioning):
    shape = DiTShape(VOCAB_SIZE, time_conditioning=time_conditioning)
    weights = random_weights(shape, seed=1)
    out = import_mdlm(write_hugging_face(tmp_path / "mdlm-owt", weights, shape), tokenizer_dir, tmp_path / "export")
    _assert_mdlm_logits(out, weights, shape)
    exported = load_export(out)
    assert (exported.spec.schedule, exported.spec.schedule_args) == ("loglinear", {"eps": 1e-3})
    assert exported.network.time_independent is not time_conditioning
    assert exported.config["weights"] == "published"
    if time_conditioning:  # the times matter, through sigma(t)
        z = _tokens(shape)
        with torch.no_grad():
            assert float((exported.network(z, TIMES) - exported.network(z, TIMES.flip(0))).abs().max()) > 1e-3


def test_the_lightning_checkpoint_imports_its_ema_by_default_and_its_live_weights_on_request(
        tokenizer_dir, tmp_path):
    shape = DiTShape(VOCAB_SIZE)
    ema, live = random_weights(shape, seed=2), random_weights(shape, seed=3)
    marker = tmp_path / "pwned"
    checkpoint = write_lightning(tmp_path / "mdlm.ckpt", live, ema, shape, marker)

    out = import_mdlm(checkpoint, tokenizer_dir, tmp_path / "ema")
    _assert_mdlm_logits(out, ema, shape)
    config = load_export(out).config
    assert (config["weights"], config["ema_decay"], config["step"]) == ("ema", 0.9999, 1234)

    _assert_mdlm_logits(import_mdlm(checkpoint, tokenizer_dir, tmp_path / "live", weights="model"), live, shape)
    assert not marker.exists(), "a payload in the checkpoint ran"


def test_unmask_import_then_sample_and_eval_work_on_the_export(tokenizer_dir, tmp_path, capsys):
    shape = DiTShape(VOCAB_SIZE)
    marker = tmp_path / "pwned"
    weights = random_weights(shape, seed=4)
    checkpoint = write_lightning(tmp_path / "mdlm.ckpt", weights, weights, shape, marker)
    out = tmp_path / "export"
    assert unmask_in_process(["import", "mdlm", str(checkpoint), "--tokenizer", str(tokenizer_dir),
                              "--out", str(out)]) == 0
    assert not marker.exists(), "a payload in the checkpoint ran"
    assert unmask_in_process(["sample", str(out), "--num", "1", "--steps", "8", "--seq-len", "16"]) == 0
    assert "----- sample 1 " in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(_lines()[:20]))
    assert unmask_in_process(["eval", str(out), "--datasets", str(text), "--samples", "2", "--batch-size", "4",
                              "--seq-len", "16", "--out", str(tmp_path / "report")]) == 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert results["model"]["weights"] == "ema"
    exported = load_export(out)  # the bound of the imported model, as the process computes it
    x = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bound = build_process(exported.spec).nelbo(exported.network, x, generator=torch.Generator().manual_seed(1))
    assert bool(torch.isfinite(bound).all())


def test_the_report_of_a_published_model_names_its_weights_and_no_step(tokenizer_dir, tmp_path):
    shape = DiTShape(VOCAB_SIZE)
    source = write_hugging_face(tmp_path / "mdlm-owt", random_weights(shape, seed=8), shape)
    out = import_mdlm(source, tokenizer_dir, tmp_path / "export")
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(_lines()[:10]))
    assert unmask_in_process(["eval", str(out), "--datasets", str(text), "--samples", "2", "--seq-len", "16",
                              "--out", str(tmp_path / "report")]) == 0
    model = json.loads((tmp_path / "report" / "results.json").read_text())["model"]
    assert (model["weights"], model["step"]) == ("published", None)
    assert "Hugging Face directory" in model["weights_note"]
    assert f"at step {MISSING}" in (tmp_path / "report" / "report.md").read_text()


# ----------------------------------------------------------------------------- refusals
def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def _add_tensor(name: str, *shape: int):
    return lambda directory: _edit_weights(directory, lambda tensors: tensors.update({name: torch.zeros(shape)}))


REFUSALS = {
    "unknown tensor": (_add_tensor("backbone.blocks.0.attn_qkv.bias", 3),
                       r"unknown tensor backbone\.blocks\.0\.attn_qkv\.bias: not part of MDLM's DiT"),
    "outside the backbone": (_add_tensor("lm_head.weight", 3),
                             r"unknown tensor 'lm_head\.weight'"),
    "missing tensor": (lambda d: _edit_weights(d, lambda t: t.pop("backbone.output_layer.linear.bias")),
                       r"missing tensor backbone\.output_layer\.linear\.bias"),
    "shape": (_add_tensor("backbone.blocks.1.attn_out.weight", 64, 32),
              r"backbone\.blocks\.1\.attn_out\.weight has shape \(64, 32\), expected \(64, 64\)"),
    "declared width": (lambda d: _edit_config(d, hidden_dim=128),
                       r"hidden_dim is 128, but backbone\.vocab_embed\.embedding has size 64"),
    "heads": (lambda d: _edit_config(d, n_heads=8),
              r"backbone\.rotary_emb\.inv_freq is not the rotary frequencies of base 10000 for heads of 8"),
    "model type": (lambda d: _edit_config(d, model_type="bert"), r"model_type is 'bert', not 'mdlm'"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_does_not_fit_is_refused_naming_it(tokenizer_dir, tmp_path, case):
    shape = DiTShape(VOCAB_SIZE)
    source = write_hugging_face(tmp_path / "mdlm", random_weights(shape, seed=5), shape)
    edit, message = REFUSALS[case]
    edit(source)
    with pytest.raises(UserError, match=message):
        import_mdlm(source, tokenizer_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    other = tmp_path / "other-tok"
    train_sentencepiece(_lines(), other, vocab_size=VOCAB_SIZE - 10)
    shape = DiTShape(VOCAB_SIZE)
    source = write_hugging_face(tmp_path / "mdlm", random_weights(shape, seed=5), shape)
    with pytest.raises(UserError, match=r"backbone\.vocab_embed\.embedding has 301 rows, a vocabulary of 300 tokens "
                                        r"plus the mask, but the tokenizer has 290 tokens"):
        import_mdlm(source, other, tmp_path / "export")


def test_checkpoint_refusals_say_what_to_do(tokenizer_dir, tmp_path):
    shape = DiTShape(VOCAB_SIZE)
    weights = random_weights(shape, seed=6)
    no_ema = write_lightning(tmp_path / "no-ema.ckpt", weights, weights, shape, tmp_path / "m", with_ema=False)
    with pytest.raises(UserError, match=r"holds no EMA .*--weights model"):
        import_mdlm(no_ema, tokenizer_dir, tmp_path / "export")
    d3pm = write_lightning(tmp_path / "d3pm.ckpt", weights, weights, shape, tmp_path / "m",
                           config=mdlm_config(shape, parameterization="d3pm"))
    with pytest.raises(UserError, match=r"parameterization is 'd3pm': unmask imports SUBS models only"):
        import_mdlm(d3pm, tokenizer_dir, tmp_path / "export")
    directory = write_hugging_face(tmp_path / "hf", weights, shape)
    with pytest.raises(UserError, match="holds one set of weights"):
        import_mdlm(directory, tokenizer_dir, tmp_path / "export", weights="model")
    shutil.copy(tmp_path / "no-ema.ckpt", tmp_path / "truncated.ckpt")
    with open(tmp_path / "truncated.ckpt", "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(UserError, match="truncated.ckpt"):
        import_mdlm(tmp_path / "truncated.ckpt", tokenizer_dir, tmp_path / "export")
