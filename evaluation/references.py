"""Published perplexities to place our numbers next to (docs/MATH.md, "Reference numbers").

    references_for("wikitext2")   # GPT-2, SEDD absorb and MD4 (small and medium), MD4 Table 1
    references_for("owt")         # OpenWebText held-out: AR, SEDD, MDLM (MDLM paper)

Every entry is a GPT-2 BPE model evaluated at sequence length 1024. GPT-2 was trained on
WebText, the others on OpenWebText. GPT-2 and AR values are exact perplexities, the
diffusion values are upper bounds (``is_bound``). The evaluation protocol alone (split,
BOS/EOS handling, detokenizer, wrapping) moves these numbers by 5 to 15 percent across
papers, so a comparison needs the same tokenizer and the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REFERENCES", "REFERENCE_SEQ_LEN", "REFERENCE_TOKENIZER", "Reference",
           "protocol_note", "references_for"]

REFERENCE_TOKENIZER = "GPT-2 BPE"
REFERENCE_SEQ_LEN = 1024
SMALL = "small ~ 124M"
MEDIUM = "medium ~ 355M"
WEBTEXT = "WebText"
OPENWEBTEXT = "OpenWebText"
MD4_TABLE_1 = "MD4 paper, Table 1"
MDLM_PAPER = "MDLM paper"
# The columns of MD4 Table 1, under our dataset names (1BW is lm1b).
ZERO_SHOT_DATASETS = ("lambada", "wikitext2", "ptb", "wikitext103", "lm1b")
OWT = "owt"


@dataclass(frozen=True)
class Reference:
    """One published perplexity: who, on what, and how far it is comparable with ours."""

    model: str          # label, e.g. "MD4"
    value: float        # the perplexity (or its upper bound when is_bound)
    is_bound: bool      # True for a "<=" entry (a diffusion NELBO bound)
    dataset: str        # our dataset key: lambada, wikitext2, ptb, wikitext103, lm1b, owt
    scale: str          # SMALL or MEDIUM
    tokenizer: str      # REFERENCE_TOKENIZER for every entry here
    training_data: str  # WEBTEXT for GPT-2, OPENWEBTEXT otherwise
    source: str         # MD4_TABLE_1 or MDLM_PAPER
    note: str = ""      # training budget or checkpoint, when the source gives it

    @property
    def display_value(self) -> str:
        """The value as the papers write it: "<= 23.21" for a bound, "17.54" when exact."""
        return f"{'≤ ' if self.is_bound else ''}{self.value:.2f}"


# (model, scale, training data, is_bound, values in ZERO_SHOT_DATASETS order)
_MD4_TABLE_1_ROWS: tuple[tuple[str, str, str, bool, tuple[float, ...]], ...] = (
    ("GPT-2", SMALL, WEBTEXT, False, (45.04, 42.43, 138.43, 41.60, 75.20)),
    ("SEDD absorb", SMALL, OPENWEBTEXT, True, (50.92, 41.84, 114.24, 40.62, 79.29)),
    ("MD4", SMALL, OPENWEBTEXT, True, (48.43, 34.94, 102.26, 35.90, 68.10)),
    ("GPT-2", MEDIUM, WEBTEXT, False, (35.66, 31.80, 123.14, 31.39, 55.72)),
    ("SEDD absorb", MEDIUM, OPENWEBTEXT, True, (42.77, 31.04, 87.12, 29.98, 61.19)),
    ("MD4", MEDIUM, OPENWEBTEXT, True, (44.12, 25.84, 66.07, 25.84, 51.45)),
)

# OpenWebText held-out perplexities of small models (MDLM paper): (model, value, is_bound, note)
_OWT_ROWS: tuple[tuple[str, float, bool, str], ...] = (
    ("AR (Transformer)", 17.54, False, ""),
    ("SEDD absorb", 24.10, True, ""),
    ("MDLM", 23.21, True, "262B training tokens"),
    ("MDLM", 22.98, True, "released checkpoint, 524B training tokens"),
)


def _zero_shot_references() -> list[Reference]:
    return [Reference(model, value, is_bound, dataset, scale, REFERENCE_TOKENIZER, training,
                      MD4_TABLE_1)
            for model, scale, training, is_bound, values in _MD4_TABLE_1_ROWS
            for dataset, value in zip(ZERO_SHOT_DATASETS, values, strict=True)]


def _owt_references() -> list[Reference]:
    return [Reference(model, value, is_bound, OWT, SMALL, REFERENCE_TOKENIZER, OPENWEBTEXT,
                      MDLM_PAPER, note)
            for model, value, is_bound, note in _OWT_ROWS]


REFERENCES: tuple[Reference, ...] = tuple(_zero_shot_references() + _owt_references())

# Where our reading of a set is known to differ from the SEDD/MDLM evaluation code
# (evaluation/datasets.py explains why): the gap is part of any comparison.
_PROTOCOL_NOTES = {
    "wikitext2": "our units are whole articles (one EOS per article); the SEDD/MDLM code puts an "
                 "EOS after every line, blank lines included",
    "wikitext103": "our units are whole articles (one EOS per article); the SEDD/MDLM code puts "
                   "an EOS after every line, blank lines included",
    "lm1b": "our test split is the benchmark's heldout shard 00000; the SEDD/MDLM code scores "
            "all 50 heldout shards (about 50x more sentences)",
}


def references_for(dataset: str) -> list[Reference]:
    """The published numbers on ``dataset`` (our key), in table order; [] for any other set."""
    return [reference for reference in REFERENCES if reference.dataset == dataset]


def protocol_note(dataset: str) -> str | None:
    """A known difference between our protocol on ``dataset`` and the references', if any."""
    return _PROTOCOL_NOTES.get(dataset)
