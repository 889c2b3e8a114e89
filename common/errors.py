"""The one exception type for mistakes a user can fix (bad input, config, paths), and how a
message describes a broken JSON line. The checks of output paths that every command makes
before any work live in ``common.outputs``."""

from __future__ import annotations

import json


class UserError(Exception):
    """A mistake the user can fix. The message names the file, line, field or flag and the
    fix; the CLI prints it without a traceback and exits non-zero."""


def json_problem(err: json.JSONDecodeError) -> str:
    """What json found wrong on a line, and where: "Expecting value at column 5". Some of its
    messages end in " at" ("Unterminated string starting at"): the column follows once."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"
