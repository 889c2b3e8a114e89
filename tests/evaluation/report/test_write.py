"""The report of `unmask eval` (``evaluation.report.write``): files, numbers in the tables, a
self-contained and escaped HTML page, plots only where there is data for them, and the section of
`unmask lm-eval`'s downstream tasks. Its zero-shot table and the published rows:
test_zero_shot_table."""

import copy
import json
import math
import re

import pytest

from evaluation.report.write import JSON_NAME, read_record, write_report
from evaluation.results import DownstreamResults, EvalResults
from model.sampling import SamplingPlan
from tests.support.results_fixtures import SHA, make_downstream, make_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# src/href (quoted or not) pointing anywhere on the network
EXTERNAL_LINK = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)

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
    assert ("| dataset | protocol | tokens | NELBO/token (nats ± SE) | perplexity bound (95% interval) "
            "| bits/byte |") in markdown
    lambada = _row(markdown, "lambada")
    bits_per_byte = f"{3.5 * 245_569 / (math.log(2) * 1e6):.4f}"
    for text in ("| unmask, test split |", "245,569", "3.5000 ± 0.0100", "33.12 (32.47 – 33.77)", bits_per_byte):
        assert text in lambada
    wikitext = _row(markdown, "wikitext2")
    for text in ("287,644", "3.2500 ± 0.0200", "25.79 (24.80 – 26.82)"):
        assert text in wikitext
    assert "33.12 (32.47 – 33.77)" in html


def test_title_protocol_and_mlflow(report):
    results, _, markdown, html = report
    assert markdown.startswith("# Evaluation report: /runs/small/export at step 12,000\n")
    for key in results["protocol"]:  # every field, verbatim
        assert f"`{key}`" in markdown and f"<code>{key}</code>" in html
    assert r"`documents + EOS concatenated \| cut into blocks`" in markdown  # the | stays in its cell
    assert f"`{SHA}`" in markdown and "`sentence per line`" in markdown and "`1234567`" in markdown
    assert "`network.n_layers`" in markdown and "`tokenizer.kind`" in markdown
    assert "MLflow run `0123abcd` at `http://127.0.0.1:5000`." in markdown


def test_html_is_self_contained_and_escaped(report):
    _, files, _, html = report
    assert not EXTERNAL_LINK.search(html)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert html.count('src="data:image/png;base64,') == len(files.plots) == 2
    assert "<script" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; more" in html


def test_markdown_sample_is_verbatim_quote(report):
    _, _, markdown, _ = report
    assert "Sample 1: 128 network calls." in markdown
    assert '> ```text\n> The <script>alert("x")</script> & more\n>\n> second paragraph\n> ```' in markdown


def test_markdown_links_plots_by_relative_path(report):
    _, files, markdown, _ = report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert links == ["plots/curves.png", "plots/per_t_lambada.png"]
    assert all((files.markdown.parent / link).is_file() for link in links)


def test_autoregressive_wording(tmp_path):
    files = write_report(make_results("autoregressive", per_t=False), tmp_path)
    markdown = files.markdown.read_text(encoding="utf-8")
    assert "| dataset | protocol | tokens | NLL/token (nats) | perplexity (exact) | bits/byte |" in markdown
    assert "perplexity bound" not in markdown and "±" not in _row(markdown, "lambada")
    assert _row(markdown, "lambada").endswith(f"| 33.12 | {3.5 * 245_569 / (math.log(2) * 1e6):.4f} |")
    ours = _row(markdown, "this run (autoregressive, step 12,000)")  # the zero-shot table: exact, no interval
    assert ours.endswith("| — | 25.79 | — | 33.12 | — | — | — |") and "≤" not in ours
    assert "perplexity (exact)" in files.html.read_text(encoding="utf-8")


def test_no_plots_without_data(tmp_path):
    files = write_report(make_results(per_t=False, samples=False), tmp_path, curves={"train/loss": []})
    assert files.plots == [] and not (tmp_path / "plots").exists()
    markdown, html = files.markdown.read_text(encoding="utf-8"), files.html.read_text(encoding="utf-8")
    assert "![" not in markdown and "plots/" not in markdown and "## Plots" not in markdown
    assert "<img" not in html and "data:image" not in html
    assert "## Samples" not in markdown


