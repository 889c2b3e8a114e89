"""MkDocs hooks of the manual (``mkdocs.yml``: ``hooks``), the checks that make the build fail.

- The API pages (``docs/api/*.md``) render the docstrings of the modules they name with
  ``::: module``; every public function, class and method of those modules must have a
  docstring, or the build stops and lists the ones without (``undocumented``).
- The config reference in ``docs/training.md`` must be the table ``pipeline.config_reference``
  generates from ``pipeline/config.py`` (``stale_config_reference``).
- ``BENCHMARKS.md`` lives beside README.md, where GitHub shows it; the site takes it in as
  ``benchmarks.md``, and the pages' links to ``../BENCHMARKS.md`` point there.

``tests/end_to_end/test_docs.py`` runs the same two checks, so ``make test`` catches them too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
API_PAGES = DOCS / "api"
CONFIG_PAGE = DOCS / "training.md"
BENCHMARKS = REPO / "BENCHMARKS.md"
_IDENTIFIER = re.compile(r"^::: ([\w.]+)\s*$", flags=re.M)
_REFERENCE = re.compile(r"<!-- config-reference:[^\n]*-->\n(.*?)<!-- end config-reference -->", flags=re.S)


def api_modules() -> list[str]:
    """The modules the API pages render, in page order."""
    return [name for page in sorted(API_PAGES.glob("*.md")) for name in _IDENTIFIER.findall(page.read_text())]


def _public_members(obj):
    """The public functions and classes of a module or class (griffe), with their methods."""
    for name, member in obj.members.items():
        if member.is_alias or name.startswith("_") or not member.is_public:
            continue
        if member.is_function or member.is_class:
            yield member
        if member.is_class:
            yield from _public_members(member)


def undocumented(modules: list[str], search_path: Path = REPO) -> list[str]:
    """The public functions, classes and methods of ``modules`` (found under ``search_path``)
    that have no docstring."""
    import griffe

    # An override of a documented method inherits its docstring, as on the API pages (the same
    # extension runs there: mkdocs.yml).
    extensions = griffe.load_extensions("griffe_inherited_docstrings")
    loader = griffe.GriffeLoader(search_paths=[str(search_path)], allow_inspection=False, extensions=extensions)
    for name in modules:
        loader.load(name)
    loader.resolve_aliases(external=False)
    missing = []
    for name in modules:
        missing += [member.path for member in _public_members(loader.modules_collection[name])
                    if not member.has_docstring]
    return missing


def stale_config_reference() -> str | None:
    """Why the config reference of the training page is not what the code generates, or None."""
    from pipeline.config_reference import reference_markdown

    page = CONFIG_PAGE.relative_to(REPO) if CONFIG_PAGE.is_relative_to(REPO) else CONFIG_PAGE
    match = _REFERENCE.search(CONFIG_PAGE.read_text())
    if not match:
        return f"{page} lost its config-reference markers"
    if match.group(1) != reference_markdown():
        return (f"{page}: the config reference differs from pipeline/config.py; "
                "regenerate it: python -m pipeline.config_reference --write")
    return None


def on_pre_build(config, **kwargs) -> None:
    from mkdocs.exceptions import PluginError

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    problems = [f"no docstring: {path}" for path in undocumented(api_modules())]
    if stale := stale_config_reference():
        problems.append(stale)
    if problems:
        raise PluginError("the manual's checks failed:\n  " + "\n  ".join(problems))


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    files.append(File.generated(config, "benchmarks.md", content=BENCHMARKS.read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    return markdown.replace("](../BENCHMARKS.md", "](benchmarks.md")
