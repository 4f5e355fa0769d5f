"""deploy/systemd: the unit through ``systemd-analyze verify`` and its offline security review
(skipped where systemd-analyze is missing), and the directives the deployment relies on."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_files import UNIT, unit_directives

EXEC = "/opt/draftcache/bin/draftcache"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
MAX_EXPOSURE = 2.0  # systemd-analyze security: 1.2 today, 9.6 without the sandbox


def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None or not SYSTEM_UNITS.is_dir():
        pytest.skip("systemd-analyze is not installed")
    return exe


def verify(unit: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` in a scratch root holding the unit, the system's units (for
    default dependencies) and a stand-in ExecStart binary, since none is installed here."""
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    if not (root / SYSTEM_UNITS.relative_to("/")).exists():
        shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    stub = root / EXEC.lstrip("/")
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    cmd = [analyze(), "verify", "--man=no", f"--root={root}", unit.name]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    out = verify(UNIT, tmp_path)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stderr


def test_systemd_analyze_verify_reports_a_broken_unit(tmp_path: Path) -> None:
    broken = tmp_path / "broken.service"
    text = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=sometimes\nRestartt=always")
    broken.write_text(text)
    out = verify(broken, tmp_path / "root")
    assert "Failed to parse protect system value" in out.stderr and "Unknown key" in out.stderr


def security(unit: Path) -> subprocess.CompletedProcess[str]:
    cmd = [analyze(), "security", "--offline=yes", f"--threshold={round(MAX_EXPOSURE * 10)}", str(unit)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_exposure_stays_low(tmp_path: Path) -> None:
    assert security(UNIT).returncode == 0
    sandbox = ("Protect", "Private", "Restrict", "SystemCall", "Capability", "NoNewPrivileges", "DynamicUser")
    weak = tmp_path / "weak.service"
    weak.write_text("\n".join(line for line in UNIT.read_text().splitlines() if not line.startswith(sandbox)))
    assert security(weak).returncode != 0


def test_hardened_service_with_its_own_state_directory() -> None:
    from cache_service.cli import build_parser

    service = {k: v for section, k, v in unit_directives() if section == "Service"}
    expected = {
        "EnvironmentFile": "/etc/draftcache/env",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "StateDirectory": "draftcache",
        "DynamicUser": "yes",
        # SIGTERM to draftcache alone: it flushes into its embedded Redis, then stops it.
        "KillMode": "mixed",
    }
    assert {k: service.get(k) for k in expected} == expected
    assert int(service["LimitNOFILE"]) >= 65536
    # numba compiles kernels at run time: writable+executable pages must stay allowed.
    assert service.get("MemoryDenyWriteExecute", "no") == "no"
    env = dict(item.split("=", 1) for item in shlex.split(service["Environment"]))
    assert env["DRAFTCACHE_DATA_DIR"] == "%S/" + service["StateDirectory"]
    assert env["NUMBA_CACHE_DIR"].startswith("%C/" + service["CacheDirectory"])
    binary, *argv = shlex.split(service["ExecStart"])
    assert binary == EXEC and build_parser().parse_args(argv).command == "serve"


def test_the_environment_file_is_installed_for_root_alone() -> None:
    """The environment file may hold the Redis URL with its password: the documented install
    gives it no group or other access (systemd reads it as root)."""
    installs = [line for line in UNIT.read_text().splitlines() if "install" in line and "/etc/draftcache/env" in line]
    (line,) = installs
    words = shlex.split(line.lstrip("# ").split("  #")[0])
    mode = int(words[words.index("-m") + 1], 8)
    assert mode & 0o077 == 0, oct(mode)
