"""What a training run is made of, resolved from its config and its data before any work:
the network shape, the tokenizer, and the identity (hashes, commit) a checkpoint records.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.errors import UserError
from data_prep.shards.format import TOKENIZER_DIR, Manifest
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.load import load_tokenizer
from model.transformer import TransformerConfig, preset
from pipeline.config import ModelSection

__all__ = ["network_config", "find_tokenizer"]



def network_config(model: ModelSection, manifest: Manifest) -> TransformerConfig:
    """The transformer for ``model`` over the data's vocabulary and sequence length."""
    vocab, seq_len = manifest.tokenizer["vocab_size"], manifest.seq_len
    max_seq_len = model.max_seq_len or seq_len
    if max_seq_len < seq_len:
        raise UserError(f"config field model.max_seq_len = {max_seq_len} is shorter than the data's "
                        f"sequence length {seq_len} (manifest.json); raise it or leave it unset")
    if model.block_size is not None and seq_len % model.block_size:
        raise UserError(f"config field model.block_size = {model.block_size} does not divide the data's sequence "
                        f"length {seq_len} (manifest.json); choose a divisor of {seq_len}")
    shape = {k: v for k, v in (("n_layers", model.n_layers), ("d_model", model.d_model),
                                ("n_heads", model.n_heads)) if v is not None}
    try:
        config = preset(model.preset, vocab, **shape)
        return replace(config, max_seq_len=max_seq_len, dropout=model.dropout,
                       time_conditioning=model.time_conditioning,
                       causal=model.objective == "autoregressive", vocab_multiple=model.vocab_multiple)
    except ValueError as err:
        raise UserError(f"config section model: {err}") from None


def find_tokenizer(manifest: Manifest, data_dir: Path) -> Tokenizer:
    """The tokenizer the shards were made with, checked against the manifest's sha256.

    A prep keeps the tokenizer's files in the data directory's ``tokenizer/`` (the manifest's
    path), so a data directory trains wherever it is copied.
    """
    recorded = manifest.tokenizer.get("path") or ""
    expected = manifest.tokenizer["sha256"]
    candidates = [data_dir / TOKENIZER_DIR]
    found = []  # what is at each candidate that is not the tokenizer of the shards
    for path in candidates:
        if not path.exists():
            continue
        try:
            tokenizer = load_tokenizer(path)
        except UserError as err:
            found.append(f"{path} cannot be loaded ({err})")
            continue
        if tokenizer.sha256 == expected:
            _check_vocab_size(tokenizer, manifest, data_dir)
            return tokenizer
        found.append(f"{path} holds another tokenizer (sha256 {tokenizer.sha256[:12]}..., {tokenizer.vocab_size} "
                     f"tokens; the manifest records {manifest.tokenizer.get('vocab_size')}): replaced since the prep")
    shards = f"the shards were made with tokenizer {recorded!r} (sha256 {expected[:12]}...)"
    if found:
        raise UserError(f"{data_dir}/manifest.json: {shards}, but {'; '.join(found)}. Put the tokenizer of the "
                        f"shards back in {data_dir / TOKENIZER_DIR}, or prep the corpus again with the one there "
                        f"(into a new --out)")
    raise UserError(f"{data_dir}/manifest.json: {shards}, not found at any of "
                    f"{[str(c) for c in candidates]}; rerun that `unmask prep --out {data_dir}` where its tokenizer "
                    f"is (nothing is redone): the prep then keeps a copy in {data_dir / TOKENIZER_DIR}")


def _check_vocab_size(tokenizer: Tokenizer, manifest: Manifest, data_dir: Path) -> None:
    """The manifest's vocabulary sizes the network: one that disagrees with the tokenizer the
    shards were made with (a hand-edited manifest) would fail at the first step, or worse,
    silently train a network too small or too large for the data."""
    recorded = manifest.tokenizer["vocab_size"]
    if recorded != tokenizer.vocab_size:
        raise UserError(f"{data_dir}/manifest.json: tokenizer.vocab_size is {recorded}, but the tokenizer the "
                        f"shards were made with ({tokenizer.path}) has {tokenizer.vocab_size} tokens; restore "
                        f"the manifest (or rerun `unmask prep`)")
