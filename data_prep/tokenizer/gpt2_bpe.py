"""GPT-2's byte-level BPE from OpenAI's ``encoder.json`` and ``vocab.bpe``, encoded by tiktoken.

tiktoken is the fastest encoder we found that gives GPT-2's exact ids (several times the
``tokenizers`` BPE, which gives the same ids; ``tests/data_prep/tokenizer/test_gpt2_bpe.py`` compares the two on
every shared corpus and on adversarial text). Its ``Encoding`` is built here from the two
files' bytes, never through ``tiktoken.get_encoding``, which downloads the files or reads
them from a cache keyed by URL.

tiktoken merges by the rank of the merged bytes, and that rank is the token's id, so it
needs the layout of GPT-2's files: the id of the token made by merge rule ``N`` of
``vocab.bpe`` is 256 + N, and the 256 single bytes are tokens. Files laid out otherwise are
refused; a ``tokenizer.json`` (``data_prep.tokenizer.hugging_face``) takes any BPE.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from data_prep.tokenizer.base import Tokenizer, read_tokenizer_file, refuse_lone_surrogates

__all__ = ["GPT2_ENCODER_FILE", "GPT2_EOS_TOKEN", "GPT2_MERGES_FILE", "GPT2BPETokenizer"]

# GPT-2's files, as OpenAI published them.
GPT2_ENCODER_FILE = "encoder.json"
GPT2_MERGES_FILE = "vocab.bpe"
GPT2_EOS_TOKEN = "<|endoftext|>"
NUM_BYTE_TOKENS = 256

# GPT-2's pre-tokenizer, as tiktoken writes it for its "gpt2" encoding: the same splits as
# the original r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# with possessive quantifiers, which its regex engine runs faster.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def _byte_of_char() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the files spell each byte as one printable
    character, the byte itself where it is printable, else one from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_of = {chr(byte): byte for byte in printable}
    others = (byte for byte in range(NUM_BYTE_TOKENS) if byte not in byte_of.values())
    byte_of.update({chr(NUM_BYTE_TOKENS + n): byte for n, byte in enumerate(others)})
    return byte_of


_BYTE_OF_CHAR = _byte_of_char()


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from OpenAI's ``encoder.json`` and ``vocab.bpe``.

    ``sha256`` is the hash of the bytes of ``encoder.json`` followed by those of
    ``vocab.bpe``: it names the files, not the library that encodes with them. Following
    GPT-2, ``<|endoftext|>`` is both eos and bos, and there is no pad. Text that contains the
    string ``<|endoftext|>`` is encoded as ordinary text, as GPT-2's own encoder does, so a
    document cannot forge a boundary; ``decode`` of its id gives the string.
    """

    kind = "gpt2-bpe"

    def __init__(self, encoder_json: bytes, vocab_bpe: bytes, path: str | Path = "") -> None:
        self._encoder_json = bytes(encoder_json)
        self._vocab_bpe = bytes(vocab_bpe)
        self.path = str(path)
        self.sha256 = hashlib.sha256(self._encoder_json + self._vocab_bpe).hexdigest()
        encoder_path = Path(self.path) / GPT2_ENCODER_FILE
        encoder = _parse_encoder(self._encoder_json, encoder_path)
        merges = _parse_merges(self._vocab_bpe, Path(self.path) / GPT2_MERGES_FILE)
        self.eos_id = encoder.pop(GPT2_EOS_TOKEN)
        self._encoding = tiktoken.Encoding(
            f"gpt2-bpe-{self.sha256[:12]}", pat_str=GPT2_PATTERN,
            mergeable_ranks=_mergeable_ranks(encoder, self.eos_id, merges, encoder_path),
            special_tokens={GPT2_EOS_TOKEN: self.eos_id})
        self.vocab_size = self._encoding.n_vocab
        self.bos_id = self.eos_id
        self.pad_id = None

    @classmethod
    def from_directory(cls, directory: str | Path) -> GPT2BPETokenizer:
        """Load ``encoder.json`` and ``vocab.bpe`` from ``directory``."""
        directory = Path(directory)
        return cls(read_tokenizer_file(directory / GPT2_ENCODER_FILE),
                   read_tokenizer_file(directory / GPT2_MERGES_FILE), directory)

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The wrapped tiktoken encoding, for measuring the library without this wrapper."""
        return self._encoding

    def encode(self, text: str) -> list[int]:
        refuse_lone_surrogates((text,))
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: tiktoken's own batch call starts a thread pool, and each prep worker is
        # one core. Specials are read as text (encode_ordinary), as in ``encode``.
        refuse_lone_surrogates(texts)
        encode = self._encoding.encode_ordinary
        return [encode(text) for text in texts]

    def encode_pieces(self, texts: list[str], ends: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        """As the base class, in one encoder call when every text ends a document: the texts
        joined by ``<|endoftext|>``, encoded with that one special token allowed. tiktoken
        splits the text at each allowed special token and runs its pre-tokenizer on each part
        alone, so every document is encoded exactly as by itself; and on documents of about 40
        tokens, one call per document took a fifth longer. A document that holds the string
        ``<|endoftext|>`` must not be cut there: such a batch goes the general way."""
        joined = GPT2_EOS_TOKEN.join(texts)
        # The string has no proper prefix that is also a suffix, so the joins cannot make new
        # occurrences: any count above the joins is a document holding it.
        if not all(ends) or joined.count(GPT2_EOS_TOKEN) != len(texts) - 1:
            return super().encode_pieces(texts, ends)
        if not joined.isascii():  # an O(1) test; else each text is checked, to name the one at fault
            refuse_lone_surrogates(texts)
        ids = self._encoding.encode_to_numpy(joined, allowed_special={GPT2_EOS_TOKEN}, disallowed_special=())
        ids = np.append(ids, np.uint32(self.eos_id))
        return ids, np.diff(np.flatnonzero(ids == self.eos_id), prepend=-1)

    def decode(self, ids: Sequence[int]) -> str:
        # Bytes that are not UTF-8 (ids cut inside a character) become U+FFFD, as GPT-2 does.
        return self._encoding.decode(list(ids))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / GPT2_ENCODER_FILE, self._encoder_json)
        atomic_write_bytes(directory / GPT2_MERGES_FILE, self._vocab_bpe)

    def __getstate__(self) -> dict[str, Any]:
        return {"encoder_json": self._encoder_json, "vocab_bpe": self._vocab_bpe,
                "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def _mergeable_ranks(encoder: dict[str, int], eos_id: int, merges: list[tuple[str, str]],
                     path: Path) -> dict[bytes, int]:
    """tiktoken's ranks (token bytes -> id) of the tokens of ``encoder`` (eos left out),
    checked against the layout tiktoken needs (module docstring)."""
    layout = (f"tiktoken needs GPT-2's layout (the 256 byte tokens, then merge rule N of "
              f"{GPT2_MERGES_FILE} making token 256 + N); save the tokenizer as a tokenizer.json "
              f"with the tokenizers library and pass that instead")
    try:
        ranks = {bytes(_BYTE_OF_CHAR[char] for char in token): rank for token, rank in encoder.items()}
    except KeyError as err:
        raise UserError(f"{path}: token with the character {err.args[0]!r}, which is not one of GPT-2's "
                        f"byte characters; {layout}") from None
    for number, (left, right) in enumerate(merges):
        if encoder.get(left + right) != NUM_BYTE_TOKENS + number:
            raise UserError(f"{path}: merge rule {number} ({left} {right}) does not make token "
                            f"{NUM_BYTE_TOKENS + number}; {layout}")
    if len(ranks) != NUM_BYTE_TOKENS + len(merges) or any(bytes([b]) not in ranks for b in range(NUM_BYTE_TOKENS)):
        raise UserError(f"{path}: expected the {NUM_BYTE_TOKENS} byte tokens, one token per merge rule and "
                        f"{GPT2_EOS_TOKEN}, got {len(encoder) + 1} tokens; {layout}")
    if len({*ranks.values(), eos_id}) != len(ranks) + 1:
        raise UserError(f"{path}: two tokens share an id; {layout}")
    return ranks


def _parse_encoder(data: bytes, path: Path) -> dict[str, int]:
    try:
        encoder = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); "
                        f"expected GPT-2's token -> id map") from None
    if not isinstance(encoder, dict) or GPT2_EOS_TOKEN not in encoder:
        raise UserError(f"{path} is not GPT-2's encoder.json: expected a token -> id map "
                        f"holding {GPT2_EOS_TOKEN}")
    return encoder


def _parse_merges(data: bytes, path: Path) -> list[tuple[str, str]]:
    """The merge rules of ``vocab.bpe``: one "left right" pair a line after a version header."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err}); expected GPT-2's merge rules") from None
    merges = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line or line.startswith("#version"):
            continue
        left, space, right = line.partition(" ")
        if not (left and space and right) or " " in right:
            raise UserError(f"{path}:{line_number}: expected a merge rule 'left right', "
                            f"got {line!r}")
        merges.append((left, right))
    return merges
