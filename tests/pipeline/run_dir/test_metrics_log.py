"""RUN/metrics.jsonl: appended step by step, cut back to the resume point, read for a step's work."""

from __future__ import annotations

import json

from pipeline.run_dir.metrics_log import MetricsLog


def test_a_resumed_run_forgets_the_records_after_its_checkpoint(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.forget_after(3)  # no file yet: nothing to forget
    assert not log.path.exists() and not log.holds_a_step()
    for step in range(5):
        log.append({"train/loss": 1.0 / (step + 1)}, step)
    with open(log.path, "a") as out:
        out.write('{"step": 5, "train/lo')  # torn by a kill: after every step
    log.forget_after(3)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 1, 2, 3]
    assert json.loads(log.path.read_text().splitlines()[2]) == {"step": 2, "train/loss": 1.0 / 3}


def test_a_step_is_a_record_after_the_untrained_validation_or_a_torn_line(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"val/nelbo_per_token": 5.0}, 0)
    assert not log.holds_a_step()
    log.path.write_text(log.path.read_text() + '{"step": 1, "tra')
    assert log.holds_a_step()
    log.forget_after(-1)  # a run started from scratch keeps no record
    assert log.path.read_text() == "" and not log.holds_a_step()
