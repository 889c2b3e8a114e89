"""Sentencepiece tokenizers trained on a corpus as the readers read it: ``unmask tokenizer
train``, and the tokenizer that ``unmask prep --vocab-size`` trains into its output directory.

    trained = train_tokenizer(TrainingRequest(("corpus/",), vocab_size=32000), "tok/")
    tokenizer = prep_tokenizer(TrainingRequest(("corpus/",), 32000), "shards/")  # shards/tokenizer

The training text is every document piece of the inputs, in corpus order, streamed
(``CorpusText``); ``train_sentencepiece`` keeps a bounded, deterministic sample of its lines.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.outputs import InputPath, OutputKind, new_output_dir, staged_directory
from data_prep.readers import (
    BINARY_FIX,
    ReadCounters,
    ReadOptions,
    WorkUnit,
    binary_reason,
    local_roots,
    plan_units,
    read_batches,
    resolve_inputs,
    skipped_as_binary,
)
from data_prep.shards.format import TOKENIZER_DIR
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import (
    SP_MODEL_FILE,
    SentencePieceTokenizer,
    train_sentencepiece,
)

__all__ = ["TOKENIZER_KIND", "TRAINING_REQUEST_NAME", "CorpusText", "TrainedTokenizer", "TrainingRequest",
           "prep_tokenizer", "train_tokenizer"]

# Written next to a tokenizer that `unmask prep --vocab-size` trained, to reuse it on rerun.
TRAINING_REQUEST_NAME = "training_request.json"


# What `unmask tokenizer train --out` writes: a directory that appears whole.
TOKENIZER_KIND = OutputKind("tokenizer", "a tokenizer of `unmask tokenizer train`", whole=True)


@dataclass(frozen=True)
class TrainingRequest:
    """What a sentencepiece tokenizer is trained on, and how."""

    inputs: tuple[str, ...]  # files, directories or globs, as resolve_inputs takes them
    vocab_size: int
    model_type: str = "bpe"  # a data_prep.tokenizer.MODEL_TYPES entry
    seed: int = 0            # of the training sample
    read: ReadOptions = field(default_factory=ReadOptions)

    def record(self) -> dict[str, Any]:
        """The request as JSON data: a trained tokenizer is reused while this is unchanged."""
        return {"inputs": list(self.inputs), "vocab_size": self.vocab_size,
                "model_type": self.model_type, "seed": self.seed, "read": asdict(self.read)}


@dataclass(frozen=True)
class TrainedTokenizer:
    """A trained tokenizer, and what the user should know about the inputs it was trained on."""

    tokenizer: SentencePieceTokenizer
    warnings: list[str]  # the input files skipped as binary, each with why; empty if none


class CorpusText:
    """Every document piece of the inputs, in corpus order, streamed; once read through, the
    files it skipped as binary. The inputs are resolved when reading starts, so that a
    trainer's checks of its own arguments come first."""

    def __init__(self, inputs: tuple[str, ...], options: ReadOptions) -> None:
        self._inputs, self._options = inputs, options
        self._units: list[WorkUnit] = []
        self._counters = ReadCounters()

    def __iter__(self) -> Iterator[str]:
        """The documents' text; a UserError naming the binary files if they were all there was."""
        self._units = plan_units(resolve_inputs(self._inputs), self._options)
        for unit in self._units:
            for batch in read_batches(unit, self._options, self._counters):
                yield from batch.texts
        if not self._counters.documents and self._counters.binary_files_skipped:
            raise UserError(f"--input {' '.join(self._inputs)}: no text to train the tokenizer on: "
                            f"{skipped_as_binary(self._skipped())}")

    def _skipped(self) -> list[tuple[str, str]]:
        return [(unit.file.uri, reason) for unit in self._units
                if unit.start == 0 and (reason := binary_reason(unit.file))]

    def warnings(self) -> list[str]:
        """The files skipped as binary, with why and how to fix it; empty if none."""
        if not self._counters.binary_files_skipped:
            return []
        skipped = self._skipped()
        return [f"tokenizer training skipped {len(skipped)} input file(s) as binary; {BINARY_FIX}:",
                *(f"  {uri}: {reason}" for uri, reason in skipped)]


def train_tokenizer(request: TrainingRequest, out_dir: str | Path) -> TrainedTokenizer:
    """Train a sentencepiece tokenizer on a sample of the inputs and write it into `out_dir`
    (checked first, so that a bad one fails before the training; the directory appears whole,
    ``common.outputs``)."""
    inputs = [InputPath(root, "--input") for root in local_roots(request.inputs)]
    with new_output_dir(out_dir, TOKENIZER_KIND, "--out", inputs) as staging:
        trained = _train(request, staging)
    return replace(trained, tokenizer=SentencePieceTokenizer.from_file(Path(out_dir) / SP_MODEL_FILE))


def prep_tokenizer(request: TrainingRequest, prep_dir: str | Path) -> Tokenizer:
    """The tokenizer that a prep into `prep_dir` trains for itself, in PREP_DIR/tokenizer: the
    one trained there before if `request` is unchanged, else a new one."""
    directory = Path(prep_dir) / TOKENIZER_DIR
    marker = directory / TRAINING_REQUEST_NAME
    if marker.is_file() and json.loads(marker.read_text()) == request.record():
        return load_tokenizer(directory)
    with staged_directory(directory) as staging:
        # The prep reports binary inputs itself (in its manifest and warnings).
        _train(request, staging)
        atomic_write_bytes(staging / TRAINING_REQUEST_NAME, json.dumps(request.record(), sort_keys=True).encode())
    return load_tokenizer(directory)


def _train(request: TrainingRequest, directory: Path) -> TrainedTokenizer:
    corpus = CorpusText(request.inputs, request.read)
    tokenizer = train_sentencepiece(corpus, directory, request.vocab_size, request.model_type,
                                    seed=request.seed)
    return TrainedTokenizer(tokenizer, corpus.warnings())
