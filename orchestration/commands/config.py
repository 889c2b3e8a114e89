"""``unmask config``: what a config resolves to, and what each field means."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from common.errors import UserError
from pipeline.config import config_yaml, load_config, parse_overrides
from pipeline.config_reference import FieldDoc, field_docs

RAW = argparse.RawDescriptionHelpFormatter
MEANING_WIDTH = 88

EPILOG = """\
examples:
  unmask config show --config configs/demo.yaml --train.max_steps 50
  unmask config fields                # every field
  unmask config fields train          # one section
  unmask config fields optim.lr       # one field
"""


def _cmd_show(args: argparse.Namespace) -> int:
    print(config_yaml(load_config(args.config, parse_overrides(args.overrides))), end="")
    return 0


def _matching(docs: list[FieldDoc], name: str | None) -> list[FieldDoc]:
    if name is None:
        return docs
    chosen = [doc for doc in docs if doc.name == name or doc.name.split(".")[0] == name]
    if not chosen:
        sections = sorted({doc.name.split(".")[0] for doc in docs})
        raise UserError(f"no config section or field {name!r}; sections: {', '.join(sections)}")
    return chosen


def _cmd_fields(args: argparse.Namespace) -> int:
    for doc in _matching(field_docs(), args.name):
        safe = "; may change on resume" if doc.resume_safe else ""
        print(f"{doc.name}: {doc.type} = {doc.default}{safe}")
        if doc.meaning:
            print(textwrap.indent(textwrap.fill(doc.meaning, MEANING_WIDTH), "    "))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``config`` to the ``unmask`` command."""
    config = commands.add_parser("config", help="show a resolved config, or what each field means",
                                 description="Inspect training configs: the YAML a config (with its base: and "
                                             "--SECTION.FIELD overrides) resolves to, and every field's type, "
                                             "default and meaning.", epilog=EPILOG, formatter_class=RAW)
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the resolved config as YAML",
                              description="Print the resolved config (defaults, base:, the file, overrides) as "
                                          "YAML that --config reads back.", epilog=EPILOG, formatter_class=RAW)
    show.add_argument("--config", type=Path, help="YAML config (default: the defaults)")
    show.set_defaults(handler=_cmd_show, accepts_overrides=True)
    fields = actions.add_parser("fields", help="every field's type, default and meaning",
                                description="The config reference: type, default and meaning of each field.",
                                epilog=EPILOG, formatter_class=RAW)
    fields.add_argument("name", nargs="?", metavar="SECTION[.FIELD]", help="only this section or field")
    fields.set_defaults(handler=_cmd_fields)
