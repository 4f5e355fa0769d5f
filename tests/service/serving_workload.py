"""Serving and decoding in a fresh interpreter, reporting every compiled loop built or loaded
after start-up.

``python -m tests.service.serving_workload server REDIS_URL TRACES TOKENIZER PRIOR_FILE
SHARED_DIR``: three service replicas start on the given Redis (each warms up as ``serve`` does), the third
serving lifetime indexes memory-mapped from ``SHARED_DIR``. From then on
every compilation numba starts and every signature a project kernel adds is recorded, while:
decoders step batches through the stream and through unary calls (pre-speculation, feedback
with rejected branches, requests finishing and committing), a prior is published and picked
up, the lifetime memory is rebuilt, sessions are written back, and a session moves to the
other replica.

``python -m tests.service.serving_workload client TARGET``: a decoder's client is made, then
steps sequences through the service at ``TARGET`` (pre-speculating, on the stream and on unary
calls), and through one that is down (the fallback drafts).

Either prints one JSON object: ``{"compiled": [...], "loaded": [...]}``. Start-up compiles;
serving and decoding must not: a compile holds the interpreter lock for seconds, so every call
on the event loop waits (and decoders fall back), or the decoder's step does.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import numba
from draftcache.v1 import draftcache_pb2 as pb

import indexer.kernels
from cache_service.app import warm_up
from cache_service.config import ServiceConfig
from cache_service.host.compiles import CompileWatch
from cache_service.host.shared_indexes import warm_mapped
from tests.service.conftest import Replica, eventually

WAIT_S = 30.0  # for write-back, following and prior polling, with decoders' processes beside
WIRE = {"server": "cache_service.rpc.wire", "client": "decoder_client.wire"}


def project_dispatchers(side: str) -> dict[str, Any]:
    """Every compiled function one side's modules define (its wire format and the kernels),
    by qualified name."""
    modules = [importlib.import_module(WIRE[side])]
    kernels = pkgutil.iter_modules(indexer.kernels.__path__)
    modules += [importlib.import_module(f"indexer.kernels.{m.name}") for m in kernels]
    out = {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, numba.core.dispatcher.Dispatcher) and value.__module__ == module.__name__:
                out[f"{module.__name__}.{name}"] = value
    return out


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cache_service.cli", *args], check=True, capture_output=True, timeout=300)


class Watch:
    """Compilations started and signatures added, from now on, on one side."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.before = {name: set(d.signatures) for name, d in project_dispatchers(side).items()}
        self.compiles = CompileWatch()
        self.compiles.start()

    def report(self) -> dict[str, list[str]]:
        self.compiles.stop()
        loaded = [
            f"{name}{sig}"
            for name, d in project_dispatchers(self.side).items()
            for sig in set(d.signatures) - self.before.get(name, set())
        ]
        return {"compiled": self.compiles.compiled, "loaded": sorted(loaded)}


def server(url: str, traces: str, tokenizer: str, prior_file: str, shared_dir: str) -> dict[str, list[str]]:
    # As each replica's start does, here first: a cold compile outlasts a start's timeout, and
    # one in the third's start would be a compile while the first two serve.
    warm_up()
    warm_mapped(ServiceConfig().drafter.lifetime)
    replicas: list[Replica] = []
    try:
        a, b = Replica(url), Replica(url)
        replicas += [a, b]
        c = Replica(url, lifetime_dir=Path(shared_dir))  # serving memory-mapped lifetime indexes
        replicas.append(c)
        watch = Watch("server")  # what each replica's own watch sees, all three together
        load = ("bench-load", traces, "--tokenizer", tokenizer, "--decoders", "2", "--batch", "8", "--passes", "0")
        target = f"127.0.0.1:{a.app.server.port}"
        _cli(*load, "--target", target, "--seconds", "4", "--lookahead", "2")
        _cli(*load, "--target", target, "--seconds", "2", "--unary")
        c_target = f"127.0.0.1:{c.app.server.port}"
        c.admin.Rebuild(pb.RebuildRequest())  # publishes a generation of what a committed
        _cli(*load, "--target", c_target, "--seconds", "2")
        (ns,) = [n.name for n in a.admin.Namespaces(pb.NamespacesRequest()).namespaces]
        store = a.app.persistence.store
        version = store.put_prior(ns, Path(prior_file).read_bytes())
        eventually(lambda: a.admin.Stats(pb.StatsRequest(namespace=ns)).namespaces[0].prior_version == version, WAIT_S)
        a.admin.Rebuild(pb.RebuildRequest(namespace=ns))
        # A session drafted from the prior and the rebuilt memory, with a rejected branch,
        # written back, then continued on the other replica.
        opened = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace=ns, prompt=[1, 450, 4996, 17354, 1701])])
        sid = a.stub.OpenSessions(opened).session_ids[0]
        tree = a.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[])])).trees[0]
        rejected = [pb.RejectedBranch(tokens=[int(tree.tokens[0]) if tree.tokens else 29871])]
        feedback = pb.FeedbackItem(session_id=sid, accepted=[13], rejected=rejected)
        a.stub.Feedback(pb.FeedbackRequest(items=[feedback]))
        eventually(lambda: (s := store.load_session(sid)) is not None and s.snapshot.context.size == 6, WAIT_S)
        b.stub.Draft(pb.DraftRequest(items=[pb.DraftItem(session_id=sid, new_tokens=[29892])]))
        b.stub.CloseSessions(pb.CloseSessionsRequest(sessions=[pb.CloseSession(session_id=sid, commit=True)]))
        eventually(lambda: a.admin.Stats(pb.StatsRequest()).pending_writes == 0, WAIT_S)
        return watch.report()
    finally:
        for replica in replicas:
            replica.stop()


def client(target: str) -> dict[str, list[str]]:
    from decoder_client.client import ClientConfig, DraftClient

    prompts = [[1, 450, 4996, 17354, 1701, 450, 4996], [1, 29871, 13, 29871, 13, 29871]]
    clients = [
        DraftClient(ClientConfig(target=target, namespace="toy", lookahead=2)),
        DraftClient(ClientConfig(target=target, namespace="toy", stream=False)),
        DraftClient(ClientConfig(target="127.0.0.1:1", namespace="toy")),  # nothing listens: down
    ]
    watch = Watch("client")
    for c in clients:
        sessions = c.open(prompts)
        new: list[list[int]] = [[], []]
        for _ in range(6):
            trees = c.draft(sessions, new)
            # Each sequence accepts its tree's first token, if any, and one of the target's own.
            new = [[int(t.tokens[0]), 13] if t.tokens.size else [13] for t in trees]
        c.add_tokens(sessions, new)
        c.close(sessions)
        c.shutdown()
    return watch.report()


if __name__ == "__main__":
    run = {"server": server, "client": client}[sys.argv[1]]
    try:
        print(json.dumps(run(*sys.argv[2:])))
    except BaseException:
        # The traceback last, and nothing after it: threads still running at exit would
        # log over it.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
