"""Shared test helpers."""

import os

from common.ray_runtime import pin_local_ray_to_loopback

pin_local_ray_to_loopback()  # before anything imports ray: tests talk to 127.0.0.1 only

pytest_plugins = ["tests.support.mlflow_server"]

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.oracle import EnumerableDistribution  # noqa: E402


class ConstantDenoiser:
    """Predicts the same distribution at every position; counts its calls and times."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.logits = probs.log().float()
        self.calls: list[torch.Tensor] = []

    def __call__(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(t.clone())
        return self.logits.expand(*z.shape, -1).clone()


def z_scores(samples: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|mean - truth| / standard error, per column of ``samples`` [repeats, ...]."""
    standard_error = samples.std(0) / samples.shape[0] ** 0.5
    return (samples.mean(0) - truth).abs() / standard_error


def chi_square_statistic(samples: torch.Tensor, law: torch.Tensor, oracle: EnumerableDistribution) -> float:
    """Pearson's statistic of the sequences ``samples`` [N, L] against the probabilities ``law``
    over its support (infinite if a sample falls outside); int((law > 0).sum()) - 1 degrees of freedom."""
    counts = torch.bincount(oracle.index_of(samples), minlength=len(law)).double()
    support = law > 0
    if bool(counts[~support].any()):
        return math.inf
    expected = samples.shape[0] * law[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


# One false alarm in 10^4 per check (the tests use fixed seeds, so it never flakes).
CHI_SQUARE_NORMAL_QUANTILE = 3.719


def chi_square_limit(degrees_of_freedom: int) -> float:
    """The 1 - 1e-4 quantile of chi-square(k), by Wilson and Hilferty's cube-root normal
    approximation (about 1% high for k = 10, 2% for k = 5; no scipy needed)."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + CHI_SQUARE_NORMAL_QUANTILE * (2 / (9 * k)) ** 0.5) ** 3


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
