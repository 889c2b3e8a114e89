"""The interface every tokenizer kind implements (``data_prep.tokenizer`` loads them), and
what the kinds share: reading their files, and refusing text that is not Unicode.

Text holding a lone surrogate (``"\\ud800"``: Python allows it in a ``str``, UTF-8 has no
bytes for it) is refused with a ValueError by every kind: its ids could not decode back to
it, and the libraries disagree on it (some raise an obscure error, tiktoken would quietly
read it as U+FFFD). The corpus readers repair such text before any tokenizer sees it
(``--bad-utf8``), so a prep never meets it.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import UserError

__all__ = ["Tokenizer", "read_tokenizer_file", "refuse_lone_surrogates"]


class Tokenizer(ABC):
    """Text to token ids and back. SentencePiece models trained by ``train_sentencepiece`` and
    GPT-2's BPE are exact, ``decode(encode(text)) == text`` for every string; a Hugging Face
    ``tokenizer.json`` is exact when its pipeline is (see ``data_prep.tokenizer.hugging_face``).

    ``encode`` adds no special tokens, and reads special tokens written in the text as plain
    text (a document cannot forge a boundary); callers add ``eos_id`` (and ``bos_id``)
    themselves. Text with lone surrogates is refused with a ValueError (module docstring).
    """

    kind: str             # "sentencepiece", "gpt2-bpe" or "tokenizer-json"
    path: str             # where the model was loaded from ("" if built from bytes)
    sha256: str           # identity of the model files
    vocab_size: int       # ids are 0..vocab_size-1
    eos_id: int
    bos_id: int | None
    pad_id: int | None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` through the library's fastest single-thread path."""

    def encode_pieces(self, texts: list[str], ends: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``texts`` back to back, with ``eos_id`` after each text that ends a
        document (``ends``), and the number of ids of each text, its EOS included: what
        ``encode_batch`` and appending EOS give, as two arrays. A kind may override it with a
        faster path that gives the same arrays."""
        ids = self.encode_batch(texts)
        for text_ids in itertools.compress(ids, ends):
            text_ids.append(self.eos_id)  # a fresh list from the encoder: nothing is copied
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(counts.sum())), counts

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""

    @abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write the model files into ``directory``; ``load_tokenizer(directory)`` then
        gives a tokenizer with the same ``sha256``."""

    def describe(self) -> dict[str, Any]:
        """The JSON-able record of this tokenizer for the data manifest."""
        return {"kind": self.kind, "path": self.path, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "pad_id": self.pad_id}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, "
                f"sha256={self.sha256[:12]}...)")


def refuse_lone_surrogates(texts: Iterable[str]) -> None:
    """Raise a ValueError naming the first lone surrogate in ``texts``; do nothing if none."""
    for index, text in enumerate(texts):
        if text.isascii():  # the usual case, and a far cheaper test than encoding
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"text {index} holds a lone surrogate {text[err.start]!r} at character {err.start}: "
                f"it is not Unicode text and has no UTF-8 bytes; repair it first (the prep's readers "
                f"replace it with U+FFFD)") from None


def read_tokenizer_file(path: Path) -> bytes:
    """The bytes of a tokenizer file; a UserError naming it if it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read tokenizer file {path}: {err.strerror}") from None
