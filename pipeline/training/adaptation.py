"""Adapting an autoregressive model into a diffusion model: the network and weights the run starts from.

A diffusion run started from a causal source (``--init-from`` an unmask autoregressive run or
export, or a Hugging Face causal LM directory, ``pipeline.interchange.causal_lm_import``) is
adapted, DiffuGPT's and DiffuLLaMA's recipe (Gong et al., ICLR 2025): its network is the
source's, widths and layers, made bidirectional and time-free, with the shift
(``adapt.shift``: ``model.shift``); its embedding gains the mask's row (id V: the mean of the V
token rows) and, shifted, the start row (id V + 1: the source's start row, which an
autoregressive network keeps at id V); a learned position table too short for the start row
gains rows, copies of its last. Every other weight is the source's. The attention then opens
over ``adapt.anneal_steps`` steps (``model.annealing``). ``AdaptationRecord`` says what was done;
checkpoints, exports, MLflow and the report carry it in the source's record. docs/adapting.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import Tensor

from common.errors import UserError
from model.transformer import TransformerConfig
from pipeline.config import AdaptSection, Config

__all__ = [
    "MASK_INIT",
    "AdaptationRecord",
    "adaptation_record",
    "adapted_network",
    "adapted_tensors",
    "check_adaptable",
    "check_not_adapting",
    "is_adaptation",
]

# How the mask's embedding row starts: the point the token rows are spread around, so the new
# token's first attention scores and logits are those of an average token, none singled out.
MASK_INIT = "mean of the V token embedding rows"


@dataclass(frozen=True)
class AdaptationRecord:
    """What adapting the source did (module docstring), as checkpoints and exports record it."""

    target: str                        # "MDLM" or "BD3 (block size L')"
    shift: bool                        # adapt.shift
    anneal_steps: int                  # adapt.anneal_steps
    mask_id: int                       # V: the new token
    mask_init: str                     # MASK_INIT
    start: str                         # what the start row holds
    positions: list[int] | None        # a learned table's rows [before, after] when it grew; None: unchanged

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> AdaptationRecord:
        return cls(**{f.name: record.get(f.name) for f in fields(cls)})


def is_adaptation(source_network: dict, config: Config) -> bool:
    """Whether a run of ``config`` from a source of ``source_network`` (its TransformerConfig
    fields) adapts it: a causal source into a diffusion run."""
    return bool(source_network.get("causal")) and config.model.objective == "diffusion"


def check_adaptable(config: Config, source: str) -> None:
    """What an adapted run's config must be: the absorbing process (MDLM, or block diffusion),
    no time conditioning, no document masking; one line naming the field otherwise."""
    model = config.model
    if model.process != "absorbing":
        raise UserError(f"config field model.process = {model.process!r}: an autoregressive model ({source}) is "
                        "adapted to the absorbing process (MDLM, or block diffusion with model.block_size); set "
                        "absorbing")
    if model.time_conditioning:
        raise UserError(f"config field model.time_conditioning = true: an adapted model ({source}) takes no time "
                        "conditioning (adaLN-zero would start every block at zero, not at the source's); set false")
    if model.document_mask:
        raise UserError(f"config field model.document_mask = true: an adapted model ({source}) attends over its "
                        "whole window (the shift and the annealing have no document form yet); set false")


def check_not_adapting(adapt: AdaptSection) -> None:
    """The ``adapt`` section applies to an adapted run only: one that sets it otherwise is refused."""
    if adapt != AdaptSection():
        raise UserError("config section adapt: adapts an autoregressive model into a diffusion model, and this run "
                        "starts from none (--init-from an autoregressive run or export, or a Hugging Face causal "
                        "LM); leave the section out")


def adapted_network(source: TransformerConfig, run: TransformerConfig, shift: bool) -> TransformerConfig:
    """The adapted run's network: ``source``'s widths and layers, bidirectional and time-free,
    shifted when ``shift``; ``run``'s (the config's and data's) context, dropout and vocabulary padding."""
    family = source.family
    if family is not None and family.learned_positions:
        family = replace(family, learned_positions=max(family.learned_positions, run.max_seq_len + int(shift)))
    return replace(source, max_seq_len=run.max_seq_len, dropout=run.dropout, vocab_multiple=run.vocab_multiple,
                   causal=False, time_conditioning=False, shift=shift, family=family)


def adapted_tensors(tensors: dict[str, Tensor], source: TransformerConfig,
                    network: TransformerConfig) -> dict[str, Tensor]:
    """The causal source's tensors (unpadded; embed.weight [V + 1, d], row V its start row) for
    the adapted ``network``: rows [tokens, mask (MASK_INIT), start if shifted], a learned table
    grown with copies of its last row."""
    embedding, vocab = tensors["embed.weight"], source.vocab_size
    token_rows, start_row = embedding[:vocab], embedding[vocab:vocab + 1]
    rows = [token_rows, token_rows.mean(0, keepdim=True)] + ([start_row] if network.shift else [])
    out = dict(tensors, **{"embed.weight": torch.cat(rows)})
    if "positions.weight" in tensors:
        table, needed = tensors["positions.weight"], network.family.learned_positions
        extra = table[-1:].expand(needed - table.shape[0], -1)
        out["positions.weight"] = torch.cat([table, extra])
    return out


def adaptation_record(config: Config, source: TransformerConfig, network: TransformerConfig,
                      start: str) -> AdaptationRecord:
    """The record of adapting ``source`` into ``network`` under ``config``; ``start``: what the
    source's start row is (its token, or unmask's start row)."""
    block_size = config.model.block_size
    grown = (None if network.rotary or network.family.learned_positions == source.family.learned_positions
             else [source.family.learned_positions, network.family.learned_positions])
    return AdaptationRecord(target="MDLM" if block_size is None else f"BD3 (block size {block_size})",
                            shift=network.shift, anneal_steps=config.adapt.anneal_steps, mask_id=network.vocab_size,
                            mask_init=MASK_INIT, start=f"{start} (row {network.start_id})" if network.shift
                            else "none: unshifted", positions=grown)
