"""The read flags (``data_prep.readers.options``): a bad value names its flag."""

import pytest

from common.errors import UserError
from data_prep.readers import (
    ReadOptions,
)


@pytest.mark.parametrize("field, value, flag", [
    ("text_format", "markdown", "--text-format"), ("bad_utf8", "ignore", "--bad-utf8"),
    ("bad_json", "warn", "--bad-json"), ("max_piece_bytes", 3, "max_piece_bytes"),
])
def test_bad_options_name_the_flag(field, value, flag):
    with pytest.raises(UserError, match=flag):
        ReadOptions(**{field: value})
