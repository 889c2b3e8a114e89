"""The bytes of a text or JSONL file, decompressed if gzip, read in blocks; the byte-order
mark at its start; and whether the file is binary (skipped whole, not read)."""

from __future__ import annotations

import codecs
from itertools import chain
from typing import Iterator

from common.errors import UserError
from data_prep.readers.inputs import InputFile, filesystem

__all__ = ["BINARY_CHECK_BYTES", "BINARY_FIX", "READ_BLOCK_BYTES", "UTF8_BOM", "ByteSource", "binary_reason",
           "head_binary_reason", "skipped_as_binary", "without_bom"]

# One read per MiB amortizes the cost of a call (a syscall, or an HTTP range request on an
# object store) and bounds the memory a reader holds.
READ_BLOCK_BYTES = 1 << 20
UTF8_BOM = codecs.BOM_UTF8
# A text or JSONL file is binary, and skipped whole, when its first BINARY_CHECK_BYTES
# (decompressed) hold a NUL byte, as git and GNU grep decide; or when it starts with a UTF-16
# or UTF-32 byte-order mark (such text holds NULs where it is ASCII; CJK text may hold none).
BINARY_CHECK_BYTES = 8000
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
# What to do with files skipped as binary: most often they are UTF-16 text.
BINARY_FIX = "leave them out, or convert UTF-16 text to UTF-8 (iconv -f UTF-16 -t UTF-8 IN > OUT.txt)"


class ByteSource:
    """The bytes of one text or JSONL file, decompressed if gzip, read in blocks. Offsets are
    in the (decompressed) text; only uncompressed files can be read at an offset cheaply."""

    def __init__(self, file: InputFile) -> None:
        self.file = file
        self._fs, self._path = filesystem(file.uri)
        self._handle = None if file.compression else self._fs.open_input_file(self._path)

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._handle is not None:
            self._handle.close()

    def blocks(self, start: int) -> Iterator[bytes]:
        """The bytes from offset `start` to the end of the file, in blocks."""
        if self._handle is None:
            yield from self._gzip_blocks(start)
            return
        while block := self._handle.read_at(READ_BLOCK_BYTES, start):
            start += len(block)
            yield block

    def read_at(self, start: int, size: int) -> bytes:
        """`size` bytes from offset `start`; uncompressed files only (units that start mid-file)."""
        return self._handle.read_at(size, start)

    def head(self, size: int) -> bytes:
        """The first `size` bytes of the (decompressed) text, fewer if the file is shorter."""
        if self._handle is not None:
            return self._handle.read_at(size, 0)
        data = b""
        for block in self._gzip_blocks(0):
            data += block[:size - len(data)]
            if len(data) >= size:
                break
        return data

    def _gzip_blocks(self, start: int) -> Iterator[bytes]:
        try:
            with self._fs.open_input_stream(self._path, compression="gzip") as stream:
                # gzip cannot seek: decompress from the beginning and drop what precedes `start`.
                while start > 0 and (dropped := stream.read(min(start, READ_BLOCK_BYTES))):
                    start -= len(dropped)
                while block := stream.read(READ_BLOCK_BYTES):
                    yield block
        except OSError as err:
            raise UserError(f"{self.file.uri}: cannot decompress it as gzip ({err}); recompress "
                            f"it, or drop the .gz suffix if it is not compressed") from err


def head_binary_reason(head: bytes) -> str | None:
    """Why a file whose text starts with `head` (its first BINARY_CHECK_BYTES) is binary, or
    None if it is text."""
    for bom, encoding in _WIDE_BOMS:
        if head.startswith(bom):
            return f"{encoding} text (byte-order mark), not UTF-8"
    if b"\0" in head:
        return (f"NUL bytes in its first {BINARY_CHECK_BYTES} bytes (binary, as git and grep "
                f"decide; or UTF-16 text without a byte-order mark)")
    return None


def binary_reason(file: InputFile) -> str | None:
    """Why `read_unit` skips this text or JSONL file as binary (a NUL byte in its first
    BINARY_CHECK_BYTES, decompressed; or a UTF-16/UTF-32 byte-order mark), or None."""
    if file.format == "parquet":
        return None
    with ByteSource(file) as source:
        return head_binary_reason(source.head(BINARY_CHECK_BYTES))


def skipped_as_binary(files: list[tuple[str, str]]) -> str:
    """The files (uri, ``binary_reason``) skipped as binary in one clause, with ``BINARY_FIX``:
    for the refusal of inputs of which nothing else was read."""
    named = "; ".join(f"{uri}: {reason}" for uri, reason in files)
    return f"{len(files)} file(s) skipped as binary ({named}): {BINARY_FIX}"


def without_bom(blocks: Iterator[bytes]) -> tuple[int, Iterator[bytes]]:
    """A file's blocks without a leading UTF-8 byte-order mark, and the bytes the mark took."""
    first = next(blocks, b"")
    skip = len(UTF8_BOM) if first.startswith(UTF8_BOM) else 0
    # Through a list iterator, which lets go of the first block once past it.
    return skip, chain(iter([first[skip:]]), blocks)
