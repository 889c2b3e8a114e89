"""`unmask import bd3lm`: BD3-LM's Hugging Face directories become block-diffusion exports whose
logits are those BD3-LM's own modeling code computed on the committed fixtures
(``tests/fixtures/bd3lm``, built by ``make_fixtures.py`` with their ``modeling_bd3lm.py``), and
what our block model cannot compute exactly is refused, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models

from common.errors import UserError
from model.block_attention import AttentionLayout, KVCache
from model.spec import build_process
from pipeline.interchange.bd3lm_import import import_bd3lm
from pipeline.interchange.export import export_to_hf, load_export
from tests.support.bd3lm_fixtures import CASES, EOS, VOCAB_SIZE, WORDS, source_copy, their_outputs, write_tokenizer
from tests.support.cli_runner import unmask_in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5  # float32 logits of O(1): the two computations differ in rounding only


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("bd3lm-tokenizer"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_export_computes_bd3lm_s_logits_over_x_t_and_x_0(tokenizer_dir, tmp_path, name):
    block_size, adaln = CASES[name]
    exported = load_export(import_bd3lm(source_copy(tmp_path, name), tokenizer_dir, tmp_path / "export"))
    assert exported.spec.block_size == block_size
    assert (exported.spec.schedule, exported.spec.schedule_args) == ("loglinear", {"eps": 1e-3})
    assert exported.network.config.adaptive_norm is adaln and exported.network.time_independent
    reference = their_outputs(name)
    input_ids = reference["input_ids"]  # [x_t ; x_0], [B, 2L]
    length = input_ids.shape[1] // 2
    with torch.no_grad():  # our training / evaluation forward over [z ; x], as BD3-LM's
        ours = exported.network(input_ids[:, :length], None, clean=input_ids[:, length:], block_size=block_size)
    their = reference["logits"]  # [B, L, V + 1]: the mask's column last
    torch.testing.assert_close(ours, their[..., :VOCAB_SIZE], rtol=0, atol=TOLERANCE)
    assert float(their.abs().max()) > 1.0, "the fixture's logits are not trivial"
    imported = exported.config["imported_from"]
    assert (imported["codebase"], imported["block_size"], imported["training_mask_rate"]) == ("bd3lm", block_size,
                                                                                            [0.001, 0.999])


def test_a_config_as_published_imports_with_the_same_network(tokenizer_dir, tmp_path):
    """The released config.json (kuleshov-group/bd3lm-owt-block_size4, as the Hub shows it) has no
    adaln or causal field (their config's defaults: true, false) and carries the Hub's own
    fields (auto_map, _name_or_path, torch_dtype): it imports as the fixture that spells them out."""
    source = source_copy(tmp_path, "released")
    config = json.loads((source / "config.json").read_text())
    published = {key: value for key, value in config.items() if key not in ("adaln", "causal", "dtype")}
    published.update({"_name_or_path": "kuleshov-group/bd3lm-owt-block_size4", "attn_backend": "sdpa",
                      "auto_map": {"AutoConfig": "configuration_bd3lm.BD3LMConfig",
                                   "AutoModelForMaskedLM": "modeling_bd3lm.BD3LM"},
                      "torch_dtype": "float32", "transformers_version": "4.49.0"})
    (source / "config.json").write_text(json.dumps(published))
    ours = load_export(import_bd3lm(source, tokenizer_dir, tmp_path / "export"))
    spelled_out = load_export(import_bd3lm(source_copy(tmp_path / "fixture", "released"), tokenizer_dir,
                                           tmp_path / "fixture-export"))
    assert ours.network.config == spelled_out.network.config and ours.spec == spelled_out.spec


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kv_cached_block_forward_gives_bd3lm_s_sampling_logits(tokenizer_dir, tmp_path, name):
    """Our sampler's calls (finished blocks through the KV cache, then the noisy block) equal BD3-LM's
    sample_mode forward, block-causal over the same tokens, at every position."""
    block_size, _ = CASES[name]
    network = load_export(import_bd3lm(source_copy(tmp_path, name), tokenizer_dir, tmp_path / "export")).network
    reference = their_outputs(name)
    ids, their = reference["sample_ids"], reference["sample_logits"]
    cache = KVCache(append=True)
    outputs = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], block_size):
            cache.append = start + block_size < ids.shape[1]  # the last block is the noisy one
            outputs.append(network(ids[:, start:start + block_size], None, layout=AttentionLayout(None, None, cache)))
    torch.testing.assert_close(torch.cat(outputs, dim=1), their[..., :VOCAB_SIZE], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", sorted(CASES))
def test_its_hugging_face_format_gives_bd3lm_s_logits_in_transformers(tokenizer_dir, tmp_path, monkeypatch, name):
    """The imported export, written as a transformers directory (``export_to_hf``): our modeling
    file's block forward over [x_t ; x_0] computes what BD3-LM's own code did."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    import transformers

    directory = export_to_hf(import_bd3lm(source_copy(tmp_path, name), tokenizer_dir, tmp_path / "export"), tmp_path / "hf")
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(directory), trust_remote_code=True).eval()
    assert model.config.block_size == CASES[name][0]
    reference = their_outputs(name)
    input_ids = reference["input_ids"]  # [x_t ; x_0], [B, 2L]
    length = input_ids.shape[1] // 2
    with torch.no_grad():
        logits = model(input_ids=input_ids[:, :length], clean_ids=input_ids[:, length:]).logits
    torch.testing.assert_close(logits, reference["logits"][..., :VOCAB_SIZE], rtol=0, atol=TOLERANCE)


