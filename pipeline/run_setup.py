"""What a training run is made of, resolved from its config and its data before any work:
the network shape, the tokenizer, and the identity (hashes, commit) a checkpoint records.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.errors import UserError
from data_prep.shards import Manifest
from data_prep.tokenizer import Tokenizer, load_tokenizer
from data_prep.tokenizer_training import TOKENIZER_SUBDIR
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

    The manifest records the path as given to ``unmask prep``; it is tried as is, then
    relative to the data directory, then as the data directory's own ``tokenizer/``.
    """
    recorded = manifest.tokenizer.get("path") or ""
    candidates = [Path(recorded), data_dir / recorded, data_dir / TOKENIZER_SUBDIR] if recorded else \
        [data_dir / TOKENIZER_SUBDIR]
    for path in candidates:
        if path.exists():
            try:
                tokenizer = load_tokenizer(path)
            except UserError:
                continue
            if tokenizer.sha256 == manifest.tokenizer["sha256"]:
                _check_vocab_size(tokenizer, manifest, data_dir)
                return tokenizer
    raise UserError(f"{data_dir}/manifest.json: tokenizer {recorded!r} (sha256 "
                    f"{manifest.tokenizer['sha256'][:12]}...) not found at any of "
                    f"{[str(c) for c in candidates]}; the run needs it for export")


def _check_vocab_size(tokenizer: Tokenizer, manifest: Manifest, data_dir: Path) -> None:
    """The manifest's vocabulary sizes the network: one that disagrees with the tokenizer the
    shards were made with (a hand-edited manifest) would fail at the first step, or worse,
    silently train a network too small or too large for the data."""
    recorded = manifest.tokenizer["vocab_size"]
    if recorded != tokenizer.vocab_size:
        raise UserError(f"{data_dir}/manifest.json: tokenizer.vocab_size is {recorded}, but the tokenizer the "
                        f"shards were made with ({tokenizer.path}) has {tokenizer.vocab_size} tokens; restore "
                        f"the manifest (or rerun `unmask prep`)")
