"""Shards straight from object storage: a real S3-compatible server (moto's) on 127.0.0.1,
reached through pyarrow's S3 client by ``AWS_ENDPOINT_URL``; the faults a store has."""

import itertools
import json
import math
import os
import re
import threading
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from common import stop_request
from common.errors import UserError
from common.stop_request import StopRequested
from data_prep.shards import loader, storage
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import READ_STATS, ChunkCache
from tests.support.cli_refusals import one_line_error
from tests.support.cli_runner import run_unmask
from tests.support.paths import GPT2, TINY
from tests.support.s3_server import CREDENTIALS, S3Server
from tests.support.shard_fixtures import write_numbered_split
from tests.support.train_helpers import run_train, write_config

SHARDS = [40, 40, 40, 40]  # 160 sequences of 8 tokens, chunks of 4 rows


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One server for the module, its endpoint and keys in the environment (and only there)."""
    server = S3Server()
    saved = {key: os.environ.get(key) for key in server.env}
    os.environ.update(server.env)
    server.start()
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    write_numbered_split(directory, SHARDS, rows_per_chunk=4)
    return directory


@pytest.fixture(scope="module")
def remote_data(s3, local_data):
    return s3.upload(local_data, "shards", "corpus/v1")


def _ids(batches):
    return [batch[:, 0].tolist() for batch in batches]


def _make(data, **kwargs):
    return StreamingLoader(data, "train", 4, rank=1, world_size=2, seed=5, shuffle_window=16, **kwargs)


def test_batches_from_s3_are_those_from_the_local_copy(local_data, remote_data, tmp_path):
    assert _ids(_make(remote_data)) == _ids(_make(local_data))
    assert _ids(_make(remote_data, num_workers=2)) == _ids(_make(local_data)), "workers read the store too"


def test_the_cache_serves_a_second_epoch_and_keeps_its_size_limit(local_data, remote_data, tmp_path):
    chunk = (local_data / "train" / "shard-000000.tar").stat().st_size // 10  # more than one chunk's bytes
    cached = _make(remote_data, cache=ChunkCache(tmp_path / "cache", limit_bytes=1 << 30))
    READ_STATS.reset()
    first = _ids(cached)
    fetched = READ_STATS.bytes_read
    assert fetched > 0 and READ_STATS.cache_hits == 0
    READ_STATS.reset()
    again = _make(remote_data, cache=ChunkCache(tmp_path / "cache", limit_bytes=1 << 30))
    assert _ids(again) == first and READ_STATS.bytes_read == 0 and READ_STATS.cache_hits > 0
    small = ChunkCache(tmp_path / "small", limit_bytes=3 * chunk)
    assert _ids(_make(remote_data, cache=small)) == first
    small.trim()
    held = sum(p.stat().st_size for p in (tmp_path / "small").glob("??/*"))
    assert 0 < held <= 3 * chunk


def test_a_restarted_server_stalls_the_epoch_but_loses_or_repeats_no_batch(s3, local_data, remote_data):
    """The server goes down after the first batch and comes back once the loader has met the
    outage (refused connections, retried): the epoch goes on with exactly the batches of the
    local copy."""
    expected = _ids(_make(local_data))
    loader = _make(remote_data)
    READ_STATS.reset()
    batches = iter(loader)
    got = _ids(itertools.islice(batches, 1))
    s3.stop()

    def come_back() -> None:
        while READ_STATS.retries == 0:  # the loader has met the refused connections
            threading.Event().wait(0.05)
        s3.start()

    restarter = threading.Thread(target=come_back)
    restarter.start()
    got += _ids(batches)
    restarter.join()
    assert READ_STATS.retries > 0, "the outage was met"
    assert got == expected


def test_a_truncated_object_is_named_in_one_line(s3, local_data, tmp_path):
    broken = tmp_path / "data"
    write_numbered_split(broken, SHARDS, rows_per_chunk=4)
    shard = broken / "train" / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    uri = s3.upload(broken, "shards", "truncated")
    with pytest.raises(UserError, match=r"^s3://shards/truncated/train/shard-000002.tar: ends before byte \d+ "
                                        r"\(truncated; the manifest says \d+ bytes\); copy the data again") as caught:
        list(_make(uri, num_workers=1))
    assert "\n" not in str(caught.value)


def test_a_missing_object_and_a_missing_manifest_are_named(s3, local_data):
    uri = s3.upload(local_data, "shards", "missing")
    s3.filesystem().delete_file("shards/missing/train/shard-000001.tar")
    with pytest.raises(UserError, match=r"s3://shards/missing/train/shard-000001.tar: shard listed in the "
                                        r"manifest is missing"):
        list(_make(uri))
    with pytest.raises(UserError, match=r"s3://shards/nothing-here/manifest.json: no manifest; run "
                                        r"`unmask prep --out s3://shards/nothing-here` first"):
        _make("s3://shards/nothing-here")


def test_credentials_in_a_uri_are_refused(s3):
    with pytest.raises(UserError, match="the URI carries credentials; remove them and set AWS_ACCESS_KEY_ID"):
        _make("s3://AKIAEXAMPLE:secret@shards/corpus/v1")
    with pytest.raises(UserError, match="the URI carries credentials"):
        _make("s3://shards/corpus/v1?access_key=AKIAEXAMPLE&secret_key=secret")


def test_every_sequence_once_per_epoch_from_s3(remote_data):
    loader = StreamingLoader(remote_data, "train", 8, seed=2, shuffle_window=32)
    seen = sorted(i for batch in loader for i in batch[:, 0].tolist())
    assert seen == list(range(160)) and torch.is_tensor(next(iter(loader)))


@pytest.mark.slow
def test_prep_out_to_s3_then_train_and_eval_from_s3_keep_keys_out_of_the_run(s3, tmp_path):
    """`unmask prep --out s3://...` uploads the shards, then the manifest; `unmask train --data
    s3://...` trains on them through the chunk cache and `unmask eval --shards s3://...`
    scores their val split; the store's keys (in the environment only) appear in no file of
    the run, the evaluation, the MLflow store or the cache."""
    source = tmp_path / "input.txt"
    source.write_text(TINY.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    env = {**s3.env, "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/ml.db"}
    uri = "s3://prepped/tiny/v1"
    s3.filesystem().create_dir("prepped")
    prep = run_unmask(["prep", "--input", str(source), "--out", uri, "--seq-len", "64", "--tokenizer", str(GPT2),
                       "--val-fraction", "0.1", "--no-progress"], env=env)
    assert prep.returncode == 0, prep.stderr
    assert "(the manifest last)" in prep.stdout
    again = run_unmask(["prep", "--input", str(source), "--out", uri, "--seq-len", "64", "--tokenizer", str(GPT2),
                        "--val-fraction", "0.1", "--no-progress"], env=env)
    assert again.returncode == 0 and "uploaded 1 file(s)" in again.stdout, "a rerun sends only the manifest"
    manifest = storage.read_manifest(uri)
    assert sum(s.sequences for s in manifest.splits["train"].shards) >= 48
    refused = run_unmask(["prep", "--input", str(source), "--out", "s3://KEY:SECRET@prepped/x", "--seq-len", "64",
                          "--tokenizer", str(GPT2)], env=env)
    assert refused.returncode != 0 and "--out: the URI carries credentials" in refused.stderr
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 3}, "checkpoint": {"every": 3}})
    run = run_train(tmp_path / "run", uri, config, env=env)
    assert all(math.isfinite(v) for v in run.losses().values()) and len(run.losses()) == 3
    assert any((tmp_path / "cache" / "unmask" / "chunks").glob("??/*")), "chunks went through the cache"
    scored = run_unmask(["eval", str(run.run_dir), "--datasets", "val", "--shards", uri, "--max-documents", "40",
                         "--samples", "2", "--batch-size", "8", "--out", str(tmp_path / "eval")], env=env)
    assert scored.returncode == 0, scored.stderr
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"]["val"]["dataset"]["path"] == uri
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"].encode()
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            assert secret not in path.read_bytes(), path


def test_transient_errors_are_retried_and_lasting_ones_are_not():
    """A 503 (SlowDown) or a reset connection is retried with backoff until it heals; a
    missing object or a refused key is raised at once."""
    policy = storage.RetryPolicy(budget_s=5.0, first_wait_s=0.001, max_wait_s=0.002)
    failures = [OSError("AWS Error SLOW_DOWN (HTTP status 503) during GetObject operation: Please reduce "
                        "your request rate."), ConnectionResetError("Connection reset by peer")]

    def flaky():
        if failures:
            raise failures.pop(0)
        return b"ok"

    READ_STATS.reset()
    assert storage.with_retries(flaky, "s3://b/x", policy) == b"ok" and READ_STATS.retries == 2
    for lasting in (FileNotFoundError("Path does not exist"), OSError("AWS Error ACCESS_DENIED: AccessDenied")):
        calls = []

        def fails(error=lasting):
            calls.append(1)
            raise error

        with pytest.raises(OSError):
            storage.with_retries(fails, "s3://b/x", policy)
        assert len(calls) == 1


def test_the_ray_train_launcher_passes_a_uri_through():
    """What the launcher hands its workers (``orchestration.cluster.ray_train.launch``)."""
    assert storage.resolve_location("s3://bucket/shards/v1") == "s3://bucket/shards/v1"
    assert storage.resolve_location("shards") == str((Path.cwd() / "shards").resolve())


def test_a_scheme_pyarrow_lacks_goes_through_fsspec(local_data):
    """``memory://`` has no pyarrow filesystem; fsspec's in-process one serves the same chunks."""
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in sorted(p for p in local_data.rglob("*") if p.is_file()):
        memory.pipe(f"/fsspec-data/{path.relative_to(local_data).as_posix()}", path.read_bytes())
    assert _ids(_make("memory://fsspec-data")) == _ids(_make(local_data))


