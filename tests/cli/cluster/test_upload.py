"""What ``unmask submit`` uploads: the file selection (git checkout or not, secrets, ignores,
exclusions), the zip that is sent, the size limit and what it prints. No cluster needed;
``tests/cli/cluster/test_jobs.py`` checks the package that reaches a real Ray head."""

from __future__ import annotations

import os
import subprocess
import zipfile

import pytest

from common.errors import UserError
from orchestration.cluster.upload import EXCLUDES, SECRET_PATTERNS, _matches, _rules, plan_upload, write_package
from tests.support.cli_runner import unmask_in_process
from tests.support.paths import REPO
from tests.support.upload_fixtures import CODE, OUTSIDE_LINK, PRIVATE_KEY_FILES, SECRETS, seed_project, uploaded_names


@pytest.fixture(params=["git", "plain", "git-absent"])
def project(request, tmp_path, monkeypatch):
    """The seeded working dir: a git checkout, a plain directory, and a checkout on a
    machine without git (the tree is walked, honouring the .gitignore files itself)."""
    root = seed_project(tmp_path / "project", tmp_path / "outside", git=request.param != "plain")
    if request.param == "git-absent":
        monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    return root


def test_exactly_the_code_is_selected_and_every_secret_is_left_out(project):
    plan = plan_upload(project)
    assert [name for name, _ in plan.files] == sorted(CODE)
    listing = "git" if (project / ".git").is_dir() and "no-git-here" not in os.environ["PATH"] else "walk"
    assert plan.listing == listing
    # Reported: the secret-looking files that would otherwise have gone. In the checkout that
    # includes .env, which is gitignored but tracked (force-added); elsewhere .gitignore drops it.
    reported = set(SECRETS) if listing == "git" else set(SECRETS) - {".env"}
    assert sorted(name for name, _ in plan.secrets) == sorted(reported)
    assert {name for name, why in plan.secrets if why == "holds a private key"} == set(PRIVATE_KEY_FILES)
    assert plan.outside == (OUTSIDE_LINK,)
    assert plan.allowed == ()
    assert dict(plan.files)["README.md"] == (project / "README.md").stat().st_size


def test_the_package_holds_exactly_the_planned_files_and_is_reproducible(tmp_path):
    project = seed_project(tmp_path / "project", tmp_path / "outside", git=True)
    (project / "scripts" / "run.sh").chmod(0o755)
    plan = plan_upload(project)
    first = write_package(plan, tmp_path / "a.zip")
    with zipfile.ZipFile(first) as package:
        assert sorted(package.namelist()) == sorted(CODE)
        assert package.read("pipeline/x.py") == (project / "pipeline" / "x.py").read_bytes()
        assert package.getinfo("scripts/run.sh").external_attr >> 16 & 0o777 == 0o755
        package.extractall(tmp_path / "unpacked")
    assert uploaded_names(tmp_path / "unpacked") == sorted(CODE)
    assert write_package(plan_upload(project), tmp_path / "b.zip").read_bytes() == first.read_bytes()


def test_exclude_and_include_secret_flags(tmp_path):
    project = seed_project(tmp_path / "project", tmp_path / "outside", git=True)
    plan = plan_upload(project, excludes=("*.md", "/scripts/"), include_secrets=(".env.production",))
    names = [name for name, _ in plan.files]
    assert "README.md" not in names and "docs/keys.md" not in names and "scripts/run.sh" not in names
    assert ".env.production" in names and plan.allowed == (".env.production",)
    assert "INCLUDING 1 secret-looking file (--include-secret): .env.production" in plan.summary()
    assert ".env" not in names and ".env.production" not in dict(plan.secrets)
    with pytest.raises(UserError, match="negation is not supported"):
        plan_upload(project, excludes=("!README.md",))


def test_a_working_dir_inside_a_checkout_uploads_only_its_own_files(tmp_path):
    project = seed_project(tmp_path / "project", tmp_path / "outside", git=True)
    plan = plan_upload(project / "configs")
    assert plan.listing == "git"
    assert [name for name, _ in plan.files] == [".gitignore", "environment.yaml", "keep.tmp", "tiny.yaml"]
    assert [name for name, _ in plan.secrets] == [".env.local"]
    assert plan.outside == ("settings.txt",)  # its target, ../.env, is outside this working dir


