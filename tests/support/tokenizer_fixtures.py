"""Hugging Face tokenizers built here with the ``tokenizers`` library (nothing is downloaded):
the reference GPT-2 BPE from ``encoder.json`` + ``vocab.bpe``, and small BPE, WordPiece and
Unigram ``tokenizer.json`` files trained on a slice of tinyshakespeare; and the corpus and sizes
of the SentencePiece models the tokenizer tests train (``tests/data_prep/tokenizer/conftest.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.support.paths import GPT2 as GPT2_DIR  # noqa: F401 (DATA: for importers)
from tests.support.paths import TINY as SHAKESPEARE
from tests.support.paths import require_shared

TRAINING_PARAGRAPHS = 600  # enough for real merges, trained in well under a second
VOCAB_SIZE = 600
# The SentencePiece models: small enough to train in well under a second, large enough for real merges.
SENTENCEPIECE_VOCAB_SIZE = 512
SENTENCEPIECE_SAMPLE_SENTENCES = 4000


def reference_gpt2() -> Tokenizer:
    """GPT-2's BPE from its two files in the ``tokenizers`` library, as the prep ran it before
    tiktoken: the reference for GPT-2's ids."""
    encoder = json.loads((GPT2_DIR / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in
              (GPT2_DIR / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:] if line]
    tokenizer = Tokenizer(models.BPE(vocab=encoder, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _paragraphs() -> list[str]:
    return require_shared(SHAKESPEARE).read_text(encoding="utf-8").split("\n\n")[:TRAINING_PARAGRAPHS]


def _save(tokenizer: Tokenizer, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def byte_level_bpe(path: Path, special_tokens: tuple[str, ...] = ("</s>", "<s>", "<pad>"),
                   normalizer: normalizers.Normalizer | None = None) -> Path:
    """A GPT-2-style byte-level BPE (exact for every string unless ``normalizer``), saved at ``path``."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_paragraphs(), trainer)
    return _save(tokenizer, path)


def wordpiece(path: Path) -> Path:
    """BERT's recipe: lowercasing normalizer, whitespace and punctuation split, [CLS] ... [SEP]
    template, and (as BERT's files have) truncation to 512 tokens."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                        special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    tokenizer.train_from_iterator(_paragraphs(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                                 ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    tokenizer.enable_truncation(512)
    return _save(tokenizer, path)


def unigram(path: Path) -> Path:
    """A SentencePiece-style Unigram model behind a Metaspace pre-tokenizer."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                      unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(_paragraphs()[:TRAINING_PARAGRAPHS // 2], trainer)
    return _save(tokenizer, path)


def shakespeare_documents() -> list[str]:
    """tinyshakespeare's paragraphs: the corpus of the SentencePiece models."""
    return require_shared(SHAKESPEARE).read_text(encoding="utf-8").split("\n\n")