# ------------------------------------------------------------------ refusals: final at once, in one line
def test_a_refused_key_is_final_at_once_and_names_where_the_credentials_came_from(s3, remote_data):
    """Every request answered 403: 45 retries over 10 minutes before; now one line, no retry,
    naming the credentials' source (never the key)."""
    loader = _make(remote_data)  # the manifest read while the key was good
    source = (f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment, for the store at {s3.endpoint} "
              f"(AWS_ENDPOINT_URL); check them, and that the bucket's policy allows them")
    READ_STATS.reset()
    with s3.refusing_credentials():
        with pytest.raises(UserError, match=r"^s3://shards/corpus/v1/manifest.json: access denied \(.*ACCESS_DENIED"
                                            r".*\): the store refused the credentials from ") as refused:
            storage.read_manifest(remote_data)
        with pytest.raises(UserError, match=r"^s3://shards/corpus/v1/train/shard-00000\d.tar: access denied") as read:
            list(loader)
    for error in (refused, read):
        assert str(error.value).endswith(source) and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in str(error.value)
    assert READ_STATS.retries == 0


def test_the_credentials_source_is_named_in_the_order_the_sdk_looks(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    assert storage.credential_source("s3://b/x") == (f"the instance's role (no AWS_ACCESS_KEY_ID in the environment, "
                                                     f"no {tmp_path / 'credentials'})")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/token")
    assert storage.credential_source("s3://b/x").startswith("the web identity token of AWS_WEB_IDENTITY_TOKEN_FILE")
    (tmp_path / "credentials").write_text("[research]\n")
    monkeypatch.setenv("AWS_PROFILE", "research")
    assert storage.credential_source("s3://b/x") == f"profile 'research' of {tmp_path / 'credentials'}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://minio.lab:9000")
    assert storage.credential_source("s3://b/x") == ("AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment, "
                                                     "for the store at https://minio.lab:9000 (AWS_ENDPOINT_URL)")
    assert storage.credential_source("gs://b/x") == "the gs:// filesystem's default credentials"


