"""A small document model and its two renderings: GitHub-flavoured Markdown and one
self-contained HTML page.

    document = [Heading(1, "Title"), paragraph("Prose, then ", Code("a value"), "."),
                Table(("field", "value"), ((Code("seed"), Code("0")),))]
    render_markdown(document), render_html(document, "Title")

Text is given as it should read; each renderer escapes it for its format. A plain ``str`` is
prose, ``Code`` is shown verbatim in monospace, ``Quote`` is a verbatim block (a sample) and
``Plot`` a PNG image with a caption: linked by relative path in Markdown, inlined as a data URI
in HTML, so the page needs nothing beside it. See docs/evaluation.md#the-report.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "Code", "Heading", "Inline", "Paragraph", "Plot", "Quote", "Table", "paragraph",
           "render_html", "render_markdown"]

# Markdown punctuation that could start emphasis, code, links or raw HTML (or end a cell). An
# underscore inside a word (d_model) cannot start emphasis: it is left as it is, for reading.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]<>|#&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem;
       margin: 2rem auto; padding: 0 1rem; color: #1b1f24; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2rem; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #d0d7de; padding: 0.3rem 0.6rem; text-align: left;
         vertical-align: top; overflow-wrap: anywhere; }
th { background: #f6f8fa; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 0.85rem; }
blockquote { margin: 0.5rem 0 1rem; padding: 0.4rem 1rem; border-left: 4px solid #d0d7de;
             background: #f6f8fa; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; }
figure { margin: 1rem 0; } img { max-width: 100%; }
figcaption { font-size: 0.9rem; color: #57606a; }
"""


# ------------------------------------------------------------------------- the blocks
@dataclass(frozen=True)
class Code:
    """Inline text shown verbatim in monospace (values, paths, hashes)."""

    text: str


Inline = str | Code  # a plain str is prose: each renderer escapes it for its format


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    parts: tuple[Inline, ...]


@dataclass(frozen=True)
class Table:
    header: tuple[Inline, ...]
    rows: tuple[tuple[Inline, ...], ...]


@dataclass(frozen=True)
class Quote:
    """Verbatim text (a sample), as a quoted block."""

    text: str


@dataclass(frozen=True)
class Plot:
    """A rendered plot: its path relative to the report and its PNG bytes."""

    relative_path: Path
    title: str    # short: the image's alternative text
    caption: str  # what the plot shows, in a sentence or two
    png: bytes


Block = Heading | Paragraph | Table | Quote | Plot


def paragraph(*parts: Inline) -> Paragraph:
    """A paragraph of prose and ``Code`` parts, in order."""
    return Paragraph(tuple(parts))


# ------------------------------------------------------------------------- Markdown
def _md_text(text: str) -> str:
    # Prose stays on its line (a newline would end a table row or a paragraph).
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text.replace("\n", " "))


def _md_code(text: str) -> str:
    text = text.replace("\n", " ")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    # A span that starts or ends with a backtick needs a space between it and the fence.
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_inline(part: Inline) -> str:
    return _md_code(part.text) if isinstance(part, Code) else _md_text(part)


def _md_cell(part: Inline) -> str:
    # GFM splits cells at every unescaped "|", even inside a code span.
    return _md_inline(part).replace("|", r"\|") if isinstance(part, Code) else _md_inline(part)


def _md_table(table: Table) -> str:
    def row(cells: Iterable[Inline]) -> str:
        return "| " + " | ".join(_md_cell(cell) for cell in cells) + " |"

    lines = [row(table.header), "|" + "---|" * len(table.header), *map(row, table.rows)]
    return "\n".join(lines)


def _md_quote(text: str) -> str:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    body = "\n".join(f"> {line}" if line else ">" for line in text.split("\n"))
    return f"> {fence}text\n{body}\n> {fence}"


def _md_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {_md_text(block.text)}"
    if isinstance(block, Paragraph):
        return "".join(map(_md_inline, block.parts))
    if isinstance(block, Table):
        return _md_table(block)
    if isinstance(block, Quote):
        return _md_quote(block.text)
    return f"![{_md_text(block.title)}]({block.relative_path.as_posix()})\n\n{_md_text(block.caption)}"


def render_markdown(document: list[Block]) -> str:
    """The document as GitHub-flavoured Markdown; plots linked by relative path."""
    return "\n\n".join(map(_md_block, document)) + "\n"


# ------------------------------------------------------------------------- HTML
def _html_inline(part: Inline) -> str:
    if isinstance(part, Code):
        return f"<code>{html.escape(part.text)}</code>"
    return html.escape(part)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{_html_inline(cell)}</th>" for cell in table.header)
    body = "".join("<tr>" + "".join(f"<td>{_html_inline(cell)}</td>" for cell in row) + "</tr>\n"
                   for row in table.rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _html_plot(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(plot.title)}">'
            f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>")


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{''.join(map(_html_inline, block.parts))}</p>"
    if isinstance(block, Table):
        return _html_table(block)
    if isinstance(block, Quote):
        return f"<blockquote><pre>{html.escape(block.text)}</pre></blockquote>"
    return _html_plot(block)


def render_html(document: list[Block], title: str) -> str:
    """The document as one self-contained HTML page: inline CSS, plots as data URIs."""
    body = "\n".join(map(_html_block, document))
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n")
