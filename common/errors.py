"""The one exception type for mistakes a user can fix (bad input, config, paths). The checks of
output paths that every command makes before any work live in ``common.outputs``."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix. The message names the file, line, field or flag and the
    fix; the CLI prints it without a traceback and exits non-zero."""
