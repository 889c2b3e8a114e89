"""Published perplexities to place our numbers next to (docs/math.md#reference-numbers).

    references_for("wikitext2")   # GPT-2, SEDD absorb, MD4 (small and medium; MD4 Table 1), MDLM
    references_for("owt")         # OpenWebText held-out: AR, SEDD, MDLM (MDLM paper)

Every entry is a GPT-2 BPE model evaluated at sequence length 1024 (GPT-2 trained on WebText,
the others on OpenWebText); GPT-2 and AR values are exact perplexities, diffusion values upper
bounds (``is_bound``). The protocol alone moves these numbers by 5 to 15 percent across
papers, so a comparison needs the same tokenizer and protocol. MDLM's own zero-shot row is
listed next to MD4's with every value missing (``value`` None): docs/math.md and the seeds hold
no MDLM zero-shot table, and nothing is quoted from memory. See docs/evaluation.md#the-report.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MISSING_VALUE", "REFERENCES", "REFERENCE_SEQ_LEN", "REFERENCE_TOKENIZER", "Reference",
           "protocol_note", "references_for"]

REFERENCE_TOKENIZER = "GPT-2 BPE"
REFERENCE_SEQ_LEN = 1024
SMALL = "small ~ 124M"
MEDIUM = "medium ~ 355M"
WEBTEXT = "WebText"
OPENWEBTEXT = "OpenWebText"
MD4_TABLE_1 = "MD4 paper, Table 1"
MDLM_PAPER = "MDLM paper"
MDLM_ZERO_SHOT = "MDLM paper, zero-shot table"
MISSING_VALUE = "missing (not in our sources: docs/math.md, seeds)"
# The columns of MD4 Table 1, under our dataset names (1BW is lm1b).
ZERO_SHOT_DATASETS = ("lambada", "wikitext2", "ptb", "wikitext103", "lm1b")
OWT = "owt"


@dataclass(frozen=True)
class Reference:
    """One published perplexity: who, on what, and how far it is comparable with ours."""

    model: str          # label, e.g. "MD4"
    value: float | None  # the perplexity (or its upper bound when is_bound); None: not in our sources
    is_bound: bool      # True for a "<=" entry (a diffusion NELBO bound)
    dataset: str        # our dataset key: lambada, wikitext2, ptb, wikitext103, lm1b, owt
    scale: str          # SMALL or MEDIUM
    tokenizer: str      # REFERENCE_TOKENIZER for every entry here
    training_data: str  # WEBTEXT for GPT-2, OPENWEBTEXT otherwise
    source: str         # MD4_TABLE_1 or MDLM_PAPER
    note: str = ""      # training budget or checkpoint, when the source gives it
    protocol: str = ""  # the evaluation.bounds.protocols name it was measured with, when known

    @property
    def display_value(self) -> str:
        """The value as the papers write it: "<= 23.21" for a bound, "17.54" when exact."""
        if self.value is None:
            return MISSING_VALUE
        return f"{'≤ ' if self.is_bound else ''}{self.value:.2f}"


# (model, scale, training data, is_bound, values in ZERO_SHOT_DATASETS order, source, protocol)
_ZERO_SHOT_ROWS: tuple[tuple[str, str, str, bool, tuple[float | None, ...], str, str], ...] = (
    ("GPT-2", SMALL, WEBTEXT, False, (45.04, 42.43, 138.43, 41.60, 75.20), MD4_TABLE_1, ""),
    ("SEDD absorb", SMALL, OPENWEBTEXT, True, (50.92, 41.84, 114.24, 40.62, 79.29), MD4_TABLE_1, ""),
    ("MD4", SMALL, OPENWEBTEXT, True, (48.43, 34.94, 102.26, 35.90, 68.10), MD4_TABLE_1, ""),
    # Next to MD4's: MDLM's own row, whose numbers our sources do not hold (module docstring).
    ("MDLM", SMALL, OPENWEBTEXT, True, (None,) * len(ZERO_SHOT_DATASETS), MDLM_ZERO_SHOT, "mdlm"),
    ("GPT-2", MEDIUM, WEBTEXT, False, (35.66, 31.80, 123.14, 31.39, 55.72), MD4_TABLE_1, ""),
    ("SEDD absorb", MEDIUM, OPENWEBTEXT, True, (42.77, 31.04, 87.12, 29.98, 61.19), MD4_TABLE_1, ""),
    ("MD4", MEDIUM, OPENWEBTEXT, True, (44.12, 25.84, 66.07, 25.84, 51.45), MD4_TABLE_1, ""),
)

# OpenWebText held-out perplexities of small models (MDLM paper): (model, value, is_bound, note)
_OWT_ROWS: tuple[tuple[str, float, bool, str], ...] = (
    ("AR (Transformer)", 17.54, False, ""),
    ("SEDD absorb", 24.10, True, ""),
    ("MDLM", 23.21, True, "262B training tokens"),
    ("MDLM", 22.98, True, "released checkpoint, 524B training tokens"),
)


def _zero_shot_references() -> list[Reference]:
    return [Reference(model, value, is_bound, dataset, scale, REFERENCE_TOKENIZER, training, source,
                      protocol=protocol)
            for model, scale, training, is_bound, values, source, protocol in _ZERO_SHOT_ROWS
            for dataset, value in zip(ZERO_SHOT_DATASETS, values, strict=True)]


def _owt_references() -> list[Reference]:
    return [Reference(model, value, is_bound, OWT, SMALL, REFERENCE_TOKENIZER, OPENWEBTEXT,
                      MDLM_PAPER, note)
            for model, value, is_bound, note in _OWT_ROWS]


REFERENCES: tuple[Reference, ...] = tuple(_zero_shot_references() + _owt_references())

# Where our reading of a set is known to differ from the SEDD/MDLM evaluation code, per
# protocol (evaluation/bounds/datasets.py and evaluation/bounds/protocols.py explain why): the gap is part of
# any comparison.
_WIKITEXT_NOTE = ("our units are whole articles (one EOS per article), on the test split; the SEDD/MDLM "
                  "code puts an EOS after every line, blank lines included, and MDLM's scores the "
                  "validation split (--protocol mdlm does both)")
_LM1B_NOTE = ("our test split is the benchmark's heldout shard 00000; the SEDD/MDLM code scores all 50 "
              "heldout shards (about 50x more sentences)")
_PROTOCOL_NOTES = {
    "unmask": {
        "wikitext2": _WIKITEXT_NOTE,
        "wikitext103": _WIKITEXT_NOTE,
        "ptb": "we score the test split; MDLM's code scores the validation split (--protocol mdlm)",
        "lambada": "our passages start without the newline the GPT-2/SEDD/MDLM code puts before each "
                   "(--protocol mdlm, or --detokenizer lambada_gpt2)",
        "lm1b": _LM1B_NOTE,
    },
    "mdlm": {"lm1b": _LM1B_NOTE},
}


def references_for(dataset: str) -> list[Reference]:
    """The published numbers on ``dataset`` (our key), in table order; [] for any other set."""
    return [reference for reference in REFERENCES if reference.dataset == dataset]


def protocol_note(dataset: str, protocol: str = "unmask") -> str | None:
    """A known difference between ``protocol`` (an evaluation.bounds.protocols name) on ``dataset`` and
    the reference code's reading of it, if any."""
    return _PROTOCOL_NOTES.get(protocol, {}).get(dataset)
