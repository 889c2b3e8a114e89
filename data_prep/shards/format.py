"""The shard format: WebDataset tar files of packed token sequences, and their manifest.

A shard ``DIR/{split}/shard-NNNNNN.tar`` holds fixed-length sequences packed from documents
separated by EOS, in chunks of about ``CHUNK_BYTES``: each chunk is one tar member
``SSSSSS-CCCCCC.tokens.npy`` holding a ``[rows, seq_len]`` uint16 or uint32 array (the last
chunk of a shard may be shorter). Tar headers carry no time, owner or host, so the same
sequences always give the same bytes. The manifest (``MANIFEST_NAME``, ``Manifest``) lists
every shard and every chunk's byte range and sha256 (``ChunkInfo``): a reader fetches a chunk
with one range request and checks it as it reads it. This module owns the format: the
writer, the readers (``decode_chunk`` for one chunk's bytes, ``iter_chunks`` for a whole
shard) and the manifest; ``DIR/tokenizer`` (``TOKENIZER_DIR``) holds the tokenizer the shards
were made with. The reasoning: docs/data-preparation.md, "What comes out".
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator

import numpy as np

from common.atomic_files import atomic_write_bytes, temporary_path
from common.bounded_read import read_bounded
from common.errors import UserError
from common.file_records import sha256_file

# The manifest's format_version, the one this unmask writes and reads: a manifest of another
# is refused in one line (docs/concepts.md, "Formats and versions").
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"  # the tokenizer's files, in the data directory: the manifest's tokenizer path
SPLITS = ("train", "val")
# Target bytes of token data per tar member (see the module docstring).
CHUNK_BYTES = 1 << 20
# Token ids up to this bound fit in uint16.
UINT16_LIMIT = 1 << 16
# The most a manifest may hold: about 200 bytes per chunk (CHUNK_BYTES of tokens), so 1 GiB
# lists some 5 TiB of shards. A path to something else is refused, not read to the end.
MAX_MANIFEST_BYTES = 1 << 30

__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "SPLITS", "TOKENIZER_DIR", "ChunkInfo", "ShardInfo",
    "SplitInfo", "Manifest",
    "WrittenShard", "token_dtype", "chunk_rows", "shard_path", "write_shard", "iter_chunks", "decode_chunk",
]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every token id."""
    return np.dtype("<u2") if vocab_size <= UINT16_LIMIT else np.dtype("<u4")


def chunk_rows(seq_len: int, dtype: np.dtype) -> int:
    """Sequences per tar member: about CHUNK_BYTES of tokens, at least one sequence."""
    return max(1, CHUNK_BYTES // (seq_len * np.dtype(dtype).itemsize))


def shard_path(split: str, index: int) -> str:
    """Path of a shard relative to the data directory."""
    return f"{split}/shard-{index:06d}.tar"


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), version=(1, 0), allow_pickle=False)
    return buffer.getvalue()


def _reproducible_member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


@dataclass(frozen=True)
class WrittenShard:
    """What ``write_shard`` wrote: the file's sha256 and size, and where each chunk lies in it."""

    sha256: str
    bytes: int
    chunks: list["ChunkInfo"]


def write_shard(path: str | Path, sequences: np.ndarray, shard_index: int, rows_per_chunk: int) -> WrittenShard:
    """Write ``sequences`` [n, seq_len] as a shard at ``path`` atomically.

    The tar is built under a temporary name and renamed, so a killed writer leaves either
    no shard or a complete one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    chunks = []
    with open(tmp, "wb") as handle:
        with tarfile.open(fileobj=handle, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for chunk, start in enumerate(range(0, len(sequences), rows_per_chunk)):
                rows = sequences[start:start + rows_per_chunk]
                data = _npy_bytes(rows)
                member = _reproducible_member(f"{shard_index:06d}-{chunk:06d}.tokens.npy", len(data))
                # A USTAR header is one block; the member's data follows it.
                chunks.append(ChunkInfo(offset=tar.offset + tarfile.BLOCKSIZE, bytes=len(data), rows=len(rows),
                                        sha256=hashlib.sha256(data).hexdigest()))
                tar.addfile(member, io.BytesIO(data))
        handle.flush()
        os.fsync(handle.fileno())
    digest = sha256_file(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, path)
    return WrittenShard(digest, size, chunks)


# The .npy header versions a chunk may carry (the writer uses 1.0; 2.0 is 1.0 with a longer header).
_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def decode_chunk(data: bytes, source: str) -> np.ndarray:
    """The ``[rows, seq_len]`` array of one chunk's bytes (a ``.npy`` file, never pickled)."""
    try:
        stream = io.BytesIO(data)
        version = np.lib.format.read_magic(stream)
        read_header = _NPY_HEADER_READERS.get(version)
        if read_header is None:
            raise ValueError(f"npy format version {version}")
        shape, fortran_order, dtype = read_header(stream)
        if fortran_order or dtype.hasobject or len(shape) != 2:
            raise ValueError(f"a {len(shape)}-d {'Fortran-ordered ' if fortran_order else ''}{dtype} array")
        # A read-only view of the bytes, not a copy: the loader gathers its rows once, into lanes.
        return np.frombuffer(data, dtype=dtype, count=shape[0] * shape[1], offset=stream.tell()).reshape(shape)
    except (ValueError, EOFError, OSError) as err:
        raise UserError(f"{source}: corrupt chunk ({type(err).__name__}: {err}); {_SHARD_FIX}") from None


