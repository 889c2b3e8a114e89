"""The report of `unmask eval`: files, numbers in the tables, labelled references, a
self-contained and escaped HTML page, plots only where there is data for them."""

import copy
import json
import math
import re

import pytest

from evaluation.estimator import Z_95
from evaluation.references import REFERENCES, references_for
from evaluation.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SAMPLE_TEXT = 'The <script>alert("x")</script> & more\n\nsecond paragraph'
# src/href (quoted or not) pointing anywhere on the network
EXTERNAL_LINK = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)
SHA = "ab" * 32


def _dataset_record(name: str, nelbo: float, se: float, tokens: int, utf8_bytes: int,
                    per_t: bool) -> dict:
    low, high = math.exp(nelbo - Z_95 * se), math.exp(nelbo + Z_95 * se)
    record = {
        "dataset": {"name": name, "split": "test", "path": f"/data/{name}/test.txt",
                    "sha256": SHA, "detokenizer": name, "unit": "sentence per line",
                    "documents": 100, "dropped_empty": 0, "utf8_bytes": utf8_bytes},
        "estimate": {"nelbo_per_token": nelbo, "standard_error": se, "num_tokens": tokens,
                     "num_blocks": 10, "samples_per_block": 16, "kind": "continuous",
                     "discrete_steps": None, "seed": 0, "error_method": "replicates",
                     "perplexity_bound": math.exp(nelbo), "perplexity_interval_95": [low, high],
                     "degrees_of_freedom": 15},
        "perplexity_bound": math.exp(nelbo), "perplexity_interval": [low, high],
        "nelbo_per_token": nelbo, "standard_error": se,
        "bits_per_byte": nelbo * tokens / (math.log(2) * utf8_bytes), "num_tokens": tokens,
    }
    if per_t:
        t = [(i + 0.5) / 64 for i in range(64)]
        record["per_t"] = {"t": t, "contribution": [nelbo * (1 + 0.5 * (x - 0.5)) for x in t]}
    return record


def make_results(objective: str = "diffusion", *, per_t: bool = True, samples: bool = True) -> dict:
    return {
        "model": {"path": "/runs/small/export", "objective": objective, "step": 12000,
                  "tokens_seen": 6_291_456_000, "weights": "ema",
                  "network": {"n_layers": 12, "d_model": 768, "n_heads": 12, "vocab_size": 50258,
                              "max_seq_len": 1024},
                  "tokenizer": {"kind": "gpt2-bpe", "sha256": SHA, "vocab_size": 50258}},
        "protocol": {"seq_len": 1024, "samples_per_block": 16, "seed": 0,
                     "estimator": "autoregressive" if objective == "autoregressive" else "continuous",
                     "discrete_steps": None, "target_rel_error": 0.002, "add_eos": True,
                     "wrapping": "documents + EOS concatenated | cut into blocks",
                     "precision": "float32 weights; sums float64", "world_size": 2},
        "datasets": {
            "lambada": _dataset_record("lambada", 3.5, 0.01, 245_569, 1_000_000, per_t),
            "wikitext2": _dataset_record("wikitext2", 3.25, 0.02, 287_644, 1_234_567, False),
        },
        "samples": [{"text": SAMPLE_TEXT, "network_calls": 128, "steps": 1000}] if samples else [],
        "mlflow": {"tracking_uri": "http://127.0.0.1:5000", "run_id": "0123abcd"},
        "created": "2025-01-02T03:04:05+00:00", "unmask_version": "0.1.0", "git_commit": "deadbeef",
    }


CURVES = {"train/loss": [(step, 10.0 / (1 + step / 100)) for step in range(0, 2000, 10)],
          "val/nelbo_per_token": [(step, 11.0 / (1 + step / 100)) for step in range(0, 2000, 500)]}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    results = make_results()
    files = write_report(copy.deepcopy(results), tmp_path_factory.mktemp("report") / "new" / "dir",
                         curves=CURVES)
    return results, files, files.markdown.read_text(encoding="utf-8"), files.html.read_text(encoding="utf-8")


def _row(markdown: str, first_cell: str) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |")]
    assert rows, f"no table row starts with {first_cell!r}"
    return rows[0]


def test_files_exist_and_results_round_trip(report):
    results, files, _, _ = report
    for path in (files.markdown, files.html, files.json, *files.plots):
        assert path.is_file()
    assert json.loads(files.json.read_text(encoding="utf-8")) == results
    assert [path.name for path in files.plots] == ["curves.png", "per_t_lambada.png"]
    for path in files.plots:
        assert path.parent.name == "plots" and path.read_bytes().startswith(PNG_MAGIC)
    assert not list(files.json.parent.rglob("*.tmp-*")), "temporary files left behind"


def test_results_rows_carry_numbers_and_interval(report):
    _, _, markdown, html = report
    assert ("| dataset | tokens | NELBO/token (nats ± SE) | perplexity bound (95% interval) "
            "| bits/byte |") in markdown
    lambada = _row(markdown, "lambada")
    bits_per_byte = f"{3.5 * 245_569 / (math.log(2) * 1e6):.4f}"
    for text in ("245,569", "3.5000 ± 0.0100", "33.12 (32.47 – 33.77)", bits_per_byte):
        assert text in lambada
    wikitext = _row(markdown, "wikitext2")
    for text in ("287,644", "3.2500 ± 0.0200", "25.79 (24.80 – 26.82)"):
        assert text in wikitext
    assert "33.12 (32.47 – 33.77)" in html


