"""The one exception type for mistakes a user can fix (bad input, config, paths)."""


class UserError(Exception):
    """A mistake the user can fix. The message names the file, line, field or flag and the
    fix; the CLI prints it without a traceback and exits non-zero."""
