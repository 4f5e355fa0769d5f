"""The ``draftcache`` command: one entry point, one subcommand per job.

Every flag can also come from a ``DRAFTCACHE_<FLAG>`` environment variable (``--budget`` from
``DRAFTCACHE_BUDGET``); flags win. Configuration dataclasses are built here and passed whole.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from cache_service import index_bench, replay_bench, warm
from decoder_client.traces import read_traces
from indexer.drafter import DrafterConfig, DraftParams
from indexer.prior import PriorConfig, StaticPrior

logger = logging.getLogger("draftcache")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("DRAFTCACHE_" + name.upper().replace("-", "_"), default)


def _add(p: argparse.ArgumentParser, flag: str, **kw: object) -> None:
    """An option whose default comes from the environment when set there."""
    name = flag.lstrip("-")
    env = _env(name)
    if env is not None:
        kw["default"] = kw["type"](env) if "type" in kw else env  # type: ignore[operator]
    p.add_argument(flag, **kw)  # type: ignore[arg-type]


def _prior_args(p: argparse.ArgumentParser) -> None:
    _add(p, "--orders", default="1,2,3,4", help="leader lengths of the prior's tables")
    _add(p, "--follower-len", type=int, default=8)
    _add(p, "--top-k", type=int, default=4)
    _add(p, "--max-leaders", type=int, default=1 << 18, help="per order")


def _prior_config(a: argparse.Namespace) -> PriorConfig:
    orders = tuple(int(x) for x in str(a.orders).split(",") if x)
    return PriorConfig(orders=orders, follower_len=a.follower_len, top_k=a.top_k, max_leaders=a.max_leaders)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftcache", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay traces and report MAT (tokens per verification step)")
    r.add_argument("traces", type=Path)
    _add(r, "--target", default=None, help="host:port of a running service (default: the engine in-process)")
    _add(r, "--budget", type=int, default=64, help="draft tree size in tokens")
    _add(r, "--max-depth", type=int, default=32)
    _add(r, "--min-score", type=float, default=0.0)
    _add(r, "--limit", type=int, default=None, help="replay only the first N conversations")
    _add(r, "--vocab-size", type=int, default=None, help="default: the tokenizer's, else the traces' max id + 1")
    _add(r, "--baselines", default="", help="comma list: prompt-lookup,suffix-decoding")
    _add(r, "--suffix-factor", type=float, default=8.0)
    _add(r, "--suffix-min-prob", type=float, default=0.01)
    _add(r, "--prior", type=Path, default=None, help="a prior file written by 'draftcache warm'")
    _add(r, "--warm-corpus", type=Path, default=None, help="warm a prior from this corpus first")
    _add(r, "--corpus-format", default="sharegpt", choices=warm.FORMATS)
    _add(r, "--tokenizer", type=Path, default=None, help="tokenizer folder of the traces' namespace")
    _add(r, "--prior-cache", type=Path, default=None, help="reuse / store the warmed prior here")
    _prior_args(r)
    r.add_argument("--json", action="store_true", help="machine-readable output")

    w = sub.add_parser("warm", help="build a static prior from a corpus")
    _add(w, "--namespace", required=_env("namespace") is None)
    _add(w, "--tokenizer", type=Path, required=_env("tokenizer") is None)
    _add(w, "--corpus", type=Path, required=_env("corpus") is None)
    _add(w, "--format", default="sharegpt", choices=warm.FORMATS)
    _add(w, "--out", type=Path, required=_env("out") is None, help="prior file to write")
    _prior_args(w)

    b = sub.add_parser("bench-index", help="rebuild time, lookup latency and bytes per token at a buffer size")
    _add(b, "--corpus", type=Path, required=_env("corpus") is None, help="real text to fill the buffer with")
    _add(b, "--format", default="sharegpt", choices=warm.FORMATS)
    _add(b, "--tokenizer", type=Path, required=_env("tokenizer") is None)
    _add(b, "--tokens", type=int, default=10_000_000, help="buffer size in tokens")
    _add(b, "--queries", type=int, default=20_000)
    b.add_argument("--json", action="store_true")
    return parser


def _warm_prior(
    corpus: Path, fmt: str, tokenizer: Path, config: PriorConfig, *, vocab_size: int | None = None
) -> StaticPrior:
    from tqdm import tqdm

    encode, vocab = warm.load_tokenizer(tokenizer)
    if vocab_size is not None and vocab_size != vocab:
        raise warm.CorpusError(f"tokenizer {tokenizer} has {vocab} ids but the namespace has {vocab_size}")
    start = time.perf_counter()
    with tqdm(desc=f"tokenizing {corpus.name}", unit=" docs", file=sys.stderr, disable=None) as bar:

        def progress(docs: int, tokens: int) -> None:
            bar.update(docs - bar.n)
            bar.set_postfix(tokens=f"{tokens / 1e6:.1f}M")

        tokens = warm.tokenize_corpus(warm.read_corpus(corpus, fmt), encode, vocab, progress=progress)
    prior = warm.build_prior(tokens, config)
    logger.info(
        "prior: %d corpus tokens -> %.1f MB of tables in %.1f s",
        tokens.size,
        prior.nbytes / 1e6,
        time.perf_counter() - start,
    )
    return prior


def _write_atomic(path: Path, blob: bytes) -> None:
    """Write a file whole or not at all: a crash never leaves a truncated prior behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def cmd_warm(a: argparse.Namespace) -> int:
    prior = _warm_prior(a.corpus, a.format, a.tokenizer, _prior_config(a))
    _write_atomic(a.out, prior.to_bytes())
    print(f"namespace {a.namespace}: prior of {prior.source_tokens} tokens, {prior.nbytes / 1e6:.1f} MB -> {a.out}")
    return 0


