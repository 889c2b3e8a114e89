"""Prep as one call: the tokenizer loaded or trained, then the shards written (or found up to
date). What ``unmask prep`` and the prep stage of ``unmask run`` both run.

    result = prepare(PrepRequest(PrepConfig(inputs=("corpus/",), seq_len=1024), Path("shards"),
                                 vocab_size=32000))
    result.nothing_to_do   # True when the shards already matched
    result.warnings()      # input files skipped as binary, for the user
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError, output_dir
from data_prep.hf_tokenizer import NO_SPECIAL_TOKENS, ROLE_FLAGS, SpecialTokens
from data_prep.prep import PrepConfig, PrepResult, prep
from data_prep.tokenizer import Tokenizer, load_tokenizer
from data_prep.tokenizer_training import TOKENIZER_SUBDIR, TrainingRequest, prep_tokenizer

__all__ = ["PrepRequest", "prepare"]


@dataclass(frozen=True)
class PrepRequest:
    """One prep: what determines the shards, where they go, the tokenizer, how to run it."""

    config: PrepConfig
    out_dir: Path
    tokenizer: str | Path | None = None  # load it: a .model, a trained directory, a GPT-2 directory,
                                         # a tokenizer.json (or a directory holding one)
    vocab_size: int | None = None        # or train a sentencepiece tokenizer of this size first
    special_tokens: SpecialTokens = NO_SPECIAL_TOKENS  # roles for a tokenizer.json (--eos-token ...)
    workers: int = 1                     # 1: in this process; more: Ray actors
    ray_address: str | None = None       # None: a local Ray (for more than one worker)
    overwrite: bool = False              # replace a different prep in out_dir
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.tokenizer is None) == (self.vocab_size is None):
            raise UserError("give either --tokenizer (a tokenizer to load) or --vocab-size (the size "
                            "of one to train)")
        if self.workers < 1:
            raise UserError(f"--workers must be >= 1, got {self.workers}")
        if self.tokenizer is None and self.special_tokens.given():
            flags = ", ".join(ROLE_FLAGS[role] for role in self.special_tokens.given())
            raise UserError(f"{flags}: special tokens go with --tokenizer TOKENIZER_JSON; a tokenizer trained "
                            f"with --vocab-size has its own")


def prepare(request: PrepRequest) -> PrepResult:
    """Run (or resume, or skip) a prep, with the tokenizer it names: loaded, or trained into
    OUT/tokenizer and reused on a rerun while its training request is unchanged. A tokenizer
    given special tokens is kept in OUT/tokenizer too (``_keep_with_shards``)."""
    output_dir(request.out_dir, "--out")  # before training a tokenizer into it
    config = request.config
    if request.tokenizer is not None:
        tokenizer = load_tokenizer(request.tokenizer, request.special_tokens)
    else:
        training = TrainingRequest(config.inputs, request.vocab_size, seed=config.seed, read=config.read)
        tokenizer = prep_tokenizer(training, request.out_dir)
    result = prep(config, tokenizer, request.out_dir, workers=request.workers,
                  ray_address=request.ray_address, overwrite=request.overwrite,
                  progress=request.progress, tokenizer_follows_inputs=request.tokenizer is None)
    if request.special_tokens.given():
        _keep_with_shards(tokenizer, Path(request.out_dir) / TOKENIZER_SUBDIR)
    return result


def _keep_with_shards(tokenizer: Tokenizer, directory: Path) -> None:
    """Save ``tokenizer`` into ``directory`` (OUT/tokenizer, which the prep owns) unless it is
    there already. Special tokens given by flags are in no file of the tokenizer's own
    directory, so loading that gives another tokenizer; training looks for the shards'
    tokenizer in OUT/tokenizer too, and finds this one (with its special_tokens_map.json)."""
    try:
        if load_tokenizer(directory).sha256 == tokenizer.sha256:
            return
    except UserError:  # absent, or not a tokenizer
        pass
    shutil.rmtree(directory, ignore_errors=True)  # a tokenizer that --vocab-size trained here before
    tokenizer.save(directory)
