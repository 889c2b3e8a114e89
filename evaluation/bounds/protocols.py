"""Zero-shot evaluation protocols: the split, units and detokenizer each named dataset is read
with, and how its token stream becomes scored blocks.

    protocol = get_protocol("bd3lm")
    protocol.reading("wikitext2")        # DatasetReading(split="valid", detokenizer="wikitext_mdlm", rows=True)
    wrapped = protocol.wrap(token_ids_per_unit, 1024, bos_id=bos, eos_id=eos, pad_id=pad)
    wrapped.blocks, wrapped.dropped_tokens

``unmask`` (the default): the test split, our units and detokenizers, an EOS after every unit,
blocks of the model's training length, the last one padded: every token is scored exactly once
and none is dropped (docs/evaluation.md#the-protocol). The other three reproduce the zero-shot
data of an anchor's code (re-stated, not copied; compared block for block with that code's own
output in tests/evaluation/bounds/test_protocols.py), to compare with its numbers: its splits,
the rows of its Hugging Face datasets, its detokenizers, every chunk of L - 2 tokens framed as
BOS chunk EOS, the last partial chunk dropped and counted, L = 1024. ``mdlm``: MDLM's
``dataloader.py``, an EOS after every row, all L positions scored. ``bd3lm``: BD3-LM's
zero-shot scripts (``insert_valid_eos=False``: no EOS between rows; ``ignore_bos``: the BOS is
never masked nor scored). ``duo``: Duo's zero-shot scripts (no EOS between rows, all L positions
scored), the wrapping MDLM's paper describes for its Table 3. An autoregressive export never
scores a framed block's BOS, as every anchor's AR baseline predicts the L - 1 tokens after it.
Where they depart from running the anchors' code, and why: docs/evaluation.md#the-anchors-protocols.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain

import torch

from common.errors import UserError
from evaluation.bounds.estimator import Blocks, wrap_blocks

__all__ = ["BD3LM", "DEFAULT_PROTOCOL", "DUO", "MDLM", "MDLM_BLOCK_LENGTH", "PROTOCOLS", "UNMASK", "DatasetReading",
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
    framed: bool                      # BOS chunk EOS blocks, the last partial chunk dropped
    block_length: int | None          # None: the model's max_seq_len
    wrapping: str                     # the wrapping in words, for results.json
    eos_per_unit: bool = True         # framed: an EOS after every row before the chunking
    bos_scored: bool = True           # framed: a diffusion model masks and scores the BOS

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
             add_eos: bool = True, autoregressive: bool = False) -> WrappedBlocks:
        """The token ids of every unit, in order, as scored blocks of ``seq_len`` (for an
        ``autoregressive`` model a framed block's BOS is context, not scored)."""
        if self.framed:
            return frame_blocks(documents, seq_len, bos_id=eos_id if bos_id is None else bos_id, eos_id=eos_id,
                                eos_per_unit=self.eos_per_unit, score_bos=self.bos_scored and not autoregressive,
                                protocol=self.name)
        return WrappedBlocks(wrap_blocks(documents, seq_len, eos_id=eos_id, pad_id=pad_id, add_eos=add_eos), 0)


def frame_blocks(documents: list[list[int]], seq_len: int, *, bos_id: int, eos_id: int, eos_per_unit: bool = True,
                 score_bos: bool = True, protocol: str = "mdlm") -> WrappedBlocks:
    """The MDLM-line wrapping: every unit followed by EOS (unless not ``eos_per_unit``), the
    stream cut into chunks of ``seq_len - 2`` tokens, each block ``[bos] chunk [eos]`` with every
    position scored but the BOS unless ``score_bos`` (a position not scored is never masked
    either); the tokens after the last whole chunk are dropped (``dropped_tokens``)."""
    chunk = seq_len - FRAME_TOKENS
    if chunk < 1:
        raise UserError(f"--seq-len {seq_len} leaves no room between the BOS and EOS of a framed block: "
                        f"use at least {FRAME_TOKENS + 1}")
    separator = [eos_id] if eos_per_unit else []
    stream = torch.tensor(list(chain.from_iterable([*doc, *separator] for doc in documents)), dtype=torch.long)
    num_blocks = stream.numel() // chunk
    if num_blocks == 0:
        raise UserError(f"{stream.numel()} tokens make no whole block of {seq_len} (the {protocol} protocol drops a "
                        f"partial one): evaluate more documents or give a shorter --seq-len")
    body = stream[:num_blocks * chunk].view(num_blocks, chunk)  # [N, L - 2]
    tokens = torch.cat([body.new_full((num_blocks, 1), bos_id), body, body.new_full((num_blocks, 1), eos_id)], 1)
    positions = torch.ones_like(tokens, dtype=torch.bool)  # [N, L]
    positions[:, 0] = score_bos
    return WrappedBlocks(Blocks(tokens, positions), dropped_tokens=stream.numel() - num_blocks * chunk)


UNMASK = ZeroShotProtocol(
    name="unmask", splits={}, detokenizers={}, rows=False, framed=False, block_length=None,
    wrapping="documents + EOS concatenated and cut into seq_len blocks; the last block padded, "
             "padding never masked nor scored; no BOS")
# The splits and detokenizers of the MDLM line's get_dataset (MDLM's, BD3-LM's and Duo's are the
# same): validation splits, but 1BW and AG News (test) and LAMBADA (OpenAI's test file); no
# detokenizer for AG News, WikiText's and 1BW's rules on the whole article for the scientific papers.
_ANCHOR_SPLITS = {"ptb": "valid", "wikitext2": "valid", "wikitext103": "valid", "lambada": "test", "lm1b": "test",
                  "ag_news": "test", "pubmed": "valid", "arxiv": "valid"}
_ANCHOR_DETOKENIZERS = {"wikitext2": "wikitext_mdlm", "wikitext103": "wikitext_mdlm", "lambada": "lambada_mdlm",
                        "ag_news": "identity", "pubmed": "scientific_papers_mdlm", "arxiv": "scientific_papers_mdlm"}
_FRAMING = ("cut into chunks of seq_len - 2 tokens, each block BOS chunk EOS; the last partial chunk dropped "
            "(dropped_tokens)")
MDLM = ZeroShotProtocol(
    name="mdlm", splits=_ANCHOR_SPLITS, detokenizers=_ANCHOR_DETOKENIZERS, rows=True, framed=True,
    block_length=MDLM_BLOCK_LENGTH,
    wrapping=f"MDLM's dataloader.py: HF rows + EOS concatenated, {_FRAMING}; every position scored (BOS and EOS "
             f"too; an AR model: all but the BOS)")
BD3LM = ZeroShotProtocol(
    name="bd3lm", splits=_ANCHOR_SPLITS, detokenizers=_ANCHOR_DETOKENIZERS, rows=True, framed=True,
    block_length=MDLM_BLOCK_LENGTH, eos_per_unit=False, bos_scored=False,
    wrapping=f"BD3-LM's zero-shot scripts (insert_valid_eos=False, ignore_bos): HF rows concatenated without EOS, "
             f"{_FRAMING}; the BOS never masked nor scored, every other position scored")
DUO = ZeroShotProtocol(
    name="duo", splits=_ANCHOR_SPLITS, detokenizers=_ANCHOR_DETOKENIZERS, rows=True, framed=True,
    block_length=MDLM_BLOCK_LENGTH, eos_per_unit=False,
    wrapping=f"Duo's zero-shot scripts (insert_valid_eos=False; MDLM's paper, Suppl. D.5): HF rows concatenated "
             f"without EOS, {_FRAMING}; every position scored (an AR model: all but the BOS)")
PROTOCOLS: dict[str, ZeroShotProtocol] = {protocol.name: protocol for protocol in (UNMASK, MDLM, BD3LM, DUO)}
DEFAULT_PROTOCOL = UNMASK.name


def get_protocol(name: str) -> ZeroShotProtocol:
    """The protocol called ``name``; a UserError naming ``--protocol`` and the choices otherwise."""
    if name not in PROTOCOLS:
        raise UserError(f"--protocol {name!r} is not one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]
