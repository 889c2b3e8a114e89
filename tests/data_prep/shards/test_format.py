"""The shard format: reproducible tars, WebDataset-readable chunks, the manifest."""

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
import webdataset as wds

from common.errors import UserError
from data_prep.shards.format import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    chunk_rows,
    decode_chunk,
    iter_chunks,
    token_dtype,
    write_shard,
)
from tests.support.shard_fixtures import write_numbered_split


def _sequences(rows=10, seq_len=16, seed=0):
    return np.random.default_rng(seed).integers(0, 50257, (rows, seq_len)).astype("<u2")


def test_write_is_reproducible_and_atomic(tmp_path):
    seqs = _sequences()
    a = write_shard(tmp_path / "a" / "shard.tar", seqs, 0, rows_per_chunk=4)
    b = write_shard(tmp_path / "b" / "shard.tar", seqs, 0, rows_per_chunk=4)
    assert a == b
    assert (tmp_path / "a" / "shard.tar").read_bytes() == (tmp_path / "b" / "shard.tar").read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["shard.tar"]  # no temporary left
    with tarfile.open(tmp_path / "a" / "shard.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["000000-000000.tokens.npy", "000000-000001.tokens.npy",
                                         "000000-000002.tokens.npy"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}


def test_chunks_round_trip_through_webdataset(tmp_path):
    seqs = _sequences(rows=11)
    write_shard(tmp_path / "s.tar", seqs, 3, rows_per_chunk=4)
    with open(tmp_path / "s.tar", "rb") as stream:
        chunks = list(iter_chunks(stream))
    assert [len(c) for c in chunks] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate(chunks), seqs)
    # The stock WebDataset pipeline reads the same samples.
    samples = list(wds.WebDataset(str(tmp_path / "s.tar"), shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == ["000003-000000", "000003-000001", "000003-000002"]
    np.testing.assert_array_equal(np.concatenate([s["tokens.npy"] for s in samples]), seqs)


def test_dtype_and_chunking_rules():
    assert token_dtype(50257) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")
    assert chunk_rows(1024, np.dtype("<u2")) == CHUNK_BYTES // 2048
    assert chunk_rows(10**7, np.dtype("<u4")) == 1


def test_container_overhead_is_under_two_percent(tmp_path):
    seq_len, dtype = 1024, np.dtype("<u2")
    rows = chunk_rows(seq_len, dtype) * 4 + 7
    seqs = np.zeros((rows, seq_len), dtype)
    write_shard(tmp_path / "s.tar", seqs, 0, chunk_rows(seq_len, dtype))
    overhead = (tmp_path / "s.tar").stat().st_size / seqs.nbytes - 1
    assert 0 < overhead < 0.02


def test_foreign_member_is_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("000000.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    buffer.seek(0)
    with pytest.raises(UserError, match="not an unmask shard"):
        list(iter_chunks(buffer, "x.tar"))


def test_manifest_round_trip_and_errors(tmp_path):
    manifest = write_numbered_split(tmp_path, [5, 4])
    again = Manifest.read(tmp_path)
    assert again == manifest and again.sha256() == manifest.sha256()
    with pytest.raises(UserError, match="no manifest; run `unmask prep"):
        Manifest.read(tmp_path / "missing")
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    raw["format_version"] = 99
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(UserError, match="format version 99, newer than this unmask reads .2.; upgrade unmask"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(UserError, match="not a valid unmask manifest"):
        Manifest.read(tmp_path)


def test_a_manifest_larger_than_its_limit_is_refused_without_reading_it(tmp_path):
    write_numbered_split(tmp_path, [5, 4])
    with open(tmp_path / MANIFEST_NAME, "r+b") as handle:
        handle.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: reading it would take a GiB of memory
    with pytest.raises(UserError, match=r"manifest.json: holds more than 1 GiB, the most unmask reads as a shard "
                                        r"manifest; check that the path names a shard manifest"):
        Manifest.read(tmp_path)


@pytest.mark.parametrize(("field", "value", "complaint"), [
    ("bytes", 10**15, r"offset \d+ \+ bytes 1000000000000000 runs past the end of the shard \(its bytes: \d+\)"),
    ("rows", 10**12, r"rows 1000000000000 of 16 bytes each do not fit its bytes \d+ \(with the array's header\)"),
    ("offset", -512, r"offset -512 is not a count \(an integer >= 0\)"),
    ("offset", 512, r"offset 512 lies before the end of the chunk before it \(byte \d+\)"),
])
def test_a_hand_edited_chunk_table_is_refused_before_anything_is_read(tmp_path, field, value, complaint):
    """A chunk's byte count of 10^15 was a MemoryError in os.pread, rows of 10^12 a ValueError
    inside a DataLoader worker, an offset of -512 an OSError: the manifest is checked against
    the shard sizes it records, one line naming the shard, the chunk and the field."""
    from data_prep.shards.loader import StreamingLoader

    write_numbered_split(tmp_path, [5, 4], rows_per_chunk=2)
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    raw["splits"]["train"]["shards"][0]["chunks"][1][field] = value
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(UserError, match=rf"manifest.json: shard train/shard-000000.tar, chunk 1: {complaint}; "
                                        r"the manifest was edited or damaged: rerun the `unmask prep` that made it, "
                                        r"with --overwrite$") as caught:
        StreamingLoader(tmp_path, "train", 2)
    assert "\n" not in str(caught.value)


def test_a_chunk_table_that_disagrees_with_the_shards_sequences_is_refused(tmp_path):
    write_numbered_split(tmp_path, [5, 4], rows_per_chunk=2)
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    raw["splits"]["train"]["shards"][1]["sequences"] = 5
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"shard train/shard-000001.tar: its chunks hold 4 rows, but sequences is 5"):
        Manifest.read(tmp_path)


def test_the_chunk_ranges_are_the_members_data_with_their_sha256(tmp_path):
    """A reader fetches one chunk with one range request and checks it without reading the
    rest of the shard: each ChunkInfo is exactly its member's bytes."""
    seqs = _sequences(rows=11)
    written = write_shard(tmp_path / "s.tar", seqs, 0, rows_per_chunk=4)
    data = (tmp_path / "s.tar").read_bytes()
    assert written.bytes == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    assert [c.rows for c in written.chunks] == [4, 4, 3]
    with tarfile.open(tmp_path / "s.tar") as tar:
        members = tar.getmembers()
        for member, chunk in zip(members, written.chunks, strict=True):
            assert (chunk.offset, chunk.bytes) == (member.offset_data, member.size)
            assert tar.extractfile(member).read() == data[chunk.offset:chunk.offset + chunk.bytes]
            assert hashlib.sha256(data[chunk.offset:chunk.offset + chunk.bytes]).hexdigest() == chunk.sha256
    np.testing.assert_array_equal(
        np.concatenate([decode_chunk(data[c.offset:c.offset + c.bytes], "s.tar") for c in written.chunks]), seqs)


def test_a_prep_of_an_older_format_is_replaced_only_with_overwrite(tmp_path):
    """The loader asks to rerun `unmask prep --overwrite` on older data: prep itself must
    then replace it (and without --overwrite say so), not fail on the old manifest."""
    from data_prep.resume import start_or_resume

    write_numbered_split(tmp_path, [4])
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    raw["format_version"] = 1
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"holds a prep in shard format 1 \(this unmask writes format 2\); pass "
                                        r"--overwrite"):
        start_or_resume(tmp_path, {"sha256": "new"}, overwrite=False)
    assert start_or_resume(tmp_path, {"sha256": "new"}, overwrite=True) == (None, "")
    assert not (tmp_path / MANIFEST_NAME).exists() and not (tmp_path / "train").exists()


def test_a_prep_of_a_newer_format_or_a_damaged_manifest_is_named_so_and_replaced_only_with_overwrite(tmp_path):
    """A newer unmask's prep is not called old; a hand-damaged manifest does not stop the
    rerun that the refusal of it advises."""
    from data_prep.resume import start_or_resume

    write_numbered_split(tmp_path, [4])
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**raw, "format_version": 9}))
    with pytest.raises(UserError, match=r"holds a prep of a newer unmask \(shard format 9; this one writes format 2: "
                                        r"upgrade unmask to resume it\); pass --overwrite"):
        start_or_resume(tmp_path, {"sha256": "new"}, overwrite=False)
    raw["splits"]["train"]["shards"][0]["chunks"][0]["offset"] = -512
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"holds a damaged manifest \(.*offset -512 is not a count.*\); pass "
                                        r"--overwrite"):
        start_or_resume(tmp_path, {"sha256": "new"}, overwrite=False)
    assert start_or_resume(tmp_path, {"sha256": "new"}, overwrite=True) == (None, "")
    assert not (tmp_path / MANIFEST_NAME).exists()
