"""``unmask prep`` as one call: the tokenizer loaded or trained, then the shards written (or
found up to date) by ``data_prep.write_shards``. What ``unmask prep`` and the prep stage of
``unmask run`` both run; the manual: docs/data-preparation.md.

    result = prep(PrepRequest(PrepConfig(inputs=("corpus/",), seq_len=1024), Path("shards"),
                              vocab_size=32000))
    result.nothing_to_do   # True when the shards already matched
    result.warnings()      # what the user must know: binary inputs, many repaired documents, padding
    result.notes()         # documents repaired or skipped, counted, with the flag that changes it
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.disk_full import DiskFull, is_disk_full
from common.errors import UserError
from common.outputs import InputPath, check_output_dir, claim_output_dir
from data_prep.readers import local_roots
from data_prep.resume import WORK_DIR
from data_prep.tokenizer.hugging_face import NO_SPECIAL_TOKENS, ROLE_FLAGS, SpecialTokens
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.training import TrainingRequest, prep_tokenizer
from data_prep.write_shards import PREP_KIND, PrepConfig, PrepResult, write_shards

__all__ = ["PrepRequest", "prep"]


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


def prep(request: PrepRequest) -> PrepResult:
    """Run (or resume, or skip) a prep, with the tokenizer it names: loaded, or trained into
    OUT/tokenizer and reused on a rerun while its training request is unchanged. Either way
    the prep keeps the tokenizer's files in OUT/tokenizer (``data_prep.write_shards``). A full
    disk is one ``DiskFull`` line saying what a rerun resumes from."""
    out = Path(request.out_dir)
    try:
        return _prep(request, out)
    except Exception as err:
        if not is_disk_full(err, out, by_free_space=False):
            raise
        done = len(list((out / WORK_DIR / "ledger").glob("*.json")))  # finished units and shards
        kept = (f"the {done} units and shards it finished are kept in {out / WORK_DIR}, and rerunning the same "
                f"command resumes from them" if done else "nothing of it was kept")
        raise DiskFull(f"--out {out}: no space left on device while writing the prep; {kept}: free space on that "
                       f"disk (or give another --out) and rerun") from None


def _prep(request: PrepRequest, out: Path) -> PrepResult:
    config = request.config
    corpus = [InputPath(root, "--input") for root in local_roots(config.inputs)]
    check_output_dir(out, PREP_KIND, "--out", corpus)  # before training a tokenizer into it
    run = dict(workers=request.workers, ray_address=request.ray_address, overwrite=request.overwrite,
               progress=request.progress)
    if request.tokenizer is not None:
        return write_shards(config, load_tokenizer(request.tokenizer, request.special_tokens), out, **run)
    training = TrainingRequest(config.inputs, request.vocab_size, seed=config.seed, read=config.read)
    claim = claim_output_dir(out, PREP_KIND, "--out", corpus)
    try:
        tokenizer = prep_tokenizer(training, out)
    except BaseException:
        claim.abandon()  # nothing was trained: the directory goes if the claim made it
        raise
    return write_shards(config, tokenizer, out, tokenizer_follows_inputs=True, **run)
