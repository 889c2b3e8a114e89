"""Where a prep stands in its output directory, and what a rerun keeps of it.

A prep is identified by its identity (the format, the config, the tokenizer's sha256, the
inputs' names and sizes), recorded in ``DIR/.prep-work/identity.json`` while it runs and as the
manifest's ``prep_config_sha256`` when it is done. ``start_or_resume`` finds a finished prep
of the same identity (nothing to do), unfinished work of it (resumed from the ledger), or
another prep's work, which only ``--overwrite`` replaces. Unfinished work that differs only
in --bad-utf8 / --bad-json goes on, redoing only the units the change acts on. The manual:
docs/data-preparation.md, "Guarantees".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from data_prep.ledger import Ledger
from data_prep.shards.format import FORMAT_VERSION, MANIFEST_NAME, SPLITS, Manifest

__all__ = ["IDENTITY_NAME", "WORK_DIR", "start_or_resume"]

# The work of an unfinished prep, in its output directory: the ledger, the units' tokens and
# the identity of the prep they belong to.
WORK_DIR = ".prep-work"
IDENTITY_NAME = "identity.json"
# The read flags that decide what happens to bad input, not what good input is, with the
# counters of the documents each one acts on. A prep that stopped unfinished may go on with
# other values of them: only the units whose counters show such documents are redone.
POLICY_COUNTERS = {"bad_utf8": ("bad_utf8_repaired", "bad_utf8_skipped"),
                   "bad_json": ("bad_json_skipped",)}


def _shards_intact(out: Path, manifest: Manifest) -> bool:
    return all((out / shard.path).is_file() and (out / shard.path).stat().st_size == shard.bytes
               for split in manifest.splits.values() for shard in split.shards)


def _policy_changes(old: dict, new: dict, tokenizer_follows: bool) -> dict[str, tuple[str, str]] | None:
    """The POLICY_COUNTERS flags whose values differ between two prep identities, as
    ``{name: (old, new)}``, when nothing else differs; None when anything else does. With
    ``tokenizer_follows`` (prep trained the tokenizer from these inputs and flags), the
    tokenizer may differ too."""
    def read(identity: dict) -> dict:
        config = identity.get("config")
        return config.get("read") or {} if isinstance(config, dict) else {}

    def rest(identity: dict) -> dict:
        identity = json.loads(json.dumps(identity))  # as identity.json holds it
        identity.pop("sha256", None)
        if tokenizer_follows:
            identity.pop("tokenizer_sha256", None)
        for name in POLICY_COUNTERS:
            read(identity).pop(name, None)
        return identity

    if not read(old) or rest(old) != rest(new):
        return None
    return {name: (read(old).get(name), read(new).get(name))
            for name in POLICY_COUNTERS if read(old).get(name) != read(new).get(name)}


def _resume_with_policy(out: Path, changes: dict[str, tuple[str, str]], new_tokenizer: bool) -> str:
    """Keep an unfinished prep's work that a change of the error-policy flags leaves as it is.

    A unit whose counters show no document that a changed flag acts on (no invalid UTF-8 for
    --bad-utf8, no broken JSONL line for --bad-json) reads the same under either value, so its
    tokens stand; the others are forgotten and tokenized again. When any is, the shards (cut
    from the units' tokens) are cut again too. The output is then the one an uninterrupted
    prep with the new flags writes. A tokenizer that the change retrained (``new_tokenizer``)
    changes every unit."""
    ledger = Ledger(out / WORK_DIR / "ledger")
    counters = [counter for name in changes for counter in POLICY_COUNTERS[name]]
    units = ledger.keys("unit-")
    redo = [key for key in units
            if new_tokenizer or any(ledger.get(key)["counters"].get(c, 0) for c in counters)]
    for key in redo:
        ledger.forget(key)
    if redo:
        for key in ledger.keys("shard-"):
            ledger.forget(key)
        for split in SPLITS:
            shutil.rmtree(out / split, ignore_errors=True)
    flags = ", ".join(f"--{name.replace('_', '-')} {old} -> {new}" for name, (old, new) in changes.items())
    retrained = ", which retrained the tokenizer" if new_tokenizer else ""
    return (f"{flags} since the unfinished prep{retrained}: kept {len(units) - len(redo)} of its "
            f"{len(units)} finished units, redid the {len(redo)} that the change affects")


def _format_version(manifest_path: Path) -> object:
    """The shard format a manifest declares (None if it is not one): a manifest of another
    format is replaced like a different prep's, with --overwrite."""
    try:
        return json.loads(manifest_path.read_text()).get("format_version")
    except (ValueError, AttributeError):
        return None


def _another_format(version: object) -> str:
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        return (f"a prep of a newer unmask (shard format {version}; this one writes format {FORMAT_VERSION}: "
                f"upgrade unmask to resume it)")
    return f"a prep in shard format {version} (this unmask writes format {FORMAT_VERSION})"


def _finished(out: Path) -> tuple[Manifest | None, str | None]:
    """The manifest in ``out``, or None and what is wrong with it (a hand-edited one)."""
    try:
        return Manifest.read(out), None
    except UserError as err:
        return None, f"a damaged manifest ({err})"


def start_or_resume(out: Path, identity: dict, overwrite: bool,
                    tokenizer_follows: bool = False) -> tuple[Manifest | None, str]:
    """Ready ``out`` for the prep ``identity``: the finished manifest when it matches (nothing
    to do); else None, with another prep's work refused or cleared (``overwrite``) and the work
    directory ready. Unfinished work that differs only in --bad-utf8 / --bad-json goes on
    (``_resume_with_policy``); the second value says so ("" otherwise). ``tokenizer_follows``:
    the tokenizer was trained from the inputs and read flags, so it may differ too."""
    work = out / WORK_DIR
    manifest_path, identity_path = out / MANIFEST_NAME, work / IDENTITY_NAME
    note = ""
    if manifest_path.is_file() and (version := _format_version(manifest_path)) != FORMAT_VERSION:
        what = _another_format(version)
    elif manifest_path.is_file():
        manifest, what = _finished(out)
        if manifest is not None and manifest.prep_config_sha256 == identity["sha256"] and \
                _shards_intact(out, manifest):
            return manifest, note
        what = what or ("a different prep's manifest" if manifest.prep_config_sha256 != identity["sha256"]
                        else "a manifest whose shards are missing or damaged")
    elif identity_path.is_file() and (unfinished := json.loads(identity_path.read_text()))["sha256"] \
            != identity["sha256"]:
        changes = _policy_changes(unfinished, identity, tokenizer_follows)
        if changes:
            new_tokenizer = unfinished.get("tokenizer_sha256") != identity["tokenizer_sha256"]
            what, note = None, _resume_with_policy(out, changes, new_tokenizer)
        else:
            what = "unfinished work of a different prep"
    else:
        what = None
    if what is not None:
        if not overwrite:
            raise UserError(f"{out} holds {what}; pass --overwrite to replace it, or choose another --out")
        for name in (MANIFEST_NAME, WORK_DIR, *SPLITS):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    (work / "units").mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(identity_path, json.dumps(identity, sort_keys=True).encode())
    return None, note
