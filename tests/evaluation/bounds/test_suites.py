"""``--suite zero-shot`` (``evaluation.bounds.suites``): the seven sets of the papers' zero-shot
table found under --data-dir, the missing ones named with their files and where to get them,
and `unmask eval --suite zero-shot` end to end, its table in the report."""

from __future__ import annotations

import csv
import json
import logging
import zipfile
from pathlib import Path

import pytest

from common.errors import UserError
from data_prep.tokenizer.load import load_tokenizer
from evaluation.bounds.scoring import ScoringConfig, with_suite
from evaluation.bounds.suites import SUITES, ZERO_SHOT, missing_sets
from tests.evaluation.bounds.test_protocols import ENDOFTEXT, mdlm_blocks, mdlm_rows
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import GPT2, SHARED, needs_shared
from tests.support.tokenizer_fixtures import reference_gpt2

SHARED_SETS = ("ptb", "wikitext-2-raw", "lambada", "lm1b", "ag_news")
needs_data = needs_shared(*SHARED_SETS, "pubmed/hf_dummy_fixture_2rows", "gpt2-bpe")
SEQ_LEN, DOCUMENTS = 64, 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """../shared/data's sets and PubMed's two-row fixture as the release's val.txt; no ArXiv."""
    root = tmp_path_factory.mktemp("data")
    for name in SHARED_SETS:
        (root / name).symlink_to(SHARED / name)
    (root / "pubmed").mkdir()
    with zipfile.ZipFile(SHARED / "pubmed/hf_dummy_fixture_2rows/dummy_data.zip") as archive:
        (root / "pubmed/val.txt").write_bytes(archive.read("dummy_data/pubmed-dataset.zip/pubmed-dataset/val.txt"))
    return root


@needs_data
@pytest.mark.parametrize("protocol, pubmed_split", [("duo", "valid"), ("unmask", "test")])
def test_the_suite_is_its_sets_under_the_data_directory_in_the_papers_order(data_dir, caplog, protocol,
                                                                            pubmed_split):
    caplog.set_level(logging.WARNING, "unmask.eval")
    config = with_suite(ScoringConfig(suite=ZERO_SHOT, data_dir=str(data_dir), protocol=protocol))
    present = ("ptb", "wikitext103", "lm1b", "lambada", "ag_news", "pubmed")
    assert config.datasets == (present if pubmed_split == "valid" else present[:-1])  # no pubmed/test.txt
    missing = missing_sets(ZERO_SHOT, config.datasets, protocol)
    assert [(item.name, item.split) for item in missing][-1] == ("arxiv", pubmed_split)
    assert "arxiv/arxiv-dataset" in missing[-1].expected and "arxiv-dataset.zip" in missing[-1].expected
    assert f"--suite zero-shot: arxiv is not scored: arxiv ({pubmed_split} split): expected arxiv/" in caplog.text
    config.check()
    assert with_suite(config) == config  # chosen once: a second call changes nothing
    assert SUITES[ZERO_SHOT] == ("ptb", "wikitext103", "lm1b", "lambada", "ag_news", "pubmed", "arxiv")


@pytest.mark.parametrize("config, message", [
    ({"suite": ZERO_SHOT}, "--suite zero-shot reads its sets from --data-dir"),
    ({"suite": "zero_shot", "data_dir": "."}, "--suite 'zero_shot' is not one of zero-shot"),
    ({"suite": ZERO_SHOT, "datasets": ("ptb", "val"), "data_dir": "."}, "val is not one of them"),
])
def test_bad_suites_are_refused_in_one_line(config, message):
    with pytest.raises(UserError, match=message):
        with_suite(ScoringConfig(**config)).check()


def test_a_suite_with_none_of_its_sets_names_every_file_it_looked_for(tmp_path):
    with pytest.raises(UserError) as refusal:
        with_suite(ScoringConfig(suite=ZERO_SHOT, data_dir=str(tmp_path), protocol="bd3lm"))
    message = str(refusal.value)
    assert message.startswith(f"--suite zero-shot: none of its sets is under --data-dir {tmp_path}: ptb (valid split)")
    assert "ag_news (test split): expected ag_news/test.csv (AG News's CSV" in message
    assert "pubmed (valid split): expected pubmed/val.txt or pubmed/pubmed-dataset/val.txt" in message
    assert "\n" not in message


# ------------------------------------------------------------------ unmask eval --suite zero-shot
def _ag_news_rows(count: int) -> list[str]:
    """HF ag_news's text, re-stated: title, a space, description, read with its csv dialect."""
    with open(SHARED / "ag_news/test.csv", encoding="utf-8") as stream:
        rows = csv.reader(stream, quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL, skipinitialspace=True)
        return [f"{title} {description}" for _, title, description in list(rows)[:count]]


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory):
    """An untrained one-layer network over GPT-2's vocabulary."""
    gpt2 = load_tokenizer(GPT2)
    return write_untrained_export(tmp_path_factory.mktemp("gpt2-export") / "export", gpt2, GPT2, max_seq_len=128)


@pytest.mark.slow
@needs_data
def test_unmask_eval_suite_zero_shot_under_bd3lm_end_to_end(gpt2_export, data_dir, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["eval", str(gpt2_export), "--suite", ZERO_SHOT, "--data-dir", str(data_dir), "--protocol", "bd3lm",
            "--seq-len", str(SEQ_LEN), "--max-documents", str(DOCUMENTS), "--quick", "--samples", "2",
            "--batch-size", "16", "--out", str(out)]
    assert unmask_in_process(argv) == 0
    printed = capsys.readouterr().out
    assert "protocol: bd3lm" in printed and "arxiv: not scored (valid split): expected arxiv/val.txt" in printed
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert sorted(results["datasets"]) == sorted(["ptb", "wikitext103", "lm1b", "lambada", "ag_news", "pubmed"])  # results.json sorts keys
    assert results["protocol"]["suite"]["name"] == ZERO_SHOT and results["protocol"]["add_eos"] is False
    assert [item["name"] for item in results["protocol"]["suite"]["missing"]] == ["arxiv"]
    # BD3-LM's blocks: no EOS between rows, the BOS of every block context only (L - 1 tokens scored).
    for name, rows in (("ptb", mdlm_rows("ptb")[:DOCUMENTS]), ("ag_news", _ag_news_rows(DOCUMENTS))):
        blocks = mdlm_blocks(rows, SEQ_LEN, eos_per_row=False)
        assert results["datasets"][name]["num_tokens"] == blocks.shape[0] * (SEQ_LEN - 1)
        assert results["datasets"][name]["dataset"]["protocol"] == "bd3lm"
        assert bool((blocks[:, 0] == ENDOFTEXT).all())
    assert len(reference_gpt2().encode(_ag_news_rows(1)[0]).ids) < SEQ_LEN  # a block holds several items
    markdown = (out / "report.md").read_text(encoding="utf-8")
    table = markdown[markdown.index("## Zero-shot table"):markdown.index("### Published under other protocols")]
    assert "| BD3-LM L'=4 | small ~ 124M | BD3-LM (Arriola et al. 2025), Table 5 | ≤ 96.81 |" in table
    assert "Not scored (— in the table): the suite's sets whose files are not under --data-dir: arxiv" in table
    assert "sequence length is 64" in table and "first max_documents documents" in table
