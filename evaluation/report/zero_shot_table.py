"""The report's zero-shot table: this run's numbers in the papers' layout (MDLM's Table 3: PTB,
WikiText, LM1B, LAMBADA, AG News, PubMed, ArXiv) beside the published rows measured under the
same protocol, and the rows of other protocols apart, marked as not comparable.

    blocks = zero_shot_blocks(results)     # report blocks (evaluation.report.document)

Every published row names its source, protocol, tokenizer and training, and where its numbers
were read (``evaluation.report.references``); a row is put beside ours only when its protocol is
the one our numbers were measured under, and the table says so whichever way it goes. Our cells
carry their 95% Monte Carlo interval. See docs/evaluation.md#the-zero-shot-table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from evaluation.bounds.protocols import UNMASK
from evaluation.report.document import Block, Heading, Inline, Table, paragraph
from evaluation.report.references import (
    MDLM_COLUMNS,
    MISSING_REFERENCES,
    REFERENCE_SEQ_LEN,
    REFERENCE_TOKENIZER,
    REFERENCES,
    SOURCES,
    Source,
    protocol_note,
)
from evaluation.results import DatasetResult, EvalResults

__all__ = ["COLUMN_NAMES", "zero_shot_blocks"]

GPT2_TOKENIZER_KIND = "gpt2-bpe"  # data_prep.tokenizer's kind of the GPT-2 byte-level BPE
AUTOREGRESSIVE = "autoregressive"
NOT_SCORED = "—"
COLUMN_NAMES = {("ptb",): "PTB", ("wikitext103", "wikitext2"): "WikiText", ("wikitext2",): "WikiText-2",
                ("wikitext103",): "WikiText-103", ("lm1b",): "LM1B", ("lambada",): "LAMBADA", ("ag_news",): "AG News",
                ("pubmed",): "PubMed", ("arxiv",): "ArXiv"}


def _number(value: float) -> str:
    return f"{value:,.2f}" if math.isfinite(value) else "n/a"


def _protocol_of(record: DatasetResult) -> str:
    """The protocol a number used (the val split of the training shards is only read by ours)."""
    return record.dataset.get("protocol", UNMASK.name)


def _our_cell(record: DatasetResult | None, exact: bool) -> str:
    if record is None:
        return NOT_SCORED
    low, high = record.perplexity_interval
    value = f"{'' if exact else '≤ '}{_number(record.perplexity_bound)}"
    return value if exact else f"{value} ({_number(low)} – {_number(high)})"


def _scored(results: EvalResults, column: tuple[str, ...]) -> DatasetResult | None:
    """Our number for a column: its first key we scored (WikiText-103 before WikiText-2)."""
    return next((results.datasets[key] for key in column if key in results.datasets), None)


def _reference_cell(source: Source, model: str, scale: str, column: tuple[str, ...]) -> str:
    found = next((reference for reference in REFERENCES if reference.source is source and reference.model == model
                  and reference.scale == scale and reference.dataset == column[0]), None)
    return found.display_value if found else NOT_SCORED


def _rows_of(source: Source) -> list[tuple[str, str, str]]:
    """(model, scale, training) of every row of ``source``, in table order."""
    rows: list[tuple[str, str, str]] = []
    for reference in REFERENCES:
        row = (reference.model, reference.scale, reference.training)
        if reference.source is source and row not in rows:
            rows.append(row)
    return rows


def _our_scale(network: dict[str, Any]) -> str:
    if not network:
        return NOT_SCORED
    return (f"{network.get('n_layers', '?')} layers, d_model {network.get('d_model', '?')}, "
            f"{network.get('n_heads', '?')} heads")


def _source_line(source: Source) -> str:
    protocol = f"--protocol {source.protocol}" if source.protocol else "none of ours"
    return (f"{source.citation}. Protocol: {protocol}; {source.protocol_note}. Tokenizer {REFERENCE_TOKENIZER}, "
            f"sequence length {REFERENCE_SEQ_LEN}; trained on {source.training}. Numbers read in {source.read_in}.")


def _header(columns: Sequence[tuple[str, ...]], *first: str) -> tuple[str, ...]:
    return (*first, *(COLUMN_NAMES[column] for column in columns))


def _comparable_table(results: EvalResults, sources: list[Source]) -> Table:
    """Ours and the published rows of our protocol, in MDLM's layout."""
    model = results.model
    exact = model.objective == AUTOREGRESSIVE
    ours: tuple[Inline, ...] = (f"this run ({model.objective}, step {model.step:,})" if model.step is not None
                                else f"this run ({model.objective})", _our_scale(model.network), "this report",
                                *(_our_cell(_scored(results, column), exact) for column in MDLM_COLUMNS))
    published = tuple((name, scale, source.citation,
                       *(_reference_cell(source, name, scale, column) for column in MDLM_COLUMNS))
                      for source in sources for name, scale, _ in _rows_of(source))
    return Table(_header(MDLM_COLUMNS, "model", "scale", "source"), (ours, *published))


