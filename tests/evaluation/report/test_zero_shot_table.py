"""The report's zero-shot table (``evaluation.report.zero_shot_table``) and the published rows it
puts beside ours (``evaluation.report.references``): the papers' layout with our intervals, only
rows of the run's protocol beside its numbers, every published row with its source, the sets a
suite could not score."""

import copy

import pytest

from evaluation.bounds.protocols import PROTOCOLS
from evaluation.report.references import (
    MISSING_REFERENCES,
    REFERENCES,
    SOURCES,
    references_for,
)
from evaluation.report.write import write_report
from tests.support.results_fixtures import dataset_record, make_results

TABLE_SETS = ("ptb", "wikitext103", "lm1b", "lambada", "ag_news", "pubmed", "arxiv")


def _markdown(results: dict, tmp_path) -> str:
    return write_report(copy.deepcopy(results), tmp_path / "report").markdown.read_text(encoding="utf-8")


def _table_results(protocol: str, names=TABLE_SETS) -> dict:
    results = make_results(per_t=False)
    results["protocol"]["name"] = protocol
    results["datasets"] = {name: dataset_record(name, 3.0 + index / 10, 0.01, 100_000, 400_000, False)
                           for index, name in enumerate(names)}
    for record in results["datasets"].values():
        record["dataset"].update(protocol=protocol, split="valid")
    return results


def _section(markdown: str) -> str:
    return markdown[markdown.index("## Zero-shot table"):markdown.index("## Samples")]


