"""The server's subcommands: ``serve``, ``warm``, ``migrate``, ``sessions``, ``stats``, ``rebuild``,
``namespaces``.

Configuration dataclasses are built here from the flags and passed whole. Heavy modules (the
server, numba kernels, tokenizers) are imported inside the command that needs them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cache_service.admin.options import (
    TREE_RANK,
    TREE_RANK_HELP,
    TREE_RANKS,
    HelpFormatter,
    add,
    positive,
    seconds,
    share,
)
from cache_service.admin.warm import FORMATS as CORPUS_FORMATS

if TYPE_CHECKING:
    import grpc
    import numpy as np
    from draftcache.v1.draftcache_pb2 import StorageHealth

    from cache_service.storage.redis_store import RedisStore
    from indexer.prior import PriorConfig, StaticPrior

logger = logging.getLogger("draftcache")


def prior_args(p: argparse.ArgumentParser) -> None:
    """The prior's shape: shared by ``warm`` and the tools that warm a prior themselves."""
    add(p, "--orders", default="1,2,3,4", help="leader lengths of the prior's tables")
    add(p, "--follower-len", type=positive, default=8, help="tokens kept after each leader")
    add(p, "--top-k", type=positive, default=4, help="followers kept per leader")
    add(p, "--max-leaders", type=positive, default=1 << 18, help="leaders kept per order (the most frequent)")


def prior_config(a: argparse.Namespace) -> PriorConfig:
    from indexer.prior import PriorConfig

    orders = tuple(int(x) for x in str(a.orders).split(",") if x)
    return PriorConfig(orders=orders, follower_len=a.follower_len, top_k=a.top_k, max_leaders=a.max_leaders)


def storage_args(p: argparse.ArgumentParser) -> None:
    add(
        p,
        "--redis-url",
        default=None,
        help="storage: redis://[user:pass@]host:port/db, rediss:// (TLS, ?ssl_ca_certs=...), "
        "redis+cluster://host:port,host:port, redis+sentinel://host:port/service[/db]; default: the embedded one",
    )
    add(p, "--data-dir", type=Path, default=Path("data"), help="where the embedded Redis keeps its files")


def target_args(p: argparse.ArgumentParser, default: str | None = "127.0.0.1:50051") -> None:
    """How to reach a running service: address, bearer token, TLS."""
    add(p, "--target", default=default, help="host:port of the service")
    add(p, "--token", default=None, help="bearer token, when the service authenticates (--tokens-file)")
    add(p, "--tls-ca", type=Path, default=None, help="PEM root certificate: reach the service over TLS")
    add(
        p, "--timeout", type=seconds, default=None,
        help="seconds to wait for the service's answer, connecting included (default: 30 for stats and "
        "namespaces list, 600 for rebuild and namespaces delete)",
    )  # fmt: skip


def redis_url(a: argparse.Namespace) -> str:
    """``--redis-url``, else the URL the embedded server of ``--data-dir`` published."""
    if a.redis_url:
        return str(a.redis_url)
    published = a.data_dir / "redis" / "url"
    if not published.exists():
        raise ValueError(
            f"no --redis-url and no running embedded Redis in {a.data_dir} (start 'draftcache serve' first)"
        )
    return published.read_text().strip()