def _replay_prior(a: argparse.Namespace, vocab_size: int) -> StaticPrior | None:
    if a.prior is not None:
        return StaticPrior.from_bytes(a.prior.read_bytes())
    if a.warm_corpus is None:
        return None
    if a.prior_cache is not None and a.prior_cache.exists():
        logger.info("using cached prior %s", a.prior_cache)
        return StaticPrior.from_bytes(a.prior_cache.read_bytes())
    if a.tokenizer is None:
        raise ValueError("--warm-corpus needs --tokenizer (the traces' tokenizer)")
    prior = _warm_prior(a.warm_corpus, a.corpus_format, a.tokenizer, _prior_config(a), vocab_size=vocab_size)
    if a.prior_cache is not None:
        _write_atomic(a.prior_cache, prior.to_bytes())
    return prior


def cmd_replay(a: argparse.Namespace) -> int:
    config = replay_bench.ReplayConfig(
        params=DraftParams(budget=a.budget, max_depth=a.max_depth, min_score=a.min_score),
        drafter=DrafterConfig(),
        baselines=tuple(b for b in str(a.baselines).split(",") if b),
        suffix_factor=a.suffix_factor,
        suffix_min_prob=a.suffix_min_prob,
    )
    conversations = read_traces(a.traces, limit=a.limit)
    if not conversations:
        raise ValueError(f"{a.traces}: no conversations")
    vocab = a.vocab_size
    if vocab is None and a.tokenizer is not None:
        vocab = warm.load_tokenizer(a.tokenizer)[1]
    namespace = replay_bench.namespace_of(conversations, vocab)
    # Through a service, its own priors apply (warmed into its storage); in-process, ours.
    prior = None if a.target else _replay_prior(a, namespace.vocab_size)
    gc.freeze()
    drafter_list = [replay_bench.remote_drafter(a.target, namespace, config.params)] if a.target else []
    if a.target:
        config = replace(config, include_engine=False)
    drafter_list += replay_bench.drafters(namespace, config, prior)
    results = replay_bench.run_replay(conversations, drafter_list)
    print(replay_bench.report(results, a.traces, as_json=a.json))
    return 0


def cmd_bench_index(a: argparse.Namespace) -> int:
    import json

    encode, vocab = warm.load_tokenizer(a.tokenizer)
    tokens = warm.tokenize_corpus(warm.read_corpus(a.corpus, a.format), encode, vocab)
    config = index_bench.IndexBenchConfig(buffer_tokens=a.tokens, queries=a.queries)
    result = index_bench.run_index_bench(tokens, config)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<24}{value}")
    return 0


COMMANDS = {"replay": cmd_replay, "warm": cmd_warm, "bench-index": cmd_bench_index}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Long-lived tables are never garbage: keep the cyclic collector off them and rare.
    gc.set_threshold(50_000, 50, 100)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError) as exc:  # bad input: one clear line, no traceback
        print(f"draftcache {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
