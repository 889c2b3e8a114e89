"""UTF-8 verdicts: decoding with repair, and checking bytes too long to hold as they stream by."""

from __future__ import annotations

import codecs

__all__ = ["Utf8Check", "decode", "is_blank"]

# Bytes checked at a time: bounds the text that checking makes (up to 4 bytes a character).
_CHECK_STEP_BYTES = 64 << 10


def decode(data: bytes) -> tuple[str, bool]:
    """The text of UTF-8 bytes, invalid ones replaced by U+FFFD, and whether there were any."""
    try:
        return data.decode(), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def is_blank(text: str) -> bool:
    """Whether a document's text is empty or only (Unicode) whitespace: it is skipped."""
    return not text or text.isspace()


class Utf8Check:
    """Verdicts on bytes too long to hold, fed in chunks: valid UTF-8? only whitespace?"""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.bad_utf8 = False
        self.blank = True

    def feed(self, data: bytes, final: bool = False) -> None:
        """Check the next bytes; `final` ends the text (an unfinished character is invalid)."""
        for begin in range(0, len(data), _CHECK_STEP_BYTES):
            self._step(data[begin:begin + _CHECK_STEP_BYTES], False)
        if final:
            self._step(b"", True)

    def _step(self, data: bytes, final: bool) -> None:
        if self.bad_utf8:
            return  # one invalid byte decides it
        try:
            text = self._decoder.decode(data, final)
        except UnicodeDecodeError:
            self.bad_utf8, self.blank = True, False  # the repair, U+FFFD, is not whitespace
            return
        self.blank = self.blank and is_blank(text)
