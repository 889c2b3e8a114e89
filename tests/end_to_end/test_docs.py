"""The manual stays true: the Python examples of README.md and docs/*.md run as written, the
config reference is the one the code generates, every public function of the API pages has a
docstring, and every page is reachable. ``make docs`` (CI) also builds the site strictly, which
checks links and anchors; these are the checks that need no build."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import REPO
from tests.support.shard_fixtures import write_numbered_split

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def _blocks(page: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def _hooks():
    """docs/hooks.py, the checks ``make docs`` runs (it is no package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What the examples of a page must have computed, beyond running: name -> check.
CHECKS = {
    "data-preparation.md": lambda ns: ns["batch"].shape == (8, 16),
    "import-export.md": lambda ns: ns["logits"].shape == (1, 16, 320) and ns["exported"].tokenizer.vocab_size == 320
    and ns["block_logits"].shape == (1, 16, 320) and ns["bd3"].config.block_size == 4,
    "sampling.md": lambda ns: len(ns["samples"]) == 4 and len(ns["continuations"]) == 2
    and all(sample.network_calls > 0 for sample in ns["samples"]),
    "downstream.md": lambda ns: 0 <= ns["results"]["results"]["my_choice"]["acc,none"] <= 1,
    "model-api.md": lambda ns: ns["tokens"].shape == (2, 64) and ns["stats"].network_calls <= 2 * 64
    and ns["loss"].shape == (2,) and ns["bound"].shape == (4,),
}
EXAMPLE_PAGES = [page for page in PAGES if _blocks(page)]


def test_the_manual_has_its_examples():
    assert {page.name for page in EXAMPLE_PAGES} >= set(CHECKS), "a page lost its Python examples"


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_python_examples_run(page, tmp_path, monkeypatch):
    """A page's examples run in order in one namespace (later ones continue earlier ones), from
    a directory holding what they read: shards/ and an export at runs/tiny/export."""
    monkeypatch.chdir(tmp_path)
    # The Hugging Face example loads our modeling file: offline, cached under tmp_path.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    # lm-eval's example: torch's collect_env report costs ~8 s of subprocesses and is not checked.
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    write_numbered_split(tmp_path / "shards", [20, 12], seq_len=16)  # what the loader example reads
    _write_exports(tmp_path / "runs")                               # what the export examples load
    namespace: dict = {}
    for block in _blocks(page):
        exec(compile(block, str(page), "exec"), namespace)
    check = CHECKS.get(page.name)
    assert check is None or check(namespace), f"{page.name}: an example computed something else"


def _write_exports(runs: Path) -> None:
    """Exports of untrained tiny networks over a tokenizer of a few hundred lines: runs/tiny/export,
    and a block diffusion model of block size 4 at runs/bd3/export."""
    text = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(400)]
    tokenizer = train_sentencepiece(text, runs / "tiny" / "tok", vocab_size=320)
    write_untrained_export(runs / "tiny" / "export", tokenizer, runs / "tiny" / "tok")
    write_untrained_export(runs / "bd3" / "export", tokenizer, runs / "tiny" / "tok", config={"block_size": 4})


def test_the_config_reference_is_the_generated_one():
    assert _hooks().stale_config_reference() is None


def test_the_config_reference_check_catches_a_stale_table(tmp_path, monkeypatch):
    hooks = _hooks()
    page = tmp_path / "training.md"
    page.write_text(hooks.CONFIG_PAGE.read_text().replace("| `optim.lr` | `float` | `0.0003` |",
                                                          "| `optim.lr` | `float` | `0.001` |"))
    monkeypatch.setattr(hooks, "CONFIG_PAGE", page)
    assert "differs from pipeline/config.py" in hooks.stale_config_reference()


def test_every_public_function_of_the_api_pages_has_a_docstring():
    hooks = _hooks()
    modules = hooks.api_modules()
    assert {"model.absorbing", "model.transformer", "pipeline.interchange.export", "evaluation.generation.generate"} <= set(modules)
    assert hooks.undocumented(modules) == []


def test_the_docstring_check_catches_an_undocumented_function(tmp_path):
    package = tmp_path / "toy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "api.py").write_text(textwrap.dedent('''
        """A module."""
        __all__ = ["Documented", "bare"]

        class Documented:
            """A class."""
            def method(self):
                return 1
            def _private(self):
                return 2

        def bare():
            return 3

        def not_exported():
            return 4
    '''))
    assert sorted(_hooks().undocumented(["toy.api"], search_path=tmp_path)) == ["toy.api.Documented.method",
                                                                                 "toy.api.bare"]


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = set(_nav_pages(config["nav"]))
    written = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    generated = {"benchmarks.md"}  # docs/hooks.py adds BENCHMARKS.md
    assert written - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - written - generated == set(), "nav entries without a page"


def test_the_readme_links_resolve():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = [link.split("#")[0] for link in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in link]
    assert targets, "the README lost its links into the manual"
    assert [target for target in targets if not (REPO / target).exists()] == []


@pytest.mark.slow
def test_make_docs_fails_on_a_broken_link(tmp_path):
    """The build `make docs` runs is strict: a copy of the manual with one broken link fails,
    naming it (``--quiet``, say, would silently turn strict mode off)."""
    recipe = re.search(r"^docs: .*\n\t(.*)$", (REPO / "Makefile").read_text(), flags=re.M).group(1)
    command = shlex.split(recipe.replace("$(VENV)/bin/mkdocs", f"{sys.executable} -m mkdocs"), comments=True)
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mkdocs.yml", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    for package in ("common", "model", "data_prep", "pipeline", "evaluation", "orchestration"):
        (tmp_path / package).symlink_to(REPO / package)  # what the API pages render
    with open(tmp_path / "docs" / "mlflow.md", "a") as page:
        page.write("\nSee [the missing page](no-such-page.md).\n")
    build = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert build.returncode != 0 and "no-such-page.md" in build.stderr
