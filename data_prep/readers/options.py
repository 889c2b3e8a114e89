"""How to read a corpus: the read flags of ``unmask prep`` and ``unmask tokenizer train``.

``ReadOptions`` is part of a prep's identity (``asdict`` of it goes into the manifest's prep
config and its hash), so a field added here changes every manifest: add one only with a new
flag that changes what is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from common.errors import UserError

__all__ = ["DEFAULT_PIECE_BYTES", "MIN_PIECE_BYTES", "BadJson", "BadUtf8", "ReadOptions",
           "TextFormat"]

# Plain text: documents separated by blank lines / one document per line / one per file.
TextFormat = Literal["paragraphs", "lines", "file"]
BadUtf8 = Literal["replace", "skip"]
BadJson = Literal["error", "skip"]

# 1 MiB per piece: longer than nearly every web document, so most documents are one piece,
# while a book-sized one still reaches the tokenizer in bounded chunks.
DEFAULT_PIECE_BYTES = 1 << 20
# The longest UTF-8 character, so that every piece holds at least one.
MIN_PIECE_BYTES = 4


@dataclass(frozen=True)
class ReadOptions:
    """How to read the corpus; each field is the CLI flag named beside it."""

    text_format: TextFormat = "paragraphs"  # --text-format (plain-text files only)
    text_field: str = "text"                # --text-field: the JSONL field holding the text
    text_column: str = "text"               # --text-column: the Parquet column holding it
    bad_utf8: BadUtf8 = "replace"           # --bad-utf8: repair with U+FFFD, or skip the document
    bad_json: BadJson = "error"             # --bad-json: on a broken JSONL line, stop or skip it
    max_piece_bytes: int = DEFAULT_PIECE_BYTES  # longer documents come out in pieces

    def __post_init__(self) -> None:
        for flag, value, choices in (("--text-format", self.text_format, TextFormat),
                                     ("--bad-utf8", self.bad_utf8, BadUtf8),
                                     ("--bad-json", self.bad_json, BadJson)):
            if value not in get_args(choices):
                raise UserError(f"{flag} must be one of {', '.join(get_args(choices))}, got {value!r}")
        if self.max_piece_bytes < MIN_PIECE_BYTES:
            raise UserError(f"max_piece_bytes must be at least {MIN_PIECE_BYTES} (the longest "
                            f"UTF-8 character), got {self.max_piece_bytes}")
