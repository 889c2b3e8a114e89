"""Stopping a prep at a known point, for the kill tests: ``python -m tests.support.prep_stall N --
prep ARGS`` runs ``unmask prep ARGS`` in this process with its ledger stalling (sleeping)
once it holds N entries, so that a test can SIGKILL the prep there. One-worker preps only:
they run in this process, where the patch applies."""

from __future__ import annotations

import sys
import time

STALL_POLL_S = 3600


def main(argv: list[str]) -> int:
    """``N -- ARGS``: run ``unmask ARGS``, stalling once the prep's ledger holds N entries."""
    from data_prep.ledger import Ledger
    from orchestration.cli import main as unmask

    entries, args = int(argv[0]), argv[argv.index("--") + 1:]
    record = Ledger.record

    def record_then_stall(ledger: Ledger, key: str, entry: dict) -> None:
        record(ledger, key, entry)
        while len(ledger) >= entries:
            time.sleep(STALL_POLL_S)

    Ledger.record = record_then_stall
    return unmask(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