def _row(text: str, first_cell: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, f"{len(rows)} rows start with {first_cell!r}"
    return rows[0]


def _cells(row: str) -> list[str]:
    return row.strip("| ").split(" | ")


def _our_cell(record: dict) -> str:
    low, high = record["perplexity_interval"]
    return f"≤ {record['perplexity_bound']:.2f} ({low:.2f} – {high:.2f})"


def test_every_published_row_names_its_source_protocol_and_training():
    assert all(source.citation and source.read_in and source.training and source.protocol_note for source in SOURCES)
    assert {source.protocol for source in SOURCES} - set(PROTOCOLS) == {None}
    assert {(source.citation, source.protocol) for source in SOURCES if source.protocol} == {
        ("MDLM (Sahoo et al. 2024), Table 3", "duo"), ("BD3-LM (Arriola et al. 2025), Table 5", "bd3lm"),
        ("Duo (Sahoo et al. 2025), Table 2", "duo")}
    assert all(reference.source in SOURCES or reference.dataset == "owt" for reference in REFERENCES)
    assert MISSING_REFERENCES and all(item.published_in and item.why for item in MISSING_REFERENCES)


def test_the_published_numbers_as_their_tables_print_them():
    def row(dataset, citation, model):
        return [r for r in references_for(dataset) if r.source.citation.startswith(citation) and r.model == model]
    (mdlm,) = row("ag_news", "MDLM", "MDLM")
    assert (mdlm.value, mdlm.is_bound, mdlm.display_value, mdlm.protocol) == (61.15, True, "≤ 61.15", "duo")
    (ar,) = row("pubmed", "MDLM", "AR (retrained)")
    assert (ar.value, ar.is_bound, ar.training) == (49.01, False, "OpenWebText, 524B tokens")
    (bd3lm,) = row("arxiv", "BD3-LM", "BD3-LM L'=4")
    assert (bd3lm.value, bd3lm.protocol) == (39.20, "bd3lm")
    (duo,) = row("lm1b", "Duo", "Duo")
    assert duo.value == 73.86
    # The papers' single Wikitext column stands for both of our keys (the same validation text).
    assert [r.value for r in row("wikitext2", "MDLM", "MDLM")] == [r.value for r in row("wikitext103", "MDLM", "MDLM")]
    # MD4's table keeps WikiText-2 and -103 apart, and has no AG News, PubMed or ArXiv column.
    assert [r.value for r in row("wikitext2", "MD4", "MD4")] == [34.94, 25.84]
    assert not [r for r in references_for("ag_news") if r.source.citation.startswith("MD4")]
    assert references_for("val") == []


def test_rows_of_the_run_s_protocol_stand_beside_its_numbers_the_others_apart(tmp_path):
    section = _section(_markdown(_table_results("duo"), tmp_path))
    comparable, others = section.split("### Published under other protocols: not comparable with this run's "
                                       "--protocol duo", 1)
    assert comparable.index("| model | scale | source | PTB | WikiText | LM1B | LAMBADA | AG News | PubMed | ArXiv |")
    results = _table_results("duo")
    ours = _cells(_row(comparable, "this run (diffusion, step 12,000)"))
    assert ours[3:] == [_our_cell(results["datasets"][name]) for name in TABLE_SETS]  # the papers' column order
    assert ours[3] == "≤ 20.09 (19.70 – 20.48)"
    assert _row(comparable, "MDLM").split(" | ")[2] == "MDLM (Sahoo et al. 2024), Table 3"
    assert "| Duo | small ~ 124M | Duo (Sahoo et al. 2025), Table 2 | ≤ 89.35 |" in comparable
    assert "BD3-LM" not in comparable.split("Protocol: --protocol duo")[0]  # BD3-LM's rows are not beside ours
    assert "| BD3-LM L'=4 | small ~ 124M | OpenWebText, 524B tokens | ≤ 96.81 |" in others
    assert "| MD4 | medium ~ 355M |" in others and "Protocol: none of ours" in others


@pytest.mark.parametrize("protocol", ["unmask", "mdlm"])
def test_a_protocol_no_paper_used_gets_no_published_row_beside_it_and_says_so(tmp_path, protocol):
    section = _section(_markdown(_table_results(protocol), tmp_path))
    comparable = section.split("### Published under other protocols", 1)[0]
    assert f"No published row was measured under --protocol {protocol}: none is comparable" in comparable
    assert [line for line in comparable.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        _row(comparable, "this run (diffusion, step 12,000)")]
    assert "| MDLM | small ~ 124M | OpenWebText, 524B tokens | ≤ 95.26 |" in section  # apart, with its protocol


def test_sets_read_under_another_protocol_and_unscored_columns_are_marked(tmp_path):
    results = _table_results("duo", names=("ptb", "lambada"))
    results["datasets"]["lambada"]["dataset"]["protocol"] = "mdlm"
    section = _section(_markdown(results, tmp_path))
    assert "lambada were read with another protocol than --protocol duo: their cells are not comparable" in section
    assert _cells(_row(section, "this run (diffusion, step 12,000)"))[3:] == [
        _our_cell(results["datasets"]["ptb"]), "—", "—", _our_cell(results["datasets"]["lambada"]), "—", "—", "—"]


def test_the_sets_a_suite_could_not_score_are_named_with_their_files(tmp_path):
    results = _table_results("bd3lm", names=TABLE_SETS[:5])
    results["protocol"]["suite"] = {"name": "zero-shot", "missing": [
        {"name": "pubmed", "split": "valid", "expected": "expected pubmed/val.txt (the release's JSON lines)"}]}
    section = _section(_markdown(results, tmp_path))
    assert ("Not scored (— in the table): the suite's sets whose files are not under --data-dir: pubmed (valid "
            "split): expected pubmed/val.txt (the release's JSON lines).") in section


def test_caveats_and_protocol_notes_follow_the_run(tmp_path):
    results = _table_results("unmask", names=("lm1b", "wikitext2"))
    results["model"]["tokenizer"]["kind"] = "bpe"
    results["protocol"].update(seq_len=128, blocks_per_replicate=64)
    section = _section(_markdown(results, tmp_path))
    assert "This run's tokenizer (bpe) is not GPT-2 BPE: per-token perplexities are NOT comparable" in section
    assert "This run's sequence length is 128, the published rows' 1024." in section
    assert "(--quick): the bound is the whole set's, its interval wider." in section
    assert "lm1b: our test split is the benchmark's heldout shard 00000" in section
    assert "wikitext2: our units are whole articles" in section
    results["protocol"]["name"] = "bd3lm"
    for record in results["datasets"].values():
        record["dataset"]["protocol"] = "bd3lm"
    section = _section(_markdown(results, tmp_path / "bd3lm"))
    assert "heldout shard 00000" in section and "whole articles" not in section  # bd3lm reads WikiText as BD3-LM


def test_no_table_without_a_set_of_it(tmp_path):
    results = _table_results("unmask", names=())
    results["datasets"] = {"val": dataset_record("val", 3.0, 0.01, 1000, 4000, False)}
    assert "## Zero-shot table" not in _markdown(results, tmp_path)
