"""`unmask eval` end to end (``evaluation.zero_shot``): a trained export, real datasets, MLflow, the
report, data parallelism, a block diffusion export's bound, and the model a run means (its
latest checkpoint, exported again in the place of an older export)."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
from mlflow.tracking import MlflowClient

from common.errors import UserError
from evaluation.bounds.scoring import ScoringConfig
from evaluation.zero_shot import ReportOptions, run_zero_shot
from tests.support.cli_runner import run_unmask
from tests.support.paths import SHARED, require_shared
from tests.support.results_fixtures import make_results
from tests.support.shard_fixtures import write_numbered_split
from tests.support.train_helpers import run_train, write_config

pytestmark = pytest.mark.slow

# Few documents and time samples: these tests check the plumbing, not the numbers.
QUICK = ["--max-documents", "40", "--samples", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinyshakespeare_shards, mlflow_server):
    """The `tiny` preset, trained a few steps and tracked on a real MLflow server."""
    root = tmp_path_factory.mktemp("eval")
    config = write_config(root / "c.yaml", {
        "model": {"preset": "tiny", "n_layers": None, "d_model": None, "n_heads": None},
        "train": {"max_steps": 4}, "eval": {"every": 2}})
    return run_train(root / "run", tinyshakespeare_shards, config, extra=["--mlflow-uri", mlflow_server]).run_dir


@pytest.fixture(scope="module")
def micro_trained(tmp_path_factory, tinyshakespeare_shards):
    """A 2 x 64 network: cheap enough to score the whole val split several times."""
    root = tmp_path_factory.mktemp("eval-micro")
    config = write_config(root / "c.yaml", {"train": {"max_steps": 2}, "eval": {"every": 0}})
    return run_train(root / "run", tinyshakespeare_shards, config).run_dir


def test_eval_reports_bounds_logs_them_to_the_training_run_and_writes_the_report(
        trained, tinyshakespeare_shards, mlflow_server):
    require_shared("ptb", "lambada")
    proc = run_unmask(["eval", str(trained), "--datasets", "ptb,lambada", "--data-dir", str(SHARED),
                       "--num-samples", "2", "--sample-steps", "16", *QUICK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "perplexity <=" in proc.stdout
    report = trained / "report"
    results = json.loads((report / "results.json").read_text())
    assert set(results["datasets"]) == {"ptb", "lambada"}
    plots = {p.name for p in (report / "plots").glob("*.png")}
    assert {"curves.png", "per_t_ptb.png", "per_t_lambada.png"} <= plots
    for record in results["datasets"].values():
        low, high = record["perplexity_interval"]
        assert low < record["perplexity_bound"] < high
        assert record["bits_per_byte"] > 0 and record["num_tokens"] > 0
    assert results["protocol"]["samples_per_block"] == 2 and results["protocol"]["max_documents"] == 40
    assert results["datasets"]["ptb"]["dataset"]["sha256"]  # the file that was read, by content
    assert len(results["samples"]) == 2 and results["model"]["weights"] == "ema"
    assert (report / "report.md").is_file() and (report / "report.html").is_file()
    training_run = json.loads((trained / "mlflow_run.json").read_text())
    assert training_run["tracking_uri"] == mlflow_server
    assert results["mlflow"]["run_id"] == training_run["run_id"]  # the training's own MLflow run
    client = MlflowClient(mlflow_server)
    tracked = client.get_run(training_run["run_id"]).data
    assert tracked.metrics["eval/ptb/perplexity_bound"] == pytest.approx(results["datasets"]["ptb"]["perplexity_bound"])
    # The samples' plan as tags (a later evaluation may sample otherwise), their cost as a metric.
    assert (tracked.tags["eval/sampling/sampler"], tracked.tags["eval/sampling/steps"]) == ("ancestral", "16")
    assert tracked.metrics["eval/samples/mean_network_calls"] == results["sampling"]["mean_network_calls"]
    assert "report" in {a.path for a in client.list_artifacts(training_run["run_id"])}


def test_two_processes_give_the_single_process_result(micro_trained, tinyshakespeare_shards, tmp_path):
    from pipeline.interchange.export import export

    args = [str(export(micro_trained)), "--datasets", "val", "--shards", str(tinyshakespeare_shards), *QUICK]
    one = run_unmask(["eval", *args, "--out", str(tmp_path / "one")])
    two = run_unmask(["eval", *args, "--out", str(tmp_path / "two")], world_size=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    first, second = (json.loads((tmp_path / d / "results.json").read_text())["datasets"]["val"] for d in ("one", "two"))
    assert second["num_tokens"] == first["num_tokens"]
    assert second["nelbo_per_token"] == pytest.approx(first["nelbo_per_token"], rel=1e-12)  # float order only
    assert second["standard_error"] == pytest.approx(first["standard_error"], rel=1e-9)


def test_a_run_of_unmask_run_scores_its_own_val_split_without_shards(micro_trained, tinyshakespeare_shards,
                                                                      tmp_path):
    """`unmask run` keeps its shards in RUN/data: `unmask eval RUN --datasets val` reads them."""
    run_dir = tmp_path / "run"
    shutil.copytree(micro_trained, run_dir)
    args = ["--datasets", "val", *QUICK]
    alone = run_unmask(["eval", str(run_dir), *args, "--out", str(tmp_path / "alone")])
    assert alone.returncode == 2 and "finds its own RUN/data" in alone.stderr
    shutil.copytree(tinyshakespeare_shards, run_dir / "data")
    own = run_unmask(["eval", str(run_dir), *args, "--out", str(tmp_path / "own")])
    named = run_unmask(["eval", str(run_dir), *args, "--shards", str(tinyshakespeare_shards),
                        "--out", str(tmp_path / "named")])
    assert own.returncode == 0 and named.returncode == 0, (own.stderr + named.stderr)[-3000:]
    first, second = (json.loads((tmp_path / d / "results.json").read_text())["datasets"]["val"] for d in ("own", "named"))
    assert first["dataset"]["path"] == str((run_dir / "data").resolve())
    assert first["nelbo_per_token"] == second["nelbo_per_token"] and first["num_tokens"] == second["num_tokens"]


def test_eval_refuses_bad_input_with_clear_messages(micro_trained, tmp_path):
    trained = micro_trained
    unknown = run_unmask(["eval", str(trained), "--datasets", "enwik8", "--data-dir", str(tmp_path)])
    assert unknown.returncode == 2
    assert "unknown dataset 'enwik8'" in unknown.stderr and "lambada" in unknown.stderr
    missing = run_unmask(["eval", str(trained), "--datasets", "ptb", "--data-dir", str(tmp_path)])
    assert missing.returncode == 2 and "ptb.test.txt" in missing.stderr and "SOURCES.md" in missing.stderr
    other = tmp_path / "other-shards"
    (other / "train").mkdir(parents=True)
    write_numbered_split(other, [8], seq_len=64, split="val")
    mismatch = run_unmask(["eval", str(trained), "--datasets", "val", "--shards", str(other)])
    assert mismatch.returncode == 2 and "differs from the model's" in mismatch.stderr


def test_an_autoregressive_run_without_ema_gets_its_exact_perplexity_from_its_live_weights(
        tmp_path, tinyshakespeare_shards, micro_trained):
    config = write_config(tmp_path / "c.yaml", {"model": {"objective": "autoregressive"}, "train": {"max_steps": 2}})
    run_dir = run_train(tmp_path / "run", tinyshakespeare_shards, config).run_dir
    for ema_file in (run_dir / "checkpoints").glob("step-*/rank-*.pt"):
        ema_file.unlink()  # as if the checkpoint had been written without an EMA
        state_file = ema_file.parent / "unmask_state.json"
        state = json.loads(state_file.read_text())
        del state["files"][ema_file.name]
        state_file.write_text(json.dumps(state))
    proc = run_unmask(["eval", str(run_dir), "--datasets", "val", "--shards", str(tinyshakespeare_shards), *QUICK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has no EMA; evaluating its live weights" in proc.stderr
    results = json.loads((run_dir / "report" / "results.json").read_text())
    assert results["model"]["weights"] == "model"
    record = results["datasets"]["val"]
    assert record["estimate"]["kind"] == "autoregressive" and record["standard_error"] == 0
    assert record["perplexity_interval"] == [record["perplexity_bound"]] * 2
    assert "perplexity (exact)" in (run_dir / "report" / "report.md").read_text()

    # The diffusion model's report shows its gap to this AR baseline on the same tokens.
    compared = run_unmask(["eval", str(micro_trained), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                           "--compare", str(run_dir / "report" / "results.json"), "--out", str(tmp_path / "cmp"),
                           *QUICK])
    assert compared.returncode == 0, compared.stderr[-3000:]
    ours = json.loads((tmp_path / "cmp" / "results.json").read_text())
    gap = ours["datasets"]["val"]["nelbo_per_token"] - record["nelbo_per_token"]
    assert ours["comparison"]["model"]["objective"] == "autoregressive"
    markdown = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Comparison" in markdown and f"{gap:.4f}" in markdown


def test_compare_refuses_the_results_of_an_older_layout_with_how_to_redo_them(tmp_path):
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    results = make_results()
    results["datasets"] = {str(own): results["datasets"]["lambada"]}
    del results["protocol"]["name"]   # written before protocols had names
    other = tmp_path / "other" / "results.json"
    other.parent.mkdir()
    other.write_text(json.dumps(results))
    refusal = (f"--compare {other}: not the results.json of an `unmask eval` (it lacks protocol.name); rerun "
               f"`unmask eval` to write it anew")
    with pytest.raises(UserError, match=f"^{re.escape(refusal)}$"):
        run_zero_shot(tmp_path / "run", ScoringConfig(datasets=(str(own),)), ReportOptions(compare=other))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ block diffusion
@pytest.mark.slow
def test_unmask_eval_reports_the_block_bound_and_names_the_block_size(block_export, tinyshakespeare_shards,
                                                                       tmp_path, mlflow_server):
    import json

    from mlflow import MlflowClient

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "report"
    assert unmask_in_process(["eval", str(block_export), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                              "--max-documents", "10", "--samples", "2", "--batch-size", "8", "--num-samples", "2",
                              "--sample-steps", "4", "--mlflow-uri", mlflow_server, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["block_size"] == 8 and "blocks of 8 tokens" in results["protocol"]["bound"]
    assert math.isfinite(results["datasets"]["val"]["nelbo_per_token"])
    assert len(results["samples"]) == 2  # drawn by the block sampler
    assert "block_size" in (out / "report.md").read_text()
    tags = MlflowClient(mlflow_server).get_run(results["mlflow"]["run_id"]).data.tags
    assert tags["eval/block_size"] == "8"


def test_an_evaluation_length_that_cuts_a_block_is_refused_in_one_line(block_export, tinyshakespeare_shards, capsys):
    from tests.support.cli_runner import unmask_in_process

    assert unmask_in_process(["eval", str(block_export), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                              "--seq-len", "60", "--out", "unused"]) == 2
    assert "--seq-len 60: the model is a block diffusion over blocks of 8 tokens" in capsys.readouterr().err


def test_a_run_whose_export_cannot_be_written_is_named_so_not_as_out(micro_run, tmp_path, capsys):
    """`eval RUN --out X` exports RUN first, into RUN/export: a refusal of that directory named
    it "--out", the flag that had been given for X."""
    from tests.support.cli_refusals import one_line_error

    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    (run / "export").write_text("in the way")
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    err = one_line_error(capsys, "eval", str(run), "--datasets", str(own), "--out", str(tmp_path / "report"))
    assert err.startswith(f"unmask eval: error: the run's export (written for this command) {run / 'export'}: is a "
                          f"file")
    assert err.endswith(f"; or export it elsewhere (`unmask export {run} --out DIR`) and give DIR")
    assert "--out" not in err.split("; or export")[0] and not (tmp_path / "report").exists()


def test_compile_on_is_refused_for_a_block_export_before_scoring(block_export, tinyshakespeare_shards, capsys):
    from tests.support.cli_runner import unmask_in_process

    assert unmask_in_process(["eval", str(block_export), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                              "--compile", "on", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--compile on: a block diffusion model is sampled and scored uncompiled" in err and "Traceback" not in err


# ------------------------------------------------------------------ which model a run means
def test_eval_of_a_run_scores_its_latest_checkpoint_in_the_place_of_an_older_export(micro_run, tmp_path, caplog):
    """RUN/export at step 1 while the run's latest checkpoint is step 2: `unmask eval RUN` exports
    step 2 in its place (saying so), and the report is of step 2 beside the validation of step 2.
    The older export named by its own path is evaluated as asked, beside the validations up to
    its step, not the later ones."""
    from pipeline.interchange.export import export
    from tests.support.cli_refusals import write_text_file
    from tests.support.cli_runner import unmask_in_process

    run = tmp_path / "run"
    shutil.copytree(micro_run, run)  # checkpoints at steps 1 and 2, validations at 0 and 2
    export(run, step=1)
    text = write_text_file(tmp_path)
    assert unmask_in_process(["eval", str(run), "--datasets", str(text), "--samples", "2"]) == 0
    assert (f"{run / 'export'} holds step 1, and the run's latest checkpoint is step 2: exporting step-00000002 "
            f"(ema weights) in its place") in caplog.text
    results = json.loads((run / "report" / "results.json").read_text())
    assert results["model"]["step"] == 2 and results["training"]["final_step"] == 2
    assert json.loads((run / "export" / "config.json").read_text())["step"] == 2
    export(run, step=1)
    out = tmp_path / "older"
    assert unmask_in_process(["eval", str(run / "export"), "--datasets", str(text), "--samples", "2",
                              "--out", str(out)]) == 0
    assert (f"{run / 'export'} holds step 1, and the run's latest checkpoint is step 2: reading it as asked"
            in caplog.text)
    older = json.loads((out / "results.json").read_text())
    assert older["model"]["step"] == 1 and older["training"]["final_step"] == 0
