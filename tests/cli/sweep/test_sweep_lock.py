"""One ``unmask sweep`` per sweep directory: a second one is refused in one line naming the first."""

from __future__ import annotations

import subprocess
import sys

from orchestration.exit_codes import USER_ERROR
from tests.support.cli_runner import cli_env, unmask_in_process
from tests.support.paths import REPO

HOLD = """
import sys
from pathlib import Path
from common.outputs import claim_output_dir
from orchestration.sweep import SWEEP_KIND
from orchestration.sweep.lock import sweep_lock
out = Path(sys.argv[1])
claim_output_dir(out, SWEEP_KIND, "--out")
with sweep_lock(out):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_sweep_on_one_directory_is_refused_naming_the_first(sweep_file, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, env=cli_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        status = unmask_in_process(["sweep", str(sweep_file()), "--out", str(out)])
        message = capsys.readouterr().err.strip()
        assert status == USER_ERROR and "another unmask sweep runs on it" in message and "\n" not in message
        assert f'"pid": {holder.pid}' in message and not (out / "trials").exists()
    finally:
        holder.communicate("")
    assert holder.returncode == 0