def test_a_missing_bucket_is_named_as_such_for_reading_and_for_writing(s3):
    """`train --data s3://nosuchbucket/...` advised a prep into the bucket that is not there."""
    with pytest.raises(UserError, match=r"^--data s3://nosuchbucket/shards: the bucket 'nosuchbucket' does not exist "
                                        r"at this store; check the name, or create the bucket and then run `unmask "
                                        r"prep --out s3://nosuchbucket/shards`$"):
        storage.read_manifest("s3://nosuchbucket/shards")
    with pytest.raises(UserError, match=r"^--out s3://nosuchbucket/shards: the bucket 'nosuchbucket' does not exist"):
        storage.check_writable("s3://nosuchbucket/shards", "--out")
    storage.check_writable("s3://shards/fresh", "--out")
    assert not s3.filesystem().get_file_info(pafs.FileSelector("shards/fresh", allow_not_found=True)), \
        "the write check leaves nothing"


def test_prep_out_to_a_bucket_that_does_not_exist_is_refused_before_the_prep(s3, tmp_path, monkeypatch, capsys):
    """It was a 25-line traceback after the whole local prep (NO_SUCH_BUCKET at the upload)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "input.txt"
    source.write_text("a paragraph of text\n\nand another one\n" * 20)
    err = one_line_error(capsys, "prep", "--input", str(source), "--out", "s3://bucket-that-does-not-exist/shards",
                         "--seq-len", "16", "--tokenizer", str(GPT2), "--no-progress")
    assert err.endswith("--out s3://bucket-that-does-not-exist/shards: the bucket 'bucket-that-does-not-exist' does "
                        "not exist at this store; check the name, or create the bucket and rerun")
    assert not (tmp_path / "cache").exists(), "nothing was prepared"


def test_an_upload_the_store_refuses_is_one_line_that_keeps_the_prep(s3, local_data):
    with s3.refusing_credentials(), pytest.raises(UserError) as refused:
        storage.upload_data(local_data, "s3://shards/refused")
    assert str(refused.value).startswith("s3://shards/refused/train/shard-000000.tar: access denied")
    assert str(refused.value).endswith(f"; the prep is kept in {local_data}: rerun the same command to send what the "
                                       f"store lacks")


def test_a_tokenizer_missing_from_the_bucket_is_named_there_not_in_the_local_copy(s3, tinyshakespeare_shards,
                                                                                  tmp_path):
    """The message named only the local cache and advised putting the tokenizer back there;
    and a local copy made of a damaged tokenizer would have been used after its repair."""
    from pipeline.training.build import find_tokenizer

    uri = s3.upload(tinyshakespeare_shards, "shards", "tokenizer-gone")
    bucket, model = s3.filesystem(), "shards/tokenizer-gone/tokenizer/tokenizer.model"
    bucket.delete_file(model)
    with pytest.raises(UserError, match=rf"^{uri}/tokenizer: missing from the store, where the manifest records the "
                                        rf"tokenizer the shards were made with; upload the prep's tokenizer/ there "
                                        rf"again \(rerunning the same `unmask prep --out {uri}` sends what the store "
                                        rf"lacks\)$"):
        storage.localize_metadata(uri, tmp_path)
    with bucket.open_output_stream(model) as out:
        out.write(b"not a sentencepiece model")
    damaged = storage.localize_metadata(uri, tmp_path)
    with pytest.raises(UserError) as refused:
        find_tokenizer(storage.read_manifest(uri), damaged, uri)
    assert str(refused.value).startswith(f"{uri}/manifest.json: the shards were made with tokenizer 'tokenizer'")
    assert f"but {uri}/tokenizer (its copy in {damaged / 'tokenizer'}) cannot be loaded" in str(refused.value)
    assert str(refused.value).endswith(f"Put the tokenizer of the shards back in {uri}/tokenizer, or prep the corpus "
                                       f"again with the one there (into a new --out)")
    s3.upload(tinyshakespeare_shards / "tokenizer", "shards", "tokenizer-gone/tokenizer")
    restored = storage.localize_metadata(uri, tmp_path)
    assert restored != damaged and find_tokenizer(storage.read_manifest(uri), restored, uri).kind == "sentencepiece"


def test_an_unusable_cache_dir_is_named_by_its_setting(s3, remote_data, tmp_path, monkeypatch, capsys):
    """A file (or a path below one) as data.cache_dir was a 27-54-line NotADirectoryError."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    fix = "; the data read from object storage is cached there: set data.cache_dir to a writable directory"
    with pytest.raises(UserError, match=rf"^data.cache_dir = {a_file}: is a file, not a directory{re.escape(fix)}$"):
        storage.cache_root(str(a_file))
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))
    with pytest.raises(UserError, match=rf"^the default cache directory \(\$XDG_CACHE_HOME/unmask\) = {a_file}/unmask: "
                                        rf"lies below {a_file}, a file"):
        storage.cache_root(None)
    with pytest.raises(UserError, match=r"^data.cache_dir = /sys/unmask-cache: cannot be written \(.+\); the data"):
        storage.cache_root("/sys/unmask-cache")  # sysfs takes no directory of ours, even from root
    assert storage.cache_root(str(tmp_path / "new" / "cache")).is_dir()
    run = tmp_path / "run"
    err = one_line_error(capsys, "train", "--data", remote_data, "--run-dir", str(run), "--data.cache_dir",
                         str(a_file / "sub"))
    assert f"data.cache_dir = {a_file / 'sub'}: lies below {a_file}, a file" in err and not run.exists()


