"""`unmask export --format hf`: transformers loads the directory (our modeling file, nothing from
a hub) and gives load_export's logits; every exported file is readable by the group."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from model.transformer import FamilyLayers, TransformerConfig
from pipeline.interchange.export import WEIGHTS_FILE, export, export_to_hf, load_export, write_export
from pipeline.interchange.hf_export import HF_MODELING_FILE
from pipeline.interchange.mdlm_import import import_mdlm
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.export_fixtures import write_untrained_export
from tests.support.mdlm_reference import DiTShape, random_weights, reference_logits, sigma_of, write_hugging_face
from tests.support.paths import GPT2, REPO, needs_shared
from tests.support.train_helpers import run_train, write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE = 300
MAX_SEQ_LEN = 32
TIMES = torch.tensor([0.1, 0.6])
MDLM_OPTIONS = {"time_conditioning": True, "tie_weights": False, "mlp_bias": True, "head_bias": True,
                "head_mask_row": True, "time_frequencies": 256, "time_input": "loglinear_sigma",
                "rope_angles": "float32"}
NETWORKS = {
    "tied, time-free": {},
    "untied, time-conditioned": {"tie_weights": False, "time_conditioning": True},
    "MDLM's options": MDLM_OPTIONS,
    "MDLM's options, time-free": {**MDLM_OPTIONS, "time_conditioning": False, "adaptive_norm": True},
    "causal": {"causal": True},
    # adapted from autoregressive models (docs/adapting.md): a family's layers, the shift
    "GPT-2 layers, shifted": {"shift": True, "mlp_bias": True, "family": FamilyLayers(
        learned_positions=MAX_SEQ_LEN + 1, norm_bias=True, mlp_hidden=48, qkv_bias=True, out_bias=True)},
    "Llama layers, shifted": {"shift": True, "rope_angles": "float32", "family": FamilyLayers(
        norm="rmsnorm", mlp="swiglu", mlp_hidden=48, kv_heads=1)},
    "Qwen2 layers": {"family": FamilyLayers(norm="rmsnorm", mlp="swiglu", mlp_hidden=48, kv_heads=1, qkv_bias=True)},
}


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    """transformers, offline, caching the modeling files it loads under a temporary directory."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_MODULES_CACHE"] = str(tmp_path_factory.mktemp("hf-modules"))
    import transformers

    return transformers


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-tokenizer")
    lines = [f"the cat {i} sat on the mat {i * 7 % 13} and {i % 5}" for i in range(300)]
    train_sentencepiece(lines, root / "tok", vocab_size=VOCAB_SIZE)
    return root / "tok"


