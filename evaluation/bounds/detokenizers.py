"""Detokenizers for the zero-shot evaluation sets: undo each set's word tokenization before our
tokenizer reads the text, as the GPT-2 paper's zero-shot evaluation did (``DETOKENIZERS`` by name).

The rules are those of SEDD's and MDLM's evaluation code (louaaron/Score-Entropy-Discrete-Diffusion
``data.py``, kuleshov-group/mdlm ``dataloader.py``), quirks included, because the published
numbers were measured on text detokenized that way. The departures (WikiText's " N " rule,
LAMBADA's quotes and leading newline, the scientific papers' rules applied line by line) are
listed in docs/evaluation.md#the-datasets-and-their-detokenizers and noted where they happen;
``wikitext_mdlm``, ``lambada_mdlm`` and ``scientific_papers_mdlm`` have none (the text of MDLM's,
BD3-LM's and Duo's code exactly, for their protocols). Every function is pure (``str -> str``),
deterministic, and never turns a single space into two.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = [
    "DETOKENIZERS", "LAMBADA_GPT2_PREFIX", "Detokenizer", "ag_news_detokenize", "identity", "lambada_detokenize",
    "lambada_gpt2_detokenize", "lambada_mdlm_detokenize", "lambada_plain_detokenize", "lm1b_detokenize",
    "ptb_detokenize", "scientific_papers_detokenize", "scientific_papers_mdlm_detokenize", "wikitext_detokenize",
    "wikitext_mdlm_detokenize",
]

Detokenizer = Callable[[str], str]


def _replace_all(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """Apply literal replacements in order (order matters: later rules see earlier output)."""
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def _tighten_pair(opening: str, closing: str) -> re.Pattern[str]:
    """A regex for "OPEN  inner  CLOSE" that keeps the inner text without its edge spaces."""
    o, c = re.escape(opening), re.escape(closing)
    return re.compile(rf"{o}\s*([^{c}]*?)\s*{c}")


def _keep_delimiters(match: re.Match[str]) -> str:
    """A pair match rewritten as its two one-character delimiters around the inner text."""
    whole = match.group(0)
    return whole[0] + match.group(1) + whole[-1]


def _tighten_all(text: str, pairs: tuple[re.Pattern[str], ...]) -> str:
    """Drop the padding spaces inside every delimiter pair, one pair kind after another."""
    for pair in pairs:
        text = pair.sub(_keep_delimiters, text)
    return text


def _per_line(text: str, line_rule: Detokenizer) -> str:
    """Run a one-line rule on every line, then strip the whole. Line by line because the
    corpora were tokenized that way, and a rule that saw several lines at once could pair a
    quote with one from another paragraph."""
    return "\n".join(line_rule(line) for line in text.split("\n")).strip()


def identity(text: str) -> str:
    """The text unchanged (for corpora that are already natural text)."""
    return text


# ---------------------------------------------------------------- WikiText
_WT_CONTRACTION = (("s '", "s'"),)  # "Evans ' chiral" -> "Evans' chiral" (possessive plural)
_WT_NUMBER_SEPARATORS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_WT_PUNCTUATION = tuple((f" {p} ", f"{p} ") for p in ":;.!?,")
_WT_PAIRS = tuple(_tighten_pair(o, c) for o, c in ("()", "[]", "{}", '""', "''"))
# Section headings "= = Career = =" -> "== Career ==": longest first so "= = =" stays whole.
_WT_HEADINGS = (("= = = =", "===="), ("= = =", "==="), ("= =", "=="))
_WT_LATE = ((" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" 's", "'s"))


# MDLM's rule for a quote before a digit between slashes. Its replacement is the literal text
# "/'[0-9]/" (a regex written where a string was meant): it matches nothing in WikiText, and MDLM's
# code runs it on every set it detokenizes this way, so the _mdlm rules keep it.
_WT_MDLM_SLASH_QUOTE = re.compile(r"/' [0-9]/")
# MDLM's late rules, in its order: the degree sign, the spaces around its rows' newline, its PTB
# number rule (" N " -> " 1 "), then the possessive.
_WT_MDLM_LATE = ((" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "),
                 (" 's", "'s"))


def _wikitext_common(text: str, *, slash_quote: bool = False) -> str:
    """The rules ours and MDLM's share, in their order, up to the section headings
    (``slash_quote``: MDLM's slash-quote rule, after the contraction, where it runs it)."""
    text = _replace_all(text, _WT_CONTRACTION)
    if slash_quote:
        text = _WT_MDLM_SLASH_QUOTE.sub("/'[0-9]/", text)
    text = _replace_all(text, _WT_NUMBER_SEPARATORS + _WT_PUNCTUATION)
    return _replace_all(_tighten_all(text, _WT_PAIRS), _WT_HEADINGS)


def _wikitext_line(line: str) -> str:
    return _replace_all(_wikitext_common(line), _WT_LATE).strip()


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText tokenization: " @-@ " -> "-", " @,@ " -> ",", " @.@ " -> ".", no space before
    : ; . ! ? , and "'s", none inside (), [], {}, "" and '' pairs, "= = X = =" -> "== X ==",
    " ° " -> "°", and each line stripped (the files pad every line with a space each side)."""
    return _per_line(text, _wikitext_line)


def wikitext_mdlm_detokenize(text: str) -> str:
    """MDLM's WikiText rules on one row of HF ``wikitext-*-raw-v1`` (a line with its newline):
    those of ``wikitext_detokenize``, plus " N " -> " 1 " and its slash-quote rule, with no
    stripping: only a space next to a newline goes, so a row keeps its leading space
    (" = Robert Boulter =\\n")."""
    return _replace_all(_wikitext_common(text, slash_quote=True), _WT_MDLM_LATE)


# ---------------------------------------------------------------- Penn Treebank
_PTB_CONTRACTIONS = ((" 's", "'s"), ("s ' ", "s' "), (" n't", "n't"))
_PTB_SLASH = (("\\/", "/"),)  # the treebank escapes "/" as "\/"
# Mikolov's PTB writes every number as "N"; the reference reads it as "1". Only an N with a
# space on both sides: like the reference (which strips each sentence first), an N that starts
# or ends a sentence stays "N".
_PTB_NUMBER = re.compile(r"(?<= )N(?= )")
_PTB_CURRENCY = (("$ 1", "$1"), ("# 1", "#1"))
# Out-of-vocabulary words were replaced by "<unk>" in the file; the reference writes "?" so the
# BPE does not spend three tokens on a marker that is not text.
_PTB_UNK = (("<unk>", "?"),)


def _ptb_line(line: str) -> str:
    line = _replace_all(line.strip(), _PTB_CONTRACTIONS + _PTB_SLASH)
    line = _PTB_NUMBER.sub("1", line)
    return _replace_all(line, _PTB_CURRENCY + _PTB_UNK)


def ptb_detokenize(text: str) -> str:
    """Undo Mikolov-PTB tokenization as SEDD/MDLM do: " 's" -> "'s", "s ' " -> "s' ",
    " n't" -> "n't", "\\/" -> "/", a space-delimited number placeholder "N" -> "1" (then "$ 1" ->
    "$1", "# 1" -> "#1"), and "<unk>" -> "?", each line stripped. The text stays lower-case and
    without punctuation, as Mikolov's preprocessing left it."""
    return _per_line(text, _ptb_line)


# ---------------------------------------------------------------- One Billion Word
_LM1B_URLS = (("http : / / ", "http://"), ("https : / / ", "https://"))
_LM1B_CLITIC = re.compile(r" '(\w+)")  # "we 're" -> "we're", "Wal-Mart 's" -> "Wal-Mart's"
# A full stop after a word, mid-sentence or at the end. The word needs a space before it, as in
# the reference, so a stop after the sentence's first word keeps its space.
_LM1B_STOP_MID = re.compile(r" (\w+) \. ")
_LM1B_STOP_END = re.compile(r" (\w+) \.$")
_LM1B_QUESTION = ((" ? ", "? "),)
_LM1B_QUESTION_END = re.compile(r" \?$")
_LM1B_BANG = ((" ! ", "! "),)
_LM1B_BANG_END = re.compile(r" !$")
_LM1B_PUNCTUATION = ((" , ", ", "), (" : ", ": "), (" ; ", "; "), (" / ", "/"))
# Pairs whose inner text is tightened only when a single space pads it on both sides.
_LM1B_PAIRS = (
    re.compile(r'" ([^"]+) "'), re.compile(r"' ([^']+) '"),
    re.compile(r"\( ([^()]+) \)"), re.compile(r"\[ ([^\[\]]+) \]"),
)
_LM1B_CURRENCY = (("$ ", "$"), ("\N{POUND SIGN} ", "\N{POUND SIGN}"))


def _lm1b_rules(line: str) -> str:
    """The One-Billion-Word rules in their order, on the text as given (the end-of-sentence
    rules anchor at its end: Python's "$" also matches before a final newline)."""
    line = _replace_all(line, _LM1B_URLS)
    line = _LM1B_CLITIC.sub(r"'\1", line)
    line = _LM1B_STOP_END.sub(r" \1.", _LM1B_STOP_MID.sub(r" \1. ", line))
    line = _LM1B_QUESTION_END.sub("?", _replace_all(line, _LM1B_QUESTION))
    line = _LM1B_BANG_END.sub("!", _replace_all(line, _LM1B_BANG))
    line = _replace_all(line, _LM1B_PUNCTUATION)
    line = _tighten_all(line, _LM1B_PAIRS)
    return _replace_all(line, _LM1B_CURRENCY)


def _lm1b_line(line: str) -> str:
    # Stripped first, as HF's lm1b reader does: the end-of-sentence rules anchor at the end.
    return _lm1b_rules(line.strip())


def lm1b_detokenize(text: str) -> str:
    """Undo One-Billion-Word tokenization as SEDD/MDLM do: URLs, clitics (" 're", " 's"), no space
    before . ? ! , : ; (a "." only after a word), "/" joined, spaces trimmed inside "", '', ()
    and [] pairs, and "$ " / "£ " joined to the amount. Case and other spacing are kept."""
    return _per_line(text, _lm1b_line)


# ---------------------------------------------------------------- LAMBADA
# Typographic and LaTeX-style double quotes all become the ASCII quote, as GPT-2's LAMBADA
# scripts did.
_CURLY_DOUBLE_QUOTES = (("\N{LEFT DOUBLE QUOTATION MARK}", '"'), ("\N{RIGHT DOUBLE QUOTATION MARK}", '"'))
_LAMBADA_QUOTES = _CURLY_DOUBLE_QUOTES + (("``", '"'), ("''", '"'))
# GPT-2's LAMBADA scripts (and SEDD/MDLM) start every passage with a newline.
LAMBADA_GPT2_PREFIX = "\n"
_PLAIN_NOT = ((" n't", "n't"),)  # "was n't" -> "wasn't"; the other clitics are lm1b's rule


def lambada_detokenize(text: str) -> str:
    """Normalize LAMBADA's double quotes (“ ” `` '') to '"' and strip the passage. Curly single
    quotes stay (docs/evaluation.md#the-datasets-and-their-detokenizers)."""
    return _replace_all(text, _LAMBADA_QUOTES).strip()


def lambada_gpt2_detokenize(text: str) -> str:
    """``lambada_detokenize`` with the GPT-2 / SEDD / MDLM leading newline, for reproducing their
    numbers exactly (the newline is one more token to score in every passage)."""
    return LAMBADA_GPT2_PREFIX + lambada_detokenize(text)


def lambada_mdlm_detokenize(text: str) -> str:
    """MDLM's LAMBADA rule: only the curly double quotes become '"' (a LaTeX-style "''" stays),
    then the passage is stripped and starts with a newline."""
    return LAMBADA_GPT2_PREFIX + _replace_all(text, _CURLY_DOUBLE_QUOTES).strip()


def lambada_plain_detokenize(text: str) -> str:
    """For the original LAMBADA release (lower-cased, tokenized: "`` no , '' she said", "was
    n't"): the quote normalization, " n't", then the One-Billion-Word rules for the rest. Case
    cannot be restored, so this text is not comparable with the GPT-2 test file."""
    return lm1b_detokenize(_replace_all(lambada_detokenize(text), _PLAIN_NOT))


# ---------------------------------------------------------------- AG News
def ag_news_detokenize(text: str) -> str:
    """An AG News item (title, a space, description, as Hugging Face joins them) stripped. Its
    escapes ("#39;" for an apostrophe, "\\" for a line break, HTML entities) are the set's own
    text, scored by every paper as they are: left alone (docs/evaluation.md)."""
    return text.strip()


# ---------------------------------------------------------------- scientific papers (PubMed, ArXiv)
def _scientific_papers_line(line: str) -> str:
    return _lm1b_line(_wikitext_line(line))


def scientific_papers_detokenize(text: str) -> str:
    """Undo the tokenization of the scientific papers ("one - third", " , ", "( n = 30 )"): the
    WikiText rules, then the One-Billion-Word ones, as MDLM's code does, but line by line (one
    line is one sentence of the release's ``article_text``) and without WikiText's " N " -> " 1 "
    rule, which turns the variable N of ArXiv's formulas into 1. Each line stripped."""
    return _per_line(text, _scientific_papers_line)


def scientific_papers_mdlm_detokenize(text: str) -> str:
    """MDLM's ``scientific_papers_detokenizer`` (BD3-LM's and Duo's are the same): its WikiText
    rules, then its One-Billion-Word rules, on the whole article at once: quotes pair across
    sentences, the end-of-sentence rules see only the article's end, nothing is stripped."""
    return _lm1b_rules(wikitext_mdlm_detokenize(text))


DETOKENIZERS: dict[str, Detokenizer] = {
    "identity": identity,
    "wikitext": wikitext_detokenize,
    "ptb": ptb_detokenize,
    "lm1b": lm1b_detokenize,
    "lambada": lambada_detokenize,
    "lambada_gpt2": lambada_gpt2_detokenize,
    "lambada_plain": lambada_plain_detokenize,
    "wikitext_mdlm": wikitext_mdlm_detokenize,
    "lambada_mdlm": lambada_mdlm_detokenize,
    "ag_news": ag_news_detokenize,
    "scientific_papers": scientific_papers_detokenize,
    "scientific_papers_mdlm": scientific_papers_mdlm_detokenize,
}