def test_title_protocol_and_mlflow(report):
    results, _, markdown, html = report
    assert markdown.startswith("# Evaluation report: /runs/small/export at step 12,000\n")
    for key, value in results["protocol"].items():  # every field, verbatim
        assert f"`{key}`" in markdown and f"<code>{key}</code>" in html
    assert r"`documents + EOS concatenated \| cut into blocks`" in markdown  # the | stays in its cell
    assert f"`{SHA}`" in markdown and "`sentence per line`" in markdown and "`1234567`" in markdown
    assert "`network.n_layers`" in markdown and "`tokenizer.kind`" in markdown
    assert "MLflow run `0123abcd` at `http://127.0.0.1:5000`." in markdown


def test_reference_rows_are_labelled(report):
    _, _, markdown, html = report
    assert "only comparable at the same tokenizer and the same evaluation protocol" in markdown
    for name in ("lambada", "wikitext2"):
        section = markdown.split(f"\n### {name}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        ours = _row(section, "this run (diffusion, step 12,000)")
        assert "≤ " in ours and "12 layers, d_model 768, 12 heads" in ours
        references = references_for(name)
        assert len(references) == 6
        for reference in references:
            row = next(line for line in section.splitlines()
                       if line.startswith(f"| {reference.model} |") and reference.display_value in line
                       and reference.scale in line)
            assert "GPT-2 BPE" in row and reference.training_data in row and "MD4 paper, Table 1" in row
    assert "small ~ 124M" in html and "GPT-2 BPE" in html


def test_html_is_self_contained_and_escaped(report):
    _, files, _, html = report
    assert not EXTERNAL_LINK.search(html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert html.count('src="data:image/png;base64,') == len(files.plots) == 2
    assert "<script" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; more" in html


def test_markdown_sample_is_verbatim_quote(report):
    _, _, markdown, _ = report
    assert "Sample 1: 1,000 steps, 128 network calls." in markdown
    assert '> ```text\n> The <script>alert("x")</script> & more\n>\n> second paragraph\n> ```' in markdown


def test_markdown_links_plots_by_relative_path(report):
    _, files, markdown, _ = report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert links == ["plots/curves.png", "plots/per_t_lambada.png"]
    assert all((files.markdown.parent / link).is_file() for link in links)


def test_autoregressive_wording(tmp_path):
    files = write_report(make_results("autoregressive", per_t=False), tmp_path)
    markdown = files.markdown.read_text(encoding="utf-8")
    assert "| dataset | tokens | NLL/token (nats) | perplexity (exact) | bits/byte |" in markdown
    assert "perplexity bound" not in markdown and "±" not in _row(markdown, "lambada")
    assert _row(markdown, "lambada").endswith(f"| 33.12 | {3.5 * 245_569 / (math.log(2) * 1e6):.4f} |")
    assert "| this run (autoregressive, step 12,000) | 33.12 |" in markdown
    assert "perplexity (exact)" in files.html.read_text(encoding="utf-8")


def test_no_plots_without_data(tmp_path):
    files = write_report(make_results(per_t=False, samples=False), tmp_path, curves={"train/loss": []})
    assert files.plots == [] and not (tmp_path / "plots").exists()
    markdown, html = files.markdown.read_text(encoding="utf-8"), files.html.read_text(encoding="utf-8")
    assert "![" not in markdown and "plots/" not in markdown and "## Plots" not in markdown
    assert "<img" not in html and "data:image" not in html
    assert "## Samples" not in markdown


def test_unknown_dataset_and_non_gpt2_tokenizer_are_flagged(tmp_path):
    results = make_results(per_t=False)
    results["datasets"] = {"notes/my file.txt": results["datasets"]["lambada"]}
    results["model"]["tokenizer"]["kind"] = "sentencepiece"
    results["protocol"]["seq_len"] = 512
    markdown = write_report(results, tmp_path).markdown.read_text(encoding="utf-8")
    assert "No published reference numbers for these datasets." in markdown
    assert "(sentencepiece) is not GPT-2 BPE" in markdown and "sequence length is 512" in markdown


def test_per_t_plot_names_are_distinct_file_names(tmp_path):
    results = make_results()
    record = results["datasets"]["lambada"]
    results["datasets"] = {"a/b.txt": record, "a b.txt": record}
    files = write_report(results, tmp_path)
    assert [path.name for path in files.plots] == ["per_t_a_b.txt.png", "per_t_a_b.txt_2.png"]


def test_malformed_results_write_nothing(tmp_path):
    results = make_results()
    del results["datasets"]["lambada"]["bits_per_byte"]
    with pytest.raises(ValueError, match="datasets.lambada.bits_per_byte"):
        write_report(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_references_as_data():
    assert {reference.dataset for reference in REFERENCES} == {
        "lambada", "wikitext2", "ptb", "wikitext103", "lm1b", "owt"}
    lm1b = references_for("lm1b")
    assert [(r.model, r.scale, r.value, r.is_bound) for r in lm1b] == [
        ("GPT-2", "small ~ 124M", 75.20, False), ("SEDD absorb", "small ~ 124M", 79.29, True),
        ("MD4", "small ~ 124M", 68.10, True), ("GPT-2", "medium ~ 355M", 55.72, False),
        ("SEDD absorb", "medium ~ 355M", 61.19, True), ("MD4", "medium ~ 355M", 51.45, True)]
    assert {r.training_data for r in lm1b if r.model == "GPT-2"} == {"WebText"}
    owt = references_for("owt")
    assert [(r.value, r.is_bound, r.source) for r in owt] == [
        (17.54, False, "MDLM paper"), (24.10, True, "MDLM paper"), (23.21, True, "MDLM paper"),
        (22.98, True, "MDLM paper")]
    assert all(r.tokenizer == "GPT-2 BPE" and r.training_data == "OpenWebText" for r in owt)
    assert references_for("val") == []