# ------------------------------------------------------------------ a stop request ends the retries
def test_a_stop_request_ends_a_retry_at_once_in_this_process_and_in_a_dataloader_worker(s3, remote_data):
    """While the store is down, a signal (the trainer's handler calls ``stop_request.request``)
    ends the retry's wait at once with ``StopRequested``, in a reading thread or in a worker
    process; the outage alone was retried for ``RetryPolicy.budget_s`` (600 s)."""
    in_threads, in_worker = _make(remote_data), _make(remote_data, num_workers=1)
    READ_STATS.reset()
    s3.stop()
    try:
        def stop_when_retrying() -> None:
            while READ_STATS.retries == 0:  # a read of this process has met the outage and waits
                threading.Event().wait(0.05)
            stop_request.request()

        stopper = threading.Thread(target=stop_when_retrying)
        stopper.start()
        with pytest.raises(StopRequested, match=r"s3://shards/corpus/v1/train/shard-00000\d.tar: stopped while "
                                                r"retrying \(.*\)$"):
            list(in_threads)
        stopper.join()
        assert READ_STATS.retries < 2 * loader.READ_THREADS, "each reading thread gave up at its first wait"
        with pytest.raises(StopRequested, match="stopped while retrying"):  # the stop already requested
            list(in_worker)
    finally:
        stop_request.reset()
        s3.start()
    assert _ids(_make(remote_data)) == _ids(_make(remote_data)), "the store serves again; nothing is stopped"