def iter_chunks(stream: BinaryIO, source: str = "<stream>") -> Iterator[np.ndarray]:
    """Yield the chunk arrays of a shard stream in order, with WebDataset's tar iterator.
    A truncated or garbled shard raises ``UserError`` naming ``source``."""
    from webdataset.tariterators import tar_file_iterator  # lazily: it imports torch

    try:
        for member in tar_file_iterator(stream):
            name, data = member["fname"], member["data"]
            if not name.endswith(".tokens.npy"):
                raise UserError(f"{source}: unexpected member {name!r}; not an unmask shard")
            yield np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    except (tarfile.TarError, ValueError, EOFError, OSError) as err:
        raise UserError(f"{source}: truncated or corrupt shard ({type(err).__name__}: {err}); {_SHARD_FIX}") \
            from None


# Shards are reproducible from their inputs; a copied data directory can be copied again.
_SHARD_FIX = "copy the data directory again, or rerun `unmask prep` with --overwrite"


# ------------------------------------------------------------------------- manifest
def _check_inside(relative: str, manifest_path: str) -> None:
    """A manifest names shards inside its own directory: an absolute path or a ``..`` would
    let a received manifest make the loader read any file on the machine."""
    pure = PurePosixPath(relative)
    if not relative or pure.is_absolute() or "\\" in relative or ".." in pure.parts or ":" in relative:
        raise UserError(f"{manifest_path}: shard path {relative!r} leaves the data directory; a manifest may "
                        "only name files inside it (rerun `unmask prep`)")


@dataclass
class ChunkInfo:
    """One tar member of a shard: the bytes of its ``.npy`` data, read with one range request."""

    offset: int          # of the member's data in the shard file
    bytes: int
    rows: int            # sequences in the chunk
    sha256: str          # of those bytes: checked as they are read, no second read of the shard


@dataclass
class ShardInfo:
    path: str            # relative to the data directory
    sequences: int
    tokens: int          # real tokens (sequences * seq_len minus padding)
    utf8_bytes: int      # source bytes of the documents whose EOS lies in this shard
    sha256: str
    bytes: int           # size of the tar file
    chunks: list[ChunkInfo] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict) -> "ShardInfo":
        return cls(**{**raw, "chunks": [ChunkInfo(**c) for c in raw.get("chunks", [])]})


@dataclass
class SplitInfo:
    documents: int = 0
    tokens: int = 0              # sum over documents of (tokens + 1 EOS)
    utf8_bytes: int = 0
    sequences: int = 0
    padding_tokens: int = 0      # pad ids at the end of the last sequence (0 if it is full)
    shards: list[ShardInfo] = field(default_factory=list)


