"""Exports of untrained small networks, written by the exporter's own writer: what
``unmask sample``, ``load_export`` and the manual's examples read, without a training run; and
the text and sizes of the exports of every kind that the device tests share (``tests/conftest.py``'s
``exports_of_every_kind``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from model.learned import LearnedSchedule
from model.spec import ModelSpec
from model.trainable import SCHEDULE_PREFIX
from model.transformer import Transformer, preset
from pipeline.interchange.export import EXPORT_FORMAT_VERSION, write_export

if TYPE_CHECKING:
    from data_prep.tokenizer.base import Tokenizer

# One layer of width 32: a `tiny` network that builds in milliseconds.
SMALL_NETWORK = {"n_layers": 1, "d_model": 32, "n_heads": 2}
# The exports of every kind: their tokenizer's vocabulary, trained on LINES, and their context.
EXPORT_VOCAB, EXPORT_LENGTH = 300, 32
LINES = [f"the {animal} sat on the {place} at {i}." for i in range(200)
         for animal, place in [(("cat", "dog", "fox", "owl")[i % 4], ("mat", "log", "hill", "roof")[i * 3 % 4])]]


def write_untrained_export(out: Path, tokenizer: Tokenizer, tokenizer_dir: Path, *,
                           objective: str = "diffusion", config: dict | None = None, **network) -> Path:
    """Write ``out``: an untrained ``SMALL_NETWORK`` (``network`` overrides its fields; causal
    for the autoregressive ``objective``) over ``tokenizer``'s vocabulary, the tokenizer saved
    in ``tokenizer_dir``, and ``config`` (e.g. a schedule) added to the export's config."""
    shape = {**SMALL_NETWORK, "causal": objective == "autoregressive", **network}
    model = Transformer(preset("tiny", tokenizer.vocab_size, **shape))
    record = {"format_version": EXPORT_FORMAT_VERSION, **ModelSpec(network=model.config, objective=objective).to_dict(),
              **(config or {}), "weights": "ema", "step": 0, "tokenizer_sha256": tokenizer.sha256}
    tensors = model.state_dict()
    if record.get("process") == "learned":  # the learned schedule's theta, at its initial value
        tensors.update({f"{SCHEDULE_PREFIX}{name}": value for name, value in
                        LearnedSchedule(tokenizer.vocab_size).state_dict().items()})
    write_export(out, tensors, record, tokenizer_dir)
    return out
