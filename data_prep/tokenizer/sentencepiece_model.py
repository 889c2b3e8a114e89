"""SentencePiece tokenizers: ``SentencePieceTokenizer`` (a trained model, loaded) and
``train_sentencepiece`` (a model trained on texts).

Exact: trained with an identity normalizer and byte fallback (characters outside the
vocabulary become UTF-8 byte pieces, never ``<unk>``), ``decode(encode(text)) == text`` for
every string. A tokenizer pickles with its model bytes, not a path, so a Ray actor on another
machine gets the same tokenizer; ``sha256`` identifies the model files. Training streams its
documents once and keeps a bounded reservoir sample of their lines: with the same documents
and seed the trained ``tokenizer.model`` is byte-identical. The manual:
docs/data-preparation.md, "Tokenizers".
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from data_prep.tokenizer.base import Tokenizer, refuse_lone_surrogates
from data_prep.tokenizer.gpt2_bpe import GPT2_ENCODER_FILE, GPT2_MERGES_FILE
from data_prep.tokenizer.hugging_face import (
    TOKENIZER_JSON_FILE,
)

# Files written by ``train_sentencepiece``; ``SentencePieceTokenizer.save`` writes the model alone.
SP_MODEL_FILE = "tokenizer.model"
SP_VOCAB_FILE = "tokenizer.vocab"  # "piece<TAB>score" per id, for reading, never loaded
SP_METADATA_FILE = "tokenizer.json"  # a record of the training, not a Hugging Face tokenizer.json
# Special ids of a trained SentencePiece model. SentencePiece's defaults for unk, bos and
# eos, plus a pad id (SentencePiece disables pad by default) for fixed-length batches of
# unpacked text. Putting all four first keeps the 256 byte pieces at the fixed ids 4..259.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NUM_SPECIAL_PIECES = 4
NUM_BYTE_PIECES = 256  # byte fallback reserves one piece per byte value
MIN_VOCAB_SIZE = NUM_SPECIAL_PIECES + NUM_BYTE_PIECES + 1  # + at least one learned piece

MODEL_TYPES = ("bpe", "unigram")  # SentencePiece's two subword algorithms

# SentencePiece's default sentence limit, in bytes. Its trainer skips longer sentences
# (with a warning); the sampler cuts them instead, so no text is lost and the counts are exact.
MAX_SENTENCE_BYTES = 4192
# A chunk of this many characters is at most MAX_SENTENCE_BYTES bytes (UTF-8 takes at most
# 4 bytes per character), so cutting needs no byte arithmetic.
_MAX_CUT_CHARS = MAX_SENTENCE_BYTES // 4

# The trainer holds the whole sample in memory. A million sentences (on the order of 100 MB
# of text) is ample for vocabularies in the tens of thousands; BPE training on a million
# news and Wikipedia lines peaked under 1 GB of memory.
DEFAULT_SAMPLE_SENTENCES = 1_000_000

# Characters covering this fraction of the sample get a piece of their own; rarer ones are
# spelled in byte pieces rather than each taking a vocabulary slot. SentencePiece's default.
CHARACTER_COVERAGE = 0.9995

# The unigram trainer sums per-thread partial counts, so its pieces and scores depend on the
# number of threads (BPE's do not), and the model file records the count either way. A fixed
# count, not os.cpu_count(), makes the model bytes a function of the documents, seed and
# options alone, whichever machine trains it.
TRAIN_NUM_THREADS = 16

# The trainer logs every EM/merge round at level 0 (INFO); keep warnings and errors.
_TRAIN_LOG_LEVEL = 1

_SP_TRAIN_OPTIONS: dict[str, Any] = {
    # Exact round trip: no NFKC, no whitespace cleanup, no dummy leading space, and
    # characters outside the vocabulary become byte pieces instead of <unk>.
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "byte_fallback": True,
    # Runs of spaces (indentation, alignment) may become pieces of their own.
    "allow_whitespace_only_pieces": True,
    "character_coverage": CHARACTER_COVERAGE,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_id": PAD_ID,
    "max_sentence_length": MAX_SENTENCE_BYTES,
    "input_sentence_size": 0,  # the sample is already drawn: train on all of it
    "num_threads": TRAIN_NUM_THREADS,
}

# What a tokenizer path may hold, for the messages that refuse one.
TOKENIZER_KINDS = (f"a SentencePiece .model file, a directory holding {SP_MODEL_FILE} (from `unmask tokenizer "
          f"train`), a directory holding GPT-2's {GPT2_ENCODER_FILE} and {GPT2_MERGES_FILE}, or a Hugging Face "
          f"{TOKENIZER_JSON_FILE} (the file, or a directory holding it)")

# Batch encodes run on one thread: ``unmask prep`` runs one tokenizer per core in Ray
# workers, and a library thread pool per worker would oversubscribe the cores.
ENCODE_THREADS = 1

# SentencePiece writes a space as U+2581 and decodes every U+2581 back to a space, so a
# literal U+2581 in the text would come back as a space. Text holding one is encoded
# around it, with the character spelled in byte pieces, which decode to it unchanged.
_META_SPACE = "\u2581"

__all__ = [
    "CHARACTER_COVERAGE",
    "DEFAULT_SAMPLE_SENTENCES",
    "MAX_SENTENCE_BYTES",
    "MIN_VOCAB_SIZE",
    "MODEL_TYPES",
    "SentencePieceTokenizer",
    "SentenceSample",
    "TOKENIZER_KINDS",
    "draw_sentence_sample",
    "train_sentencepiece",
]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; ``sha256`` is the hash of the ``.model`` file's bytes.

    Any model loads; only one trained with byte fallback (as ``train_sentencepiece``
    trains) round-trips every string.
    """

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, path: str | Path = "") -> None:
        # Keep the bytes as read: re-serializing a parsed model need not reproduce them.
        self._model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self._model_proto)
        self.path = str(path)
        self.sha256 = hashlib.sha256(self._model_proto).hexdigest()
        self.vocab_size = self._sp.get_piece_size()
        if self.vocab_size == 0:  # sentencepiece loads an empty proto as a model of no pieces
            raise UserError(f"SentencePiece model {self.path or '(from bytes)'} is empty ({len(self._model_proto)} "
                            f"bytes, no pieces): truncated or emptied; copy it again from where it was trained")
        if self._sp.eos_id() < 0:
            raise UserError(f"SentencePiece model {self.path or '(from bytes)'} has no eos piece; "
                            f"documents need one to mark their ends: train with an eos_id")
        self.eos_id = self._sp.eos_id()
        self.bos_id = _optional_id(self._sp.bos_id())
        self.pad_id = _optional_id(self._sp.pad_id())
        self._meta_space_ids = self._byte_piece_ids(_META_SPACE)

    @classmethod
    def from_file(cls, path: str | Path) -> SentencePieceTokenizer:
        """Load a ``.model`` file."""
        path = Path(path)
        try:
            return cls(path.read_bytes(), path)
        except OSError as err:
            raise UserError(f"cannot read tokenizer model {path}: {err.strerror}") from None
        except RuntimeError:
            raise UserError(f"{path} is not a SentencePiece model; pass {TOKENIZER_KINDS}") from None

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The wrapped processor, for measuring the library without this wrapper."""
        return self._sp

    def _byte_piece_ids(self, char: str) -> list[int] | None:
        """The byte-fallback ids spelling ``char``, or None if the model has no byte pieces."""
        ids = [self._sp.piece_to_id(f"<0x{byte:02X}>") for byte in char.encode("utf-8")]
        return ids if all(self._sp.is_byte(i) for i in ids) else None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            batch = self._sp.encode(texts, num_threads=ENCODE_THREADS)
        except TypeError:  # what the library says of a lone surrogate
            refuse_lone_surrogates(texts)
            raise
        if self._meta_space_ids:
            for i, text in enumerate(texts):
                if _META_SPACE in text:
                    batch[i] = self._encode_around_meta_space(text)
        return batch

    def _encode_around_meta_space(self, text: str) -> list[int]:
        """Encode the parts between literal U+2581s; spell each U+2581 in byte pieces."""
        parts = self._sp.encode(text.split(_META_SPACE))
        ids = parts[0]
        for part in parts[1:]:
            ids += self._meta_space_ids
            ids += part
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(ids)

    def vocab_listing(self) -> str:
        """One "piece<TAB>score" line per id, as in SentencePiece's ``.vocab`` files."""
        return "".join(f"{self._sp.id_to_piece(i)}\t{self._sp.get_score(i):g}\n"
                       for i in range(self.vocab_size))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / SP_MODEL_FILE, self._model_proto)

    def __getstate__(self) -> dict[str, Any]:
        return {"model_proto": self._model_proto, "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


@dataclass(frozen=True)
class SentenceSample:
    """A uniform sample of the lines of a stream of documents."""

    sentences: list[str]
    documents_seen: int
    sentences_seen: int


def draw_sentence_sample(documents: Iterable[str], size: int, seed: int = 0) -> SentenceSample:
    """Reservoir-sample at most ``size`` sentences from the lines of ``documents``.

    Reads the documents once and holds only the sample. Empty lines are skipped; lines
    over ``MAX_SENTENCE_BYTES`` are cut into pieces that fit. Every sentence is kept with
    the same probability, and the same documents and seed give the same sample.
    """
    if size < 1:
        raise ValueError(f"the sample size must be >= 1, got {size}")
    rng = random.Random(seed)
    sample: list[str] = []
    documents_seen = sentences_seen = 0
    for document in documents:
        documents_seen += 1
        for sentence in _sentences(document):
            # Algorithm R: the n-th sentence replaces a random slot with probability size / n.
            if sentences_seen < size:
                sample.append(sentence)
            else:
                slot = rng.randrange(sentences_seen + 1)
                if slot < size:
                    sample[slot] = sentence
            sentences_seen += 1
    return SentenceSample(sample, documents_seen, sentences_seen)


def _sentences(document: str) -> Iterator[str]:
    for line in document.splitlines():
        # Measure bytes only for lines long enough to possibly exceed the limit.
        if len(line) > _MAX_CUT_CHARS and len(line.encode("utf-8")) > MAX_SENTENCE_BYTES:
            for start in range(0, len(line), _MAX_CUT_CHARS):
                yield line[start:start + _MAX_CUT_CHARS]
        elif line:
            yield line


def train_sentencepiece(
    documents: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    model_type: str = "bpe",
    *,
    sample_sentences: int = DEFAULT_SAMPLE_SENTENCES,
    seed: int = 0,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model on a sample of the lines of ``documents``.

    Writes ``tokenizer.model``, ``tokenizer.vocab`` and ``tokenizer.json`` (the options,
    special ids, sha256 and sample counts) into ``out_dir``, each through a temporary file,
    so a crash never leaves a partial file. ``tokenizer.json`` is written last: when it
    exists, the model is complete.
    """
    if model_type not in MODEL_TYPES:
        raise UserError(f"--model-type {model_type!r} is not supported; choose one of "
                        f"{', '.join(MODEL_TYPES)}")
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size must be an integer >= {MIN_VOCAB_SIZE} ({NUM_SPECIAL_PIECES} special "
            f"pieces, {NUM_BYTE_PIECES} byte pieces and at least one learned piece), "
            f"got {vocab_size!r}")
    sample = draw_sentence_sample(documents, sample_sentences, seed)
    if not sample.sentences:
        raise UserError(f"the corpus for tokenizer training has no text: "
                        f"{sample.documents_seen} documents, none with a non-empty line")
    options = {**_SP_TRAIN_OPTIONS, "model_type": model_type, "vocab_size": vocab_size}
    model_proto = _train(sample, options)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = SentencePieceTokenizer(model_proto, out_dir / SP_MODEL_FILE)
    atomic_write_bytes(out_dir / SP_MODEL_FILE, model_proto)
    atomic_write_bytes(out_dir / SP_VOCAB_FILE, tokenizer.vocab_listing().encode("utf-8"))
    metadata = {
        **tokenizer.describe(),
        "path": SP_MODEL_FILE,  # beside this record, wherever the directory goes
        "model_type": model_type,
        "unk_id": UNK_ID,
        "seed": seed,
        "documents_seen": sample.documents_seen,
        "sentences_seen": sample.sentences_seen,
        "sentences_sampled": len(sample.sentences),
        "sample_sentences": sample_sentences,
        "train_options": options,
        "sentencepiece_version": spm.__version__,
    }
    atomic_write_bytes(out_dir / SP_METADATA_FILE,
                  (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return tokenizer


def _train(sample: SentenceSample, options: dict[str, Any]) -> bytes:
    """Run the SentencePiece trainer; return the serialized model."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sample.sentences),
                                       model_writer=model, minloglevel=_TRAIN_LOG_LEVEL,
                                       **options)
    except RuntimeError as err:
        user_error = _vocab_size_error(str(err), options, len(sample.sentences))
        if user_error is None:
            raise
        raise user_error from None
    return model.getvalue()


_TOO_SMALL = re.compile(r"smaller than required_chars\. \d+ vs (\d+)")
_TOO_LARGE = re.compile(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)")


def _vocab_size_error(message: str, options: dict[str, Any],
                      num_sentences: int) -> UserError | None:
    """Translate SentencePiece's vocabulary-size failures; None for any other failure."""
    vocab_size = options["vocab_size"]
    if match := _TOO_SMALL.search(message):
        needed = int(match.group(1))
        return UserError(
            f"--vocab-size {vocab_size} is too small for this corpus: it needs at least {needed} "
            f"({NUM_SPECIAL_PIECES} special pieces, {NUM_BYTE_PIECES} byte pieces and one piece "
            f"per character covering {CHARACTER_COVERAGE:.2%} of the sample); use a value "
            f">= {needed}")
    if match := _TOO_LARGE.search(message):
        most = int(match.group(1))
        return UserError(
            f"--vocab-size {vocab_size} is too large for the {num_sentences} sampled sentences: "
            f"{options['model_type']} training finds at most {most} pieces; use a value in "
            f"[{MIN_VOCAB_SIZE}, {most}] or train on more text")
    return None


def _optional_id(token_id: int) -> int | None:
    """SentencePiece reports a disabled special token as id -1."""
    return token_id if token_id >= 0 else None
