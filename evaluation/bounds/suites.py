"""Named suites of zero-shot sets: ``--suite zero-shot`` scores the seven sets of the papers'
zero-shot tables (MDLM's Table 3, BD3-LM's Table 5, Duo's Table 2), those present under
``--data-dir``.

    present = present_sets("zero-shot", "data/", "duo")   # the sets whose files are there, in the papers' order
    missing_sets("zero-shot", present, "duo")            # the others: name, the files expected, where to get them

A set whose files are absent is left out with a warning naming the files and where to get them
(the report lists it too); a suite with none of its sets present is refused. ``scoring.with_suite``
puts the present sets into a ``ScoringConfig``. WikiText is scored
once, as ``wikitext103``: its raw validation and test text is WikiText-2's (SOURCES.md section 3),
the "Wikitext" column of every table. See docs/evaluation.md#the-zero-shot-table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from evaluation.bounds.datasets import expected_files, find_dataset_file
from evaluation.bounds.protocols import get_protocol

__all__ = ["SUITES", "ZERO_SHOT", "MissingSet", "missing_sets", "present_sets", "suite_sets"]

log = logging.getLogger("unmask.eval")

ZERO_SHOT = "zero-shot"
# In the column order of the papers' tables: PTB, Wikitext, LM1B, Lambada, AG News, Pubmed, Arxiv.
SUITES: dict[str, tuple[str, ...]] = {ZERO_SHOT: ("ptb", "wikitext103", "lm1b", "lambada", "ag_news", "pubmed",
                                                  "arxiv")}


@dataclass(frozen=True)
class MissingSet:
    """A set of a suite that was not scored, and what would let it be."""

    name: str
    split: str
    expected: str  # the files it is read from under the data directory, and where to get them

    def line(self) -> str:
        return f"{self.name} ({self.split} split): {self.expected}"


def suite_sets(suite: str) -> tuple[str, ...]:
    if suite not in SUITES:
        raise UserError(f"--suite {suite!r} is not one of {', '.join(SUITES)}")
    return SUITES[suite]


def missing_sets(suite: str, scored: Iterable[str], protocol: str, split: str | None = None) -> tuple[MissingSet, ...]:
    """The sets of ``suite`` not in ``scored``, with the files each is read from under ``protocol``."""
    scored = set(scored)
    reading = get_protocol(protocol)
    return tuple(MissingSet(name, split_of, expected_files(name, split_of))
                 for name in suite_sets(suite) if name not in scored
                 for split_of in (reading.reading(name, split).split,))


def present_sets(suite: str, data_dir: str | None, protocol: str, split: str | None = None) -> tuple[str, ...]:
    """The sets of ``suite`` whose files are under ``data_dir`` (read as ``protocol`` reads them),
    in the suite's order; the others are logged, and none at all is refused."""
    names = suite_sets(suite)
    if data_dir is None:
        raise UserError(f"--suite {suite} reads its sets from --data-dir: give the directory that holds them "
                        f"(the layout of ../shared/data; docs/evaluation.md#the-data-directory)")
    reading = get_protocol(protocol)
    present = tuple(name for name in names if find_dataset_file(name, Path(data_dir), reading.reading(name, split).split))
    missing = missing_sets(suite, present, protocol, split)
    if not present:
        raise UserError(f"--suite {suite}: none of its sets is under --data-dir {data_dir}: "
                        + "; ".join(item.line() for item in missing))
    for item in missing:
        log.warning("--suite %s: %s is not scored: %s", suite, item.name, item.line())
    return present
