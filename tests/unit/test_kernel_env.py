"""Importing the kernels leaves the process environment alone; entry points choose the worker
threads' wait policy explicitly."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = """
import os
import indexer.kernels as kernels
before = os.environ.get("OMP_WAIT_POLICY")
kernels.prefer_passive_workers()
print(before, os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(env: dict[str, str], script: str = _SCRIPT, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _unset() -> dict[str, str]:
    """This process's environment without a wait policy of its own."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def test_importing_the_kernels_sets_nothing_and_the_entry_point_call_does():
    assert _run(_unset()) == "None PASSIVE"


def test_a_policy_the_environment_chose_is_kept():
    assert _run({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE ACTIVE"


_COMMAND_SCRIPT = """
import os, sys
import benchmarks.commands as commands
name = sys.argv[1]
parse, _ = commands._COMMANDS[name]
commands._COMMANDS[name] = (parse, lambda a: print(os.environ.get("OMP_WAIT_POLICY")) or 0)
commands.run(name, None)
"""


def _policy_in(command: str) -> str:
    return _run(_unset(), _COMMAND_SCRIPT, command)


def test_commands_that_run_a_model_leave_the_policy_to_openmp():
    """Passive workers suit the draft step's threads; a model's threads would sleep between
    its operations (decoder_client.cpu_linears)."""
    assert _policy_in("replay") == "PASSIVE"
    assert _policy_in("bench-draft") == "PASSIVE"
    for command in ("generate", "bench-generate", "bench-topk", "make-topk-trace"):
        assert _policy_in(command) == "None", command
