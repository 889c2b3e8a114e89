"""`unmask sample` checks its --out and its --reference before sampling, each refused in one line
(`unmask eval` takes the same --reference)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import one_line_error as _error

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sample_checks_out_before_sampling(capsys, a_file, tmp_path):
    base = ["sample", str(tmp_path / "run"), "--num", "1", "--steps", "2"]
    assert "is a directory; give a file name" in _cli(capsys, *base, "--out", str(tmp_path))
    assert "cannot write this file" in _cli(capsys, *base, "--out", str(a_file / "s.jsonl"))
    # Not into the export (the next `unmask export` would refuse to replace it).
    export = tmp_path / "export"
    err = _cli(capsys, "sample", str(export), "--num", "1", "--out", str(export / "samples.jsonl"))
    assert f"--out {export / 'samples.jsonl'}: lies inside the export it samples ({export}), which the command " \
           f"reads; choose a --out outside it" in err
    assert not export.exists()


def test_a_hugging_face_reference_whose_own_code_must_run_is_refused_before_sampling(capsys, tmp_path, text_file):
    reference = tmp_path / "custom-lm"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {
        "AutoModelForCausalLM": "modeling_custom.CustomLM"}}))
    (reference / "model.safetensors").write_bytes(b"")
    (reference / "modeling_custom.py").write_text("raise SystemExit('this code ran')\n")
    # The export does not exist: the reference is checked first, so no sample is ever drawn.
    for argv in (["sample", str(tmp_path / "no-export"), "--num", "1"],
                 ["eval", str(tmp_path / "no-export"), "--datasets", str(text_file), "--num-samples", "1"]):
        err = _error(capsys, *argv, "--reference", str(reference))
        assert f"--reference {reference}: model_type 'my_custom_lm' is not a causal LM of transformers" in err
        assert "maps it to the directory's own code (auto_map), which unmask never runs" in err