def test_a_file_of_one_s_own_gets_no_zero_shot_table(tmp_path):
    results = make_results(per_t=False)
    results["datasets"] = {"notes/my file.txt": results["datasets"]["lambada"]}
    markdown = write_report(results, tmp_path).markdown.read_text(encoding="utf-8")
    assert "| notes/my file.txt | unmask, test split |" in markdown and "## Zero-shot table" not in markdown


def test_per_t_plot_names_are_distinct_file_names(tmp_path):
    results = make_results()
    record = results["datasets"]["lambada"]
    results["datasets"] = {"a/b.txt": record, "a b.txt": record}
    files = write_report(results, tmp_path)
    assert [path.name for path in files.plots] == ["per_t_a_b.txt.png", "per_t_a_b.txt_2.png"]


SCHEDULE = {"exponent_min": 0.61, "exponent_median": 1.2, "exponent_max": 3.5,
            "unmask_first": [{"token": 50256, "text": "<|endoftext|>", "exponent": 3.5},
                             {"token": 198, "text": "\n", "exponent": 3.1}],
            "unmask_last": [{"token": 34501, "text": " diligently", "exponent": 0.61}]}


def test_a_learned_schedule_shows_its_spread_and_the_tokens_that_unmask_first_and_last(tmp_path, report):
    results = {**make_results(), "schedule": SCHEDULE}
    files = write_report(copy.deepcopy(results), tmp_path)
    markdown = files.markdown.read_text(encoding="utf-8")
    assert json.loads(files.json.read_text(encoding="utf-8"))["schedule"] == SCHEDULE
    section = markdown[markdown.index("## Learned schedule"):markdown.index("## Zero-shot table")]
    assert "w_v range from 0.610 (median 1.200) to 3.500" in section
    rows = [section.index(row) for row in ("Unmask first", r"| 50256 | `'<\|endoftext\|>'` | 3.500 |",
                                           r"| 198 | `'\n'` | 3.100 |", "Unmask last",
                                           "| 34501 | `' diligently'` | 0.610 |")]
    assert rows == sorted(rows)  # text shown as a Python literal: whitespace and escapes visible
    assert "Learned schedule" not in report[2]  # absent for the other processes
    broken = copy.deepcopy(results)
    del broken["schedule"]["unmask_last"][0]["exponent"]
    with pytest.raises(ValueError, match=r"schedule.unmask_last.0.exponent"):
        write_report(broken, tmp_path / "broken")


def test_malformed_results_write_nothing(tmp_path):
    results = make_results()
    del results["datasets"]["lambada"]["bits_per_byte"]
    with pytest.raises(ValueError, match="datasets.lambada.bits_per_byte"):
        write_report(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["name", "split", "max_documents", "bound"])