def test_this_project_uploads_every_file_git_tracks(tmp_path):
    """No secret pattern catches this project's own code (a `*token*` pattern would drop
    data_prep/tokenizer/load.py and break every job)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    tracked = {name for name in tracked if (REPO / name).is_file() and not _matches(_rules(EXCLUDES), name)}
    plan = plan_upload(REPO)
    assert tracked <= {name for name, _ in plan.files}, tracked - {name for name, _ in plan.files}
    assert "data_prep/tokenizer/load.py" in tracked


@pytest.mark.parametrize("pattern, path, excluded", [
    ("/runs/", "runs/a/log", True), ("/runs/", "x/runs/a", False), ("checkpoints/", "out/checkpoints/s/m.pt", True),
    ("checkpoints/", "checkpoints", False), ("*.pt", "a/b/c.pt", True), ("*.pt", "a.pth", False),
    (".git", ".git/HEAD", True), (".git", ".github/ci.yml", False), ("a/**/b", "a/x/y/b", True),
    ("a/**/b", "a/b", True), ("**/foo", "foo", True), ("x/**", "x/1/2", True), ("doc?.md", "doc1.md", True),
    ("[!a]*.py", "b.py", True), ("[!a]*.py", "a.py", False), ("docs/*.md", "docs/x/y.md", False),
])
def test_patterns_follow_gitignore_semantics(pattern, path, excluded):
    assert _matches(_rules([pattern]), path) is excluded


@pytest.mark.parametrize("patterns, path, excluded", [
    (["build/", "!*.log"], "build/x.log", True),          # nothing inside an excluded directory comes back
    (["build/", "!tools/"], "tools/build/out.bin", True),  # re-including a directory keeps its own exclusions
    (["a", "!logs"], "logs/a/x.py", True), (["*.log", "!logs/"], "logs/x.log", True),
    (["build/", "!tools/"], "tools/run.py", False), (["*.log", "!keep.log"], "d/keep.log", False),
])
def test_negations_follow_git(patterns, path, excluded):
    """As `git ls-files --others --ignored` decides. pathspec gets these wrong: its GitIgnoreSpec
    lets a later `!` re-include a file inside an excluded directory (the first three True cases),
    and its patterns also match everything under what they match, so even checked one directory
    at a time `!tools/` and `!logs` re-include tools/build/ and logs/a/. Hence upload.py's matcher."""
    assert _matches(_rules(patterns), path) is excluded


def test_the_walk_keeps_exclusions_inside_a_re_included_directory(tmp_path):
    for name in ("tools/build/out.bin", "tools/run.py", "logs/a/x.py", "logs/keep.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    (tmp_path / ".gitignore").write_text("build/\n!tools/\na\n!logs\n")
    plan = plan_upload(tmp_path)
    assert plan.listing == "walk"
    assert [name for name, _ in plan.files] == [".gitignore", "logs/keep.txt", "tools/run.py"]


@pytest.mark.parametrize("path", ["x/.env", "a.ENV", ".ssh/known_hosts", "deep/.aws/credentials", "ID_ED25519",
                                  ".ray/auth_token", "my-service-account-prod.json", "key.PEM", "store.keystore"])
def test_secret_patterns_are_case_insensitive_and_match_at_any_depth(path):
    assert _matches(_rules(SECRET_PATTERNS, ignore_case=True), path)


def test_an_upload_over_the_limit_is_refused_naming_the_biggest_files_and_the_flag(tmp_path, monkeypatch, capsys):
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    project = tmp_path / "project"
    (project / "weights").mkdir(parents=True)
    (project / "weights" / "big.bin").write_bytes(bytes(3 << 20))
    (project / "small.py").write_text("print(1)\n")
    with pytest.raises(UserError, match=r"weights/big\.bin \(3\.0 MiB\).*--max-upload-mb N"):
        plan_upload(project).check_size(2)
    plan_upload(project).check_size(4)

    # The CLI refuses before it connects (no --address here: that error would come later).
    assert unmask_in_process(["submit", "--working-dir", str(project), "--max-upload-mb", "2", "--", "version"]) == 2
    err = capsys.readouterr().err
    assert "over the 2 MiB limit" in err and "weights/big.bin" in err and "--max-upload-mb" in err
    assert "--address is required" not in err
    # Over the default limit (100 MiB) by default, accepted with a higher one.
    (project / "weights" / "big.bin").write_bytes(bytes(101 << 20))
    assert unmask_in_process(["submit", "--working-dir", str(project), "--dry-run"]) == 2
    assert "over the 100 MiB limit" in capsys.readouterr().err
    assert unmask_in_process(["submit", "--working-dir", str(project), "--dry-run", "--max-upload-mb", "200"]) == 0


def test_submit_prints_the_summary_before_anything_goes_and_dry_run_lists_every_file(tmp_path, monkeypatch,
                                                                                      capsys):
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    project = seed_project(tmp_path / "project", tmp_path / "outside", git=True)
    total = sum((project / name).stat().st_size for name in CODE)

    assert unmask_in_process(["submit", "--working-dir", str(project), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{(project / name).stat().st_size}\t{name}" for name in sorted(CODE)]
    for name in SECRETS:
        assert f"): {name}\n" in err
    assert f"left out (link to outside the working dir): {OUTSIDE_LINK}" in err
    summary = err.splitlines()[-1]
    assert total < 1024
    assert summary.startswith(f"unmask submit: uploading {len(CODE)} files ({total} B) from {project}")
    # A few named, the top-level ones first.
    assert (f"left out {len(SECRETS)} secret-looking files: .bash_history, .env, .env.production, .envrc, "
            f".git-credentials and {len(SECRETS) - 5} more;") in summary

    # Without --dry-run the summary comes first, then the connection (which fails here).
    assert unmask_in_process(["submit", "--working-dir", str(project), "--", "version"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0] == summary + " (--dry-run lists every file)" and "--address is required" in lines[1]


def test_an_empty_upload_and_a_missing_working_dir_are_clear_errors(tmp_path):
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / ".env").write_text("TOKEN=1\n")
    with pytest.raises(UserError, match="nothing to upload"):
        write_package(plan_upload(tmp_path / "only"), tmp_path / "p.zip")
    with pytest.raises(UserError, match="--working-dir .*not a directory"):
        plan_upload(tmp_path / "absent")
