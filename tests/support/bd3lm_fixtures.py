"""BD3-LM's fixtures (``tests/fixtures/bd3lm``, written by its own modeling code through
``make_fixtures.py``): their directories, the logits BD3-LM computed, and a tokenizer of their
vocabulary, for the import's tests and the GPU's."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

FIXTURES = Path(__file__).parents[1] / "fixtures" / "bd3lm"
VOCAB_SIZE = 32  # the fixtures' V (their config's vocab_size, 33, counts the mask)
EOS = "</s>"
WORDS = [EOS, "<unk>"] + [f"w{i}" for i in range(VOCAB_SIZE - 2)]
# fixture: (block size, adaLN) as make_fixtures.py wrote them
CASES = {"released": (4, True), "plain": (8, False)}


def write_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of the fixtures' V tokens (one word per id; EOS for the documents' ends)."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def source_copy(tmp_path: Path, name: str) -> Path:
    """A copy of a fixture directory (config.json, model.safetensors), free to edit."""
    source = tmp_path / name
    shutil.copytree(FIXTURES / name, source, ignore=shutil.ignore_patterns("reference.safetensors"))
    return source


def their_outputs(name: str) -> dict[str, torch.Tensor]:
    """What BD3-LM computed on the fixture: ``input_ids`` ([x_t ; x_0]) and ``logits`` of its
    training forward; ``sample_ids`` and ``sample_logits`` of its block-causal sampling forward."""
    return load_file(str(FIXTURES / name / "reference.safetensors"))