def _source_table(source: Source) -> Table:
    rows = tuple((name, scale, training, *(_reference_cell(source, name, scale, column) for column in source.columns))
                 for name, scale, training in _rows_of(source))
    return Table(_header(source.columns, "model", "scale", "training"), rows)


def _caveats(results: EvalResults) -> list[str]:
    """Why this run's numbers may not be comparable with any published row."""
    protocol = results.protocol
    caveats = []
    kind = results.model.tokenizer.kind
    if kind != GPT2_TOKENIZER_KIND:
        caveats.append(f"This run's tokenizer ({kind or 'not recorded'}) is not {REFERENCE_TOKENIZER}: per-token "
                       f"perplexities are NOT comparable with any published row (bits per byte are).")
    if protocol.seq_len != REFERENCE_SEQ_LEN:
        caveats.append(f"This run's sequence length is {protocol.seq_len}, the published rows' {REFERENCE_SEQ_LEN}.")
    if protocol.max_documents is not None:
        caveats.append("This run scored only the first max_documents documents of each set (see the protocol); "
                       "the published rows scored whole sets.")
    if protocol.blocks_per_replicate:
        caveats.append(f"Each time sample scored a random {protocol.blocks_per_replicate} blocks of a set "
                       f"(--quick): the bound is the whole set's, its interval wider.")
    return caveats


def _mixed_protocols(results: EvalResults, protocol: str) -> list[str]:
    """Sets of this run measured under another protocol than the table's (none from unmask eval)."""
    return [name for columns in MDLM_COLUMNS for name in columns
            if name in results.datasets and _protocol_of(results.datasets[name]) != protocol]


def _notes(results: EvalResults, protocol: str) -> list[Block]:
    notes = [f"{name}: {note}" for columns in MDLM_COLUMNS for name in columns if name in results.datasets
             for note in (protocol_note(name, _protocol_of(results.datasets[name])),) if note]
    return [paragraph("Where this run's reading differs from the reference code's: " + "; ".join(notes) + ".")] \
        if notes else []


def _missing_sets(results: EvalResults) -> list[Block]:
    suite = results.protocol.suite
    if not suite or not suite.missing:
        return []
    lines = "; ".join(f"{item.name} ({item.split} split): {item.expected}" for item in suite.missing)
    return [paragraph(f"Not scored ({NOT_SCORED} in the table): the suite's sets whose files are not under "
                      f"--data-dir: {lines}.")]


def zero_shot_blocks(results: EvalResults) -> list[Block]:
    """The zero-shot table section (module docstring); nothing when no set of the table was scored."""
    if not any(_scored(results, column) for column in MDLM_COLUMNS):
        return []
    protocol = results.protocol.name
    comparable = [source for source in SOURCES if source.protocol == protocol]
    others = [source for source in SOURCES if source.protocol != protocol]
    blocks: list[Block] = [
        Heading(2, "Zero-shot table"),
        paragraph(f"This run's numbers were measured under --protocol {protocol}. Published numbers are only "
                  f"comparable at the same tokenizer, sequence length and protocol: the protocol alone (split, "
                  f"BOS/EOS handling, detokenizer, wrapping) moves them by 5 to 15 percent across papers, so "
                  f"only rows of --protocol {protocol} stand beside ours; the others follow apart. ≤ marks an "
                  f"upper bound (a diffusion model's NELBO), other values are exact perplexities; our cells give "
                  f"the 95% Monte Carlo interval of the bound. The WikiText column is WikiText-103 (WikiText-2's "
                  f"validation and test text is the same)."),
        *(paragraph(caveat) for caveat in _caveats(results)),
        *_missing_sets(results),
    ]
    mixed = _mixed_protocols(results, protocol)
    if mixed:
        blocks.append(paragraph(f"{', '.join(mixed)} were read with another protocol than --protocol {protocol}: "
                                f"their cells are not comparable with the published rows beside them."))
    blocks.append(_comparable_table(results, comparable))
    if comparable:
        blocks.extend(paragraph(_source_line(source)) for source in comparable)
    else:
        blocks.append(paragraph(f"No published row was measured under --protocol {protocol}: none is comparable "
                                f"with this run's numbers. --protocol duo reads the data as MDLM's Table 3 and "
                                f"Duo's Table 2 did, --protocol bd3lm as BD3-LM's Table 5."))
    blocks.extend(_notes(results, protocol))
    if others:
        blocks.append(Heading(3, f"Published under other protocols: not comparable with this run's --protocol "
                                 f"{protocol}"))
        for source in others:
            blocks += [paragraph(_source_line(source)), _source_table(source)]
    blocks.append(Heading(3, "Published rows not in our sources"))
    blocks.extend(paragraph(f"{missing.rows}: {missing.published_in}; left out: {missing.why}.")
                  for missing in MISSING_REFERENCES)
    return blocks
