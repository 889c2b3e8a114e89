"""Where shards are read from: a local directory or any pyarrow filesystem URI, one chunk at a time.

A data location is a local path or a URI (``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``;
a scheme pyarrow lacks goes through fsspec). The loader reads each chunk it needs with one
range request (``ChunkInfo``: offset and length in the shard), so a rank fetches only its
share of the data, and checks the chunk's sha256 as it reads it: a truncated, altered or
missing object stops the run with one line naming the shard and the fix.

Remote reads:
- Credentials come only from the environment or the provider's chain (``AWS_ACCESS_KEY_ID``,
  instance roles, ``~/.aws``); a URI that carries a key is refused, so none reaches a flag,
  a log line or MLflow. ``AWS_ENDPOINT_URL`` points S3 at any S3-compatible store.
- A transient failure (503, a reset or refused connection, a timeout) is retried with
  exponential backoff for up to ``RetryPolicy.budget_s`` seconds, logged once per attempt:
  an outage of a few minutes stalls training, it does not kill it.
- ``ChunkCache``: a local directory of verified chunks, named by their sha256, kept under a
  size limit (least recently used first out), shared by the ranks and workers of a node.

The manual: docs/data-at-scale.md, "Training from a bucket".
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import urlparse

from common.errors import UserError
from data_prep.shards.format import MANIFEST_NAME, TOKENIZER_DIR, ChunkInfo, Manifest, ShardInfo

__all__ = ["ChunkCache", "ReadStats", "RetryPolicy", "ShardStore", "check_no_credentials", "default_cache_dir",
           "is_remote", "localize_metadata", "open_filesystem", "read_manifest", "read_remote_file", "resolve_location",
           "upload_data",
           "READ_STATS"]

log = logging.getLogger("unmask.storage")
T = TypeVar("T")

# Shards are reproducible from their inputs; a copied data directory can be copied again.
_SHARD_FIX = "copy the data again, or rerun `unmask prep` with --overwrite"
# Query parameters of a pyarrow S3 URI that would carry a secret.
_SECRET_PARAMS = ("access_key", "secret_key", "session_token")


def is_remote(location: str | Path) -> bool:
    """Whether ``location`` is a filesystem URI (``s3://...``) rather than a local path."""
    scheme = urlparse(str(location)).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


def resolve_location(location: str | Path) -> str:
    """``location`` as another process elsewhere names it: a URI unchanged, a path absolute."""
    return str(location) if is_remote(location) else str(Path(location).resolve())


def check_no_credentials(uri: str, flag: str = "--data") -> None:
    """Refuse a URI that carries a key: credentials come from the environment only."""
    parsed = urlparse(uri)
    if parsed.username or parsed.password or any(f"{p}=" in parsed.query for p in _SECRET_PARAMS):
        raise UserError(f"{flag}: the URI carries credentials; remove them and set AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY (or the provider's chain) in the environment instead")


def open_filesystem(uri: str):
    """(pyarrow filesystem, base path) of a URI; fsspec where pyarrow lacks the scheme."""
    import pyarrow.fs as pafs

    check_no_credentials(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except ValueError:  # pyarrow's ArrowInvalid: a scheme it has no filesystem for
        pass
    except OSError as err:
        raise UserError(f"{uri}: cannot open the filesystem ({err})") from None
    try:
        import fsspec

        filesystem, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as err:
        raise UserError(f"{uri}: no filesystem for this scheme in pyarrow or fsspec ({err})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), path


@dataclass(frozen=True)
class RetryPolicy:
    """How long a transient storage error is retried before the run stops."""

    budget_s: float = 600.0      # total wait: longer than a store's restart or a short outage
    first_wait_s: float = 0.2
    max_wait_s: float = 20.0


@dataclass
class ReadStats:
    """Bytes this process fetched from the data location (a cache hit is not a fetch)."""

    bytes_read: int = 0
    requests: int = 0
    cache_hits: int = 0
    retries: int = 0

    def reset(self) -> None:
        self.bytes_read = self.requests = self.cache_hits = self.retries = 0


READ_STATS = ReadStats()
_STATS_LOCK = threading.Lock()


def _transient(err: OSError) -> bool:
    """A missing object or a refused permission will not heal by waiting; the rest may."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    text = str(err)
    return not any(word in text for word in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "does not exist",
                                             "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                             "past end of file"))


def with_retries(action: Callable[[], T], what: str, policy: RetryPolicy) -> T:
    """``action()``, retried with exponential backoff while it fails with a transient OSError."""
    waited, wait, attempt = 0.0, policy.first_wait_s, 0
    while True:
        try:
            return action()
        except OSError as err:
            attempt += 1
            if not _transient(err) or waited >= policy.budget_s:
                raise
            pause = min(wait, policy.max_wait_s) * (0.5 + random.random() / 2)  # jitter: ranks do not sync up
            log.warning("%s: %s; retry %d in %.1f s", what, str(err).splitlines()[0], attempt, pause)
            with _STATS_LOCK:
                READ_STATS.retries += 1
            time.sleep(pause)
            waited, wait = waited + pause, wait * 2


class ChunkCache:
    """Verified chunks on local disk, named by sha256, at most ``limit_bytes`` in all."""

    def __init__(self, directory: str | Path, limit_bytes: int) -> None:
        self.directory, self.limit_bytes = Path(directory), limit_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written_since_trim = 0

    def _path(self, digest: str) -> Path:
        return self.directory / digest[:2] / digest

    def get(self, digest: str) -> bytes | None:
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        os.utime(path)  # recently used: trimmed last
        return data

    def put(self, digest: str, data: bytes) -> None:
        path = self._path(digest)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # ranks and workers share the cache: a reader sees a whole file or none
        self._written_since_trim += len(data)
        if self._written_since_trim > self.limit_bytes // 8:
            self.trim()

    def trim(self) -> None:
        """Delete the least recently used chunks until the cache fits its limit."""
        self._written_since_trim = 0
        entries = []
        for path in self.directory.glob("??/*"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # trimmed by another process
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


class ShardStore:
    """Reads verified chunks of the shards under ``location`` (a directory or a URI)."""

    def __init__(self, location: str | Path, cache: ChunkCache | None = None,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        self.location, self.cache, self.retry = str(location), cache, retry
        self.remote = is_remote(location)
        self._filesystem = None  # opened lazily: the store travels to DataLoader workers by pickle

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_filesystem": None}

    def name(self, shard: ShardInfo) -> str:
        return f"{self.location.rstrip('/')}/{shard.path}"

    def read(self, shard: ShardInfo, chunk: ChunkInfo) -> bytes:
        """The bytes of one chunk, checked against its sha256; ``UserError`` naming the shard if
        they are missing, short or altered."""
        if self.cache is not None and (data := self.cache.get(chunk.sha256)) is not None:
            if hashlib.sha256(data).hexdigest() == chunk.sha256:
                with _STATS_LOCK:
                    READ_STATS.cache_hits += 1
                return data
        data = self._fetch(shard, chunk)
        with _STATS_LOCK:
            READ_STATS.bytes_read += len(data)
            READ_STATS.requests += 1
        if len(data) != chunk.bytes:
            raise UserError(f"{self.name(shard)}: ends before byte {chunk.offset + chunk.bytes} (truncated; the "
                            f"manifest says {shard.bytes} bytes); {_SHARD_FIX}")
        if hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise UserError(f"{self.name(shard)}: the chunk at byte {chunk.offset} differs from the manifest's "
                            f"sha256 (the file is corrupt); {_SHARD_FIX}")
        if self.cache is not None:
            try:
                self.cache.put(chunk.sha256, data)
            except OSError as err:  # a full or read-only cache disk slows reading; it does not stop training
                log.warning("chunk cache %s: %s; reading on without caching this chunk", self.cache.directory, err)
        return data

    def _fetch(self, shard: ShardInfo, chunk: ChunkInfo) -> bytes:
        if not self.remote:
            try:
                with open(Path(self.location) / shard.path, "rb") as handle:
                    return os.pread(handle.fileno(), chunk.bytes, chunk.offset)
            except FileNotFoundError:
                raise UserError(f"{self.name(shard)}: shard listed in the manifest is missing; {_SHARD_FIX}") \
                    from None
        try:
            return with_retries(lambda: self._remote_range(shard, chunk), self.name(shard), self.retry)
        except FileNotFoundError:
            raise UserError(f"{self.name(shard)}: shard listed in the manifest is missing; {_SHARD_FIX}") from None
        except OSError as err:
            if not _transient(err):
                raise UserError(f"{self.name(shard)}: {str(err).splitlines()[0]}; {_SHARD_FIX}") from None
            raise UserError(f"{self.name(shard)}: unreachable for {self.retry.budget_s:.0f} s "
                            f"({str(err).splitlines()[0]}); check the store and resume the run") from None

    def _remote_range(self, shard: ShardInfo, chunk: ChunkInfo) -> bytes:
        if self._filesystem is None:
            self._filesystem = open_filesystem(self.location)
        filesystem, base = self._filesystem
        with filesystem.open_input_file(f"{base.rstrip('/')}/{shard.path}") as handle:
            # A truncated object: what it still holds of the chunk (``read`` names the shard).
            available = max(0, min(chunk.bytes, handle.size() - chunk.offset))
            return handle.read_at(available, chunk.offset) if available else b""


def read_remote_file(location: str, relative: str, retry: RetryPolicy = RetryPolicy()) -> bytes:
    """The whole file ``location/relative`` of a filesystem URI (small files: the manifest, the
    tokenizer's), read with retries; ``FileNotFoundError`` if it is not there."""
    filesystem, base = open_filesystem(location)
    path = f"{base.rstrip('/')}/{relative}"

    def fetch() -> bytes:
        with filesystem.open_input_stream(path) as handle:
            return handle.read()

    return with_retries(fetch, f"{location.rstrip('/')}/{relative}", retry)


def read_manifest(location: str | Path) -> Manifest:
    """The manifest of a data directory or of a data location's URI."""
    if not is_remote(location):
        return Manifest.read(location)
    name = f"{str(location).rstrip('/')}/{MANIFEST_NAME}"
    try:
        text = read_remote_file(str(location), MANIFEST_NAME).decode()
    except FileNotFoundError:
        raise UserError(f"{name}: no manifest; run `unmask prep --out {location}` first") from None
    except OSError as err:
        raise UserError(f"{name}: cannot read the manifest ({str(err).splitlines()[0]})") from None
    return Manifest.from_json(text, name)


def default_cache_dir() -> Path:
    """Where chunks and metadata from remote stores are kept: ``$XDG_CACHE_HOME/unmask``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unmask"


def localize_metadata(location: str, cache_root: str | Path) -> Path:
    """A local directory holding the manifest and the tokenizer of the data at ``location``
    (a URI), under ``cache_root``: what training reads besides the shards. Fetched again when
    the manifest changed; written under a temporary name and renamed, so ranks that fetch it
    at once each see a whole copy."""
    manifest = read_manifest(location).to_json()
    key = hashlib.sha256(f"{location}\n{manifest}".encode()).hexdigest()[:24]
    target = Path(cache_root) / "metadata" / key
    if (target / MANIFEST_NAME).is_file():
        return target
    staging = target.with_name(f".{key}.{os.getpid()}")
    filesystem, base = open_filesystem(location)
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(f"{base.rstrip('/')}/{TOKENIZER_DIR}", allow_not_found=True, recursive=True)
    for info in with_retries(lambda: filesystem.get_file_info(selector), location, RetryPolicy()):
        if info.type == pafs.FileType.File:
            relative = info.path[len(base.rstrip("/")) + 1:]
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_bytes(read_remote_file(location, relative))
    staging.mkdir(parents=True, exist_ok=True)
    (staging / MANIFEST_NAME).write_text(manifest)
    try:
        os.replace(staging, target)
    except OSError:  # another rank renamed its copy first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def upload_data(local: Path, location: str, skip: tuple[str, ...] = ()) -> int:
    """Copy a finished prep in ``local`` to ``location`` (a URI); the number of files sent.
    The shards and the tokenizer go first, the manifest last: a reader sees either no
    manifest or one whose every shard is there. A file already there with the same size is
    not sent again (a rerun after a failed upload resumes it; shards are named by content
    through the manifest's checksums, which every read checks)."""
    filesystem, base = open_filesystem(location)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.relative_to(local).parts[0] not in skip)
    files.sort(key=lambda p: p.name == MANIFEST_NAME)  # the manifest last
    sent = 0
    for path in files:
        relative = path.relative_to(local).as_posix()
        target = f"{base.rstrip('/')}/{relative}"
        info = with_retries(lambda: filesystem.get_file_info(target), f"{location}/{relative}", RetryPolicy())
        if relative != MANIFEST_NAME and info.size == path.stat().st_size:
            continue

        def put() -> None:
            with filesystem.open_output_stream(target) as out:  # one object, visible whole once closed
                out.write(path.read_bytes())

        with_retries(put, f"{location.rstrip('/')}/{relative}", RetryPolicy())
        sent += 1
    return sent
