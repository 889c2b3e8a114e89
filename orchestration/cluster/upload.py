"""What ``unmask submit`` uploads: the exact list of files, decided here, zipped here.

Ray would package a working directory itself, with its own exclude semantics; we do not
leave that decision to it. ``plan_upload`` lists the files (``git ls-files`` in a git
checkout, so ``.gitignore`` is honoured; a walk of the tree honouring ``.gitignore`` and
``.rayignore`` files otherwise), drops the project's exclusions (``EXCLUDES``, ``--exclude``)
and then every file that looks like a secret (``SECRET_PATTERNS``, or a private key inside),
tracked by git or not. ``write_package`` zips exactly the planned files; the zip is what Ray
uploads (a local ``.zip`` working dir is sent as is and unpacked on the cluster).

Patterns use gitignore syntax: ``name`` matches at any depth, a ``/`` inside anchors the
pattern to the directory it is relative to, a trailing ``/`` matches directories only
(and so everything under them), ``*`` ``?`` ``[abc]`` ``**`` as in git.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError
from common.units import MIB

__all__ = ["EXCLUDES", "SECRET_PATTERNS", "MAX_UPLOAD_MB", "UploadPlan", "plan_upload", "write_package"]

# Never uploaded with the code (relative to the working directory): data, training outputs
# and environments are large, and the cluster has its own.
EXCLUDES = (".git", ".venv", "venv", "/runs/", "/data/", "/shards/", "checkpoints/", "mlruns/", "mlflow.db",
            "*.tar", "*.safetensors", "*.pt", "__pycache__/", "*.egg-info/", ".pytest_cache/", "torch_extensions/")

# Never uploaded unless named with --include-secret, even when git tracks them: a job's code
# never needs them, and a package sent to a cluster is readable by everyone who can run a job
# there (it is unpacked under the head's and the workers' temp dirs and kept for reuse).
# Matched case-insensitively (a key called ID_RSA is still a key). Names only; a file of
# 1 MiB or less that holds a PEM private key block is also left out, whatever its name
# (a service-account key downloaded as project-1234-abcdef.json, a key renamed to .txt).
# Patterns are deliberately narrower than "*token*" or "*secret*": those would drop code
# such as data_prep/tokenizer/load.py.
SECRET_PATTERNS = (
    # dotenv files: API keys, database URLs, cloud credentials as variables
    ".env", ".env.*", "*.env", ".envrc",
    # SSH, GPG and password stores
    ".ssh/", ".gnupg/", ".password-store/", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.ppk",
    # cloud and cluster credentials (AWS, Google Cloud, Azure, Oracle, Kubernetes, Docker,
    # GitHub CLI, rclone, Terraform state and variables, Databricks, boto, s3cmd)
    ".aws/", ".gcloud/", ".config/gcloud/", ".azure/", ".oci/", ".kube/", "kubeconfig", "*.kubeconfig",
    ".docker/config.json", ".dockercfg", ".config/gh/", "rclone.conf", "*.tfstate", "*.tfstate.*", "*.tfvars",
    ".databrickscfg", ".boto", ".s3cfg",
    # keys, certificates with their private key, keystores, password databases
    "*.pem", "*.key", "*.p12", "*.pfx", "*.pkcs12", "*.p8", "*.jks", "*.keystore", "*.kdbx", "*.ovpn",
    # tokens and the files tools keep them in: Ray's auth_token, Hugging Face's token,
    # .vault-token, git, netrc (also W&B), PyPI, npm/yarn, Postgres, MySQL, htpasswd
    ".ray/", "*token", "*.token", "*token.txt", "*token.json", ".git-credentials", ".netrc", "_netrc",
    ".pypirc", ".npmrc", ".yarnrc.yml", ".pgpass", ".my.cnf", ".htpasswd",
    # service accounts and credential files (GCP, AWS console downloads, MLflow, cargo)
    "*service-account*.json", "*service_account*.json", "*serviceaccount*.json", "*credentials*.json",
    "credentials", "credentials.toml", "credentials.csv", "*accesskeys.csv", "client_secret*.json",
    # secrets files and directories, Kubernetes secret manifests
    "secrets/", ".secrets/", "*secret*.json", "*secret*.yaml", "*secret*.yml", "*secret*.toml", "secrets.txt",
    "*.secret", "*.secrets",
    # shell and REPL histories: secrets typed on a command line
    "*_history",
)
# The content check: a PEM private key block (RSA, EC, DSA, OpenSSH, PKCS#8, encrypted,
# PGP). Written with -{5} so that this file does not match itself.
PRIVATE_KEY = re.compile(rb"-{5}BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-{5}")
SCAN_MAX_BYTES = 1 << 20  # keys are small; larger files are not read for the check
# The default upload limit. Code and configs are a few MiB; more means data or weights were
# picked up. Ray itself refuses packages of about 500 MiB.
MAX_UPLOAD_MB = 100
IGNORE_FILES = (".gitignore", ".rayignore")  # honoured when walking; git handles .gitignore itself
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed: the same files give the same package, which Ray then reuses
SHOWN = 5  # names shown in the one-line summary


# ---- gitignore-style patterns -------------------------------------------------------------
# Matched here, not with pathspec: pathspec's patterns also match everything under what they
# match, so `build/` then `!tools/` re-includes tools/build/, and its GitIgnoreSpec lets a `!`
# re-include a file inside an excluded directory; git does neither (tests/cli/cluster/test_upload.py).

@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern
    negate: bool
    dir_only: bool
    base: str = ""  # the directory the pattern is relative to ("" = the working dir)


def _segment(part: str) -> str:
    """One path segment of a glob as a regex: * ? [...] and backslash escapes."""
    out, i = [], 0
    while i < len(part):
        char = part[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "\\" and i + 1 < len(part):
            i += 1
            out.append(re.escape(part[i]))
        elif char == "[" and (end := part.find("]", i + 2)) != -1:
            body = part[i + 1:end]
            if body[0] in "!^":
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def _rule(pattern: str, base: str = "", ignore_case: bool = False) -> _Rule | None:
    pattern = pattern.rstrip("\n\r ")
    if not pattern or pattern.startswith("#"):
        return None
    negate = pattern.startswith("!")
    pattern = pattern[1:] if negate else pattern
    dir_only = pattern.endswith("/")
    pattern = pattern.rstrip("/")
    anchored = "/" in pattern
    parts = pattern.lstrip("/").split("/")
    if not parts[-1]:
        return None
    regex = "" if anchored else "(?:.*/)?"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            regex += ".*" if last else "(?:.*/)?"
        else:
            regex += _segment(part) + ("" if last else "/")
    return _Rule(re.compile(regex, re.IGNORECASE if ignore_case else 0), negate, dir_only, base)


def _rules(patterns, base: str = "", ignore_case: bool = False) -> list[_Rule]:
    return [rule for pattern in patterns if (rule := _rule(pattern, base, ignore_case))]


def _verdict(rules: list[_Rule], rel: str, is_dir: bool) -> bool | None:
    """True if ``rules`` exclude ``rel``, False if a ``!`` rule re-includes it, None if none
    matches: the last matching rule wins, as in a .gitignore."""
    verdict = None
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        sub = rel
        if rule.base:
            if not rel.startswith(rule.base + "/"):
                continue
            sub = rel[len(rule.base) + 1:]
        if rule.regex.fullmatch(sub):
            verdict = not rule.negate
    return verdict


def _matches(rules: list[_Rule], rel: str) -> bool:
    """Whether ``rules`` exclude the file ``rel`` or one of its directories (as in git, a
    file in an excluded directory cannot be re-included)."""
    parts = rel.split("/")
    return (any(_verdict(rules, "/".join(parts[:i]), True) for i in range(1, len(parts)))
            or bool(_verdict(rules, rel, False)))


def _read_ignore_file(root: Path, directory: str, names=IGNORE_FILES) -> list[_Rule]:
    rules = []
    for name in names:
        path = root / directory / name
        if path.is_file():
            rules += _rules(path.read_text(encoding="utf-8", errors="replace").splitlines(), directory)
    return rules


# ---- listing ------------------------------------------------------------------------------

def _git_files(root: Path) -> list[str] | None:
    """Files git would commit here (tracked, and untracked but not ignored), relative to
    ``root``; None when ``root`` is not in a git checkout or git is absent."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                cwd=root, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    # Directories (nested repositories) end with /; submodules are listed but are directories.
    names = sorted({os.fsdecode(name) for name in listed.stdout.split(b"\0") if name and not name.endswith(b"/")})
    return names or None


