"""The model spec: what config.json holds, and the network and process built from it."""

from dataclasses import asdict

import pytest
import torch

from model.autoregressive import Autoregressive
from model.diffusion import MaskedDiffusion
from model.schedules import make_schedule
from model.spec import ModelSpec, build_network, build_process
from model.state_dependent import LearnedMaskedDiffusion
from model.transformer import Transformer, TransformerConfig
from model.uniform import UniformDiffusion

NETWORK = TransformerConfig(vocab_size=7, n_layers=1, d_model=16, n_heads=2, max_seq_len=8)


def test_the_spec_round_trips_through_its_dict():
    spec = ModelSpec(NETWORK, schedule="polynomial", schedule_args={"power": 2})
    record = {**spec.to_dict(), "weights": "ema", "step": 3}  # config.json holds more than the spec
    assert ModelSpec.from_dict(record) == spec


def test_an_export_written_before_the_process_key_reads_as_absorbing():
    legacy = {"network": {**asdict(NETWORK), "a_field_of_a_newer_version": 1}, "objective": "diffusion",
              "schedule": "cosine", "schedule_args": {}, "format_version": 1}
    spec = ModelSpec.from_dict(legacy)
    assert (spec.process, spec.schedule, spec.network) == ("absorbing", "cosine", NETWORK)


@pytest.mark.parametrize("spec,kind", [
    (ModelSpec(NETWORK), MaskedDiffusion),
    (ModelSpec(NETWORK, process="uniform"), UniformDiffusion),
    (ModelSpec(NETWORK, process="learned", schedule="learned", schedule_args={"initial_exponent": 2.0}),
     LearnedMaskedDiffusion),
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
    by_hand = MaskedDiffusion(make_schedule("polynomial", power=2), 7, cross_entropy_chunk_rows=4)
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


def test_bad_schedule_arguments_are_a_value_error():
    with pytest.raises(ValueError, match="bad arguments for schedule 'learned'"):
        build_process(ModelSpec(NETWORK, process="learned", schedule="learned", schedule_args={"power": 2}))
    with pytest.raises(ValueError, match="bad arguments for schedule 'linear'"):
        build_process(ModelSpec(NETWORK, schedule_args={"power": 2}))