def tokenize(corpus: Path, fmt: str, tokenizer: Path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """The corpus's documents as one array (each followed by a separator), and the vocabulary."""
    from tqdm import tqdm

    from cache_service.admin import warm

    encode, vocab = warm.load_tokenizer(tokenizer)
    if vocab_size is not None and vocab_size != vocab:
        raise warm.CorpusError(f"tokenizer {tokenizer} has {vocab} ids but the namespace has {vocab_size}")
    with tqdm(desc=f"tokenizing {corpus.name}", unit=" docs", file=sys.stderr, disable=None) as bar:

        def progress(docs: int, tokens: int) -> None:
            bar.update(docs - bar.n)
            bar.set_postfix(tokens=f"{tokens / 1e6:.1f}M")

        docs = warm.read_corpus(corpus, fmt)
        return warm.tokenize_corpus(docs, encode, vocab, progress=progress, source=str(corpus)), vocab


def warm_prior(
    corpus: Path, fmt: str, tokenizer: Path, config: PriorConfig, *, vocab_size: int | None = None
) -> StaticPrior:
    from cache_service.admin import warm

    start = time.perf_counter()
    tokens, _ = tokenize(corpus, fmt, tokenizer, vocab_size)
    prior = warm.build_prior(tokens, config)
    logger.info(
        "prior: %d corpus tokens -> %.1f MB of tables in %.1f s",
        tokens.size,
        prior.nbytes / 1e6,
        time.perf_counter() - start,
    )
    return prior


def open_store(a: argparse.Namespace) -> RedisStore:
    """The store of ``--redis-url`` (or the embedded one) with the key schema this build serves:
    an empty Redis is initialised as ``serve`` does, any other schema refused before a write."""
    from cache_service.app import connect, prepare_schema
    from cache_service.storage.redis_store import RedisStore

    client = connect(redis_url(a))
    prepare_schema(client)
    return RedisStore(client)


def write_atomic(path: Path, blob: bytes) -> None:
    """Write a file whole or not at all: a crash never leaves a truncated prior behind, and
    writers of the same file at once each replace it whole (each writes its own temporary file,
    on disk before it takes the name; one that fails removes its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:  # os.open, not mkstemp: the file gets the mode the umask gives, as write_bytes did
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _serve_args(p: argparse.ArgumentParser) -> None:
    add(p, "--host", default="127.0.0.1", help="address to listen on")
    add(p, "--port", type=int, default=50051, help="port to listen on (0: any free port)")
    storage_args(p)
    add(p, "--rebuild-interval", type=float, default=30.0, help="seconds between index rebuilds")
    add(p, "--session-ttl", type=float, default=3600.0, help="idle seconds before a session expires")
    add(
        p, "--follow-interval", type=float, default=0.2,
        help="seconds between reads of the lifetime log for other replicas' commits (and replays of journaled ones)",
    )  # fmt: skip
    add(
        p, "--flush-interval", type=float, default=0.5,
        help="seconds between write-backs of session state to storage",
    )  # fmt: skip
    add(p, "--max-batch", type=positive, default=256, help="most sessions in one call (clients split larger batches)")
    add(p, "--max-sessions", type=positive, default=100_000, help="most live sessions in one process")
    add(
        p,
        "--journal-capacity-mb",
        type=positive,
        default=256,
        help="local journal (in --data-dir) of commits storage could not take; when full, commits are refused",
    )
    add(
        p, "--storage-call-timeout", type=float, default=2.0,
        help="seconds a call waits on storage (a commit's append, a stored session, a log or prior page); past "
        "them a commit is journaled",
    )  # fmt: skip
    add(
        p, "--commit-replicas", type=int, default=0,
        help="replicas of the Redis master that must have a commit before it is acknowledged (WAIT); where fewer "
        "confirm in time it is journaled too (0: the master's answer)",
    )  # fmt: skip
    add(
        p, "--ahead-busy-limit", type=share, default=1.0,
        help="skip drafting ahead (pre-speculation) while draft calls took more than this share of the last "
        "second of a process (1: never skip)",
    )  # fmt: skip
    add(p, "--processes", type=positive, default=1, help="server processes sharing the port (one per core)")
    add(p, "--worker-ports", type=int, default=None, help="process i also serves port BASE + i alone")
    add(p, "--draft-threads", type=positive, default=1, help="worker threads one batch's draft step is shared among")
    add(p, "--tree-rank", choices=TREE_RANKS, default=TREE_RANK, help=TREE_RANK_HELP)
    add(p, "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    add(p, "--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    add(p, "--tokens-file", type=Path, default=None, help="bearer tokens of tenants (JSON); default: no auth")
    add(p, "--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS")
    add(p, "--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    add(p, "--tls-client-ca", type=Path, default=None, help="require client certificates from this CA (mTLS)")


def _warm_args(p: argparse.ArgumentParser) -> None:
    add(p, "--namespace", required=True, help="the namespace (one tokenizer) the prior is for")
    add(p, "--tokenizer", type=Path, required=True, help="tokenizer folder (tokenizer.model or tokenizer.json)")
    add(p, "--corpus", type=Path, default=None, help="corpus file (.gz read transparently)")
    add(p, "--from-prior", type=Path, default=None, help="publish this prior file ('warm --out') instead of a corpus")
    add(p, "--format", default="sharegpt", choices=CORPUS_FORMATS, help="corpus format")
    add(p, "--out", type=Path, default=None, help="write a prior file instead of publishing to Redis")
    p.add_argument(
        "--lifetime",
        action="store_true",
        help="append the corpus documents to the namespace's lifetime log (as finished requests) instead",
    )
    storage_args(p)
    prior_args(p)


def _migrate_args(p: argparse.ArgumentParser) -> None:
    storage_args(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be applied")


def _sessions_args(p: argparse.ArgumentParser) -> None:
    storage_args(p)
    add(p, "--match", default="*", help="glob over session ids")
    add(p, "--limit", type=int, default=100, help="most sessions listed")


def _admin_args(p: argparse.ArgumentParser) -> None:
    target_args(p)
    add(p, "--namespace", default="", help="one namespace (default: all)")


def cmd_warm(a: argparse.Namespace) -> int:
    if (a.corpus is None) == (a.from_prior is None):
        raise ValueError("name a --corpus to warm from, or a --from-prior file to publish (one of them)")
    if a.lifetime:
        if a.corpus is None:
            raise ValueError("--lifetime appends a corpus's documents: name it with --corpus")
        return _warm_lifetime(a)
    if a.from_prior is not None:
        if a.out is not None:
            raise ValueError("--from-prior publishes a prior file to Redis; --out writes one (drop one of them)")
        from indexer.prior import read_prior

        prior = read_prior(a.from_prior)
    else:
        prior = warm_prior(a.corpus, a.format, a.tokenizer, prior_config(a))
    blob = prior.to_bytes()
    if a.out is not None:
        write_atomic(a.out, blob)
        where = str(a.out)
    else:  # publish: the namespace is registered with the tokenizer's vocabulary, then the blob
        from cache_service.admin import warm

        vocab = warm.load_tokenizer(a.tokenizer)[1]
        try:  # a prior of another tokenizer would draft ids the namespace's model does not have
            prior.check_vocab(vocab)
        except ValueError as exc:
            raise ValueError(f"prior not published to namespace {a.namespace} (vocab {vocab}): {exc}") from None
        store = open_store(a)
        register(store, a.namespace, vocab, warm.tokenizer_fingerprint(a.tokenizer))
        where = f"Redis, version {store.put_prior(a.namespace, blob)}"
    print(f"namespace {a.namespace}: prior of {prior.source_tokens} tokens, {prior.nbytes / 1e6:.1f} MB -> {where}")
    return 0


def register(store: RedisStore, name: str, vocab: int, fingerprint: str) -> None:
    """Register the namespace with the tokenizer's vocabulary, unless it is registered with a
    size a model pads that tokenizer to (an engine created it: every id of the tokenizer fits);
    another size is refused (``NamespaceConflict``). The tokenizer's ``fingerprint`` is
    registered with it unless another one is, which is refused the same way (another tokenizer
    of the same size)."""
    from cache_service.storage.errors import NamespaceConflict
    from indexer.tokens import one_tokenizer

    registered = store.namespaces().get(name)
    if registered is None or registered < vocab or not one_tokenizer(registered, vocab):
        store.register_namespace(name, vocab)
    claimed = store.claim_tokenizer(name, fingerprint)
    if claimed != fingerprint:
        raise NamespaceConflict(f"namespace {name!r} holds the ids of tokenizer {claimed}, not {fingerprint}")


def _warm_lifetime(a: argparse.Namespace) -> int:
    """Append a corpus's documents to a namespace's lifetime log, as if each were a finished
    request: replicas following the log draft from them (the log keeps its token cap). Each
    document is appended once: run again (after a failure midway, or by mistake), the same corpus
    appends only what the log did not take (for as long as the log remembers its writers)."""
    from cache_service.admin import warm
    from cache_service.storage.errors import StorageError

    if a.out is not None:
        raise warm.CorpusError("--lifetime appends to the log in Redis; it writes no file (drop --out)")
    tokens, vocab = tokenize(a.corpus, a.format, a.tokenizer)
    store = open_store(a)
    register(store, a.namespace, vocab, warm.tokenizer_fingerprint(a.tokenizer))
    docs, writer = warm.split_documents(tokens), warm.corpus_writer(tokens)
    appended = done = 0
    for start in range(0, len(docs), 256):
        commits = [(writer, start + i, doc) for i, doc in enumerate(docs[start : start + 256])]
        try:
            ids = store.append_commits(a.namespace, commits)
        except StorageError as exc:
            raise StorageError(
                f"{exc} ({done} of {len(docs)} documents are in the log; the same command again appends the rest)"
            ) from exc
        appended += sum(i is not None for i in ids)
        done += len(ids)
    entries, held = store.log_size(a.namespace)
    again = f", {len(docs) - appended} were in it already (appended before)" if appended < len(docs) else ""
    print(
        f"namespace {a.namespace}: {appended} documents appended{again}; "
        f"the log holds {entries} requests, {held} tokens"
    )
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import asyncio

    from cache_service.app import AppConfig, serve
    from cache_service.config import EmbeddedRedisConfig, ServerConfig, ServiceConfig
    from cache_service.host.workers import check_ports, serve_processes
    from indexer.drafter import DrafterConfig

    config = AppConfig(
        service=ServiceConfig(
            drafter=DrafterConfig(threads=a.draft_threads, tree_rank=a.tree_rank),
            rebuild_interval_s=a.rebuild_interval,
            follow_interval_s=a.follow_interval,
            flush_interval_s=a.flush_interval,
            session_ttl_s=a.session_ttl,
            max_batch=a.max_batch,
            max_sessions=a.max_sessions,
            journal_capacity_bytes=a.journal_capacity_mb << 20,
            ahead_busy_limit=a.ahead_busy_limit,
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
        journal_dir=a.data_dir / "journal",
        call_timeout_s=a.storage_call_timeout,
        commit_replicas=a.commit_replicas,
        metrics_port=a.metrics_port,
        metrics_host=a.metrics_host,
    )
    if a.processes > 1:
        serve_processes(config, a.processes, worker_ports=a.worker_ports, log_format=a.log_format, verbose=a.verbose)
    else:
        check_ports(config, 1, a.worker_ports)
        asyncio.run(serve(config))
    return 0


def cmd_migrate(a: argparse.Namespace) -> int:
    import migrations
    from cache_service.app import connect

    print(migrations.run_migrate(connect(redis_url(a)), dry_run=a.dry_run))
    return 0


def cmd_sessions(a: argparse.Namespace) -> int:
    import migrations
    from cache_service.app import connect
    from cache_service.storage.redis_store import RedisStore

    client = connect(redis_url(a))
    if migrations.stored_version(client):  # a schema this build does not read is refused (empty: none)
        migrations.check(client)
    store = RedisStore(client)
    ids = store.session_ids(a.match)
    print(f"{len(ids)} sessions in storage")
    for sid in ids[: a.limit]:
        found = store.load_session(sid)
        if found is not None:  # it may expire between the scan and the read
            owner = f"  tenant {found.tenant}" if found.tenant else ""
            print(f"{sid}  {found.namespace}  {found.context.size} tokens ({found.prompt_len} prompt){owner}")
    return 0


def channel(a: argparse.Namespace) -> grpc.Channel:
    """A channel to ``--target``, over TLS when ``--tls-ca`` is given."""
    import grpc

    if a.tls_ca is None:
        return grpc.insecure_channel(a.target)
    return grpc.secure_channel(a.target, grpc.ssl_channel_credentials(root_certificates=a.tls_ca.read_bytes()))


def deadline(a: argparse.Namespace, default: float) -> float:
    """Seconds an admin call may take: ``--timeout``, else the call's own default."""
    return float(a.timeout) if a.timeout is not None else default


def call_metadata(a: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The bearer token as call metadata, as a decoder sends it."""
    return (("authorization", f"Bearer {a.token}"),) if a.token else ()


def cmd_admin(a: argparse.Namespace) -> int:
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    meta = call_metadata(a)
    with channel(a) as ch:
        admin = pb_grpc.AdminStub(ch)
        if a.command == "rebuild":
            infos = admin.Rebuild(
                pb.RebuildRequest(namespace=a.namespace), timeout=deadline(a, 600), metadata=meta
            ).namespaces
        else:
            stats = admin.Stats(pb.StatsRequest(namespace=a.namespace), timeout=deadline(a, 30), metadata=meta)
            print(
                f"sessions {stats.sessions}, drafts {stats.drafts}, commits waiting for storage {stats.pending_writes}"
            )
            if stats.HasField("storage"):
                print(storage_line(stats.storage))
            infos = stats.namespaces
    for i in infos:
        print(
            f"{i.name}: vocab {i.vocab_size}, {i.buffered_tokens} buffered tokens in {i.requests} requests, "
            f"index {i.index_tokens} tokens ({i.last_rebuild_seconds:.2f} s), prior v{i.prior_version}, "
            f"{i.sessions} sessions"
        )
    return 0


def _namespaces_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="list or delete")
    listing = actions.add_parser(
        "list", help="the namespaces the service serves (those the token may use)", formatter_class=HelpFormatter
    )
    delete = actions.add_parser(
        "delete",
        formatter_class=HelpFormatter,
        help="delete a namespace everywhere: its live sessions end without commit, and its lifetime "
        "log, priors and stored sessions leave storage (other replicas drop it when they notice)",
    )
    delete.add_argument("name", help="the namespace")
    for action in (listing, delete):  # the options follow the action: namespaces delete NAME --target ...
        target_args(action)


def cmd_namespaces(a: argparse.Namespace) -> int:
    from draftcache.v1 import draftcache_pb2 as pb
    from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

    meta = call_metadata(a)
    with channel(a) as ch:
        admin = pb_grpc.AdminStub(ch)
        if a.action == "delete":
            done = admin.DeleteNamespace(
                pb.DeleteNamespaceRequest(name=a.name), timeout=deadline(a, 600), metadata=meta
            )
            print(f"namespace {a.name} deleted; {done.sessions_closed} live sessions ended")
            return 0
        for i in admin.Namespaces(pb.NamespacesRequest(), timeout=deadline(a, 30), metadata=meta).namespaces:
            tokenizer = f"  tokenizer {i.tokenizer}" if i.tokenizer else ""
            print(f"{i.name}  vocab {i.vocab_size}{tokenizer}  {i.sessions} sessions  prior v{i.prior_version}")
    return 0


def storage_line(h: StorageHealth) -> str:
    """One line an operator reads first after a fault."""
    state = "available" if h.available else f"UNAVAILABLE for {h.unavailable_seconds:.0f} s"
    line = (
        f"storage {state}{', DISK FULL' if h.disk_full else ''}; journal {h.journaled_commits} commits, "
        f"{h.journal_bytes} of {h.journal_capacity_bytes} bytes; embedded Redis restarts {h.embedded_restarts}"
    )
    line += f"; {h.repeated_commits} repeated commits not logged again" if h.repeated_commits else ""
    return line + (f"; last error: {h.last_error}" if h.last_error else "")


_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": (_serve_args, cmd_serve),
    "warm": (_warm_args, cmd_warm),
    "migrate": (_migrate_args, cmd_migrate),
    "sessions": (_sessions_args, cmd_sessions),
    "stats": (_admin_args, cmd_admin),
    "rebuild": (_admin_args, cmd_admin),
    "namespaces": (_namespaces_args, cmd_namespaces),
}


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    _COMMANDS[name][0](p)


def run(name: str, a: argparse.Namespace) -> int:
    return _COMMANDS[name][1](a)
