"""Shared test helpers."""

from orchestration.ray_runtime import pin_local_ray_to_loopback

pin_local_ray_to_loopback()  # before anything imports ray: tests talk to 127.0.0.1 only

pytest_plugins = ["tests.mlflow_server"]

import pytest  # noqa: E402
import torch  # noqa: E402

from model.oracle import EnumerableDistribution  # noqa: E402


class ConstantDenoiser:
    """Predicts the same distribution at every position; counts its calls and times."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.logits = probs.log().float()
        self.calls: list[torch.Tensor] = []

    def __call__(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(t.clone())
        return self.logits.expand(*z.shape, -1).clone()


@pytest.fixture
def small_oracle() -> EnumerableDistribution:
    return EnumerableDistribution.random(3, 4, torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def tinyshakespeare_shards(tmp_path_factory):
    """Tokenizer and shards of the start of tinyshakespeare (seq_len 64), by the real prep."""
    from tests.train_helpers import make_tinyshakespeare_shards

    return make_tinyshakespeare_shards(tmp_path_factory.mktemp("tinyshakespeare"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny networks and thousands of small tensor ops: on a busy 2-core machine intra-op
    threads only add hand-off overhead. Modules opt in with usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
