"""Command-line options shared by the subcommands: defaults from ``DRAFTCACHE_*`` variables,
every default shown in ``--help``.

>>> import os
>>> os.environ["DRAFTCACHE_BUDGET"] = "32"
>>> p = argparse.ArgumentParser()
>>> add(p, "--budget", type=int, default=64, help="draft tokens")
>>> p.parse_args([]).budget, p.parse_args(["--budget", "8"]).budget
(32, 8)
>>> del os.environ["DRAFTCACHE_BUDGET"]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

TREE_RANK_HELP = (
    "how a tree's nodes are ranked for its budget: 'calibrated', by the chance the target accepts each "
    "(the namespace's calibration, once it has learnt from its first outcomes), or 'score', by the tiers' "
    "merged scores"
)
# indexer.drafter's DrafterConfig.tree_rank default and TREE_RANKS (a test keeps them equal): the
# command line is parsed without loading the drafter.
TREE_RANK, TREE_RANKS = "calibrated", ("calibrated", "score")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (``(default: ...)``, a list's items joined by commas),
    except where there is none to show (no value, a switch, an empty one) or the help text
    says it already; a default of 0 is shown.

    >>> p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    >>> _ = p.add_argument("--n", type=int, default=0, help="count")
    >>> _ = p.add_argument("--sizes", default=(1, 2), help="sizes")
    >>> _ = p.add_argument("--name", default="", help="one name (default: all)")
    >>> _ = p.add_argument("--pid", default=[], help="pids")
    >>> for line in p.format_help().splitlines()[-4:]:
    ...     print(" ".join(line.split()))
    --n N count (default: 0)
    --sizes SIZES sizes (default: 1,2)
    --name NAME one name (default: all)
    --pid PID pids
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unshown = default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ())
        if unshown or "(default" in text or action.required:
            return text
        if isinstance(default, (list, tuple)):
            return f"{text} (default: {','.join(map(str, default))})".replace("%", "%%")
        return super()._get_help_string(action)


def env_name(name: str) -> str:
    """The environment variable an option reads: ``DRAFTCACHE_<NAME>``, dashes as underscores."""
    return "DRAFTCACHE_" + name.upper().replace("-", "_")


def env(name: str, default: str | None = None) -> str | None:
    """``DRAFTCACHE_<NAME>`` (dashes become underscores), else ``default``."""
    return os.environ.get(env_name(name), default)


def add(p: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    """An option whose default comes from the environment when set there; a value there that
    the option would refuse on the command line is a ``ValueError`` naming the variable.

    >>> os.environ["DRAFTCACHE_COUNT"] = "0"
    >>> add(argparse.ArgumentParser(), "--count", type=positive, help="how many")
    Traceback (most recent call last):
    ...
    ValueError: DRAFTCACHE_COUNT='0' (--count): must be at least 1, got 0
    >>> del os.environ["DRAFTCACHE_COUNT"]
    """
    value = env(flag.lstrip("-"))
    if value is not None:
        name = env_name(flag.lstrip("-"))
        if "type" in kw:
            try:
                value = kw["type"](value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{name}={value!r} ({flag}): {exc}") from None
        if "choices" in kw and value not in kw["choices"]:
            raise ValueError(f"{name}={value!r} ({flag}): must be one of {', '.join(map(str, kw['choices']))}")
        kw["default"] = value
        kw.pop("required", None)
    if "help" not in kw:
        raise ValueError(f"{flag}: every option needs help text")
    p.add_argument(flag, **kw)


def positive(text: str) -> int:
    """An integer of at least 1 (argparse turns the ValueError into a usage error).

    >>> positive("3")
    3
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def share(text: str) -> float:
    """A number in [0, 1].

    >>> share("0.7")
    0.7
    """
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def non_negative(text: str) -> int:
    """An integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def seconds(text: str) -> float:
    """A duration above 0 seconds.

    >>> seconds("2.5")
    2.5
    """
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value
