"""Any Hugging Face ``tokenizer.json`` (BPE, WordPiece, Unigram, ...), run by the ``tokenizers``
library, with its special-token roles.

The roles (eos, bos, pad) come from, first to last: what the caller gives (``unmask prep
--eos-token``, ...); ``special_tokens_map.json`` or ``tokenizer_config.json`` beside the
``tokenizer.json``, as transformers writes them; the special tokens of the ``tokenizer.json``
itself, by their usual names (``KNOWN_TOKENS``). An eos is required. The unknown token is the
model's own (``unk_id``): the one the model emits for what it cannot spell.

Whatever the file configures, encoding adds no special tokens (no post-processor template),
truncates and pads nothing, and reads special tokens written in the text as text. A model
that holds a special token as an ordinary piece of its vocabulary (the library's Unigram
trainer puts them there) may still choose that piece for the text: that is the file's model.

Exactness, ``decode(encode(text)) == text``, is the pipeline's: a byte-level BPE is exact, a
normalizer or a whitespace-dropping pre-tokenizer is not (docs/data-preparation.md, "Tokenizers").
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from data_prep.tokenizer.base import Tokenizer, read_tokenizer_file, refuse_lone_surrogates

__all__ = ["KNOWN_TOKENS", "NO_SPECIAL_TOKENS", "ROLE_FLAGS", "SPECIAL_TOKENS_MAP_FILE", "TOKENIZER_CONFIG_FILE",
           "TOKENIZER_JSON_FILE", "HuggingFaceTokenizer", "SpecialTokens"]

TOKENIZER_JSON_FILE = "tokenizer.json"
# transformers' files naming the roles ({"eos_token": "</s>" or {"content": "</s>", ...}});
# ``save`` writes the first, so that a directory it wrote loads with the same roles.
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ROLES = ("eos", "bos", "pad")
# The usual names of each role among a tokenizer.json's special tokens, most specific first.
# BERT's [SEP] ends its sequences and [CLS] starts them.
KNOWN_TOKENS = {
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[SEP]"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "<|bos|>", "[CLS]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}
ROLE_FLAGS = {role: f"--{role}-token" for role in ROLES}
# Batch encodes run on one thread: each prep worker is one core (the library would start a
# thread pool per worker and oversubscribe the cores).
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


@dataclass(frozen=True)
class SpecialTokens:
    """Tokens given for the roles; None leaves a role to the tokenizer's own files."""

    eos: str | None = None
    bos: str | None = None
    pad: str | None = None

    def given(self) -> dict[str, str]:
        """The roles given, by name."""
        return {role: token for role, token in asdict(self).items() if token is not None}


