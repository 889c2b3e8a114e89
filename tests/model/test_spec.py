"""The model spec: what config.json holds, and the network and process built from it."""

from dataclasses import asdict

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.autoregressive import Autoregressive
from model.learned import LearnedDiffusion
from model.schedules import make_schedule
from model.spec import ModelSpec, build_network, build_process, build_trainable
from model.trainable import NetworkWithSchedule, split_state
from model.transformer import Transformer, TransformerConfig
from model.uniform import UniformDiffusion

NETWORK = TransformerConfig(vocab_size=7, n_layers=1, d_model=16, n_heads=2, max_seq_len=8)


def test_the_spec_round_trips_through_its_dict():
    spec = ModelSpec(NETWORK, schedule="polynomial", schedule_args={"power": 2})
    record = {**spec.to_dict(), "weights": "ema", "step": 3}  # config.json holds more than the spec
    assert ModelSpec.from_dict(record) == spec


def test_a_record_without_a_key_or_with_an_unknown_network_field_is_refused():
    """config.json holds every key of the spec: one without one (an export an earlier unmask wrote)
    is refused naming the key, as is a network field this version does not know."""
    record = ModelSpec(NETWORK, schedule="cosine").to_dict()
    without_process = {key: value for key, value in record.items() if key != "process"}
    with pytest.raises(ValueError, match=r"no key 'process'.*export \(or import\) the model again"):
        ModelSpec.from_dict(without_process)
    unpadded = {**record, "network": {k: v for k, v in asdict(NETWORK).items() if k != "vocab_multiple"}}
    with pytest.raises(ValueError, match=r"no key 'network.vocab_multiple'"):
        ModelSpec.from_dict(unpadded)
    newer = {**record, "network": {**asdict(NETWORK), "a_field_of_a_newer_version": 1}}
    with pytest.raises(ValueError, match=r"a network field this unmask does not know, 'a_field_of_a_newer_version'"):
        ModelSpec.from_dict(newer)
    assert ModelSpec.from_dict(record) == ModelSpec(NETWORK, schedule="cosine")


@pytest.mark.parametrize("spec,kind", [
    (ModelSpec(NETWORK), AbsorbingDiffusion),
    (ModelSpec(NETWORK, process="uniform"), UniformDiffusion),
    (ModelSpec(NETWORK, process="learned", schedule="learned", schedule_args={"initial_exponent": 2.0}),
     LearnedDiffusion),
    (ModelSpec(NETWORK, objective="autoregressive"), Autoregressive),
])
def test_each_kind_builds_its_process_over_the_network_vocabulary(spec, kind):
    process = build_process(spec, validate=False)
    assert type(process) is kind
    assert (process.vocab_size, process.validate) == (7, False)
    assert build_process(spec).validate  # the stated default