def _random_export(out: Path, tokenizer_dir: Path, config: dict | None = None, **network) -> Path:
    """An export of a network with random weights (no identity adaLN-zero start); ``config``
    adds to its spec (a block size)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    untrained = write_untrained_export(out.with_name(f"{out.name}-untrained"), tokenizer, tokenizer_dir,
                                       config=config, max_seq_len=MAX_SEQ_LEN, **network)
    exported = load_export(untrained)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in exported.network.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    write_export(out, exported.network.state_dict(), exported.config, tokenizer_dir)  # records what it holds
    return out


def _tokens(vocab_size: int, batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab_size + 1, (batch, length), generator=torch.Generator().manual_seed(3))


def _hf_logits(transformers, directory: Path, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(directory), trust_remote_code=True).eval()
    assert type(model).__name__ == "UnmaskForMaskedLM"
    with torch.no_grad():
        return model(input_ids=z, t=t).logits


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_transformers_loads_the_directory_and_gives_load_export_s_logits(transformers, tokenizer_dir, tmp_path, name):
    source = _random_export(tmp_path / "export", tokenizer_dir, **NETWORKS[name])
    directory = export_to_hf(source, tmp_path / "hf")
    exported = load_export(source)
    z = _tokens(VOCAB_SIZE)
    with torch.no_grad():
        expected = exported.network(z, TIMES)
    torch.testing.assert_close(_hf_logits(transformers, directory, z, TIMES), expected, rtol=0, atol=1e-6)


def test_mdlm_s_model_goes_through_import_and_hf_export_with_its_logits(transformers, tokenizer_dir, tmp_path):
    shape = DiTShape(VOCAB_SIZE, time_conditioning=True)
    weights = random_weights(shape, seed=11)
    imported = import_mdlm(write_hugging_face(tmp_path / "mdlm", weights, shape), tokenizer_dir, tmp_path / "export")
    assert unmask_in_process(["export", str(imported), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    z = _tokens(VOCAB_SIZE)
    expected = reference_logits(weights, shape, z, sigma_of(TIMES))[..., :VOCAB_SIZE]
    torch.testing.assert_close(_hf_logits(transformers, tmp_path / "hf", z, TIMES), expected, rtol=0, atol=1e-5)


def test_the_modeling_file_implements_every_network_field(transformers):
    path = REPO / "pipeline" / "interchange" / "hf_modeling" / HF_MODELING_FILE
    spec = importlib.util.spec_from_file_location("modeling_unmask", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.NETWORK_FIELDS) == {field.name for field in dataclasses.fields(TransformerConfig)}
    with pytest.raises(ValueError, match="does not know the network fields"):
        module.UnmaskConfig(network={"vocab_size": 5, "a_field_of_the_future": 1})
    with pytest.raises(ValueError, match="document_separator = 2: this file attends over the whole window"):
        module.UnmaskConfig(network={"vocab_size": 5, "document_separator": 2})
    with pytest.raises(ValueError, match="does not know the network family fields"):
        module.UnmaskConfig(network={"vocab_size": 5, "family": {"a_layer_of_the_future": 1}})


def test_a_document_masked_model_is_refused_in_one_line_and_nothing_is_written(tokenizer_dir, tmp_path):
    """The modeling file attends over the whole window: a model trained per document
    (model.document_mask) would give other logits there, so it stays an unmask export."""
    from common.errors import UserError

    source = _random_export(tmp_path / "export", tokenizer_dir, document_separator=2)
    with pytest.raises(UserError, match=r"--format hf: this model attends within each document "
                                        r"\(model.document_mask, separator id 2\)"):
        export_to_hf(source, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- block diffusion (BD3-LM)
BLOCK_LENGTH = 16  # a shorter multiple of the block size than max_seq_len, as the forward allows
# block size, network: the autoregressive extreme, BD3-LM's released layout (adaLN fed time 0), an untied head
BLOCK_CASES = {"L'=1": (1, {}), "L'=4, adaLN": (4, {"adaptive_norm": True}),
               "L'=8, untied": (8, {"tie_weights": False}),
               "L'=4, GPT-2 layers, shifted": (4, NETWORKS["GPT-2 layers, shifted"]),
               "L'=1, Llama layers, shifted": (1, NETWORKS["Llama layers, shifted"])}


def _block_batch(batch: int = 2, length: int = BLOCK_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, x_0) [B, L]: clean tokens and their copy with about half the positions masked."""
    generator = torch.Generator().manual_seed(5)
    x0 = torch.randint(0, VOCAB_SIZE, (batch, length), generator=generator)
    return torch.where(torch.rand(batch, length, generator=generator) < 0.5, VOCAB_SIZE, x0), x0


