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
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from benchmarks import index_bench, replay_bench
from benchmarks.replay import ReplayStats
from benchmarks.traces import read_traces, write_traces
from cache_service import logs
from cache_service.admin import warm
from cache_service.domain.errors import DraftCacheError
from cache_service.storage.errors import StorageError
from indexer.drafter import DrafterConfig, DraftParams
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import Namespace

if TYPE_CHECKING:
    from benchmarks.load_bench import LoadConfig

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


def _storage_args(p: argparse.ArgumentParser) -> None:
    _add(
        p,
        "--redis-url",
        default=None,
        help="storage: redis://[user:pass@]host:port/db, rediss:// (TLS, ?ssl_ca_certs=...), "
        "redis+cluster://host:port,host:port, redis+sentinel://host:port/service[/db]; default: the embedded one",
    )
    _add(p, "--data-dir", type=Path, default=Path("data"), help="where the embedded Redis keeps its files")


def _redis_url(a: argparse.Namespace) -> str:
    """``--redis-url``, else the URL the embedded server of ``--data-dir`` published."""
    if a.redis_url:
        return str(a.redis_url)
    published = a.data_dir / "redis" / "url"
    if not published.exists():
        raise ValueError(
            f"no --redis-url and no running embedded Redis in {a.data_dir} (start 'draftcache serve' first)"
        )
    return published.read_text().strip()


