"""Training with ``model.document_mask``: the network gets the data's EOS as its document
separator, the export records it, and the exported network scores validation as training did
(masked: the same number; the same weights unmasked: another)."""

from dataclasses import replace

import pytest
import torch


def test_document_mask_gives_the_network_the_data_s_eos(tinyshakespeare_shards):
    from data_prep.shards.format import Manifest
    from pipeline.config import ModelSection
    from pipeline.training.build import network_config

    manifest = Manifest.read(tinyshakespeare_shards)
    assert network_config(ModelSection(document_mask=True), manifest).document_separator == \
        manifest.tokenizer["eos_id"]
    assert network_config(ModelSection(), manifest).document_separator is None


@pytest.mark.slow
def test_a_document_masked_run_trains_and_its_export_reproduces_validation(tmp_path, tinyshakespeare_shards):
    """A real run (DeepSpeed on CPU): the export's network masks documents as training did, and
    its validation bound is the logged one; without the mask the same weights score otherwise."""
    from data_prep.shards.loader import StreamingLoader
    from model.transformer import Transformer
    from pipeline.interchange.export import export, load_export
    from pipeline.training.objective import MicroBatchSlot, make_objective
    from tests.support.train_helpers import run_train, write_config

    config = write_config(tmp_path / "c.yaml", {"model": {"document_mask": True}, "train": {"max_steps": 3}})
    run = run_train(tmp_path / "run", tinyshakespeare_shards, config)
    exported = load_export(export(run.run_dir))
    eos = exported.tokenizer.eos_id
    assert exported.config["network"]["document_separator"] == eos == exported.network.config.document_separator
    unmasked = Transformer(replace(exported.network.config, document_separator=None))
    unmasked.load_state_dict(exported.network.state_dict())
    objective = make_objective(exported.spec, validate=True)

    def validation(network, batches: int = 2) -> float:
        """The bound of the first ``batches`` val batches, at validation's times and masks."""
        loader = StreamingLoader(tinyshakespeare_shards, "val", 2, seed=1234, shuffle=False)
        total, tokens = 0.0, 0
        with torch.no_grad():
            for i, batch in zip(range(batches), loader):
                slot = MicroBatchSlot(seed=1234, step=i, rank=0, world_size=1, micro=0, micro_batches=1)
                total += float(objective.loss_sum(network, batch, slot))
                tokens += batch.numel()
        return total / tokens

    assert validation(exported.network) == pytest.approx(run.validations()[3], rel=1e-6)  # eval.batches = 2
    # 16 sequences of 64 tokens: documents of ~60 tokens, some EOS left visible by the noise
    # (a masked one splits nothing); 3 steps from the start, a small difference, not rounding.
    assert abs(validation(unmasked, 8) / validation(exported.network, 8) - 1) > 1e-6
