"""Zero-shot evaluation protocols: the split, units and detokenizer each named dataset is read
with, and how its token stream becomes scored blocks.

    protocol = get_protocol("mdlm")
    protocol.reading("wikitext2")        # DatasetReading(split="valid", detokenizer="wikitext_mdlm", rows=True)
    wrapped = protocol.wrap(token_ids_per_unit, 1024, bos_id=bos, eos_id=eos, pad_id=pad)
    wrapped.blocks, wrapped.dropped_tokens

``unmask`` (the default): the test split, our units and detokenizers, an EOS after every unit,
blocks of the model's training length, the last one padded: every token is scored exactly once
and none is dropped (docs/evaluation.md#the-protocol). ``mdlm``: the zero-shot protocol of
MDLM's code (kuleshov-group/mdlm ``dataloader.py``, re-stated, not copied), to reproduce its
numbers: its splits, the rows of its Hugging Face datasets, its detokenizers, every chunk of
L - 2 tokens framed as BOS chunk EOS with all L positions scored, the last partial chunk
dropped and counted, L = 1024. Where it departs from running MDLM's code, and why:
docs/evaluation.md#mdlms-protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain

import torch

from common.errors import UserError
from evaluation.bounds.estimator import Blocks, wrap_blocks

__all__ = ["DEFAULT_PROTOCOL", "MDLM", "MDLM_BLOCK_LENGTH", "PROTOCOLS", "UNMASK", "DatasetReading",
           "WrappedBlocks", "ZeroShotProtocol", "frame_blocks", "get_protocol"]

DEFAULT_SPLIT = "test"
MDLM_BLOCK_LENGTH = 1024
FRAME_TOKENS = 2  # the BOS and EOS around every framed block


@dataclass(frozen=True)
class DatasetReading:
    """How one named dataset is read under a protocol (``evaluation.bounds.datasets.load_dataset``)."""

    split: str
    detokenizer: str | None  # None: the dataset's own (evaluation.bounds.datasets)
    rows: bool               # the HF rows, empty ones kept, instead of our units


@dataclass(frozen=True)
class WrappedBlocks:
    """A dataset's blocks, and how many tokens of its stream the wrapping left out."""

    blocks: Blocks
    dropped_tokens: int


@dataclass(frozen=True)
class ZeroShotProtocol:
    """One way of turning the zero-shot sets into scored blocks (module docstring)."""

    name: str
    splits: Mapping[str, str]         # per named dataset; DEFAULT_SPLIT for the others
    detokenizers: Mapping[str, str]   # per named dataset; the dataset's own for the others
    rows: bool                        # read the HF rows, empty ones kept
    framed: bool                      # BOS chunk EOS blocks, all scored, the last partial chunk dropped
    block_length: int | None          # None: the model's max_seq_len
    wrapping: str                     # the wrapping in words, for results.json

    def reading(self, dataset: str, split: str | None = None, detokenizer: str | None = None) -> DatasetReading:
        """How ``dataset`` is read: the protocol's split and detokenizer unless given."""
        return DatasetReading(split=split or self.splits.get(dataset, DEFAULT_SPLIT),
                              detokenizer=detokenizer or self.detokenizers.get(dataset), rows=self.rows)

    def split_summary(self, datasets: tuple[str, ...]) -> str:
        """The split of ``datasets`` in words: one name when they share it."""
        splits = {name: self.splits.get(name, DEFAULT_SPLIT) for name in datasets}
        if len(set(splits.values())) <= 1:
            return next(iter(splits.values()), DEFAULT_SPLIT)
        return "per dataset: " + ", ".join(f"{name} {split}" for name, split in splits.items())

    def wrap(self, documents: list[list[int]], seq_len: int, *, bos_id: int | None, eos_id: int, pad_id: int,
             add_eos: bool = True) -> WrappedBlocks:
        """The token ids of every unit, in order, as scored blocks of ``seq_len``."""
        if self.framed:
            return frame_blocks(documents, seq_len, bos_id=eos_id if bos_id is None else bos_id, eos_id=eos_id)
        return WrappedBlocks(wrap_blocks(documents, seq_len, eos_id=eos_id, pad_id=pad_id, add_eos=add_eos), 0)


def frame_blocks(documents: list[list[int]], seq_len: int, *, bos_id: int, eos_id: int) -> WrappedBlocks:
    """MDLM's wrapping: every unit followed by EOS, the stream cut into chunks of
    ``seq_len - 2`` tokens, each block ``[bos] chunk [eos]`` with every position scored; the
    tokens after the last whole chunk are dropped (``dropped_tokens``)."""
    chunk = seq_len - FRAME_TOKENS
    if chunk < 1:
        raise UserError(f"--seq-len {seq_len} leaves no room between the BOS and EOS of a framed block: "
                        f"use at least {FRAME_TOKENS + 1}")
    stream = torch.tensor(list(chain.from_iterable([*doc, eos_id] for doc in documents)), dtype=torch.long)
    num_blocks = stream.numel() // chunk
    if num_blocks == 0:
        raise UserError(f"{stream.numel()} tokens make no whole block of {seq_len} (the mdlm protocol drops a "
                        f"partial one): evaluate more documents or give a shorter --seq-len")
    body = stream[:num_blocks * chunk].view(num_blocks, chunk)
    tokens = torch.cat([body.new_full((num_blocks, 1), bos_id), body, body.new_full((num_blocks, 1), eos_id)], 1)
    return WrappedBlocks(Blocks(tokens, torch.ones_like(tokens, dtype=torch.bool)),
                         dropped_tokens=stream.numel() - num_blocks * chunk)


UNMASK = ZeroShotProtocol(
    name="unmask", splits={}, detokenizers={}, rows=False, framed=False, block_length=None,
    wrapping="documents + EOS concatenated and cut into seq_len blocks; the last block padded, "
             "padding never masked nor scored; no BOS")
MDLM = ZeroShotProtocol(
    name="mdlm",
    splits={"ptb": "valid", "wikitext2": "valid", "wikitext103": "valid", "lambada": "test", "lm1b": "test"},
    detokenizers={"wikitext2": "wikitext_mdlm", "wikitext103": "wikitext_mdlm", "lambada": "lambada_mdlm"},
    rows=True, framed=True, block_length=MDLM_BLOCK_LENGTH,
    wrapping="MDLM's: HF rows + EOS concatenated, cut into chunks of seq_len - 2 tokens, each block "
             "BOS chunk EOS with every position scored (BOS and EOS too); the last partial chunk dropped "
             "(dropped_tokens)")
PROTOCOLS: dict[str, ZeroShotProtocol] = {protocol.name: protocol for protocol in (UNMASK, MDLM)}
DEFAULT_PROTOCOL = UNMASK.name


def get_protocol(name: str) -> ZeroShotProtocol:
    """The protocol called ``name``; a UserError naming ``--protocol`` and the choices otherwise."""
    if name not in PROTOCOLS:
        raise UserError(f"--protocol {name!r} is not one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]
