"""What the command line imports before it knows the command: torch and the light libraries,
never MLflow, scipy, DeepSpeed, Ray or transformers, which only some commands use and which
cost seconds at every start (``unmask --help`` included)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.cli_runner import cli_env
from tests.support.paths import REPO

# Each takes about a second or more to import; each is imported where a command uses it.
IMPORTED_ON_USE = ("deepspeed", "matplotlib", "mlflow", "pandas", "ray", "scipy", "transformers")


def test_the_command_line_starts_without_the_libraries_only_some_commands_use():
    probe = (f"import sys; sys.argv = ['unmask', '--help']; import orchestration.cli; "
             f"print(*[name for name in {IMPORTED_ON_USE!r} if name in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == []
