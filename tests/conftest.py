"""pytest's hooks for the whole suite: Ray pinned to 127.0.0.1, the MLflow server plugin, and the
fixtures several folders share (the oracle, tinyshakespeare's shards, a finished micro run,
untrained exports, one torch thread, a private MLflow store). Helpers that tests import live in
``tests/support``."""

import os

from common.ray_runtime import pin_local_ray_to_loopback

pin_local_ray_to_loopback()  # before anything imports ray: tests talk to 127.0.0.1 only

pytest_plugins = ["tests.support.mlflow_server"]

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.oracle import EnumerableDistribution  # noqa: E402

# The oracle's (vocabulary size, sequence length) unless a module sets ORACLE_SIZE.
DEFAULT_ORACLE_SIZE = (3, 4)


@pytest.fixture(scope="module")
def oracle(request) -> EnumerableDistribution:
    """An exact enumerable distribution over sequences: random (seed 0) of the requesting
    module's ``ORACLE_SIZE`` = (vocabulary size, sequence length), 3 x 4 by default."""
    vocab_size, seq_len = getattr(request.module, "ORACLE_SIZE", DEFAULT_ORACLE_SIZE)
    return EnumerableDistribution.random(vocab_size, seq_len, torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def tinyshakespeare_shards(tmp_path_factory):
    """Tokenizer and shards of the start of tinyshakespeare (seq_len 64), by the real prep."""
    from tests.support.train_helpers import make_tinyshakespeare_shards

    return make_tinyshakespeare_shards(tmp_path_factory.mktemp("tinyshakespeare"))


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory, tinyshakespeare_shards):
    """A finished 2-step run of `unmask train` on ``tinyshakespeare_shards`` (a checkpoint at
    each step, validation at steps 0 and 2, no export). Tests copy it before changing it."""
    from tests.support.train_helpers import MICRO_RUN, run_train, write_config

    root = tmp_path_factory.mktemp("micro-run")
    return run_train(root / "run", tinyshakespeare_shards, write_config(root / "micro.yaml", MICRO_RUN)).run_dir


@pytest.fixture(scope="session")
def block_export(tmp_path_factory, tinyshakespeare_shards):
    """An untrained block diffusion export (blocks of 8, max_seq_len 64) over the shards' tokenizer."""
    from data_prep.tokenizer.load import load_tokenizer
    from tests.support.export_fixtures import write_untrained_export

    tokenizer_dir = tinyshakespeare_shards / "tokenizer"
    return write_untrained_export(tmp_path_factory.mktemp("bd3") / "export", load_tokenizer(tokenizer_dir),
                                  tokenizer_dir, config={"block_size": 8}, max_seq_len=64)


@pytest.fixture(scope="session")
def exports_of_every_kind(tmp_path_factory) -> dict:
    """Loaded untrained exports of every kind (masked, uniform, learned, block diffusion, ar) over a
    tokenizer of ``LINES`` (``tests.support.export_fixtures``); a test that moves a network to a
    device puts it back."""
    from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
    from pipeline.interchange.export import load_export
    from tests.support.export_fixtures import EXPORT_LENGTH, EXPORT_VOCAB, LINES, write_untrained_export

    root = tmp_path_factory.mktemp("host_device")
    tokenizer = train_sentencepiece(LINES, root / "tok", vocab_size=EXPORT_VOCAB)
    configs = {"masked": ("diffusion", {}, {}), "uniform": ("diffusion", {"process": "uniform"},
                                                            {"time_conditioning": True}),
               "learned": ("diffusion", {"process": "learned", "schedule": "learned"}, {}),
               "block": ("diffusion", {"block_size": 8}, {}),   # block diffusion: KV cache, given_clean
               "ar": ("autoregressive", {}, {})}
    return {name: load_export(write_untrained_export(root / name, tokenizer, root / "tok", objective=objective,
                                                     config=config, max_seq_len=EXPORT_LENGTH, **network))
            for name, (objective, config, network) in configs.items()}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny networks and thousands of small tensor ops: on a busy 2-core machine intra-op
    threads only add hand-off overhead. Modules opt in with usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def shared_mlflow_store(tmp_path_factory):
    """The runs of this session share one MLflow store of their own, never the user's
    (``~/.unmask``) nor one named by MLFLOW_TRACKING_URI; subprocesses inherit it."""
    saved = {name: os.environ.get(name) for name in ("UNMASK_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["UNMASK_HOME"] = str(tmp_path_factory.mktemp("unmask-home"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
