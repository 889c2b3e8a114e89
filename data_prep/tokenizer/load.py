"""``load_tokenizer``: the tokenizer a path holds, whatever its kind (SentencePiece, GPT-2's
BPE or a Hugging Face ``tokenizer.json``).
"""

from __future__ import annotations

from pathlib import Path

from common.errors import UserError
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.gpt2_bpe import GPT2_ENCODER_FILE, GPT2_MERGES_FILE, GPT2BPETokenizer
from data_prep.tokenizer.hugging_face import (
    NO_SPECIAL_TOKENS,
    TOKENIZER_JSON_FILE,
    HuggingFaceTokenizer,
    SpecialTokens,
)
from data_prep.tokenizer.sentencepiece_model import (
    SP_MODEL_FILE,
    TOKENIZER_KINDS,
    SentencePieceTokenizer,
)

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | Path, special_tokens: SpecialTokens = NO_SPECIAL_TOKENS) -> Tokenizer:
    """Load the tokenizer at ``path``: a SentencePiece ``.model`` file, a directory holding
    ``tokenizer.model`` (``train_sentencepiece``'s output, whose ``tokenizer.json`` is a record,
    not a Hugging Face file), a directory holding GPT-2's ``encoder.json`` and ``vocab.bpe``,
    or a Hugging Face ``tokenizer.json`` file or a directory holding one. ``special_tokens``
    (``--eos-token`` ...) applies to a ``tokenizer.json`` only: the other kinds fix their roles."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        return HuggingFaceTokenizer.from_file(path, special_tokens)
    if (path / SP_MODEL_FILE).is_file() or path.is_file():
        tokenizer = SentencePieceTokenizer.from_file(path if path.is_file() else path / SP_MODEL_FILE)
    elif (path / GPT2_ENCODER_FILE).is_file() and (path / GPT2_MERGES_FILE).is_file():
        tokenizer = GPT2BPETokenizer.from_directory(path)
    elif (path / TOKENIZER_JSON_FILE).is_file():
        return HuggingFaceTokenizer.from_file(path / TOKENIZER_JSON_FILE, special_tokens)
    else:
        problem = "is a directory without tokenizer files" if path.is_dir() else "does not exist"
        raise UserError(f"tokenizer path {path} {problem}: expected {TOKENIZER_KINDS}")
    if special_tokens.given():
        flags = ", ".join(f"--{role}-token" for role in special_tokens.given())
        raise UserError(f"{flags}: only a Hugging Face {TOKENIZER_JSON_FILE} takes special tokens; {path} "
                        f"holds a {tokenizer.kind} tokenizer, whose special tokens are fixed: leave the flags out")
    return tokenizer
