"""Reading a Hugging Face causal LM directory as our autoregressive network: its next-token
logits are transformers' own within 1e-5 in float32 (GPT-2, Llama, Qwen2: tiny random models
built with transformers), and what is not such a model is refused in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from model.transformer import Transformer
from pipeline.interchange.causal_lm_import import read_causal_lm
from tests.support.causal_lm_fixtures import FAMILIES, VOCAB_SIZE, hf_logits, write_causal_lm
from tests.support.paths import needs_shared

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_shared("corpora/tinyshakespeare/input.txt")]

LENGTH = 12


def _ours(model) -> Transformer:
    network = Transformer(model.network).eval()
    network.load_state_dict(model.tensors, strict=True)
    return network


@pytest.mark.parametrize("family", list(FAMILIES))
def test_causal_logits_equal_transformers(tmp_path, family):
    """On [start, x], our network's logits are the source's on [BOS, x] (every position)."""
    model = read_causal_lm(write_causal_lm(tmp_path / family, family, seed=3))
    assert model.family == family and model.network.causal and model.network.vocab_size == VOCAB_SIZE
    assert model.start_token == model.tokenizer.bos_id
    x = torch.randint(0, VOCAB_SIZE, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    theirs = hf_logits(tmp_path / family, torch.cat([torch.full((2, 1), model.start_token), x], dim=1))
    with torch.no_grad():
        ours = _ours(model)(torch.cat([torch.full((2, 1), VOCAB_SIZE), x], dim=1))
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_untied_gpt2_head_and_sha256(tmp_path):
    """An untied head is read as ours; the weights' sha256 is the file's."""
    import hashlib

    directory = write_causal_lm(tmp_path / "gpt2", "gpt2", seed=4, tie_word_embeddings=False)
    model = read_causal_lm(directory)
    assert not model.network.tie_weights
    assert model.weights_sha256 == hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    x = torch.randint(0, VOCAB_SIZE, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    theirs = hf_logits(directory, torch.cat([torch.full((1, 1), model.start_token), x], dim=1))
    with torch.no_grad():
        ours = _ours(model)(torch.cat([torch.full((1, 1), VOCAB_SIZE), x], dim=1))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return write_causal_lm(tmp_path_factory.mktemp("source") / "gpt2", "gpt2")


def _copy(gpt2_dir, tmp_path):
    import shutil

    return shutil.copytree(gpt2_dir, tmp_path / "copy")


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "bert", "architectures": ["BertModel"]}, "not a causal language model"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     ("the architecture MistralForCausalLM (model_type 'mistral') is not one unmask adapts; supported: "
      "GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2)")),
    ({"activation_function": "relu"}, "activation_function = 'relu'"),
    ({"n_layer": 3}, "has no tensor h.2.ln_1.weight"),
])
def test_refusals_name_the_problem(gpt2_dir, tmp_path, changes, message):
    directory = _copy(gpt2_dir, tmp_path)
    _edit_config(directory, **changes)
    with pytest.raises(UserError, match="^--init-from .*copy: ") as err:
        read_causal_lm(directory)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(tmp_path):
    """A tokenizer that is not the model's (more ids than it embeds: no room for the mask id)."""
    directory = write_causal_lm(tmp_path / "small", "gpt2", vocab_size=VOCAB_SIZE - 10)
    with pytest.raises(UserError, match=f"has ids up to {VOCAB_SIZE - 1} but the model embeds {VOCAB_SIZE - 10}"):
        read_causal_lm(directory)


def test_missing_files_are_refused(gpt2_dir, tmp_path):
    directory = _copy(gpt2_dir, tmp_path)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="no tokenizer.json"):
        read_causal_lm(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no tokenizer.json|no model.safetensors"):
        read_causal_lm(directory)
    with pytest.raises(UserError, match="not a directory"):
        read_causal_lm(tmp_path / "absent")
