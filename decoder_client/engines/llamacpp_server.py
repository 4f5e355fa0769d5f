"""llama-cpp-python's OpenAI-compatible server with draftcache as every model's draft model.

``python -m llama_cpp.server`` builds its models itself, and its ``draft_model`` setting only
ever builds the engine's own ``LlamaPromptLookupDecoding``: no setting names another class. This
launcher runs the same server (its app, routes, settings and command line, all of them) with a
model proxy of its own: each ``Llama`` the server loads gets a
:class:`~decoder_client.engines.llamacpp.DraftcacheDraftModel`, attached, so every completion
and chat completion is one draft session, opened on its prompt and committed when it stops; a
model the server unloads (it holds one at a time) has its open generation committed and its
client shut down. The server answers one request at a time, which is what a draft model of
llama-cpp-python expects (one sequence per ``Llama``).

Run it as the server is run, with draftcache's settings in ``DRAFTCACHE_*`` (the vLLM proposer's
:class:`~decoder_client.engines.settings.EngineSettings`: ``DRAFTCACHE_TARGET``,
``DRAFTCACHE_NAMESPACE``, ``DRAFTCACHE_NEAR``, ...) or ``--draftcache KEY=VALUE`` (repeatable)::

    DRAFTCACHE_TARGET=127.0.0.1:50051 DRAFTCACHE_NAMESPACE=smollm2 \\
        python -m decoder_client.engines.llamacpp_server --model SmolLM2.gguf --port 8000

``--draftcache-tokens N`` is the chain length (the draft model's ``num_pred_tokens``, 10).
``--draftcache-model SMALL.gguf`` loads a small model with the served model's tokenizer to
draft beside the cache (:class:`~decoder_client.engines.llamacpp_chains.LlamaChainModel`): each
step proposes its chain unless more of the cache's is expected to be accepted. The
model is loaded with ``logits_all`` (a draft model needs it; see
:meth:`~decoder_client.engines.llamacpp.DraftcacheDraftModel.attach`) and, unless
``--flash_attn`` says otherwise, with flash attention, without which llama.cpp's batched
verification rounds unlike a one-token step and greedy outputs can part from plain decoding's
(:func:`~decoder_client.engines.llamacpp.flash_attention_off`); the server's own
``--draft_model`` is refused, as two draft models cannot share one engine.

``GET /metrics`` on the server's own port serves the loaded model's draft counts for Prometheus
(:class:`LoadedDraftCounts`: the client's drafts by source, failed calls, commits; the engine's
steps and draft tokens proposed and accepted), as ``metrics_port`` would on a port of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, cast

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from decoder_client.engines.settings import ENV_PREFIX, EngineSettings, setting_pairs

logger = logging.getLogger(__name__)


def draftcache_settings(pairs: Sequence[str], env: Mapping[str, str]) -> EngineSettings:
    """The draft models' settings: ``KEY=VALUE`` pairs over ``DRAFTCACHE_*`` variables.

    >>> s = draftcache_settings(["namespace=smollm2", "near=false"], {"DRAFTCACHE_TARGET": "h:1"})
    >>> (s.target, s.namespace, s.near)
    ('h:1', 'smollm2', False)
    >>> draftcache_settings(["namespace"], {})
    Traceback (most recent call last):
    ...
    ValueError: --draftcache wants KEY=VALUE, got 'namespace'
    """
    return EngineSettings.from_sources(setting_pairs(pairs, "--draftcache"), env)


def proxy_class(settings: EngineSettings, num_pred_tokens: int, chain_model: str | None = None) -> type:
    """llama-cpp-python's ``LlamaProxy`` (the server's holder of its loaded model), loading each
    model with draftcache as its draft model, and with ``chain_model`` (a GGUF path) a small
    model drafting beside the cache for each."""
    from llama_cpp import Llama
    from llama_cpp.server.model import LlamaProxy

    from decoder_client.engines.llamacpp import DraftcacheDraftModel, llama_fingerprint
    from decoder_client.engines.llamacpp_chains import LlamaChainModel

    class DraftcacheLlamaProxy(LlamaProxy):
        def __init__(self, models: Any) -> None:
            self.draft_models: dict[int, DraftcacheDraftModel] = {}  # id(Llama) -> its draft model
            super().__init__(models)  # loads the default model

        # The base's is a static method, which it calls through the instance: this one is called so.
        def load_llama_from_model_settings(self, model_settings: Any) -> Any:  # type: ignore[override]
            update = {"logits_all": True, "draft_model": None}
            if "flash_attn" not in model_settings.model_fields_set:  # see flash_attention_off
                update["flash_attn"] = True
            model_settings = model_settings.model_copy(update=update)
            llm = LlamaProxy.load_llama_from_model_settings(model_settings)
            chains = None
            if chain_model is not None:
                small = Llama(
                    model_path=chain_model,
                    n_ctx=llm.n_ctx(),
                    n_threads=model_settings.n_threads,
                    flash_attn=model_settings.flash_attn,  # rounding as the served model's
                    verbose=False,
                )
                chains = LlamaChainModel(small, num_pred_tokens)
            vocab = int(llm.n_vocab())
            draft = DraftcacheDraftModel.from_settings(
                settings, num_pred_tokens, vocab, tokenizer=llama_fingerprint(llm), chain_model=chains
            )
            draft.attach(llm)
            self.draft_models[id(llm)] = draft
            self._close_unloaded(keep=llm)
            logger.info(
                "draftcache: %s drafts from %s, namespace %s%s%s",
                model_settings.model, settings.target, settings.namespace, " (near)" if settings.near else "",
                f", beside the draft model {chain_model}" if chain_model else "",
            )  # fmt: skip
            return llm

        def _close_unloaded(self, keep: Any) -> None:
            """Commit and shut down the draft models of the models the server unloaded."""
            for key in [k for k in self.draft_models if k != id(keep)]:
                _close(self.draft_models.pop(key))

        def free(self) -> None:
            super().free()
            for draft in self.draft_models.values():
                _close(draft)
            logger.info("draftcache: %d draft models closed, their generations committed", len(self.draft_models))
            self.draft_models.clear()

    return DraftcacheLlamaProxy


def _close(draft: Any) -> None:
    """Commit a draft model's open generation, shut its client down, free its chain model's."""
    draft.close()
    small = getattr(draft.chain_model, "llm", None)  # the LlamaChainModel's own engine
    if small is not None:
        small.close()


class LoadedDraftCounts(Collector):
    """The counts of the draft model of the model ``server_app`` holds (it holds one at a time;
    none before the first loads), labelled with ``namespace`` and the engine, ``llama.cpp``."""

    def __init__(self, server_app: Any, namespace: str) -> None:
        self._server_app = server_app
        self._namespace = namespace

    def collect(self) -> Iterator[Metric]:
        from decoder_client.client.metrics import ClientCollector

        proxy = self._server_app._llama_proxy
        loaded = list(getattr(proxy, "draft_models", {}).values())
        if loaded:
            draft = loaded[-1]
            stats, engine = (lambda: draft.client.stats), draft.stats.counts
            counts = ClientCollector(stats, namespace=self._namespace, engine="llama.cpp", engine_counts=engine)
            yield from counts.collect()


def add_metrics_route(app: Any, server_app: Any, namespace: str) -> None:
    """``GET /metrics`` on ``app``: :class:`LoadedDraftCounts` in Prometheus's text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.responses import Response

    registry = CollectorRegistry()
    registry.register(LoadedDraftCounts(server_app, namespace))

    def metrics() -> Response:  # a plain function: FastAPI runs it off the event loop
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


