"""deploy/soak.sh, run the way an operator starts it (from another directory, with relative
paths), up to its load: two real replicas on one Redis must both come up, and whatever ends the
run must leave no process behind, the fault loop's included."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from deploy_files import DEPLOY, run_script


def processes_naming(text: str) -> list[str]:
    """The command lines of live processes that mention ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def test_both_replicas_start_and_a_failed_run_leaves_nothing_running(shared_data: Path, tmp_path: Path) -> None:
    """``shared_data``: the script reads its tokenizer there (the test skips without it, as every
    test reading the shared data does)."""
    caller = tmp_path / "a caller's dir"  # a space in the path, and not the project root
    caller.mkdir()
    # A long run whose load cannot start (no such traces): the faults loop is still sleeping
    # towards its first fault (150 s away) when the script ends. OUT is relative: read from the
    # caller's directory.
    start = time.monotonic()
    done = run_script("soak.sh", ["600", "1", "missing-traces.jsonl.gz"], caller, 150, OUT="soak-run")
    took = time.monotonic() - start
    out = caller / "soak-run"
    logs = {n: (out / f"replica{n}.log").read_text() for n in (1, 2)}
    # Each replica served, on a journal of its own (one data directory each, under OUT).
    for n, log in logs.items():
        assert "draftcache serving on" in log, log[-2000:]
        assert (out / f"replica{n}" / "journal").is_dir()
    # The load was what failed, reading the traces where the caller named them.
    assert done.returncode != 0
    assert str(caller / "missing-traces.jsonl.gz") in done.stderr, done.stderr[-2000:]
    assert took < 100, f"the script took {took:.0f} s to give up"
    left = processes_naming(str(tmp_path))
    assert not left, left
    for name in ("replica1.pid", "replica2.pid", "redis.pid"):
        pid = int((out / name).read_text())
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", name


def test_too_short_a_run_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(DEPLOY / "soak.sh"), "10"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "at least 40 seconds" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