def _load(transformers, directory: Path):
    return transformers.AutoModelForMaskedLM.from_pretrained(str(directory), trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def block_hf(transformers, tokenizer_dir, tmp_path_factory) -> Path:
    """The transformers directory of a random-weight block model, L' = 4."""
    root = tmp_path_factory.mktemp("block-hf")
    return export_to_hf(_random_export(root / "export", tokenizer_dir, config={"block_size": 4}), root / "hf")


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_a_block_model_s_directory_gives_the_export_s_forward_over_x_t_and_x_0(transformers, tokenizer_dir,
                                                                              tmp_path, name):
    block_size, network = BLOCK_CASES[name]
    source = _random_export(tmp_path / "export", tokenizer_dir, config={"block_size": block_size}, **network)
    directory = export_to_hf(source, tmp_path / "hf")
    model, exported = _load(transformers, directory), load_export(source)
    assert model.config.block_size == block_size
    z, x0 = _block_batch()
    with torch.no_grad():
        theirs = model(input_ids=z, clean_ids=x0).logits
        ours = exported.network(z, None, clean=x0, block_size=block_size)
        bidirectional = exported.network(z)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    assert float((theirs - bidirectional).abs().max()) > 1e-3, "the block mask changed nothing"


def test_a_block_s_logits_read_only_its_noisy_tokens_and_the_clean_blocks_before_it(transformers, block_hf):
    """What the docstring promises for denoising block b after a prefix: input_ids' other blocks
    and clean_ids' blocks from b on are not read; clean_ids' earlier blocks are."""
    model, block = _load(transformers, block_hf), slice(8, 12)  # block b = 2 of L' = 4
    z, x0 = _block_batch()
    other_z, later_x0, earlier_x0 = z.clone(), x0.clone(), x0.clone()
    other_z[:, :8], other_z[:, 12:] = VOCAB_SIZE, 7
    later_x0[:, 8:] = 11
    earlier_x0[:, 4:8] = 13
    with torch.no_grad():
        logits = {name: model(input_ids=noisy, clean_ids=clean).logits[:, block] for name, noisy, clean in
                  (("given", z, x0), ("other z", other_z, x0), ("later x0", z, later_x0),
                   ("earlier x0", z, earlier_x0))}
    torch.testing.assert_close(logits["other z"], logits["given"], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits["later x0"], logits["given"], rtol=0, atol=1e-6)
    assert float((logits["earlier x0"] - logits["given"]).abs().max()) > 1e-3


def test_a_block_model_misused_is_refused(transformers, block_hf, tokenizer_dir, tmp_path):
    model = _load(transformers, block_hf)
    z, x0 = _block_batch()
    with pytest.raises(ValueError, match=r"block diffusion model \(block_size 4\): pass clean_ids"):
        model(input_ids=z)
    with pytest.raises(ValueError, match=r"sequence length 10 is not a multiple of block_size 4"):
        model(input_ids=z[:, :10], clean_ids=x0[:, :10])
    with pytest.raises(ValueError, match=r"clean_ids must have input_ids' shape \(2, 16\), got \(2, 12\)"):
        model(input_ids=z, clean_ids=x0[:, :12])
    plain = _load(transformers, export_to_hf(_random_export(tmp_path / "export", tokenizer_dir), tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"clean_ids is for block diffusion models"):
        plain(input_ids=z, clean_ids=x0)
    edited = shutil.copytree(block_hf, tmp_path / "edited")  # a lost block_size would run one bidirectional pass
    config = json.loads((edited / "config.json").read_text())
    del config["block_size"]
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"block_size None differs from the export's \(unmask\.block_size 4\)"):
        _load(transformers, edited)
    config_class, network = type(model.config), model.config.network
    with pytest.raises(ValueError, match=r"block_size must be a positive integer, got 0"):
        config_class(network=network, block_size=0)
    with pytest.raises(ValueError, match=r"bidirectional network without time conditioning"):
        config_class(network={**network, "causal": True}, block_size=4)


def _modes(directory: Path) -> dict[str, int]:
    return {str(path.relative_to(directory)): stat.S_IMODE(path.stat().st_mode) for path in directory.rglob("*")}


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_every_exported_file_is_readable_by_the_group(tokenizer_dir, tmp_path, umask_022):
    private = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    os.chmod(private / "tokenizer.model", 0o600)  # a private source file is not copied private
    source = write_untrained_export(tmp_path / "export", load_tokenizer(private), private)
    directory = export_to_hf(source, tmp_path / "hf")
    for tree in (source, directory):
        modes = _modes(tree)
        assert WEIGHTS_FILE in modes and "config.json" in modes
        for name, mode in modes.items():
            expected = 0o755 if (tree / name).is_dir() else 0o644
            assert mode == expected, f"{tree.name}/{name} is {oct(mode)}, expected {oct(expected)}"
        assert stat.S_IMODE(tree.stat().st_mode) == 0o755


@needs_shared("gpt2-bpe")
def test_gpt2_s_tokenizer_files_load_in_transformers_with_our_ids(transformers, tmp_path):
    tokenizer = load_tokenizer(GPT2)
    source = write_untrained_export(tmp_path / "export", tokenizer, GPT2, max_seq_len=MAX_SEQ_LEN)
    directory = export_to_hf(source, tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "Hello world! Masked diffusion   models, 2024: naïve ünïcode\n\ttabs."
    assert theirs(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert theirs.eos_token_id == tokenizer.eos_id


@pytest.mark.slow
def test_unmask_export_format_hf_of_a_training_run(transformers, tinyshakespeare_shards, tmp_path):
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 1}, "eval": {"every": 0},
                                                "checkpoint": {"every": 1}})
    run_dir = run_train(tmp_path / "run", tinyshakespeare_shards, config).run_dir
    proc = run_unmask(["export", str(run_dir), "--format", "hf"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    directory = RunLayout(run_dir).hf_export
    exported = load_export(export(run_dir, out_dir=tmp_path / "export"))
    z = _tokens(exported.network.config.vocab_size, length=16)
    with torch.no_grad():
        expected = exported.network(z, TIMES)
    torch.testing.assert_close(_hf_logits(transformers, directory, z, TIMES), expected, rtol=0, atol=1e-6)
    assert all(mode & stat.S_IRGRP for mode in _modes(directory).values())


def test_unmask_export_format_hf_writes_a_block_export_with_its_block_size(block_export, tmp_path):
    """The transformers directory records the block size its modeling file runs the block forward at
    (its logits: the block diffusion tests above)."""
    import json

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "hf"
    assert unmask_in_process(["export", str(block_export), "--format", "hf", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == config["unmask"]["block_size"] == 8