def _walk_files(root: Path, fixed: list[_Rule]) -> list[str]:
    """Every file under ``root``, honouring .gitignore and .rayignore files as git would;
    excluded directories are not entered."""
    ignored = _read_ignore_file(root, "")
    names = []
    for directory, dirnames, filenames in os.walk(root):
        rel_dir = Path(directory).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        if rel_dir:
            ignored += _read_ignore_file(root, rel_dir)
        kept = []
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if _verdict(fixed, rel, True) or _verdict(ignored, rel, True):
                continue
            if (Path(directory) / name).is_symlink():
                names.append(rel)  # judged as a link by plan_upload, never entered
            else:
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not _verdict(ignored, rel, False):
                names.append(rel)
    return sorted(names)


# ---- the plan -----------------------------------------------------------------------------

@dataclass(frozen=True)
class UploadPlan:
    """The files ``unmask submit`` uploads from ``root``, and what it left out and why."""

    root: Path
    files: tuple[tuple[str, int], ...]           # (path relative to root, bytes), sorted
    secrets: tuple[tuple[str, str], ...] = ()    # (path, why): secret-looking, left out
    outside: tuple[str, ...] = ()                # links to outside the working dir, left out
    allowed: tuple[str, ...] = ()                # secret-looking but named with --include-secret
    listing: str = "walk"                        # "git" (git ls-files) or "walk"
    sources: dict = field(default_factory=dict, compare=False)  # path -> file read (links resolved)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def summary(self, hint: bool = True) -> str:
        """One line: what goes, and the secret-looking files that stay."""
        how = "the files git lists" if self.listing == "git" else "not a git checkout: every file, minus .gitignore"
        line = (f"unmask submit: uploading {_count(self.files, 'file')} ({_size(self.total_bytes)}) from "
                f"{self.root} ({how}; never data, runs, checkpoints, venvs)")
        line += f"; left out {_count(self.secrets, 'secret-looking file')}"
        if self.secrets:
            line += ": " + _few(sorted((name for name, _ in self.secrets), key=lambda name: (name.count("/"), name)))
        if self.outside:
            line += f"; left out {_count(self.outside, 'link')} to outside it: " + _few(self.outside)
        if self.allowed:
            line += (f"; INCLUDING {_count(self.allowed, 'secret-looking file')} (--include-secret): "
                     + _few(self.allowed))
        return line + (" (--dry-run lists every file)" if hint else "")

    def check_size(self, max_mb: float | None) -> None:
        """A UserError when the upload is over ``max_mb`` MiB, naming the biggest files."""
        if max_mb is None or self.total_bytes <= max_mb * MIB:
            return
        biggest = sorted(self.files, key=lambda item: -item[1])[:SHOWN]
        named = ", ".join(f"{name} ({_size(size)})" for name, size in biggest)
        raise UserError(f"--working-dir {self.root}: the upload would be {_size(self.total_bytes)}, over the "
                        f"{max_mb:g} MiB limit; the biggest files: {named}. Leave them out with --exclude PATTERN "
                        f"(or .gitignore), put data on storage the cluster reads, or raise the limit with "
                        f"--max-upload-mb N")


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < MIB else f"{n / MIB:.1f} MiB"


