"""The tokenizers the tokenizer tests share, built once for the folder: GPT-2's BPE from
../shared/data, a SentencePiece model of each type trained on tinyshakespeare, a byte-level BPE
tokenizer.json, and ``any_tokenizer`` of these four kinds."""

from pathlib import Path

import pytest

from data_prep.tokenizer.gpt2_bpe import GPT2BPETokenizer
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import (
    SentencePieceTokenizer,
    train_sentencepiece,
)
from tests.support.paths import GPT2 as GPT2_DIR
from tests.support.paths import require_shared
from tests.support.tokenizer_fixtures import (
    SENTENCEPIECE_SAMPLE_SENTENCES,
    SENTENCEPIECE_VOCAB_SIZE,
    byte_level_bpe,
    shakespeare_documents,
)


@pytest.fixture(scope="package")
def gpt2() -> GPT2BPETokenizer:
    require_shared(GPT2_DIR / "encoder.json")
    require_shared(GPT2_DIR / "vocab.bpe")
    tokenizer = load_tokenizer(GPT2_DIR)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    return tokenizer


@pytest.fixture(scope="package")
def sentencepiece_models(tmp_path_factory) -> dict[str, tuple[SentencePieceTokenizer, Path]]:
    """One trained model (and its directory) per model type."""
    models = {}
    for model_type in ("bpe", "unigram"):
        out_dir = tmp_path_factory.mktemp(f"sp-{model_type}")
        models[model_type] = (train_sentencepiece(shakespeare_documents(), out_dir, SENTENCEPIECE_VOCAB_SIZE,
                                                  model_type, sample_sentences=SENTENCEPIECE_SAMPLE_SENTENCES),
                              out_dir)
    return models


@pytest.fixture(params=["bpe", "unigram"])
def trained(request, sentencepiece_models) -> tuple[SentencePieceTokenizer, Path]:
    return sentencepiece_models[request.param]


@pytest.fixture(scope="package")
def byte_level_tokenizer_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json: the kind of tokenizer.json that is exact."""
    return load_tokenizer(byte_level_bpe(tmp_path_factory.mktemp("hf") / "tokenizer.json"))


@pytest.fixture(params=["gpt2-bpe", "sentencepiece-bpe", "sentencepiece-unigram", "tokenizer-json"])
def any_tokenizer(request):
    if request.param == "gpt2-bpe":
        return request.getfixturevalue("gpt2")
    if request.param == "tokenizer-json":
        return request.getfixturevalue("byte_level_tokenizer_json")
    model_type = request.param.removeprefix("sentencepiece-")
    return request.getfixturevalue("sentencepiece_models")[model_type][0]