def _prior_config(a: argparse.Namespace) -> PriorConfig:
    orders = tuple(int(x) for x in str(a.orders).split(",") if x)
    return PriorConfig(orders=orders, follower_len=a.follower_len, top_k=a.top_k, max_leaders=a.max_leaders)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftcache", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    _add(parser, "--log-format", default="text", choices=("text", "json"), help="json: one object per line")
    sub = parser.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay traces and report MAT (tokens per verification step)")
    r.add_argument("traces", type=Path)
    _add(r, "--target", default=None, help="host:port of a running service (default: the engine in-process)")
    _add(r, "--budget", type=int, default=64, help="draft tree size in tokens")
    _add(r, "--max-depth", type=int, default=32)
    _add(r, "--min-score", type=float, default=0.0)
    _add(r, "--limit", type=int, default=None, help="replay only the first N conversations")
    r.add_argument("--namespace", default=None, help="replay only this namespace's conversations (default: each)")
    _add(r, "--vocab-size", type=int, default=None, help="default: the tokenizer's, else the traces' max id + 1")
    _add(r, "--baselines", default="", help="comma list: prompt-lookup,suffix-decoding,rest")
    _add(r, "--lookahead", type=int, default=0, help="pre-speculation: outcomes drafted ahead per step")
    _add(r, "--suffix-factor", type=float, default=8.0)
    _add(r, "--suffix-min-prob", type=float, default=0.01)
    _add(r, "--rest-datastore", type=Path, default=None, help="REST's datastore (built from --warm-corpus if missing)")
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
    _add(w, "--out", type=Path, default=None, help="write a prior file instead of publishing to Redis")
    w.add_argument(
        "--lifetime",
        action="store_true",
        help="append the corpus documents to the namespace's lifetime log (as finished requests) instead",
    )
    _storage_args(w)
    _prior_args(w)

    sv = sub.add_parser("serve", help="run the gRPC service (embedded persistent Redis unless --redis-url)")
    _add(sv, "--host", default="127.0.0.1")
    _add(sv, "--port", type=int, default=50051)
    _storage_args(sv)
    _add(sv, "--rebuild-interval", type=float, default=30.0, help="seconds between index rebuilds")
    _add(sv, "--session-ttl", type=float, default=3600.0, help="idle seconds before a session expires")
    _add(sv, "--max-batch", type=int, default=256)
    _add(sv, "--max-sessions", type=int, default=100_000)
    _add(sv, "--processes", type=int, default=1, help="server processes sharing the port (one per core)")
    _add(sv, "--worker-ports", type=int, default=None, help="process i also serves port BASE + i alone")
    _add(sv, "--draft-threads", type=int, default=1, help="worker threads one batch's draft step is shared among")
    _add(sv, "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    _add(sv, "--metrics-host", default="0.0.0.0")
    _add(sv, "--tokens-file", type=Path, default=None, help="bearer tokens of tenants (JSON); default: no auth")
    _add(sv, "--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS")
    _add(sv, "--tls-key", type=Path, default=None)
    _add(sv, "--tls-client-ca", type=Path, default=None, help="require client certificates from this CA (mTLS)")

    m = sub.add_parser("migrate", help="bring the Redis key schema up to date")
    _storage_args(m)
    m.add_argument("--dry-run", action="store_true", help="only say what would be applied")

    ss = sub.add_parser("sessions", help="sessions kept in storage (any replica can continue them)")
    _storage_args(ss)
    _add(ss, "--match", default="*", help="glob over session ids")
    _add(ss, "--limit", type=int, default=100)

    for name, text in (
        ("stats", "namespaces, buffers, indexes and sessions"),
        ("rebuild", "reload priors, rebuild now"),
    ):
        c = sub.add_parser(name, help=text)
        _add(c, "--target", default="127.0.0.1:50051", help="host:port of the service")
        _add(c, "--namespace", default="", help="one namespace (default: all)")

    g = sub.add_parser("generate", help="speculative greedy decoding of one prompt with a real model")
    _add(g, "--prompt", required=_env("prompt") is None)
    _add(g, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    _add(g, "--tokenizer", type=Path, default=Path("../shared/data/tokenizers/smollm2"))
    _add(g, "--target", default=None, help="draft through this service (default: the engine in-process)")
    _add(g, "--max-new-tokens", type=int, default=128)
    _add(g, "--budget", type=int, default=64, help="most draft tokens per tree")
    g.add_argument("--no-cost-aware", action="store_true", help="verify whole trees, whatever they cost")

    rb = sub.add_parser("bench-rpc", help="draft round trip over the stream vs an echo of the same size")
    rb.add_argument("traces", type=Path, help="prompts come from these conversations")
    _add(rb, "--target", default="127.0.0.1:50051")
    _add(rb, "--tokenizer", type=Path, default=None, help="tokenizer of the traces' namespace (its vocabulary)")
    _add(rb, "--steps", type=int, default=2000)
    _add(rb, "--batch", type=int, default=32)
    rb.add_argument("--during-rebuild", action="store_true", help="measure again while indexes rebuild back to back")

    bl = sub.add_parser("bench-load", help="decoder processes stepping batches of real traces against the service")
    bl.add_argument("traces", type=Path, help="requests come from these conversations")
    _add(
        bl,
        "--format",
        default="trace",
        choices=("trace", "sharegpt"),
        help="sharegpt: a ShareGPT corpus, its first --conversations tokenized as requests never seen before",
    )
    _add(bl, "--conversations", type=int, default=4000, help="ShareGPT conversations taken (--format sharegpt)")
    bl.add_argument("--target", action="append", help="a replica (repeat for several; default 127.0.0.1:50051)")
    _add(bl, "--tokenizer", type=Path, default=None, help="tokenizer of the traces' namespace (its vocabulary)")
    _add(bl, "--decoders", type=int, default=8)
    _add(bl, "--batch", type=int, default=32)
    _add(bl, "--seconds", type=float, default=30.0)
    _add(bl, "--step-ms", type=float, default=0.0, help="the target's verification time per step (0: back to back)")
    _add(bl, "--deadline-ms", type=float, default=50.0, help="client deadline; past it the fallback drafts")
    _add(bl, "--budget", type=int, default=64)
    _add(bl, "--passes", type=int, default=1, help="times each decoder replays its share of the requests (0: no end)")
    _add(bl, "--lookahead", type=int, default=0, help="pre-speculation: outcomes drafted ahead per step")
    _add(bl, "--timeline", type=float, default=0.0, help="also report each window of this many seconds")
    bl.add_argument("--unary", action="store_true", help="one unary call per draft instead of the stream")
    bl.add_argument("--watch-pid", type=int, action="append", default=[], help="sample this process's memory and CPU")

    bd = sub.add_parser("bench-draft", help="the draft path in process: time per sequence-draft, trees' digest")
    bd.add_argument("traces", type=Path, help="requests come from these conversations")
    _add(bd, "--tokenizer", type=Path, default=None, help="tokenizer of the traces' namespace (its vocabulary)")
    _add(bd, "--batch", type=int, default=32)
    _add(bd, "--steps", type=int, default=1200)
    _add(bd, "--rebuild-every", type=int, default=300, help="steps between lifetime index rebuilds (0: never)")
    _add(bd, "--budget", type=int, default=64)
    _add(bd, "--draft-threads", type=int, default=1, help="worker threads one batch's draft step is shared among")
    _add(bd, "--prior", type=Path, default=None, help="a static prior to draft from too (a `warm --out` file)")
    _add(bd, "--lookahead", type=int, default=0, help="pre-speculation: outcomes drafted ahead per step")
    _add(bd, "--step-ms", type=float, default=0.0, help="idle time between steps (the target's verification)")

    bg = sub.add_parser("bench-generate", help="tokens/s of real decoding: greedy vs prompt lookup vs draftcache")
    data = Path("../shared/data")
    _add(bg, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    _add(bg, "--tokenizer", type=Path, default=data / "tokenizers/smollm2")
    _add(bg, "--spec-bench", type=Path, default=data / "traces/spec_bench_vicuna7b.jsonl.gz")
    _add(bg, "--llama-tokenizer", type=Path, default=data / "tokenizers/llama2-spm", help="the Spec-Bench ids'")
    _add(bg, "--agentic-traces", type=Path, default=data / "traces/swe_agent_dev.jsonl.gz")
    _add(bg, "--per-category", type=int, default=3, help="Spec-Bench prompts per task group")
    _add(bg, "--max-new-tokens", type=int, default=128)
    _add(bg, "--agentic-families", type=int, default=3, help="agent tasks, each asked --agentic-repeats times")
    _add(bg, "--agentic-repeats", type=int, default=3)
    _add(bg, "--rounds", type=int, default=2, help="runs of every method on every prompt; the fastest counts")
    _add(bg, "--agentic-prompt-tokens", type=int, default=512, help="an agent task's user turn is cut to this")
    _add(bg, "--budget", type=int, default=64, help="most draft tokens per tree before cutting")
    _add(bg, "--prior", type=Path, default=Path("data/prior-smollm2.npz"), help="static prior, used if present")
    bg.add_argument("--json", action="store_true")

    b = sub.add_parser("bench-index", help="rebuild time, lookup latency and bytes per token at a buffer size")
    _add(b, "--corpus", type=Path, required=_env("corpus") is None, help="real text to fill the buffer with")
    _add(b, "--format", default="sharegpt", choices=warm.FORMATS)
    _add(b, "--tokenizer", type=Path, required=_env("tokenizer") is None)
    _add(b, "--tokens", type=int, default=10_000_000, help="buffer size in tokens")
    _add(b, "--queries", type=int, default=20_000)
    _add(b, "--delta", type=int, default=1 << 16, help="new tokens per timed extending rebuild, the buffer full")
    _add(b, "--rounds", type=int, default=5, help="extending rebuilds timed beside sorting afresh (0: none)")
    b.add_argument("--json", action="store_true")
    return parser


def _tokenize(corpus: Path, fmt: str, tokenizer: Path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """The corpus's documents as one array (each followed by a separator), and the vocabulary."""
    from tqdm import tqdm

    encode, vocab = warm.load_tokenizer(tokenizer)
    if vocab_size is not None and vocab_size != vocab:
        raise warm.CorpusError(f"tokenizer {tokenizer} has {vocab} ids but the namespace has {vocab_size}")
    with tqdm(desc=f"tokenizing {corpus.name}", unit=" docs", file=sys.stderr, disable=None) as bar:

        def progress(docs: int, tokens: int) -> None:
            bar.update(docs - bar.n)
            bar.set_postfix(tokens=f"{tokens / 1e6:.1f}M")

        return warm.tokenize_corpus(warm.read_corpus(corpus, fmt), encode, vocab, progress=progress), vocab


def _warm_prior(
    corpus: Path, fmt: str, tokenizer: Path, config: PriorConfig, *, vocab_size: int | None = None
) -> StaticPrior:
    start = time.perf_counter()
    tokens, _ = _tokenize(corpus, fmt, tokenizer, vocab_size)
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
    if a.lifetime:
        return _warm_lifetime(a)
    prior = _warm_prior(a.corpus, a.format, a.tokenizer, _prior_config(a))
    blob = prior.to_bytes()
    if a.out is not None:
        _write_atomic(a.out, blob)
        where = str(a.out)
    else:  # publish: the namespace is registered with the tokenizer's vocabulary, then the blob
        from cache_service.app import connect
        from cache_service.storage.redis_store import RedisStore

        store = RedisStore(connect(_redis_url(a)))
        store.register_namespace(a.namespace, warm.load_tokenizer(a.tokenizer)[1])
        where = f"Redis, version {store.put_prior(a.namespace, blob)}"
    print(f"namespace {a.namespace}: prior of {prior.source_tokens} tokens, {prior.nbytes / 1e6:.1f} MB -> {where}")
    return 0


def _warm_lifetime(a: argparse.Namespace) -> int:
    """Append a corpus's documents to a namespace's lifetime log, as if each were a finished
    request: replicas following the log draft from them (the log keeps its token cap)."""
    from cache_service.app import connect
    from cache_service.storage.redis_store import RedisStore

    if a.out is not None:
        raise warm.CorpusError("--lifetime appends to the log in Redis; it writes no file (drop --out)")
    tokens, vocab = _tokenize(a.corpus, a.format, a.tokenizer)
    store = RedisStore(connect(_redis_url(a)))
    store.register_namespace(a.namespace, vocab)
    docs = index_bench.split_documents(tokens)
    for start in range(0, len(docs), 256):
        store.append_requests(a.namespace, docs[start : start + 256])
    entries, held = store.log_size(a.namespace)
    print(f"namespace {a.namespace}: {len(docs)} documents appended; the log holds {entries} requests, {held} tokens")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import asyncio

    from cache_service.app import AppConfig, serve
    from cache_service.config import EmbeddedRedisConfig, ServerConfig, ServiceConfig

    config = AppConfig(
        service=ServiceConfig(
            drafter=DrafterConfig(threads=a.draft_threads),
            rebuild_interval_s=a.rebuild_interval,
            session_ttl_s=a.session_ttl,
            max_batch=a.max_batch,
            max_sessions=a.max_sessions,
        ),
        server=ServerConfig(
            host=a.host,
            port=a.port,
            own_port=a.worker_ports if a.processes == 1 else None,  # workers: worker_config's
            tokens_file=a.tokens_file,
            tls_cert_file=a.tls_cert,
            tls_key_file=a.tls_key,
            tls_client_ca_file=a.tls_client_ca,
        ),
        redis_url=a.redis_url,
        embedded=EmbeddedRedisConfig(data_dir=a.data_dir / "redis"),
        metrics_port=a.metrics_port,
        metrics_host=a.metrics_host,
    )
    from cache_service.host.workers import check_ports, serve_processes

    if a.processes > 1:
        serve_processes(config, a.processes, worker_ports=a.worker_ports, log_format=a.log_format, verbose=a.verbose)
    else:
        check_ports(config, 1, a.worker_ports)
        asyncio.run(serve(config))
    return 0


def cmd_migrate(a: argparse.Namespace) -> int:
    import migrations
    from cache_service.app import connect

    print(migrations.run_migrate(connect(_redis_url(a)), dry_run=a.dry_run))
    return 0


def cmd_sessions(a: argparse.Namespace) -> int:
    from cache_service.app import connect
    from cache_service.storage.redis_store import RedisStore

    store = RedisStore(connect(_redis_url(a)))
    ids = store.session_ids(a.match)
    print(f"{len(ids)} sessions in storage")
    for sid in ids[: a.limit]:
        found = store.load_session(sid)
        if found is not None:  # it may expire between the scan and the read
            state = found.state
            print(f"{sid}  {state.namespace}  {state.context.size} tokens ({state.prompt_len} prompt)")
    return 0


def cmd_admin(a: argparse.Namespace) -> int:
    import grpc
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(a.target) as channel:
        admin = pb_grpc.AdminStub(channel)
        if a.command == "rebuild":
            infos = admin.Rebuild(pb.RebuildRequest(namespace=a.namespace), timeout=600).namespaces
        else:
            stats = admin.Stats(pb.StatsRequest(namespace=a.namespace), timeout=30)
            print(
                f"sessions {stats.sessions}, drafts {stats.drafts}, commits waiting for storage {stats.pending_writes}"
            )
            infos = stats.namespaces
    for i in infos:
        print(
            f"{i.name}: vocab {i.vocab_size}, {i.buffered_tokens} buffered tokens in {i.requests} requests, "
            f"index {i.index_tokens} tokens ({i.last_rebuild_seconds:.2f} s), prior v{i.prior_version}, "
            f"{i.sessions} sessions"
        )
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


def _ensure_rest_datastore(a: argparse.Namespace) -> None:
    """Build REST's datastore from the warming corpus unless the file is there already."""
    path = a.rest_datastore
    if path is None or path.exists():
        return
    if a.warm_corpus is None or a.tokenizer is None:
        raise ValueError(f"{path} does not exist; --warm-corpus and --tokenizer build it")
    logger.info("building REST's datastore %s from %s", path, a.warm_corpus)
    tokens = replay_bench.build_rest_datastore(a.warm_corpus, a.corpus_format, a.tokenizer, path)
    logger.info("REST's datastore: %d tokens", tokens)


def cmd_replay(a: argparse.Namespace) -> int:
    config = replay_bench.ReplayConfig(
        params=DraftParams(budget=a.budget, max_depth=a.max_depth, min_score=a.min_score),
        drafter=DrafterConfig(),
        baselines=tuple(b for b in str(a.baselines).split(",") if b),
        suffix_factor=a.suffix_factor,
        suffix_min_prob=a.suffix_min_prob,
        rest_datastore=a.rest_datastore,
        lookahead=a.lookahead,
    )
    conversations = read_traces(a.traces, limit=a.limit)
    if a.namespace is not None:
        held = sorted({c.namespace for c in conversations})
        conversations = [c for c in conversations if c.namespace == a.namespace]
        if not conversations:
            raise ValueError(f"{a.traces}: no conversations in namespace {a.namespace!r} (the traces hold {held})")
    if not conversations:
        raise ValueError(f"{a.traces}: no conversations")
    names = list(dict.fromkeys(c.namespace for c in conversations))
    one_tokenizer = [flag for flag, on in _TOKENIZER_BOUND.items() if on(a, config)]
    if len(names) > 1 and one_tokenizer:
        raise ValueError(
            f"{', '.join(one_tokenizer)}: for one namespace's tokenizer, and the traces hold {names}; "
            "pick one with --namespace"
        )
    vocab = a.vocab_size
    if vocab is None and a.tokenizer is not None:
        vocab = warm.load_tokenizer(a.tokenizer)[1]
    groups = replay_bench.by_namespace(conversations, vocab)
    if "rest" in config.baselines:
        _ensure_rest_datastore(a)
    if a.target:
        config = replace(config, include_engine=False)
    gc.freeze()
    per_namespace = []
    for namespace, part in groups:  # namespaces share nothing: each has drafters of its own
        # Through a service, its own priors apply (warmed into its storage); in-process, ours.
        prior = None if a.target else _replay_prior(a, namespace.vocab_size)
        drafter_list = (
            [replay_bench.remote_drafter(a.target, namespace, config.params, config.lookahead)] if a.target else []
        )
        drafter_list += replay_bench.drafters(namespace, config, prior)
        per_namespace.append((namespace.name, replay_bench.run_replay(part, drafter_list)))
    if len(per_namespace) == 1:
        print(replay_bench.report(per_namespace[0][1], a.traces, as_json=a.json))
        return 0
    merged = [ReplayStats.merged(stats) for stats in zip(*(results for _, results in per_namespace), strict=True)]
    print(replay_bench.report(merged, a.traces, as_json=a.json, by_namespace=per_namespace))
    return 0


# Replay options that hold for one namespace's tokenizer only.
_TOKENIZER_BOUND: dict[str, Callable[[argparse.Namespace, replay_bench.ReplayConfig], bool]] = {
    "--tokenizer": lambda a, _: a.tokenizer is not None,
    "--vocab-size": lambda a, _: a.vocab_size is not None,
    "--prior": lambda a, _: a.prior is not None,
    "--warm-corpus": lambda a, _: a.warm_corpus is not None,
    "the rest baseline": lambda _, config: "rest" in config.baselines,
}


def cmd_bench_index(a: argparse.Namespace) -> int:
    import json

    encode, vocab = warm.load_tokenizer(a.tokenizer)
    tokens = warm.tokenize_corpus(warm.read_corpus(a.corpus, a.format), encode, vocab)
    config = index_bench.IndexBenchConfig(
        buffer_tokens=a.tokens, queries=a.queries, delta_tokens=a.delta, rounds=a.rounds
    )
    result = index_bench.run_index_bench(tokens, config)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<28}{value}")
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from benchmarks.generate import InProcessDrafter, ServiceDrafter, run_generate
    from decoder_client.client import ClientConfig
    from decoder_client.models import load_model

    model, tokenizer = load_model(a.model, a.tokenizer)
    params = DraftParams(budget=a.budget)
    vocab = len(tokenizer)
    drafter: InProcessDrafter | ServiceDrafter
    if a.target:
        replay_bench.ensure_namespace(a.target, Namespace(name="generate", vocab_size=vocab))
        drafter = ServiceDrafter(ClientConfig(target=a.target, namespace="generate", params=params))
    else:
        drafter = InProcessDrafter(vocab, params)
    result = run_generate(
        model, tokenizer, a.prompt, drafter, max_new_tokens=a.max_new_tokens, cost_aware=not a.no_cost_aware
    )
    if isinstance(drafter, ServiceDrafter):
        drafter.finish()
    print(result["text"])
    print()
    for name in ("vanilla", "transformers-prompt-lookup", "draftcache"):
        print(f"{name:<28}{result[name]['tokens_per_s']:>8.2f} tokens/s")
    ours = result["draftcache"]
    print(
        f"MAT {ours['mat']}, accepted draft tokens by tier {ours['accepted_by_tier']}, identical {result['identical']}"
    )
    return 0 if result["identical"] else 1


def cmd_bench_generate(a: argparse.Namespace) -> int:
    from benchmarks.generate_bench import BenchConfig, report, run_bench
    from decoder_client.models import load_model

    config = BenchConfig(
        spec_bench=a.spec_bench,
        agentic=a.agentic_traces,
        llama_tokenizer=a.llama_tokenizer,
        per_category=a.per_category,
        max_new_tokens=a.max_new_tokens,
        agentic_families=a.agentic_families,
        agentic_repeats=a.agentic_repeats,
        rounds=a.rounds,
        agentic_prompt_tokens=a.agentic_prompt_tokens,
        budget=a.budget,
    )
    prior = StaticPrior.from_bytes(a.prior.read_bytes()) if a.prior is not None and a.prior.is_file() else None
    model, tokenizer = load_model(a.model, a.tokenizer)
    result = run_bench(model, tokenizer, config, prior)
    print(report(result, as_json=a.json))
    return 0 if result["lossless"] else 1


def cmd_bench_rpc(a: argparse.Namespace) -> int:
    import json

    from benchmarks.rpc_bench import run_rpc_bench

    conversations = read_traces(a.traces, limit=max(a.batch, 1))
    vocab = warm.load_tokenizer(a.tokenizer)[1] if a.tokenizer is not None else None
    namespace = replay_bench.namespace_of(conversations, vocab)
    replay_bench.ensure_namespace(a.target, namespace)
    result = run_rpc_bench(
        a.target, namespace.name, conversations, steps=a.steps, batch=a.batch, during_rebuild=a.during_rebuild
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_bench_draft(a: argparse.Namespace) -> int:
    import json

    from benchmarks.draft_bench import DraftBenchConfig, run_draft_bench

    conversations = read_traces(a.traces)
    vocab = warm.load_tokenizer(a.tokenizer)[1] if a.tokenizer is not None else None
    config = DraftBenchConfig(
        batch=a.batch,
        steps=a.steps,
        rebuild_every=a.rebuild_every,
        lookahead=a.lookahead,
        step_interval_s=a.step_ms / 1e3,
        params=DraftParams(budget=a.budget),
        drafter=DrafterConfig(threads=a.draft_threads),
    )
    prior = StaticPrior.from_bytes(a.prior.read_bytes()) if a.prior is not None else None
    namespace = replay_bench.namespace_of(conversations, vocab)
    print(json.dumps(run_draft_bench(conversations, namespace, config, prior), indent=2))
    return 0


def cmd_bench_load(a: argparse.Namespace) -> int:
    import json

    from benchmarks.load_bench import run_load

    targets = tuple(a.target or ["127.0.0.1:50051"])
    encode, vocab = warm.load_tokenizer(a.tokenizer) if a.tokenizer is not None else (None, None)
    with tempfile.TemporaryDirectory(prefix="draftcache-load-") as tmp:
        traces = a.traces
        if a.format == "sharegpt":  # tokenized once here; the decoders read it as traces
            if encode is None or vocab is None:
                raise SystemExit("bench-load --format sharegpt needs --tokenizer")
            name = "".join(c if c.isalnum() or c in "-_." else "-" for c in a.tokenizer.resolve().name)
            found = warm.sharegpt_conversations(a.traces, encode, vocab, namespace=name, limit=a.conversations)
            traces = Path(tmp) / "sharegpt.jsonl"
            write_traces(found, traces)
        conversations = read_traces(traces)
        namespace = replay_bench.namespace_of(conversations, vocab)
        for target in targets:
            replay_bench.ensure_namespace(target, namespace)
        report = run_load(_load_config(a, targets, namespace.name, traces))
    print(json.dumps(report, indent=2))
    return 0


def _load_config(a: argparse.Namespace, targets: tuple[str, ...], namespace: str, traces: Path) -> LoadConfig:
    from benchmarks.load_bench import LoadConfig

    return LoadConfig(
        targets=targets,
        namespace=namespace,
        traces=traces,
        decoders=a.decoders,
        batch=a.batch,
        seconds=a.seconds,
        step_interval_s=a.step_ms / 1e3,
        deadline_s=a.deadline_ms / 1e3,
        params=DraftParams(budget=a.budget),
        watch_pids=tuple(a.watch_pid),
        passes=a.passes,
        lookahead=a.lookahead,
        timeline_s=a.timeline,
        stream=not a.unary,
    )


COMMANDS = {
    "replay": cmd_replay,
    "warm": cmd_warm,
    "serve": cmd_serve,
    "migrate": cmd_migrate,
    "sessions": cmd_sessions,
    "stats": cmd_admin,
    "rebuild": cmd_admin,
    "bench-index": cmd_bench_index,
    "bench-rpc": cmd_bench_rpc,
    "bench-load": cmd_bench_load,
    "bench-draft": cmd_bench_draft,
    "bench-generate": cmd_bench_generate,
    "generate": cmd_generate,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Long-lived tables are never garbage: keep the cyclic collector off them and rare.
    gc.set_threshold(50_000, 50, 100)
    logs.configure(args.log_format, args.verbose)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError, DraftCacheError, StorageError) as exc:  # one clear line, no traceback
        print(f"draftcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"draftcache {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
