"""The README's Python examples run as written (the README must stay true)."""

import re
from pathlib import Path

from data_prep.tokenizer import train_sentencepiece
from tests.export_fixtures import write_untrained_export
from tests.paths import REPO
from tests.shard_fixtures import write_numbered_split

README = REPO / "README.md"


def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its API examples"
    monkeypatch.chdir(tmp_path)
    # The Hugging Face example loads our modeling file: offline, cached under tmp_path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    # lm-eval's example: torch's collect_env report costs ~8 s of subprocesses and is not checked.
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    write_numbered_split(tmp_path / "shards", [20, 12], seq_len=16)  # what the loader example reads
    _write_an_export(tmp_path / "runs" / "tiny" / "export")          # what the export example loads
    namespace: dict = {}  # later examples continue earlier ones
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["tokens"].shape == (2, 64)
    assert namespace["stats"].network_calls <= 2 * 64
    assert namespace["loss"].shape == (2,)
    assert namespace["batch"].shape == (8, 16)
    assert namespace["logits"].shape == (1, 16, 320)
    assert 0 <= namespace["results"]["results"]["my_choice"]["acc,none"] <= 1


def _write_an_export(out: Path) -> None:
    """An export of an untrained tiny network over a tokenizer of a few hundred lines."""
    text = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(400)]
    tokenizer = train_sentencepiece(text, out.parent / "tok", vocab_size=320)
    write_untrained_export(out, tokenizer, out.parent / "tok")


def test_readme_config_reference_is_the_generated_one():
    from pipeline.config_reference import reference_markdown

    text = README.read_text()
    match = re.search(r"<!-- config-reference:[^\n]*-->\n(.*?)<!-- end config-reference -->", text, flags=re.S)
    assert match, "the README lost its config reference markers"
    assert match.group(1) == reference_markdown(), "regenerate it: python -m pipeline.config_reference"
