"""The ``draftcache`` command: one entry point, one subcommand per job.

A subcommand's module is imported only when that subcommand runs, so the server's commands never
load the decoder side (torch, transformers) and ``draftcache --help`` loads nothing at all. The
tools (replay, benchmarks, generation) live in ``benchmarks/``; this table names them by module so
that the server imports nothing from them. A flag that takes a value can mostly also come from a
``DRAFTCACHE_<FLAG>`` environment variable (``--budget`` from ``DRAFTCACHE_BUDGET``; switches
and a few flags of the tools do not: README, "Configure"); flags win.

>>> sorted(COMMANDS)[:4]
['bench-draft', 'bench-draft-model', 'bench-generate', 'bench-index']
>>> missing_extra("transformers")
'decoder'
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from dataclasses import dataclass

from cache_service import logs
from cache_service.admin.options import HelpFormatter, add


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and the module whose ``add_arguments(name, parser)`` and
    ``run(name, args)`` implement it."""

    help: str
    module: str


_ADMIN = "cache_service.admin.commands"
_TOOLS = "benchmarks.commands"
COMMANDS: dict[str, Command] = {
    "serve": Command("run the gRPC service (embedded persistent Redis unless --redis-url)", _ADMIN),
    "warm": Command("build a static prior from a corpus (or fill the lifetime log with it)", _ADMIN),
    "migrate": Command("bring the Redis key schema up to date", _ADMIN),
    "sessions": Command("sessions kept in storage (any replica can continue them)", _ADMIN),
    "stats": Command("namespaces, buffers, indexes and sessions of a running service", _ADMIN),
    "rebuild": Command("reload priors and rebuild the lifetime indexes now", _ADMIN),
    "namespaces": Command("list a running service's namespaces, or delete one everywhere", _ADMIN),
    "replay": Command("replay traces and report MAT (tokens per verification step)", _TOOLS),
    "generate": Command("speculative greedy decoding of one prompt with a real model", _TOOLS),
    "bench-rpc": Command("draft round trip over the stream vs an echo of the same size", _TOOLS),
    "bench-load": Command("decoder processes stepping batches of real traces against the service", _TOOLS),
    "bench-draft": Command("the draft path in process: time per sequence-draft, trees' digest", _TOOLS),
    "bench-generate": Command("tokens/s of real decoding: greedy vs prompt lookup vs draftcache", _TOOLS),
    "bench-topk": Command(
        "MAT of real decoding with the target's top-k fed back at every node, the path, nowhere", _TOOLS
    ),
    "bench-index": Command("rebuild time, lookup latency and bytes per token at a buffer size", _TOOLS),
    "bench-draft-model": Command("a draft model's step time at a batch: rows read together vs one by one", _TOOLS),
    "make-topk-trace": Command("a SmolLM2 Spec-Bench trace with the target's top-k at every output token", _TOOLS),
    "make-draft-rows": Command("a draft model's next-token predictions along a trace, for chains in replay", _TOOLS),
}

# Packages the optional extras bring, by the extra that installs them.
_EXTRAS = {
    "torch": "decoder",
    "transformers": "decoder",
    "gguf": "decoder",
    "accelerate": "decoder",
    "arctic_inference": "peers",
    "draftretriever": "peers",
}


def missing_extra(module: str) -> str | None:
    """The extra that installs a missing top-level module, if an extra does."""
    return _EXTRAS.get(module.split(".")[0])


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is one), if any."""
    return next((word for word in argv if word in COMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given the command line, only the subcommand it names loads its module and its
    options (the others show their one-line help); without one, every subcommand is complete."""
    parser = argparse.ArgumentParser(
        prog="draftcache",
        description="draftcache: a shared drafting cache for model-free speculative decoding",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add(parser, "--log-format", default="text", choices=("text", "json"), help="json: one object per line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else _chosen(argv)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, formatter_class=HelpFormatter)
        if argv is None or name == chosen:
            importlib.import_module(command.module).add_arguments(name, p)
    return parser


def _clear_exit(command: str, exc: BaseException | str) -> int:
    print(f"draftcache {command}: error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(argv) or "?"
    try:
        args = build_parser(argv).parse_args(argv)
        # Long-lived tables are never garbage: keep the cyclic collector off them and rare.
        gc.set_threshold(50_000, 50, 100)
        logs.configure(args.log_format, args.verbose)
        return int(importlib.import_module(COMMANDS[args.command].module).run(args.command, args))
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc.name or "")
        if extra is None:
            raise
        return _clear_exit(chosen, f"{exc.name} is not installed: pip install 'draftcache[{extra}]'")
    except Exception as exc:
        return _known_failure(chosen, exc)


def _known_failure(command: str, exc: Exception) -> int:
    """One clear line for what a user can fix (bad input, files, storage, a service's answer);
    anything else is a bug and keeps its traceback."""
    import grpc

    from cache_service.domain.errors import DraftCacheError
    from cache_service.host.journal import JournalError
    from cache_service.storage.errors import StorageError

    if isinstance(exc, grpc.RpcError):
        print(f"draftcache {command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    if isinstance(exc, ValueError | OSError | DraftCacheError | StorageError | JournalError):
        return _clear_exit(command, exc)
    raise exc


if __name__ == "__main__":
    sys.exit(main())
