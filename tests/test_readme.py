"""The README's Python examples run as written (the README must stay true)."""

import re
from pathlib import Path

from tests.shard_fixtures import write_numbered_split

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README lost its API examples"
    monkeypatch.chdir(tmp_path)
    write_numbered_split(tmp_path / "shards", [20, 12], seq_len=16)  # what the loader example reads
    namespace: dict = {}  # later examples continue earlier ones
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["tokens"].shape == (2, 64)
    assert namespace["stats"].network_calls <= 2 * 64
    assert namespace["loss"].shape == (2,)
    assert namespace["batch"].shape == (8, 16)
