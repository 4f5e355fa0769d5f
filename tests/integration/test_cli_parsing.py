"""The ``draftcache`` command's surface: help for every option, defaults shown, bad values refused
before any work, and a clear word when an optional extra is missing."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.cli import COMMANDS, build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(name: str, parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every option of a subcommand, its own subcommands' included (``namespaces delete``)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                found += _options(f"{name} {sub}", subparser)
        if not isinstance(action, argparse._HelpAction):
            found.append((name, action))
    return found


def test_every_subcommand_is_in_the_table_and_every_option_has_help() -> None:
    parsers = _subparsers()
    assert set(parsers) == set(COMMANDS)
    for name, parser in parsers.items():
        for where, action in _options(name, parser):
            assert action.help, f"draftcache {where} {action.option_strings or action.dest}: no help text"


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = capsys.readouterr().out
    assert "(default: 64)" in text  # --budget
    assert "(default: 32)" in text  # --max-depth


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "t.jsonl", "--budget", "0"],
        ["replay", "t.jsonl", "--lookahead", "-1"],
        ["bench-draft", "t.jsonl", "--batch", "0"],
        ["bench-draft-model", "--batches", "1,0"],
        ["bench-draft-model", "--k", "0"],
        ["serve", "--max-batch", "0"],
    ],
)
def test_out_of_range_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be at least" in capsys.readouterr().err


def test_a_draft_model_benchmark_is_checked_before_its_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-draft-model", "--k", "4", "--accept", "4", "--model", "/nowhere"]) == 2
    assert "accept must be in [0, k)" in capsys.readouterr().err
    assert main(["bench-draft-model", "--batches", "2,4", "--going", "3", "--model", "/nowhere"]) == 2
    assert "going must be in [0, the smallest batch 2]" in capsys.readouterr().err


def test_a_prior_that_is_not_a_prior_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = tmp_path / "t.jsonl"
    traces.write_text('{"id": "a", "namespace": "toy", "segments": [{"kind": "output", "tokens": [1, 2]}]}\n')
    bogus = tmp_path / "prior.npz"
    bogus.write_bytes(b"not a prior at all")
    assert main(["replay", str(traces), "--prior", str(bogus)]) == 2
    err = capsys.readouterr().err
    assert "is not a prior file" in err and "draftcache warm --out" in err


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_missing_extra_is_named() -> None:
    # torch made unimportable, as on a server-only install.
    done = _run(
        "import sys; sys.modules['torch'] = None\n"
        "from cache_service.cli import main\n"
        "sys.exit(main(['generate', '--prompt', 'hi']))"
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'draftcache[decoder]'" in done.stderr


def test_server_commands_load_no_tool_modules() -> None:
    done = _run(
        "import sys\n"
        "from cache_service.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['stats', '--help'], ['warm', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "loaded = [m for m in ('torch', 'transformers', 'benchmarks', 'decoder_client') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("DRAFTCACHE_MAX_BATCH", "0", "DRAFTCACHE_MAX_BATCH='0' (--max-batch): must be at least 1, got 0"),
        ("DRAFTCACHE_PORT", "abc", "DRAFTCACHE_PORT='abc' (--port): invalid literal"),
        ("DRAFTCACHE_LOG_FORMAT", "xml", "DRAFTCACHE_LOG_FORMAT='xml' (--log-format): must be one of text, json"),
    ],
)
def test_a_bad_value_in_the_environment_names_its_variable(
    variable: str, value: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["serve", "--help"]) == 2  # refused before anything else is read
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_journal_in_use_by_another_process_is_one_line(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second ``serve`` on a data folder whose journal another process holds: one clear line."""
    from cache_service.app import AppConfig
    from cache_service.host.embedded_redis import EmbeddedRedisConfig
    from cache_service.host.journal import Journal

    where = AppConfig(embedded=EmbeddedRedisConfig(data_dir=tmp_path / "redis"), journal_dir=tmp_path / "journal")
    held = Journal(where.journal_path, 1 << 20, root=where.journal_root)
    held.open()
    try:
        rc = main(["serve", "--data-dir", str(tmp_path), "--redis-url", redis_url, "--port", "0"])
    finally:
        held.close()
    err = capsys.readouterr().err
    assert rc == 2 and "is in use by another process" in err and "Traceback" not in err