def parser() -> argparse.ArgumentParser:
    """llama-cpp-python's server command line, and draftcache's two flags."""
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    p = argparse.ArgumentParser(
        description="llama-cpp-python's OpenAI-compatible server with draftcache as its draft model",
        epilog="draftcache's settings: DRAFTCACHE_* (see decoder_client.engines.settings) or --draftcache KEY=VALUE",
    )
    add_args_from_model(p, Settings)
    p.add_argument("--draftcache", action="append", default=[], metavar="KEY=VALUE", help="a draftcache setting")
    p.add_argument("--draftcache-tokens", type=int, default=10, help="the draft chain's length at most (10)")
    p.add_argument(
        "--draftcache-model", default=None, metavar="GGUF", help="a small model with its tokenizer, drafting beside"
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn
    from llama_cpp.server import app as server_app
    from llama_cpp.server.cli import parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    p = parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = draftcache_settings(a.draftcache, os.environ)
    except ValueError as exc:
        p.error(f"draftcache: {exc} (set {ENV_PREFIX}TARGET and {ENV_PREFIX}NAMESPACE, or --draftcache KEY=VALUE)")
    if getattr(a, "draft_model", None):
        p.error("--draft_model: draftcache is this server's draft model")
    if a.draftcache_tokens < 1:
        p.error("--draftcache-tokens must be >= 1")
    if a.draftcache_model is not None and not os.path.isfile(a.draftcache_model):
        p.error(f"--draftcache-model: no such file: {a.draftcache_model}")
    # (typed as returning its argument, the class; it returns an instance)
    server_settings = cast("ServerSettings", parse_model_from_args(ServerSettings, a))
    model_settings = [cast("ModelSettings", parse_model_from_args(ModelSettings, a))]
    # The app builds its model proxy through this module attribute (set_llama_proxy).
    setattr(server_app, "LlamaProxy", proxy_class(settings, a.draftcache_tokens, a.draftcache_model))  # noqa: B010
    app = server_app.create_app(server_settings=server_settings, model_settings=model_settings)
    app.router.lifespan_context = _freeing(app.router.lifespan_context, server_app)
    add_metrics_route(app, server_app, settings.namespace)
    uvicorn.run(
        app,
        host=os.getenv("HOST", server_settings.host),
        port=int(os.getenv("PORT", server_settings.port)),
        ssl_keyfile=server_settings.ssl_keyfile,
        ssl_certfile=server_settings.ssl_certfile,
    )


def _freeing(inner: Any, server_app: Any) -> Any:
    """The app's lifespan, then the model proxy freed: the generation still open committed and
    each draft client shut down (its commits sent) while the server stops, before uvicorn ends
    the process (it raises the signal that stopped it again once the app has shut down)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with inner(app) as state:
            yield state
        proxy = server_app._llama_proxy
        if proxy is not None:
            proxy.free()

    return lifespan


if __name__ == "__main__":
    main(sys.argv[1:])
