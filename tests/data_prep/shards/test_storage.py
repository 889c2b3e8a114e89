"""Shards straight from object storage: a real S3-compatible server (moto's) on 127.0.0.1,
reached through pyarrow's S3 client by ``AWS_ENDPOINT_URL``; the faults a store has."""

import itertools
import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from data_prep.shards import storage
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import READ_STATS, ChunkCache
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
