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
  an outage of a few minutes stalls training, it does not kill it. A refusal (401, 403: the
  credentials or the bucket's policy) and a missing bucket or object are final: one line at
  once, a refusal naming where the credentials came from (``credential_source``). A stop
  request (SIGTERM in training, ``common.stop_request``) ends a retry's wait at once.
- ``check_writable``: a destination URI is checked (its bucket, one object written and
  removed) before the work whose output goes there.
- ``ChunkCache``: a local directory of verified chunks, named by their sha256, kept under a
  size limit (least recently used first out), shared by the ranks and workers of a node.

The manual: docs/data-at-scale.md, "Training from a bucket".
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from common import stop_request
from common.errors import UserError
from data_prep.shards.format import MANIFEST_NAME, TOKENIZER_DIR, ChunkInfo, Manifest, ShardInfo

__all__ = ["READ_STATS", "ChunkCache", "ReadStats", "RetryPolicy", "ShardStore", "cache_root", "check_no_credentials",
           "check_writable", "credential_source", "default_cache_dir", "is_remote", "localize_metadata",
           "open_filesystem", "read_manifest", "read_remote_file", "resolve_location", "upload_data"]

log = logging.getLogger("unmask.storage")
T = TypeVar("T")

# Shards are reproducible from their inputs; a copied data directory can be copied again.
_SHARD_FIX = "copy the data again, or rerun `unmask prep` with --overwrite"
# Query parameters of a pyarrow S3 URI that would carry a secret.
_SECRET_PARAMS = ("access_key", "secret_key", "session_token")
# What a store's refusal of the credentials says, in the words of the AWS SDK (pyarrow's S3:
# ACCESS_DENIED; a HEAD request's 403 carries no body, so only its status names it), of S3's
# XML errors and of Google Cloud Storage. Waiting does not heal any of them.
_DENIED = ("ACCESS_DENIED", "AccessDenied", "INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId",
           "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch", "EXPIRED_TOKEN", "ExpiredToken",
           "HTTP status 401", "HTTP status 403", "PERMISSION_DENIED", "UNAUTHENTICATED")
# What a store says of a bucket or an object it does not have.
_MISSING = ("NO_SUCH_BUCKET", "NoSuchBucket", "NO_SUCH_KEY", "NoSuchKey", "does not exist", "past end of file")
# URI schemes whose first path component is a bucket.
_BUCKET_SCHEMES = ("s3", "gs", "gcs")


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


def _denied(err: OSError) -> bool:
    """The store refused the credentials, or its policy refuses them this request."""
    return isinstance(err, PermissionError) or any(word in str(err) for word in _DENIED)


def _transient(err: OSError) -> bool:
    """A refusal or a missing bucket or object will not heal by waiting; the rest may."""
    if isinstance(err, (FileNotFoundError, IsADirectoryError)) or _denied(err):
        return False
    return not any(word in str(err) for word in _MISSING)


def _first_line(err: OSError) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def credential_source(location: str) -> str:
    """Where the client of ``location``'s store takes its credentials from, in the order of
    the AWS SDK's default chain (what pyarrow's S3 uses): named in a refusal, never the key."""
    scheme = urlparse(location).scheme
    if scheme != "s3":
        return f"the {scheme}:// filesystem's default credentials"
    env = os.environ
    shared = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    if env.get("AWS_ACCESS_KEY_ID"):
        where = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment"
    elif shared.is_file():
        where = f"profile {env.get('AWS_PROFILE') or 'default'!r} of {shared}"
    elif env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        where = "the web identity token of AWS_WEB_IDENTITY_TOKEN_FILE (role AWS_ROLE_ARN)"
    elif env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        where = "the container's credentials endpoint (AWS_CONTAINER_CREDENTIALS_*)"
    else:
        where = f"the instance's role (no AWS_ACCESS_KEY_ID in the environment, no {shared})"
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    return where + (f", for the store at {endpoint} (AWS_ENDPOINT_URL)" if endpoint else "")


def _failure(name: str, location: str, err: OSError, retry: RetryPolicy, otherwise: str,
             kept: str = "") -> UserError:
    """The one line for an OSError that ``with_retries`` gave up on, on ``name`` of
    ``location``: a refusal names the credentials' source, an outage the retry budget, and
    anything else is said with ``otherwise``; ``kept`` (what is safe) ends the line."""
    if _denied(err):
        line = (f"{name}: access denied ({_first_line(err)}): the store refused the credentials from "
                f"{credential_source(location)}; check them, and that the bucket's policy allows them")
    elif _transient(err):
        line = f"{name}: unreachable for {retry.budget_s:.0f} s ({_first_line(err)}); check the store, then rerun"
    else:
        line = f"{name}: {_first_line(err)}; {otherwise}"
    return UserError(f"{line}; {kept}" if kept else line)


def with_retries(action: Callable[[], T], what: str, policy: RetryPolicy, stop: Event | None = None) -> T:
    """``action()``, retried with exponential backoff while it fails with a transient OSError;
    a stop request on ``stop`` (default: this process's, ``common.stop_request``) ends the
    wait at once with ``StopRequested``."""
    waited, wait, attempt = 0.0, policy.first_wait_s, 0
    while True:
        try:
            return action()
        except OSError as err:
            attempt += 1
            if not _transient(err) or waited >= policy.budget_s:
                raise
            pause = min(wait, policy.max_wait_s) * (0.5 + random.random() / 2)  # jitter: ranks do not sync up
            log.warning("%s: %s; retry %d in %.1f s", what, _first_line(err), attempt, pause)
            with _STATS_LOCK:
                READ_STATS.retries += 1
            stop_request.wait(pause, f"{what}: stopped while retrying ({_first_line(err)})", stop)
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
        # This process's stop event, which travels with the store to its DataLoader workers:
        # a signal to this process ends their retries too.
        self.stop = stop_request.event()
        self._filesystem = None  # opened lazily: the store travels to DataLoader workers by pickle

    def __getstate__(self) -> dict:
        # The event goes only to a process being started (a DataLoader worker); pickled for
        # anything else, the store takes the stop event of the process that unpickles it.
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {**self.__dict__, "_filesystem": None, "stop": self.stop if spawning else None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.stop is None:
            self.stop = stop_request.event()

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
                    size = os.fstat(handle.fileno()).st_size
                    return os.pread(handle.fileno(), _available(chunk, size), chunk.offset)
            except FileNotFoundError:
                raise UserError(f"{self.name(shard)}: shard listed in the manifest is missing; {_SHARD_FIX}") \
                    from None
        try:
            return with_retries(lambda: self._remote_range(shard, chunk), self.name(shard), self.retry, self.stop)
        except FileNotFoundError:
            raise UserError(f"{self.name(shard)}: shard listed in the manifest is missing; {_SHARD_FIX}") from None
        except OSError as err:
            raise _failure(self.name(shard), self.location, err, self.retry, _SHARD_FIX) from None

    def _remote_range(self, shard: ShardInfo, chunk: ChunkInfo) -> bytes:
        if self._filesystem is None:
            self._filesystem = open_filesystem(self.location)
        filesystem, base = self._filesystem
        with filesystem.open_input_file(f"{base.rstrip('/')}/{shard.path}") as handle:
            available = _available(chunk, handle.size())
            return handle.read_at(available, chunk.offset) if available else b""


def _available(chunk: ChunkInfo, size: int) -> int:
    """The bytes of ``chunk`` that a shard of ``size`` bytes holds: of a truncated shard, what
    it still holds (``ShardStore.read`` names the shard), never more than the file."""
    return max(0, min(chunk.bytes, size - chunk.offset))


def read_remote_file(location: str, relative: str, retry: RetryPolicy = RetryPolicy()) -> bytes:
    """The whole file ``location/relative`` of a filesystem URI (small files: the manifest, the
    tokenizer's), read with retries; ``FileNotFoundError`` if it is not there."""
    filesystem, base = open_filesystem(location)
    path = f"{base.rstrip('/')}/{relative}"

    def fetch() -> bytes:
        with filesystem.open_input_stream(path) as handle:
            return handle.read()

    return with_retries(fetch, f"{location.rstrip('/')}/{relative}", retry)


def _missing_bucket(location: str) -> str | None:
    """The bucket of ``location`` (an object store's URI) if the store does not have it."""
    if urlparse(location).scheme not in _BUCKET_SCHEMES:
        return None
    import pyarrow.fs as pafs

    filesystem, base = open_filesystem(location)
    bucket = base.strip("/").split("/")[0]
    info = with_retries(lambda: filesystem.get_file_info(bucket), f"{location}: the bucket", RetryPolicy())
    return bucket if info.type == pafs.FileType.NotFound else None


def read_manifest(location: str | Path, flag: str = "--data") -> Manifest:
    """The manifest of a data directory or of a data location's URI (given with ``flag``)."""
    if not is_remote(location):
        return Manifest.read(location)
    location = str(location)
    check_no_credentials(location, flag)
    name, retry = f"{location.rstrip('/')}/{MANIFEST_NAME}", RetryPolicy()
    try:
        try:
            data = read_remote_file(location, MANIFEST_NAME, retry)
        except FileNotFoundError:
            _refuse_a_missing_bucket(location, flag, "then run `unmask prep --out {location}`")
            raise UserError(f"{name}: no manifest; run `unmask prep --out {location}` first") from None
    except OSError as err:
        raise _failure(name, location, err, retry, "cannot read the manifest") from None
    return Manifest.from_json(data.decode("utf-8", errors="replace"), name)


def _refuse_a_missing_bucket(location: str, flag: str, then: str) -> None:
    """A UserError if the store lacks the bucket of ``location``; its fix ends with ``then``."""
    bucket = _missing_bucket(location)
    if bucket is not None:
        raise UserError(f"{flag} {location}: the bucket {bucket!r} does not exist at this store; check the name, or "
                        f"create the bucket and {then.format(location=location)}")


def check_writable(location: str, flag: str) -> None:
    """Before the work whose output goes to ``location`` (a URI, given with ``flag``): its
    bucket exists and takes an object (one written and removed), so that a refusal comes
    before the work, not after it. A store that lets the probe in but not out keeps it (a
    warning says so)."""
    check_no_credentials(location, flag)
    filesystem, base = open_filesystem(location)
    probe, retry = f"{base.rstrip('/')}/.unmask-write-check-{os.getpid()}", RetryPolicy()

    def put() -> None:
        with filesystem.open_output_stream(probe) as out:
            out.write(b"")

    try:
        _refuse_a_missing_bucket(location, flag, "rerun")
        with_retries(put, f"{flag} {location}", retry)
    except OSError as err:
        raise _failure(f"{flag} {location}", location, err, retry, "cannot write there") from None
    try:
        with_retries(lambda: filesystem.delete_file(probe), f"{flag} {location}", retry)
    except OSError as err:
        log.warning("%s %s: cannot remove the write check %s (%s); remove it by hand", flag, location,
                    probe.rsplit("/", 1)[-1], _first_line(err))


def default_cache_dir() -> Path:
    """Where chunks and metadata from remote stores are kept: ``$XDG_CACHE_HOME/unmask``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unmask"


def cache_root(cache_dir: str | None) -> Path:
    """The directory that caches what is read from object storage: ``cache_dir`` (the config's
    ``data.cache_dir``; None: ``default_cache_dir()``), created if missing and checked by
    writing a file there; a one-line UserError naming the setting and the fix otherwise."""
    path = Path(cache_dir) if cache_dir else default_cache_dir()
    setting = "data.cache_dir" if cache_dir else "the default cache directory ($XDG_CACHE_HOME/unmask)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".unmask-write-check-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        in_the_way = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        problem = ("is a file, not a directory" if in_the_way == path else f"lies below {in_the_way}, a file"
                   if in_the_way is not None else f"cannot be written ({err.strerror or err})")
        raise UserError(f"{setting} = {path}: {problem}; the data read from object storage is cached there: "
                        f"set data.cache_dir to a writable directory") from None
    return path


def localize_metadata(location: str, cache_dir: str | Path) -> Path:
    """A local directory holding the manifest and the tokenizer of the data at ``location``
    (a URI), under ``cache_dir`` (``cache_root``'s): what training reads besides the
    shards. Fetched again when the manifest or the tokenizer's objects changed; written under
    a temporary name and renamed, so ranks that fetch it at once each see a whole copy. A
    tokenizer missing from the store is named there, not in the local copy."""
    manifest = read_manifest(location).to_json()
    retry, tokenizer = RetryPolicy(), f"{location.rstrip('/')}/{TOKENIZER_DIR}"
    try:
        files = _remote_files(location, TOKENIZER_DIR, retry)
        if not files:
            raise UserError(f"{tokenizer}: missing from the store, where the manifest records the tokenizer the "
                            f"shards were made with; upload the prep's {TOKENIZER_DIR}/ there again (rerunning the "
                            f"same `unmask prep --out {location}` sends what the store lacks)")
        key = hashlib.sha256(f"{location}\n{manifest}\n{files}".encode()).hexdigest()[:24]
        target = Path(cache_dir) / "metadata" / key
        if (target / MANIFEST_NAME).is_file():
            return target
        contents = {relative: read_remote_file(location, relative, retry) for relative, _, _ in files}  # small
    except FileNotFoundError:  # removed between the listing and the read
        raise UserError(f"{tokenizer}: changed while it was read; rerun") from None
    except OSError as err:
        raise _failure(tokenizer, location, err, retry, "cannot read the tokenizer") from None
    staging = target.with_name(f".{key}.{os.getpid()}")
    try:
        for relative, data in {**contents, MANIFEST_NAME: manifest.encode()}.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_bytes(data)
    except OSError as err:
        raise UserError(f"{staging}: cannot write the local copy of {location}'s manifest and tokenizer "
                        f"({err.strerror or err}); set data.cache_dir to a writable directory") from None
    try:
        os.replace(staging, target)
    except OSError:  # another rank renamed its copy first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remote_files(location: str, directory: str, retry: RetryPolicy) -> list[tuple[str, int, int]]:
    """(path relative to ``location``, size, mtime in ns) of the files under
    ``location/directory`` (a URI), in path order."""
    import pyarrow.fs as pafs

    filesystem, base = open_filesystem(location)
    base = base.rstrip("/")
    selector = pafs.FileSelector(f"{base}/{directory}", allow_not_found=True, recursive=True)
    infos = with_retries(lambda: filesystem.get_file_info(selector), f"{location.rstrip('/')}/{directory}", retry)
    return sorted((info.path[len(base) + 1:], info.size, info.mtime_ns or 0) for info in infos
                  if info.type == pafs.FileType.File)


def upload_data(local: Path, location: str, skip: tuple[str, ...] = ()) -> int:
    """Copy a finished prep in ``local`` to ``location`` (a URI); the number of files sent.
    The shards and the tokenizer go first, the manifest last: a reader sees either no
    manifest or one whose every shard is there. A file already there with the same size is
    not sent again (a rerun after a failed upload resumes it; shards are named by content
    through the manifest's checksums, which every read checks). A failure is one line that
    says the prep is kept in ``local``."""
    filesystem, base = open_filesystem(location)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.relative_to(local).parts[0] not in skip)
    files.sort(key=lambda p: p.name == MANIFEST_NAME)  # the manifest last
    sent, retry = 0, RetryPolicy()
    for path in files:
        relative = path.relative_to(local).as_posix()
        target, name = f"{base.rstrip('/')}/{relative}", f"{location.rstrip('/')}/{relative}"

        def put(target: str = target, path: Path = path) -> None:
            with filesystem.open_output_stream(target) as out:  # one object, visible whole once closed
                out.write(path.read_bytes())

        try:
            info = with_retries(lambda target=target: filesystem.get_file_info(target), name, retry)
            if relative != MANIFEST_NAME and info.size == path.stat().st_size:
                continue
            with_retries(put, name, retry)
        except OSError as err:
            raise _failure(name, location, err, retry, "cannot upload it",
                           kept=f"the prep is kept in {local}: rerun the same command to send what the store lacks") \
                from None
        sent += 1
    return sent
