"""The streaming loader: coverage, balance across ranks, determinism, exact resume."""

import itertools
import json

import numpy as np
import pytest
import torch

from common.errors import UserError
from data_prep.shards.format import iter_chunks
from data_prep.shards.loader import StreamingLoader, _EpochStream
from data_prep.shards.storage import READ_STATS
from tests.support.shard_fixtures import write_numbered_split

SHARDS = [7, 5, 9, 3, 6]  # 30 sequences, uneven shards, chunks of 3 rows
SEQ_LEN = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("numbered")
    write_numbered_split(directory, SHARDS, seq_len=SEQ_LEN)
    return directory


def _ids(batches):
    """The sequence numbers in each batch (every row holds its own number)."""
    return [batch[:, 0].tolist() for batch in batches]


def test_batches_are_long_tensors_of_the_right_shape(data_dir):
    batch = next(iter(StreamingLoader(data_dir, "train", 4)))
    assert batch.dtype == torch.long and batch.shape == (4, SEQ_LEN)
    assert bool((batch == batch[:, :1]).all())


def test_ranks_get_equal_disjoint_batches_covering_the_data(data_dir):
    world, size = 2, 4
    loaders = [StreamingLoader(data_dir, "train", size, rank=r, world_size=world, seed=3) for r in range(world)]
    per_rank = [_ids(list(loader)) for loader in loaders]
    assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0]) == 30 // (world * size)
    seen = [i for rank in per_rank for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == 24 and set(seen) <= set(range(30))


def test_one_rank_sees_every_sequence_once_per_epoch(data_dir):
    loader = StreamingLoader(data_dir, "train", 5, seed=1)
    first, second = _ids(list(loader)), _ids(list(loader))
    assert sorted(itertools.chain(*first)) == list(range(30)) == sorted(itertools.chain(*second))
    assert first != second, "each epoch has its own order"
    assert _ids(list(StreamingLoader(data_dir, "train", 5, seed=1))) == first, "order is a function of the seed"
    assert _ids(list(StreamingLoader(data_dir, "train", 5, seed=2))) != first


def test_without_shuffle_the_order_is_the_corpus_order(data_dir):
    assert list(itertools.chain(*_ids(StreamingLoader(data_dir, "train", 6, shuffle=False)))) == list(range(30))


@pytest.mark.parametrize("world", [1, 2])
def test_dataloader_workers_do_not_change_the_stream(data_dir, world):
    for rank in range(world):
        plain = _ids(StreamingLoader(data_dir, "train", 2, rank=rank, world_size=world, seed=5))
        workers = _ids(StreamingLoader(data_dir, "train", 2, rank=rank, world_size=world, seed=5, num_workers=2))
        assert workers == plain


@pytest.mark.parametrize("num_workers,stop_after", [(0, 3), (0, 7), (2, 3), (2, 4), (0, 0)])
def test_resume_yields_exactly_the_batches_an_uninterrupted_run_would(data_dir, num_workers, stop_after):
    make = lambda: StreamingLoader(data_dir, "train", 2, rank=1, world_size=2, seed=9, num_workers=num_workers)
    reference = make()
    expected = [_ids(list(reference)), _ids(list(reference))]  # two epochs
    interrupted = make()
    consumed = _ids(itertools.islice(iter(interrupted), stop_after))
    state = interrupted.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert consumed + _ids(list(resumed)) == expected[0]
    assert _ids(list(resumed)) == expected[1], "the next epoch follows"


def test_state_at_an_epoch_boundary_moves_to_the_next_epoch(data_dir):
    loader = StreamingLoader(data_dir, "train", 3, seed=4)
    first = _ids(list(loader))
    state = loader.state_dict()
    assert (state["epoch"], state["global_batches"], state["micro_batches"]) == (1, 0, 0)
    resumed = StreamingLoader(data_dir, "train", 3, seed=4)
    resumed.load_state_dict(state)
    assert _ids(list(resumed)) != first and len(_ids(list(resumed))) == len(first)


# (world size, batch size) splits of one global batch of 6: accumulation 6, 3, 2, 1
SPLITS_OF_SIX = [(1, 1), (1, 2), (2, 1), (3, 2), (2, 3), (6, 1)]


def _global_batches(data_dir, world, size, epochs=2, state=None, **kwargs):
    """The loaders of all ranks, their batches put back into global batches of 6: micro-batch
    m of rank r is slot m * world + r."""
    loaders = [StreamingLoader(data_dir, "train", size, rank=r, world_size=world, global_batch_size=6, **kwargs)
               for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    per_rank = [[batch for _ in range(epochs) for batch in _ids(list(loader))] for loader in loaders]
    micro_batches = 6 // (world * size)
    return [sum((per_rank[slot % world][g * micro_batches + slot // world] for slot in range(world * micro_batches)),
                []) for g in range(len(per_rank[0]) // micro_batches)]


def test_global_batches_do_not_depend_on_the_ranks_and_micro_batches(data_dir):
    """Global batch g is the sequences [6g, 6g + 6) of the epoch's stream, however the ranks
    and micro-batches split it: a run resumed on another number of ranks sees the same data."""
    one_loader = StreamingLoader(data_dir, "train", 6, seed=3)
    stream = _ids(list(one_loader)) + _ids(list(one_loader))  # two epochs
    assert len(stream) == 2 * (30 // 6)
    for world, size in SPLITS_OF_SIX:
        assert _global_batches(data_dir, world, size, seed=3) == stream, (world, size)
    assert _global_batches(data_dir, 2, 1, seed=3, num_workers=2) == stream, "workers change nothing"


@pytest.mark.parametrize("before,after", [((2, 1), (3, 2)), ((3, 2), (1, 2)), ((1, 6), (2, 3))])
def test_resume_on_another_number_of_ranks_continues_the_global_batches(data_dir, before, after):
    world, size = before
    loaders = [StreamingLoader(data_dir, "train", size, rank=r, world_size=world, global_batch_size=6, seed=5)
               for r in range(world)]
    micro_batches = 6 // (world * size)
    for loader in loaders:  # two global batches (optimizer steps) consumed
        list(itertools.islice(iter(loader), 2 * micro_batches))
    states = [loader.state_dict() for loader in loaders]
    assert all(state == states[0] for state in states), "every rank stands at the same position"
    reference = _global_batches(data_dir, 1, 6, seed=5)
    assert _global_batches(data_dir, *after, state=states[0], seed=5) == reference[2:], after  # then the next epoch


def test_resume_refuses_another_global_batch_and_a_position_inside_one(data_dir):
    loader = StreamingLoader(data_dir, "train", 2, world_size=1, global_batch_size=6, seed=1)
    list(itertools.islice(iter(loader), 4))  # one global batch and one of the next one's 3 micro-batches
    state = loader.state_dict()
    assert (state["global_batches"], state["micro_batches"]) == (1, 1)
    with pytest.raises(UserError, match="global_batch_size: checkpoint 6, now 4"):
        StreamingLoader(data_dir, "train", 2, global_batch_size=4, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="inside global batch 1 .* at a global batch boundary"):
        StreamingLoader(data_dir, "train", 3, world_size=2, global_batch_size=6, seed=1).load_state_dict(state)
    same = StreamingLoader(data_dir, "train", 2, world_size=1, global_batch_size=6, seed=1)
    same.load_state_dict(state)  # the same split resumes anywhere
    assert _ids(list(same)) == _ids(list(StreamingLoader(data_dir, "train", 2, global_batch_size=6, seed=1)))[4:]


def test_a_position_counted_in_batches_of_a_rank_is_refused_in_one_line_with_the_fix(data_dir):
    """A position that counts the batches of one rank, not global batches, records no order of
    the data: it is refused, not mapped onto this order."""
    loader = StreamingLoader(data_dir, "train", 2, global_batch_size=4, seed=2)
    counted = {"epoch": 0, "batches": 4, "seed": 2, "shuffle": True, "batch_size": 2, "rank": 0, "world_size": 1,
               "data_sha256": loader.data_sha256}
    with pytest.raises(UserError, match=r"cannot resume the data loader: its position refers to another order of "
                                        r"the data \(order None; this unmask resumes order 2\); train again in a "
                                        r"new --run-dir") as caught:
        loader.load_state_dict(counted)
    assert "\n" not in str(caught.value)


def test_resume_with_a_different_setup_is_refused(data_dir):
    state = StreamingLoader(data_dir, "train", 2, seed=1).state_dict()
    other = StreamingLoader(data_dir, "train", 3, seed=2)
    with pytest.raises(UserError, match=r"seed: checkpoint 1, now 2.*batch_size: checkpoint 2, now 3"):
        other.load_state_dict(state)


def test_padded_tail_is_left_out_for_training(tmp_path):
    write_numbered_split(tmp_path, [4, 3], padding_tokens=5)
    kept = list(itertools.chain(*_ids(StreamingLoader(tmp_path, "train", 1, shuffle=False))))
    assert kept == list(range(6))
    everything = StreamingLoader(tmp_path, "train", 1, shuffle=False, drop_padded_tail=False)
    assert list(itertools.chain(*_ids(everything))) == list(range(7))


def test_bad_requests_are_refused(data_dir, tmp_path):
    with pytest.raises(UserError, match="split 'val' not in"):
        StreamingLoader(data_dir, "val", 2)
    with pytest.raises(UserError, match="too few"):
        StreamingLoader(data_dir, "train", 16, world_size=2)
    with pytest.raises(UserError, match="no manifest"):
        StreamingLoader(tmp_path, "train", 2)
    write_numbered_split(tmp_path, [4, 4])
    (tmp_path / "train" / "shard-000001.tar").unlink()
    with pytest.raises(UserError, match="shard-000001.tar: shard listed in the manifest is missing"):
        list(StreamingLoader(tmp_path, "train", 2, shuffle=False))


# ----------------------------------------------------------------------------- integrity
TAR_HEADER_BYTES, NPY_HEADER_BYTES = 512, 128  # npy format 1.0 pads its header to 128 bytes here


def _flip_payload_byte(path) -> None:
    """Change the first token of a shard's first chunk (not the tar headers): the tar still parses."""
    data = bytearray(path.read_bytes())
    position = TAR_HEADER_BYTES + NPY_HEADER_BYTES  # the first member's array data
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_shard_with_flipped_payload_bytes_stops_the_loader_with_its_name(tmp_path):
    write_numbered_split(tmp_path, [4, 4])
    shard = tmp_path / "train" / "shard-000001.tar"
    _flip_payload_byte(shard)
    with open(shard, "rb") as stream:
        first_chunk = next(iter_chunks(stream))
    assert first_chunk[0, 0] != 4, "the flip must change the data, or the test proves nothing"
    with pytest.raises(UserError, match=r"shard-000001.tar: the chunk at byte 512 differs from the manifest's sha256"):
        list(StreamingLoader(tmp_path, "train", 1, shuffle=False))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_truncated_shard_is_named_with_the_fix(tmp_path, num_workers):
    write_numbered_split(tmp_path, [4, 4])
    shard = tmp_path / "train" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(UserError, match=r"shard-000000.tar: ends before byte \d+ \(truncated; the manifest says"):
        list(StreamingLoader(tmp_path, "train", 1, shuffle=False, num_workers=num_workers))


def test_a_user_error_in_a_dataloader_worker_reaches_the_user_as_itself(tmp_path):
    """Raised in a worker, DataLoader re-raises it as "Caught UserError in DataLoader worker
    process 0" with the worker's traceback in the message: the user must see the one line."""
    write_numbered_split(tmp_path, [4, 4])
    shard = tmp_path / "train" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:700])
    messages = {}
    for workers in (0, 2):
        with pytest.raises(UserError) as caught:
            list(StreamingLoader(tmp_path, "train", 1, shuffle=False, num_workers=workers))
        messages[workers] = str(caught.value)
    assert messages[2] == messages[0] and "\n" not in messages[2]
    assert "shard-000000.tar: ends before byte" in messages[2]


@pytest.mark.parametrize("path", ["../outside.tar", "/etc/passwd", "train/../../outside.tar"])
def test_manifest_paths_outside_the_data_dir_are_refused(tmp_path, path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_numbered_split(data_dir, [4])
    manifest = json.loads((data_dir / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["path"] = path
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="leaves the data directory"):
        StreamingLoader(data_dir, "train", 1)


# ----------------------------------------------------------------------------- mixing
def _global_batch_ids(loader):
    return [batch[:, 0].tolist() for batch in loader]


@pytest.mark.parametrize("seed", [0, 1])
def test_each_global_batch_mixes_two_sources_in_their_corpus_share(tmp_path, seed):
    """Two sources prepped one after the other (78% then 22% of the sequences, as PTB train
    then tinyshakespeare): each global batch's count of the second source is binomial with
    the corpus share (a dispersion test across batches passes) and no batch is one source."""
    total, second_from, size = 5800, 4524, 64  # the second source: sequences 4524 ... 5799
    write_numbered_split(tmp_path, [256] * (total // 256) + [total % 256], seq_len=4, rows_per_chunk=16)
    loader = StreamingLoader(tmp_path, "train", size, seed=seed)
    counts = np.array([sum(i >= second_from for i in batch) for batch in _global_batch_ids(loader)])
    share = (total - second_from) / total
    assert 0 < counts.min() and counts.max() < size, "no global batch is all one source"
    dispersion = ((counts - size * share) ** 2).sum() / (size * share * (1 - share))
    df = len(counts) - 1
    assert (dispersion - df) / np.sqrt(2 * df) < 3.1, f"overdispersed: {dispersion:.0f} on {df} df"
    assert abs(counts.mean() / size - share) < 0.02


@pytest.mark.parametrize("world,size", [(1, 6), (2, 3), (3, 1), (6, 1)])
def test_windows_smaller_than_the_split_keep_global_batches_and_resume(data_dir, world, size):
    """A shuffle window of 2 global batches (12 sequences): 3 windows per epoch, the last
    shorter; the global batches still do not depend on the ranks, and resume is exact."""
    reference = _global_batches(data_dir, 1, 6, seed=7, shuffle_window=12)
    assert sorted(i for batch in reference[:5] for i in batch) == list(range(30))
    assert _global_batches(data_dir, world, size, seed=7, shuffle_window=12) == reference
    loader = StreamingLoader(data_dir, "train", 6, seed=7, shuffle_window=12)
    list(itertools.islice(iter(loader), 3))
    resumed = _global_batches(data_dir, world, size, seed=7, shuffle_window=12, state=loader.state_dict())
    assert resumed == reference[3:]
    whole = _global_batches(data_dir, 1, 6, seed=7)
    assert whole != reference, "the window changes the order"


# ----------------------------------------------------------------------------- read amplification
def _chunk_bytes(directory):
    manifest = json.loads((directory / "manifest.json").read_text())
    chunks = [c for shard in manifest["splits"]["train"]["shards"] for c in shard["chunks"]]
    return sum(c["bytes"] for c in chunks), max(c["bytes"] for c in chunks)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wide")
    write_numbered_split(directory, [512] * 16, seq_len=4, rows_per_chunk=16)  # 512 chunks
    return directory


@pytest.mark.parametrize("world,size,accumulation", [(1, 64, 1), (8, 8, 1), (4, 8, 2)])
def test_each_rank_reads_only_its_share(wide_dir, world, size, accumulation):
    """Bytes a rank reads in an epoch <= 1.25 x (split / W) + two chunks per stretch of its
    lanes per window (the pieces its stretches start and end in)."""
    split_bytes, chunk_bytes = _chunk_bytes(wide_dir)
    window, global_batch = 2048, world * size * accumulation
    windows = 8192 // window
    seen = []
    for rank in range(world):
        loader = StreamingLoader(wide_dir, "train", size, rank=rank, world_size=world, seed=3,
                                 global_batch_size=global_batch, shuffle_window=window)
        READ_STATS.reset()
        seen += [i for batch in loader for i in batch[:, 0].tolist()]
        bound = 1.25 * split_bytes / world + 2 * accumulation * windows * chunk_bytes
        assert split_bytes / world * 0.9 <= READ_STATS.bytes_read <= bound, (rank, READ_STATS.bytes_read, bound)
    assert sorted(seen) == list(range(8192)), "the ranks together still cover the epoch once"


def test_each_dataloader_worker_reads_only_its_share_of_the_ranks(wide_dir):
    """The workers of a rank split its lanes: each reads about half of what the rank reads."""
    loader = StreamingLoader(wide_dir, "train", 32, rank=1, world_size=2, seed=3, shuffle_window=2048)
    READ_STATS.reset()
    whole = torch.cat(list(_EpochStream(loader.plan, 0, 0).in_worker(0, 1)))
    rank_bytes = READ_STATS.bytes_read
    parts = []
    for part in range(2):
        READ_STATS.reset()
        parts.append(list(_EpochStream(loader.plan, 0, 0).in_worker(part, 2)))
        assert READ_STATS.bytes_read <= 0.5 * rank_bytes + 2 * 4 * _chunk_bytes(wide_dir)[1], part
    joined = torch.cat([torch.cat([a, b]) for a, b in zip(*parts)])
    assert torch.equal(joined, whole), "the workers' parts join into the rank's rows"


def test_a_manifest_of_format_1_is_refused_in_one_line_with_the_fix(tmp_path):
    write_numbered_split(tmp_path, [4])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 1
    for shard in manifest["splits"]["train"]["shards"]:
        del shard["chunks"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"manifest.json: shard format version 1, this unmask reads version 2; "
                                        r"rerun `unmask prep` with --overwrite") as caught:
        StreamingLoader(tmp_path, "train", 1)
    assert "\n" not in str(caught.value)


def test_a_position_without_the_order_of_the_data_is_refused_and_the_loader_stays_at_the_start(data_dir):
    """A position records the order of the data it refers to (``ORDER_VERSION``): one without
    it, or of another, would resume other batches than an uninterrupted run's next ones."""
    loader = StreamingLoader(data_dir, "train", 2, global_batch_size=6, seed=2)
    state = {**loader.state_dict(), "global_batches": 2}
    for other in ({key: value for key, value in state.items() if key not in ("order", "shuffle_window")},
                  {**state, "order": 1}):
        with pytest.raises(UserError, match=r"its position refers to another order of the data .*train again in "
                                            r"a new --run-dir"):
            loader.load_state_dict(other)
    assert loader.state_dict()["global_batches"] == 0
    loader.load_state_dict(state)  # a position of this order resumes
    assert _ids(list(loader)) == _ids(list(StreamingLoader(data_dir, "train", 2, global_batch_size=6, seed=2)))[6:]