def test_unmask_import_bd3lm_then_sample_and_eval_run_on_the_export(tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert unmask_in_process(["import", "bd3lm", str(source_copy(tmp_path, "released")), "--tokenizer",
                              str(tokenizer_dir), "--out", str(out)]) == 0
    assert "imported BD3-LM's model" in capsys.readouterr().out
    assert unmask_in_process(["sample", str(out), "--num", "1", "--steps", "4", "--seq-len", "16"]) == 0
    assert "----- sample 1 " in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(" ".join(WORDS[2 + (i * 7 + j) % 30] for j in range(12)) for i in range(20)))
    assert unmask_in_process(["eval", str(out), "--datasets", str(text), "--samples", "2", "--batch-size", "4",
                              "--seq-len", "16", "--out", str(tmp_path / "report")]) == 0
    model = json.loads((tmp_path / "report" / "results.json").read_text())["model"]
    assert (model["weights"], model["step"]) == ("published", None)
    exported = load_export(out)  # the block bound of the imported model, as the process computes it
    x = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bound = build_process(exported.spec).nelbo(exported.network, x, generator=torch.Generator().manual_seed(1))
    assert bool(torch.isfinite(bound).all())


# ----------------------------------------------------------------------------- refusals
def _edit_config(**fields):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(fields)
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def _edit_weights(change):
    def edit(directory: Path) -> None:
        tensors = load_file(str(directory / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(directory / "model.safetensors"))
    return edit


REFUSALS = {
    "model type": (_edit_config(model_type="mdlm"), r"model_type is 'mdlm', not 'bd3lm': not a BD3-LM model"),
    "cross_attn": (_edit_config(cross_attn=False), r"config\.json: cross_attn is false: .*no block-diffusion model"),
    "causal": (_edit_config(causal=True), r"config\.json: causal is true"),
    "time conditioning": (_edit_config(time_conditioning=True),
                          r"config\.json: time_conditioning is true: .*time-free network"),
    "attention backend": (_edit_config(attn_backend="flash_attn"),
                          r"config\.json: attn_backend is 'flash_attn', not one of flex, sdpa"),
    "block size": (_edit_config(block_size=3), r"config\.json: block_size 3 does not divide model_length 16"),
    "flag type": (_edit_config(adaln="yes"), r"config\.json: adaln is 'yes', expected true or false"),
    "declared width": (_edit_config(hidden_dim=32),
                       r"hidden_dim is 32, but backbone\.vocab_embed\.embedding has size 16"),
    "shape": (_edit_weights(lambda t: t.update({"backbone.blocks.1.attn_out.weight": torch.zeros(16, 8)})),
              r"backbone\.blocks\.1\.attn_out\.weight has shape \(16, 8\), expected \(16, 16\)"),
    "missing tensor": (_edit_weights(lambda t: t.pop("backbone.output_layer.adaLN_modulation.bias")),
                       r"missing tensor backbone\.output_layer\.adaLN_modulation\.bias"),
    "unknown tensor": (_edit_weights(lambda t: t.update({"backbone.blocks.0.attn_qkv.bias": torch.zeros(48)})),
                       r"unknown tensor backbone\.blocks\.0\.attn_qkv\.bias: not part of BD3-LM's DiT"),
    "outside the backbone": (_edit_weights(lambda t: t.update({"lm_head.weight": torch.zeros(3)})),
                             r"unknown tensor 'lm_head\.weight': BD3-LM's weights all lie under 'backbone\.'"),
    "mask-rate buffer": (_edit_weights(lambda t: t.update({"sampling_eps_min": torch.zeros(2)})),
                         r"sampling_eps_min has shape \(2,\) .* expected one floating-point number"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_does_not_fit_is_refused_naming_it(tokenizer_dir, tmp_path, case):
    source = source_copy(tmp_path, "released")
    edit, message = REFUSALS[case]
    edit(source)
    with pytest.raises(UserError, match=message):
        import_bd3lm(source, tokenizer_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    words = WORDS[:-2]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match=r"backbone\.vocab_embed\.embedding has 33 rows, a vocabulary of 32 tokens "
                                        r"plus the mask, but the tokenizer has 30 tokens"):
        import_bd3lm(source_copy(tmp_path, "plain"), tmp_path / "tokenizer.json", tmp_path / "export")


def test_a_source_that_is_not_a_directory_is_refused(tokenizer_dir, tmp_path):
    with pytest.raises(UserError, match=r"does not exist; give BD3-LM's Hugging Face directory"):
        import_bd3lm(tmp_path / "missing", tokenizer_dir, tmp_path / "export")
    assert unmask_in_process(["import", "bd3lm", str(tmp_path / "missing"), "--tokenizer", str(tokenizer_dir),
                              "--out", str(tmp_path / "export")]) != 0


def test_the_export_never_replaces_its_source(tokenizer_dir, tmp_path):
    source = source_copy(tmp_path, "released")
    with pytest.raises(UserError, match=rf"--out {source}: is SOURCE"):
        import_bd3lm(source, tokenizer_dir, source)
    assert sorted(path.name for path in source.iterdir()) == ["config.json", "model.safetensors"]


def test_an_import_never_writes_into_a_training_run(tokenizer_dir, tmp_path, capsys):
    """RUN/export is the run's own model: an import written there would be evaluated and sampled
    as the run's (`unmask eval RUN`), beside the run's own training validation."""
    run = tmp_path / "xo"
    (run / "checkpoints").mkdir(parents=True)
    source = source_copy(tmp_path, "released")
    with pytest.raises(UserError, match=rf"^--out {run / 'export'}: lies inside the training run {run}, where an "
                                        r"export is taken for that run's own model"):
        import_bd3lm(source, tokenizer_dir, run / "export")
    assert unmask_in_process(["import", "bd3lm", str(source), "--tokenizer", str(tokenizer_dir), "--out",
                              str(run / "export")]) == 2
    assert "choose a directory outside it" in capsys.readouterr().err
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints"]