def test_the_built_process_gives_the_bound_of_the_one_built_by_hand():
    spec = ModelSpec(NETWORK, schedule="polynomial", schedule_args={"power": 2})
    torch.manual_seed(0)
    network = build_network(spec)
    torch.manual_seed(0)
    assert torch.equal(Transformer(NETWORK).embed.weight, network.embed.weight)
    x0 = torch.randint(0, 7, (3, 8), generator=torch.Generator().manual_seed(1))
    by_hand = AbsorbingDiffusion(make_schedule("polynomial", power=2), 7, cross_entropy_chunk_rows=4)
    built = build_process(spec, cross_entropy_chunk_rows=4)
    assert built.cross_entropy_chunk_rows == 4
    assert torch.equal(built.nelbo(network, x0, generator=torch.Generator().manual_seed(2)),
                       by_hand.nelbo(network, x0, generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("fields,match", [
    ({"objective": "masked"}, "ModelSpec.objective must be one of"),
    ({"process": "absorb"}, "ModelSpec.process must be one of"),
    ({"process": "learned"}, "the learned process takes schedule 'learned'"),
    ({"schedule": "learned"}, "the learned process takes schedule 'learned'"),
])
def test_a_bad_spec_raises_value_error_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec(NETWORK, **fields)


@pytest.mark.parametrize("block_size,match", [
    (0, r"block_size must be an integer >= 1 \(null: one block, MDLM\), got 0"),
    (-16, "block_size must be an integer >= 1 .* got -16"),
    ("4", "block_size must be an integer >= 1 .* got '4'"),
    (True, "block_size must be an integer >= 1 .* got True"),
    (3, "block_size 3 does not divide network.max_seq_len 8: a block diffusion model scores and samples whole blocks"),
    (16, "block_size 16 does not divide network.max_seq_len 8"),
])
def test_a_block_size_training_and_the_imports_refuse_is_refused_by_the_spec(block_size, match):
    """The rules `unmask train` and `unmask import bd3lm` apply to a block size hold for every spec,
    an export's config.json included: an integer >= 1 that divides the network's window."""
    with pytest.raises(ValueError, match=match):
        ModelSpec(NETWORK, block_size=block_size)
    with pytest.raises(ValueError, match=rf"{match}.*; restore the value it was written with, or export \(or "
                                         rf"import\) the model again"):
        ModelSpec.from_dict({**ModelSpec(NETWORK, block_size=4).to_dict(), "block_size": block_size})
    assert ModelSpec(NETWORK, block_size=8).block_size == 8


def test_bad_schedule_arguments_are_a_value_error_naming_the_accepted_ones():
    """One line naming the argument and those the schedule takes, not Python's signature error."""
    with pytest.raises(ValueError, match=r"^schedule 'learned' has no argument 'power'; it takes initial_exponent, "
                                         r"endpoint_eps$"):
        build_process(ModelSpec(NETWORK, process="learned", schedule="learned", schedule_args={"power": 2}))
    with pytest.raises(ValueError, match=r"^schedule 'linear' has no argument 'power'; it takes endpoint_eps$"):
        build_process(ModelSpec(NETWORK, schedule_args={"power": 2}))


LEARNED = ModelSpec(NETWORK, process="learned", schedule="learned", schedule_args={"initial_exponent": 2.0})


def test_the_trained_module_holds_a_learned_schedule_beside_the_network():
    """What a trainer optimizes: the network, plus theta for the learned process, which the
    process keeps reading; the network is initialised as build_network's."""
    torch.manual_seed(0)
    trained = build_trainable(LEARNED)
    torch.manual_seed(0)
    network = build_network(LEARNED)
    assert isinstance(trained, NetworkWithSchedule) and trained.process.schedule is trained.schedule
    parameters = dict(trained.named_parameters())
    assert set(parameters) == {f"network.{name}" for name, _ in network.named_parameters()} | {"schedule.theta"}
    assert torch.equal(parameters["network.embed.weight"], network.embed.weight)
    torch.testing.assert_close(trained.schedule.exponents(), torch.full((7,), 2.0, dtype=torch.float64))
    assert trained.process.draws == 2  # MD4's leave-one-out pair
    for process in ("absorbing", "uniform"):
        assert type(build_trainable(ModelSpec(NETWORK, process=process))) is Transformer


def test_the_module_forward_is_the_bound_and_its_gradient_reaches_theta():
    trained = build_trainable(LEARNED)
    x0 = torch.randint(0, 7, (3, 8), generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    bound = trained(x0, t, torch.Generator().manual_seed(2))
    by_hand = trained.process.nelbo(trained.network, x0, t, torch.Generator().manual_seed(2), reconstruction="uniform")
    assert torch.equal(bound, by_hand)
    bound.sum().backward()
    assert bool((trained.schedule.theta.grad != 0).any())
    assert trained.network.embed.weight.grad is not None


def test_split_state_separates_the_network_from_the_schedule():
    trained = build_trainable(LEARNED)
    network, schedule = split_state(trained.state_dict())
    assert network.keys() == build_network(LEARNED).state_dict().keys() and list(schedule) == ["theta"]
    export_names = {"embed.weight": torch.zeros(1), "schedule.theta": torch.ones(1)}  # an export's file
    assert split_state(export_names) == ({"embed.weight": export_names["embed.weight"]},
                                         {"theta": export_names["schedule.theta"]})


def test_a_learned_process_is_rebuilt_from_its_trained_state():
    trained = build_process(LEARNED)
    with torch.no_grad():
        trained.schedule.theta.uniform_(-1.0, 2.0, generator=torch.Generator().manual_seed(0))
    rebuilt = build_process(LEARNED, draws=1, state=trained.schedule.state_dict())
    assert torch.equal(rebuilt.schedule.theta, trained.schedule.theta) and rebuilt.draws == 1
    with pytest.raises(ValueError, match="bad state for schedule 'learned'"):
        build_process(LEARNED, state={"theta": torch.zeros(3)})
    with pytest.raises(ValueError, match="bad state for schedule 'learned'"):
        build_process(LEARNED, state={})  # an export without its theta
    with pytest.raises(ValueError, match="the uniform process has no parameters"):
        build_process(ModelSpec(NETWORK, process="uniform"), state={"theta": torch.zeros(7)})


@pytest.mark.parametrize("spec", [ModelSpec(NETWORK, process="uniform"), LEARNED,
                                  ModelSpec(NETWORK, objective="autoregressive")])
def test_chunked_cross_entropy_is_refused_where_the_whole_prediction_is_scored(spec):
    with pytest.raises(ValueError, match="cross_entropy_chunk_rows applies to the absorbing process only"):
        build_process(spec, cross_entropy_chunk_rows=4)