NO_SPECIAL_TOKENS = SpecialTokens()


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` and its roles (module docstring).

    ``sha256`` is the hash of the ``tokenizer.json`` bytes followed by the roles as JSON, so a
    prep with another ``--eos-token`` is another prep. ``describe()`` adds the roles' tokens
    (``special_tokens``) and the model's unknown id (``unk_id``, None if it has none).
    """

    kind = "tokenizer-json"

    def __init__(self, tokenizer_json: bytes, roles: dict[str, str | None], path: str | Path = "") -> None:
        self._tokenizer_json = bytes(tokenizer_json)
        self.path = str(path)
        self.roles = {role: roles.get(role) for role in ROLES}
        name = self.path or TOKENIZER_JSON_FILE
        record = _json(self._tokenizer_json, name)
        self._tokenizer = _for_documents(_parse(self._tokenizer_json, name))
        role_record = json.dumps(self.roles, sort_keys=True, separators=(",", ":")).encode()
        self.sha256 = hashlib.sha256(self._tokenizer_json + role_record).hexdigest()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # ids may have gaps: size by the largest
        self.eos_id, self.bos_id, self.pad_id = (self._role_id(role, name) for role in ROLES)
        self.unk_id = _unk_id(record, self._tokenizer)

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: SpecialTokens = NO_SPECIAL_TOKENS) -> HuggingFaceTokenizer:
        """Load ``path`` (a ``tokenizer.json``) with the roles of ``special_tokens``, then of the
        files beside it, then of its special tokens' names."""
        path = Path(path)
        data = read_tokenizer_file(path)
        return cls(data, find_roles(_json(data, path), path, special_tokens), path)

    def _role_id(self, role: str, name: str) -> int | None:
        """The id of the role's token; None if it has none, which eos may not."""
        token = self.roles[role]
        if token is None and role == "eos":
            raise UserError(
                f"{name}: no end-of-sequence token, and documents need one to mark their ends: none of its "
                f"special tokens is one of {', '.join(KNOWN_TOKENS['eos'])}, and no {SPECIAL_TOKENS_MAP_FILE} "
                f"or {TOKENIZER_CONFIG_FILE} beside it names one; give one with --eos-token TOKEN")
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise UserError(f"{name}: the {role} token {token!r} is not in its vocabulary; give one that "
                            f"is with {ROLE_FLAGS[role]} TOKEN")
        return token_id

    @property
    def backend(self) -> RustTokenizer:
        """The wrapped ``tokenizers`` tokenizer, for measuring the library without this wrapper."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            # The fast variant skips character offsets, which nothing here uses.
            encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except TypeError:  # what the library says of a lone surrogate
            refuse_lone_surrogates(texts)
            raise
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "special_tokens": self.roles, "unk_id": self.unk_id}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / TOKENIZER_JSON_FILE, self._tokenizer_json)
        # Every role, the missing ones as null, so that loading finds none by name instead.
        roles = {f"{role}_token": token for role, token in self.roles.items()}
        atomic_write_bytes(directory / SPECIAL_TOKENS_MAP_FILE,
                           (json.dumps(roles, indent=2, sort_keys=True) + "\n").encode())

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_json": self._tokenizer_json, "roles": self.roles, "path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def find_roles(record: dict, path: Path, special_tokens: SpecialTokens) -> dict[str, str | None]:
    """The token of each role of the tokenizer.json ``record`` at ``path`` (module docstring for
    where each is looked for), None if none."""
    roles: dict[str, str | None] = dict(special_tokens.given())
    for name in (SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE):
        beside = path.with_name(name)
        if beside.is_file():
            for role, token in _roles_in(beside).items():
                roles.setdefault(role, token)
    specials = _special_tokens(record)
    for role in ROLES:
        if role not in roles:
            roles[role] = next((token for token in KNOWN_TOKENS[role] if token in specials), None)
    return roles


def _roles_in(path: Path) -> dict[str, str | None]:
    """The roles a transformers file names: "ROLE_token" keys, a token or {"content": token}."""
    try:
        record = json.loads(read_tokenizer_file(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); fix or remove it") from None
    roles: dict[str, str | None] = {}
    for role in ROLES:
        if not isinstance(record, dict) or f"{role}_token" not in record:
            continue
        value = record[f"{role}_token"]
        token = value.get("content") if isinstance(value, dict) else value
        if token is not None and not isinstance(token, str):
            raise UserError(f"{path}: {role}_token must be a token, {{\"content\": token}} or null, "
                            f"got {value!r}")
        roles[role] = token
    return roles


def _special_tokens(record: dict) -> set[str]:
    """The contents of the added tokens marked special."""
    added = record.get("added_tokens") or []
    return {token.get("content") for token in added if isinstance(token, dict) and token.get("special")}


def _json(data: bytes, path: Path | str) -> dict:
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); expected a Hugging Face tokenizer.json") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is not a Hugging Face tokenizer.json: expected a JSON object")
    if record.get("kind") == "sentencepiece":
        raise UserError(f"{path} is the record that `unmask tokenizer train` writes beside a sentencepiece "
                        f"model, not a Hugging Face tokenizer.json; pass its directory or its tokenizer.model")
    return record


def _parse(data: bytes, name: str) -> RustTokenizer:
    """The library's tokenizer of ``data`` (valid JSON, as ``_json`` checked)."""
    try:
        return RustTokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # the library raises a bare Exception for what it cannot read
        raise UserError(f"{name} is not a tokenizer.json the tokenizers library can read: {err}") from None


def _for_documents(tokenizer: RustTokenizer) -> RustTokenizer:
    """``tokenizer`` set to encode documents whole and as written (module docstring)."""
    os.environ.setdefault(PARALLELISM_ENV, "false")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True  # "</s>" in a document is text, not eos
    return tokenizer


def _unk_id(record: dict, tokenizer: RustTokenizer) -> int | None:
    """The model's unknown token: ``unk_token`` of BPE and WordPiece, ``unk_id`` of Unigram."""
    model = record.get("model") or {}
    if model.get("unk_token") is not None:
        return tokenizer.token_to_id(model["unk_token"])
    return model.get("unk_id")