def test_results_of_an_older_layout_are_refused_with_how_to_redo_them(tmp_path, caplog, key):
    # Before the protocol recorded its name, split, document limit and bound, unmask eval wrote
    # results without them: they are not read (not guessed to be ours), in one line.
    results = make_results()
    del results["protocol"][key]
    refusal = rf"results lack protocol\.{key} \(see evaluation.results for the schema\); rerun `unmask eval`"
    with pytest.raises(ValueError, match=f"^{refusal} to write them anew$"):
        write_report(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert read_record(path, EvalResults.read) is None   # a report built beside it leaves it out, and says why
    assert re.search(f"{re.escape(str(path))}: left out of the report \\({refusal}", caplog.text)


def test_samples_show_their_quality_and_how_they_were_drawn(tmp_path):
    results = make_results(per_t=False)
    results["samples"][0].update(unigram_entropy=4.25, reference_nll=300.0, reference_tokens=100)
    plan = SamplingPlan(steps=1000, grid="cosine", top_p=0.9, seed=7)
    results["sampling"] = {"num_samples": 1, "plan": plan.to_dict(), "seq_len": 1024, "mean_unigram_entropy": 4.25,
                           "mean_network_calls": 128.0,
                           "generative_perplexity": {"reference": "/models/gpt2-large", "reference_kind": "huggingface",
                                                     "retokenized": True, "perplexity": math.exp(3.0),
                                                     "tokens": 100},
                           "sweep": [{"sampler": sampler, "budget": budget, "network_calls": min(budget, 128.0),
                                      "mean_unigram_entropy": 4.0, "generative_perplexity": 40.0 - budget / 100}
                                     for sampler in ("ancestral", "first-hitting") for budget in (16, 1024)]}
    files = write_report(copy.deepcopy(results), tmp_path)
    assert json.loads(files.json.read_text(encoding="utf-8")) == results
    markdown = files.markdown.read_text(encoding="utf-8")
    assert ("1 samples of 1,024 tokens: ancestral sampler, 1,000 steps; cosine grid; temperature 1; top-p 0.9; "
            "seed 7. They needed 128.0 network calls each on average.") in markdown
    assert "Mean unigram entropy: 4.250 nats" in markdown
    assert ("Generative perplexity: 20.09 under the huggingface model `/models/gpt2-large`, over 100 tokens: "
            "the decoded text re-encoded with the reference's tokenizer (the tokenizers differ).") in markdown
    assert ("Sample 1: 128 network calls, unigram entropy 4.250 nats, 3.000 nats/token under the "
            "reference (100 tokens).") in markdown
    assert "| first-hitting | 1,024 | 128.0 | 29.76 | 4.000 |" in markdown
    assert "plots/sampler_sweep.png" in markdown and (tmp_path / "plots" / "sampler_sweep.png").is_file()

    del results["sampling"]["generative_perplexity"]
    markdown = write_report(results, tmp_path / "no-reference").markdown.read_text(encoding="utf-8")
    assert "No generative perplexity: no reference model was given (--reference)." in markdown


def test_a_comparison_across_protocols_says_so(tmp_path):
    results = make_results(per_t=False)
    other = make_results("autoregressive", per_t=False)
    results["comparison"] = {"model": other["model"], "datasets": other["datasets"], "path": "/ar/results.json"}
    results["datasets"]["lambada"]["dataset"]["protocol"] = "mdlm"
    markdown = write_report(results, tmp_path).markdown.read_text(encoding="utf-8")
    assert "read lambada with different protocols or splits: those gaps compare different tokens." in markdown


def _task_row(markdown: str, *cells: str) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith("| " + " | ".join(cells) + " |")]
    assert len(rows) == 1, f"no single row starts with {cells}"
    return rows[0]


def test_the_downstream_section_sits_beside_the_bounds(tmp_path):
    files = write_report(make_results(), tmp_path, downstream=DownstreamResults.from_json(make_downstream(step=9000)))
    markdown = files.markdown.read_text()
    assert markdown.index("## Results") < markdown.index("## Downstream tasks") < markdown.index("## Protocol")
    assert "0.3125" in _task_row(markdown, "lambada_openai", "`acc,none`")
    assert "5,153" in _task_row(markdown, "lambada_openai", "`acc,none`")           # 500 of the task's 5,153
    assert "-3.7257 | 0.0421 | 1.9300 | 3 |" in _task_row(markdown, "lambada_openai", "500")
    assert "N/A" not in markdown and "n/a" in _task_row(markdown, "gsm8k", "`bits_per_byte,none`")
    assert "Monte Carlo lower bound" in markdown
    assert "step 9,000; the bounds above, step 12,000" in markdown
    assert "lambada_openai" in files.html.read_text()



def test_guided_downstream_scores_are_reported_as_a_ranking_never_as_bounds(tmp_path):
    downstream = make_downstream()
    downstream["settings"]["guidance"] = 0.5
    markdown = write_report(make_results(), tmp_path, downstream=DownstreamResults.from_json(downstream)).markdown
    text = markdown.read_text()
    assert "guidance, weight 0.5" in text and "it is not a likelihood bound of the model" in text
    assert "mean guided score per request (nats; not a bound)" in text
    assert "Monte Carlo lower bound" not in text and "mean log-likelihood per request" not in text


def test_downstream_tasks_alone_make_a_report_without_results_json(tmp_path):
    files = write_report(None, tmp_path, downstream=DownstreamResults.from_json(make_downstream("autoregressive")))
    markdown = files.markdown.read_text()
    assert files.json is None and not (tmp_path / JSON_NAME).exists()
    assert "## Downstream tasks" in markdown and "## Results" not in markdown
    assert "0 (exact)" in _task_row(markdown, "lambada_openai", "500") and "exact (autoregressive)" in markdown
    with pytest.raises(ValueError, match="needs results, downstream results, or both"):
        write_report(None, tmp_path)
