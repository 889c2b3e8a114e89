"""A working directory seeded with code, secrets, ignored and excluded files, for the tests of
what ``unmask submit`` uploads (``tests/cli/cluster/test_upload.py`` and the real head in ``tests/cli/cluster/test_jobs.py``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Written so that this file itself does not hold a private key block.
PEM_KEY = "-" * 5 + "BEGIN OPENSSH PRIVATE KEY" + "-" * 5 + "\nb3BlbnNzaC1rZXktdjEAAAAA\n" + "-" * 5 + \
    "END OPENSSH PRIVATE KEY" + "-" * 5 + "\n"
SERVICE_ACCOUNT = ('{"type": "service_account", "project_id": "p", "private_key_id": "0a1b", '
                   '"private_key": "' + PEM_KEY.replace("OPENSSH ", "").replace("\n", "\\n") + '"}\n')

# Uploaded: code and configs, including names close to the secret patterns (false positives
# would break the job: data_prep/tokenizer/load.py is this project's own). Not named like this
# project's modules: the job imports those, and the working dir comes first on its path.
CODE = ("marker_5e2d.txt", ".gitignore", "README.md", "pipeline/x.py", "mypkg/credentials.py",
        "mypkg/secret_scan.py", "mypkg/tokenizer.py", "mypkg/detokenizers.py", "configs/tiny.yaml",
        "configs/environment.yaml", "configs/.gitignore", "configs/keep.tmp", "docs/keys.md", "scripts/run.sh",
        "bench/.rayignore", "bench/bench.py", "tokens/vocab.txt")
# Left out because they look secret (by name, by a private key inside, or by a link to one).
SECRETS = (".env", "secrets.env", ".env.production", "configs/.env.local", ".envrc", ".ssh/id_rsa", ".ssh/config",
           "deploy/id_ed25519", "deploy/id_ecdsa.pub", "keys/ID_RSA", ".aws/credentials", ".aws/config",
           ".gcloud/key.json", ".config/gcloud/application_default_credentials.json", ".azure/accessTokens.json",
           ".kube/config", ".docker/config.json", "certs/server.pem", "certs/tls.key", "certs/client.p12",
           "certs/client.pfx", "java/store.jks", ".ray/auth_token", "auth_token", "hf/token", ".git-credentials",
           ".netrc", ".pypirc", ".npmrc", "gcp-service-account.json", "credentials.json", "client_secret_42.json",
           "k8s/db-secret.yaml", "terraform.tfstate", ".bash_history",
           "notes/renamed.txt",          # a private key under an innocent name
           "project-1234-abcdef.json",   # a service-account key as Google names its download
           "configs/settings.txt")       # a link to .env
PRIVATE_KEY_FILES = ("notes/renamed.txt", "project-1234-abcdef.json")
# Left out by .gitignore / .rayignore, or by the project's own exclusions.
IGNORED = ("notes-local/todo.txt", "train.log", "configs/scratch.tmp", "bench/results.json")
EXCLUDED = (".venv/bin/python", "runs/a/log", "data/x.txt", "out/checkpoints/step-1/model.pt",
            "export/model.safetensors", "pipeline/__pycache__/x.cpython-311.pyc", "unmask.egg-info/PKG-INFO",
            "shards/train.tar")
GITIGNORE = ".env\nnotes-local/\n*.log\n"
OUTSIDE_LINK = "linked_key"


def seed_project(root: Path, outside: Path, git: bool) -> Path:
    """Write the files above under ``root`` (and a file outside it, linked from inside);
    ``git``: make it a checkout with every file added (``.env`` forced past .gitignore)."""
    for name in (*CODE, *SECRETS, *IGNORED, *EXCLUDED):
        if name == "configs/settings.txt":
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# contents of {name}\n")
    (root / ".gitignore").write_text(GITIGNORE)
    (root / "configs" / ".gitignore").write_text("*.tmp\n!keep.tmp\n")
    (root / "bench" / ".rayignore").write_text("*.json\n")
    (root / "notes" / "renamed.txt").write_text(PEM_KEY)
    (root / "project-1234-abcdef.json").write_text(SERVICE_ACCOUNT)
    (root / "configs" / "settings.txt").symlink_to(Path("..") / ".env")
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "id").write_text("outside the working dir\n")
    (root / OUTSIDE_LINK).symlink_to(outside / "id")
    if git:
        _git(root, "init", "-q")
        _git(root, "add", "-A")
        _git(root, "add", "-f", ".env")  # tracked, yet never uploaded
    return root


def _git(root: Path, *args: str) -> None:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)


def uploaded_names(package: Path) -> list[str]:
    """The files of an unpacked package, relative to it, sorted."""
    return sorted(path.relative_to(package).as_posix() for path in package.rglob("*") if path.is_file())
