"""Published perplexities to place our numbers beside: every zero-shot row we can cite for the
seven sets of the papers' tables, each with its source, protocol, tokenizer and training.

    references_for("ag_news")        # every published number on AG News, in table order
    SOURCES                          # the tables they come from: citation, protocol, training, where we read it
    MISSING_REFERENCES               # published rows our sources do not show, and where they are published

Every number was read in a source named with it (``Source.read_in``): the papers' own text,
../shared/seeds, docs/math.md#reference-numbers. Nothing is quoted from
memory; a published row we could not read is listed in ``MISSING_REFERENCES`` instead. A source's
``protocol`` is the ``--protocol`` that reads the data as its paper did (None: none of ours);
only numbers of one protocol are comparable, which the report keeps apart. See
docs/evaluation.md#the-zero-shot-table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MD4_COLUMNS", "MDLM_COLUMNS", "MISSING_REFERENCES", "REFERENCES", "REFERENCE_SEQ_LEN",
           "REFERENCE_TOKENIZER", "SOURCES", "MissingReference", "Reference", "Source", "protocol_note",
           "references_for"]

REFERENCE_TOKENIZER = "GPT-2 BPE"
REFERENCE_SEQ_LEN = 1024
SMALL = "small ~ 124M"
MEDIUM = "medium ~ 355M"
WEBTEXT = "WebText"
OWT_524B = "OpenWebText, 524B tokens"
OWT = "owt"
# The "Wikitext" column of MDLM's, BD3-LM's and Duo's tables: WikiText-2's and WikiText-103's raw
# validation text is the same (SOURCES.md section 3), so the column stands for both of our keys.
WIKITEXT = ("wikitext103", "wikitext2")
MDLM_COLUMNS = (("ptb",), WIKITEXT, ("lm1b",), ("lambada",), ("ag_news",), ("pubmed",), ("arxiv",))
MD4_COLUMNS = (("lambada",), ("wikitext2",), ("ptb",), ("wikitext103",), ("lm1b",))


@dataclass(frozen=True)
class Source:
    """A published table: what it is, how its numbers were measured, and where we read them."""

    citation: str               # e.g. "MDLM (Sahoo et al. 2024), Table 3"
    read_in: str                # where its numbers were read here
    protocol: str | None        # the evaluation.bounds.protocols name that reads the data as it did; None: none
    protocol_note: str          # how the paper evaluated, in words
    training: str               # training data and amount, as the source states it
    columns: tuple[tuple[str, ...], ...]   # its columns, as our dataset keys (a column may stand for two)


@dataclass(frozen=True)
class Reference:
    """One published perplexity: who, on what, from which table."""

    model: str          # label, e.g. "MD4"
    value: float        # the perplexity (its upper bound when is_bound)
    is_bound: bool      # True for a "<=" entry (a diffusion NELBO bound)
    dataset: str        # our dataset key
    scale: str          # SMALL or MEDIUM
    source: Source
    training_data: str = ""   # the row's own training, where it differs from its source's
    tokenizer: str = REFERENCE_TOKENIZER

    @property
    def training(self) -> str:
        return self.training_data or self.source.training

    @property
    def protocol(self) -> str | None:
        return self.source.protocol

    @property
    def display_value(self) -> str:
        """The value as the papers write it: "≤ 23.21" for a bound, "17.54" when exact."""
        return f"{'≤ ' if self.is_bound else ''}{self.value:.2f}"


@dataclass(frozen=True)
class MissingReference:
    """A published row that none of our sources shows: where it is published, and why it is out."""

    rows: str
    published_in: str
    why: str


MD4_TABLE_1 = Source(
    "MD4 (Shi et al. 2024), Table 1", "../shared/seeds/002 (MD4 slides) and docs/math.md#reference-numbers", None,
    "the evaluation of SEDD's paper, whose rows MD4 reprints beside its own (its splits and wrapping are not "
    "recorded in our sources)", "OpenWebText (amount not stated in our source)",
    MD4_COLUMNS)
MDLM_TABLE_3 = Source(
    "MDLM (Sahoo et al. 2024), Table 3", "the paper's text (arXiv 2406.07524)", "duo",
    "validation splits, rows wrapped to 1024 with no EOS between them (MDLM Suppl. D.5), as Duo's zero-shot "
    "scripts do and Duo's Table 2 reprints these rows; MDLM's released dataloader.py puts an EOS after every row "
    "(--protocol mdlm), and its paper says AG News got WikiText's and 1BW's detokenizers where every released "
    "loader applies none", OWT_524B, MDLM_COLUMNS)
BD3LM_TABLE_5 = Source(
    "BD3-LM (Arriola et al. 2025), Table 5", "the paper's text (arXiv 2503.09573)", "bd3lm",
    "BD3-LM's scripts/zs_ppl: validation splits (test for 1BW and AG News), insert_valid_eos=False, the BOS never "
    "masked nor scored; its MDLM and SEDD rows re-evaluate those models this way", OWT_524B, MDLM_COLUMNS)
DUO_TABLE_2 = Source(
    "Duo (Sahoo et al. 2025), Table 2", "the paper's text (ICML 2025, arXiv 2506.10892)", "duo",
    "Duo's scripts/zero_shot_*.sh: validation splits (test for 1BW and AG News), insert_valid_eos=False, every "
    "position scored; its AR, SEDD absorb and MDLM rows are MDLM's Table 3", "OpenWebText, 1M steps",
    MDLM_COLUMNS)
GPT2_TABLE_3 = Source(
    "GPT-2 (Radford et al. 2019), Table 3", "the paper's text (OpenAI, 2019)", None,
    "GPT-2's own, with its invertible detokenizers (the paper's words)", WEBTEXT, MD4_COLUMNS)
SOURCES = (MDLM_TABLE_3, BD3LM_TABLE_5, DUO_TABLE_2, MD4_TABLE_1, GPT2_TABLE_3)

# (model, scale, is_bound, values in the source's column order (None: no number), training where it differs)
_ROWS: dict[Source, tuple[tuple[str, str, bool, tuple[float | None, ...], str], ...]] = {
    MDLM_TABLE_3: (
        ("AR (retrained)", SMALL, False, (82.05, 25.75, 51.25, 51.28, 52.09, 49.01, 41.73), ""),
        ("SEDD absorb (retrained)", SMALL, True, (100.09, 34.28, 68.20, 49.86, 62.09, 44.53, 38.48), ""),
        ("MDLM", SMALL, True, (95.26, 32.83, 67.01, 47.52, 61.15, 41.89, 37.37), ""),
    ),
    BD3LM_TABLE_5: (
        ("AR", SMALL, False, (81.07, 25.32, 51.14, 52.13, 52.11, 48.59, 41.22), ""),
        ("SEDD absorb", SMALL, True, (96.33, 35.98, 68.14, 48.93, 67.82, 45.39, 40.03), ""),
        ("MDLM", SMALL, True, (90.96, 33.22, 64.94, 48.29, 62.78, 43.13, 37.89), ""),
        ("BD3-LM L'=4", SMALL, True, (96.81, 31.31, 60.88, 50.03, 61.67, 42.52, 39.20), ""),
    ),
    DUO_TABLE_2: (
        ("SEDD uniform (retrained)", SMALL, True, (105.51, 41.10, 82.62, 57.29, 82.64, 55.89, 50.86), ""),
        ("UDLM (retrained)", SMALL, True, (112.82, 39.42, 77.59, 53.57, 80.96, 50.98, 44.08), ""),
        ("Duo", SMALL, True, (89.35, 33.57, 73.86, 49.78, 67.81, 44.48, 40.39), ""),
    ),
    MD4_TABLE_1: (
        ("GPT-2", SMALL, False, (45.04, 42.43, 138.43, 41.60, 75.20), WEBTEXT),
        ("D3PM", SMALL, True, (93.47, 77.28, 200.82, 75.16, 138.92), ""),
        ("Plaid", SMALL, True, (57.28, 51.80, 142.60, 50.86, 91.12), ""),
        ("SEDD absorb", SMALL, True, (50.92, 41.84, 114.24, 40.62, 79.29), ""),
        ("SEDD absorb (MD4's reimplementation)", SMALL, True, (49.73, 38.94, 107.54, 39.15, 72.96), ""),
        ("MD4", SMALL, True, (48.43, 34.94, 102.26, 35.90, 68.10), ""),
        ("GPT-2", MEDIUM, False, (35.66, 31.80, 123.14, 31.39, 55.72), WEBTEXT),
        ("SEDD absorb", MEDIUM, True, (42.77, 31.04, 87.12, 29.98, 61.19), ""),
        ("MD4", MEDIUM, True, (44.12, 25.84, 66.07, 25.84, 51.45), ""),
    ),
    GPT2_TABLE_3: (
        ("GPT-2 (117M, as the paper counts it)", SMALL, False, (35.13, 29.41, 65.85, 37.50, 75.20), ""),
        ("GPT-2 (345M, as the paper counts it)", MEDIUM, False, (15.60, 22.76, 47.33, 26.37, 55.72), ""),
    ),
}

# OpenWebText held-out perplexities of small models (MDLM paper, Table 2 and its released
# checkpoint; docs/math.md#reference-numbers): (model, value, is_bound, training)
OWT_SOURCE = Source("MDLM (Sahoo et al. 2024), Table 2", "docs/math.md#reference-numbers", None,
                    "OpenWebText's last 100k documents, wrapped as in training", "OpenWebText, 262B tokens", ((OWT,),))
_OWT_ROWS: tuple[tuple[str, float, bool, str], ...] = (
    ("AR (Transformer)", 17.54, False, ""),
    ("SEDD absorb", 24.10, True, ""),
    ("MDLM", 23.21, True, ""),
    ("MDLM (released checkpoint)", 22.98, True, OWT_524B),
)


def _references() -> tuple[Reference, ...]:
    table = [Reference(model, value, is_bound, dataset, scale, source, training)
             for source, rows in _ROWS.items() for model, scale, is_bound, values, training in rows
             for column, value in zip(source.columns, values, strict=True) if value is not None
             for dataset in column]
    owt = [Reference(model, value, is_bound, OWT, SMALL, OWT_SOURCE, training)
           for model, value, is_bound, training in _OWT_ROWS]
    return tuple(table + owt)


REFERENCES: tuple[Reference, ...] = _references()

MISSING_REFERENCES = (
    MissingReference("D3PM absorb and Plaid", "Duo (Sahoo et al. 2025), Table 2 (taken from SEDD's paper)",
                     "the stored text garbles these two rows; their values under SEDD's protocol are MD4 Table 1's"),
    MissingReference("SEDD uniform and SEDD's other rows", "SEDD (Lou et al. 2024), its zero-shot table",
                     "no stored copy of SEDD's own table was found; its absorbing rows are read through MD4 Table 1"),
    MissingReference("EDLM-NCE, EDLM-AR, EDLM-coAR", "EDLM (Xu et al. 2025), Table 2",
                     "only a secondary summary of the table is stored, not the paper"),
)

# Where our reading of a set is known to differ from the reference code's, per protocol
# (evaluation/bounds/datasets.py and evaluation/bounds/protocols.py explain why): the gap is part of
# any comparison.
_WIKITEXT_NOTE = ("our units are whole articles (one EOS per article), on the test split; the MDLM-line code puts "
                  "an EOS after every line, blank lines included (mdlm) or none at all (bd3lm, duo), on the "
                  "validation split")
_LM1B_NOTE = ("our test split is the benchmark's heldout shard 00000; the reference code scores all 50 heldout "
              "shards (about 50x more sentences)")
_AG_NEWS_NOTE = ("the reference code scores every item as Hugging Face gives it, with an EOS after it (mdlm) or "
                 "none (bd3lm, duo); we strip the item's edges")
_PAPERS_NOTE = ("we score the test split with the detokenizers applied sentence by sentence and without WikiText's "
                "' N ' -> ' 1 ' rule; the reference code scores the validation split, detokenizing each whole "
                "article (--protocol mdlm, bd3lm, duo)")
_ANCHOR_NOTES = {"lm1b": _LM1B_NOTE}
_PROTOCOL_NOTES = {
    "unmask": {
        "wikitext2": _WIKITEXT_NOTE,
        "wikitext103": _WIKITEXT_NOTE,
        "ptb": "we score the test split; the MDLM-line code scores the validation split (--protocol mdlm, bd3lm, duo)",
        "lambada": "our passages start without the newline the GPT-2/SEDD/MDLM code puts before each "
                   "(--protocol mdlm, or --detokenizer lambada_gpt2)",
        "lm1b": _LM1B_NOTE,
        "ag_news": _AG_NEWS_NOTE,
        "pubmed": _PAPERS_NOTE,
        "arxiv": _PAPERS_NOTE,
    },
    "mdlm": _ANCHOR_NOTES,
    "bd3lm": _ANCHOR_NOTES,
    "duo": _ANCHOR_NOTES,
}


def references_for(dataset: str) -> list[Reference]:
    """The published numbers on ``dataset`` (our key), in table order; [] for any other set."""
    return [reference for reference in REFERENCES if reference.dataset == dataset]


def protocol_note(dataset: str, protocol: str = "unmask") -> str | None:
    """A known difference between ``protocol`` (an evaluation.bounds.protocols name) on ``dataset`` and
    the reference code's reading of it, if any."""
    return _PROTOCOL_NOTES.get(protocol, {}).get(dataset)