def _count(items, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _few(names) -> str:
    names = list(names)
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _holds_private_key(path: Path, size: int) -> bool:
    if size > SCAN_MAX_BYTES:
        return False
    try:
        return PRIVATE_KEY.search(path.read_bytes()) is not None
    except OSError as err:
        raise UserError(f"{path}: cannot be read for the upload ({err.strerror}); fix its permissions or "
                        f"leave it out with --exclude") from None


def plan_upload(root: Path | str, excludes=(), include_secrets=()) -> UploadPlan:
    """The files of ``root`` that ``unmask submit`` uploads.

    ``excludes``: more gitignore-style patterns to leave out (``--exclude``).
    ``include_secrets``: patterns of secret-looking files to upload anyway (``--include-secret``).
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--working-dir {root}: not a directory")
    root = root.resolve()
    for pattern in (*excludes, *include_secrets):
        if pattern.startswith("!"):
            raise UserError(f"pattern {pattern!r}: negation is not supported here; name what to leave out "
                            f"(--exclude) or what to upload anyway (--include-secret)")
    fixed = _rules((*EXCLUDES, *excludes))
    secret_rules = _rules(SECRET_PATTERNS, ignore_case=True)
    allow_rules = _rules(include_secrets, ignore_case=True)

    names = _git_files(root)
    listing = "git" if names is not None else "walk"
    if names is None:
        names = _walk_files(root, fixed)
        ignored = []  # applied during the walk
    else:  # git does not know .rayignore (Ray honoured those): honour them in every listed directory
        directories = {"/".join(name.split("/")[:i]) for name in names for i in range(name.count("/") + 1)}
        ignored = [rule for directory in sorted(directories)
                   for rule in _read_ignore_file(root, directory, (".rayignore",))]

    files, secrets, outside, allowed, sources = [], [], [], [], {}
    for rel in names:
        if _matches(fixed, rel) or (ignored and _matches(ignored, rel)):
            continue
        path = root / rel
        source = path
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(root):
                outside.append(rel)
                continue
            if not target.is_file():
                continue  # a link to a directory inside: its files are listed where they are
            source = target
        elif not path.is_file():
            continue  # deleted since git listed it, a fifo, a submodule
        size = source.stat().st_size
        why = None
        if _matches(secret_rules, rel) or (source != path and
                                           _matches(secret_rules, source.relative_to(root).as_posix())):
            why = "secret-looking name"
        elif _holds_private_key(source, size):
            why = "holds a private key"
        if why and not _matches(allow_rules, rel):
            secrets.append((rel, why))
            continue
        if why:
            allowed.append(rel)
        files.append((rel, size))
        sources[rel] = source
    return UploadPlan(root, tuple(files), tuple(secrets), tuple(outside), tuple(allowed), listing, sources)


def write_package(plan: UploadPlan, path: Path) -> Path:
    """Zip exactly ``plan.files`` (paths relative to the zip's root) into ``path``. The zip
    is the same for the same files: fixed dates, sorted names, permission bits kept."""
    if not plan.files:
        raise UserError(f"--working-dir {plan.root}: nothing to upload (every file is excluded or looks secret); "
                        f"check --exclude and .gitignore, or run unmask submit --dry-run")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as package:
        for rel, _ in plan.files:
            source = plan.sources.get(rel, plan.root / rel)
            info = zipfile.ZipInfo(rel, date_time=ZIP_DATE)
            info.external_attr = (stat.S_IFREG | stat.S_IMODE(source.stat().st_mode)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            try:
                package.writestr(info, source.read_bytes())
            except OSError as err:
                raise UserError(f"{source}: cannot be read for the upload ({err.strerror}); fix its permissions "
                                f"or leave it out with --exclude") from None
    return path