@dataclass
class Manifest:
    """``DIR/manifest.json``: what a prep produced and from what."""

    format_version: int
    tokenizer: dict          # kind, path, sha256, vocab_size, eos_id, bos_id, pad_id
    seq_len: int
    dtype: str               # numpy dtype string of the token arrays, e.g. "<u2"
    chunk_rows: int          # sequences per tar member (the last of a shard may hold fewer)
    pad_id: int              # id filling the tail of a split's last sequence
    prep_config: dict
    prep_config_sha256: str
    inputs: list[dict]       # uri and size of each input file
    counts: dict             # documents kept, empty/bad UTF-8/bad JSON skipped or repaired
    splits: dict[str, SplitInfo]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def write(self, data_dir: str | Path) -> None:
        atomic_write_bytes(Path(data_dir) / MANIFEST_NAME, self.to_json().encode())

    @classmethod
    def read(cls, data_dir: str | Path) -> "Manifest":
        path = Path(data_dir) / MANIFEST_NAME
        if not path.is_file():
            raise UserError(f"{path}: no manifest; run `unmask prep --out {data_dir}` first")
        try:
            text = read_bounded(path, MAX_MANIFEST_BYTES, "a shard manifest").decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: not a valid unmask manifest ({err}); rerun `unmask prep`") from None
        except OSError as err:
            raise UserError(f"{path}: cannot read the manifest ({err})") from None
        return cls.from_json(text, str(path))

    @classmethod
    def from_json(cls, text: str, source: str) -> "Manifest":
        """The manifest in ``text`` (read from ``source``, named in errors), checked."""
        try:
            raw = json.loads(text)
            version = raw.get("format_version")
            if version != FORMAT_VERSION:
                raise UserError(_another_format(source, version))
            raw["splits"] = {name: SplitInfo(**{**split, "shards": [ShardInfo.from_dict(s) for s in split["shards"]]})
                             for name, split in raw["splits"].items()}
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise UserError(f"{source}: not a valid unmask manifest ({err}); rerun `unmask prep`") from None
        for split in manifest.splits.values():
            for shard in split.shards:
                _check_inside(shard.path, source)
        _check_chunk_tables(manifest, source)
        return manifest

    def sha256(self) -> str:
        """Identity of the data (tags training runs)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


# The token dtypes the writer uses (``token_dtype``).
_TOKEN_DTYPES = ("<u2", "<u4")
_EDITED = "the manifest was edited or damaged: rerun the `unmask prep` that made it, with --overwrite"


def _check_chunk_tables(manifest: Manifest, source: str) -> None:
    """Before anything is read: every chunk lies inside its shard (the size the manifest
    records), after the one before it, and holds its rows. A hand-edited byte count, offset
    or row count would otherwise become a read of a petabyte, of a negative offset, or rows
    that are not there; each is one line naming the shard, the chunk and the field."""
    if manifest.dtype not in _TOKEN_DTYPES or not _is_count(manifest.seq_len) or manifest.seq_len < 1:
        raise UserError(f"{source}: dtype {manifest.dtype!r} and seq_len {manifest.seq_len!r} are not a token "
                        f"array's ({'/'.join(_TOKEN_DTYPES)}, seq_len >= 1); {_EDITED}")
    row_bytes = manifest.seq_len * np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for shard in split.shards:
            where = f"{source}: shard {shard.path}"
            for field_name in ("bytes", "sequences"):
                if not _is_count(getattr(shard, field_name)):
                    raise UserError(f"{where}: {field_name} {getattr(shard, field_name)!r} is not a count; {_EDITED}")
            end = 0  # of the chunk before
            for index, chunk in enumerate(shard.chunks):
                _check_chunk(chunk, f"{where}, chunk {index}", end, shard.bytes, row_bytes)
                end = chunk.offset + chunk.bytes
            rows = sum(chunk.rows for chunk in shard.chunks)
            if rows != shard.sequences:
                raise UserError(f"{where}: its chunks hold {rows} rows, but sequences is {shard.sequences}; {_EDITED}")


def _check_chunk(chunk: ChunkInfo, where: str, after: int, shard_bytes: int, row_bytes: int) -> None:
    for field_name in ("offset", "bytes", "rows"):
        if not _is_count(getattr(chunk, field_name)):
            raise UserError(f"{where}: {field_name} {getattr(chunk, field_name)!r} is not a count (an integer "
                            f">= 0); {_EDITED}")
    if chunk.offset < after:
        raise UserError(f"{where}: offset {chunk.offset} lies before the end of the chunk before it (byte {after}); "
                        f"{_EDITED}")
    if chunk.offset + chunk.bytes > shard_bytes:
        raise UserError(f"{where}: offset {chunk.offset} + bytes {chunk.bytes} runs past the end of the shard "
                        f"(its bytes: {shard_bytes}); {_EDITED}")
    if chunk.rows < 1 or chunk.rows * row_bytes >= chunk.bytes:
        raise UserError(f"{where}: rows {chunk.rows} of {row_bytes} bytes each do not fit its bytes {chunk.bytes} "
                        f"(with the array's header); {_EDITED}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _another_format(source: str, version: object) -> str:
    """The one line for a manifest of another format than this unmask reads, with the fix."""
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        return (f"{source}: shard format version {version}, newer than this unmask reads ({FORMAT_VERSION}); "
                f"upgrade unmask")
    return (f"{source}: shard format version {version}, this unmask reads version {FORMAT_VERSION}; rerun `unmask "
            f"prep` with --overwrite (the same tokens, in this format)")
