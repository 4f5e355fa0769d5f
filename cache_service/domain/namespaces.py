"""The namespaces a service drafts in: one drafter each, with the version of its static prior."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from cache_service.domain import names
from cache_service.domain.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from cache_service.domain.items import NamespaceStats
from cache_service.domain.ports import Logged
from indexer.drafter import DrafterConfig, NamespaceDrafter
from indexer.prior import StaticPrior
from indexer.tokens import Namespace, one_tokenizer

logger = logging.getLogger(__name__)

# The largest vocabulary a namespace may be created with: 16M ids, some 60x the largest
# tokenizers in use (~256k), and far below the int32 ids' ceiling. Namespaces registered before
# this bound still load.
MAX_VOCAB_SIZE = 1 << 24


def check_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` if a new namespace may have it, else :class:`InvalidArgument`.

    >>> check_vocab_size(32000)
    32000
    """
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise InvalidArgument(f"vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size}")
    return vocab_size


class Namespaces:
    """Drafters by namespace name. ``own_ring``: each builds its own lifetime indexes (else
    they are adopted from a host's shared build)."""

    def __init__(self, config: DrafterConfig, *, own_ring: bool) -> None:
        self._config = config
        self._own_ring = own_ring
        self._drafters: dict[str, NamespaceDrafter] = {}
        self._prior_versions: dict[str, int] = {}
        self._tokenizers: dict[str, str] = {}  # fingerprints registered in storage (or here)
        self._lock = threading.RLock()  # creations come from worker threads too (see unchanged)

    def create(self, name: str, vocab_size: int) -> tuple[NamespaceDrafter, bool]:
        """The namespace's drafter, and whether it is new; :class:`AlreadyExists` when it exists
        with another vocabulary size."""
        names.namespace_name(name)
        try:
            namespace = Namespace(name=name, vocab_size=vocab_size)
        except ValueError as exc:  # the vocabulary size
            raise InvalidArgument(str(exc)) from exc
        with self._lock:
            existing = self._drafters.get(name)
            if existing is not None:
                if existing.namespace.vocab_size != vocab_size:
                    raise AlreadyExists(
                        f"namespace {name!r} exists with vocab_size {existing.namespace.vocab_size}, not {vocab_size}"
                    )
                return existing, False
            drafter = NamespaceDrafter(namespace, self._config, own_ring=self._own_ring)
            self._drafters[name] = drafter
        logger.info("namespace %s (vocab %d) ready", name, vocab_size)
        return drafter, True

    def get(self, name: str, vocab_size: int = 0, tokenizer: str = "") -> NamespaceDrafter:
        """The namespace's drafter; a name no namespace could have is :class:`InvalidArgument`,
        a well-formed unknown one :class:`NotFound`. ``vocab_size``: the vocabulary a caller's
        model has (0: not stated); one that is not the namespace's tokenizer's (the same size,
        or one a model pads it to: :func:`~indexer.tokens.one_tokenizer`) is
        :class:`FailedPrecondition` (another tokenizer: its ids mean other text here), and so is
        a ``tokenizer`` fingerprint (:mod:`indexer.fingerprint`; "": not stated) that is not the
        one registered with the namespace (none registered: not checked)."""
        drafter = self._drafters.get(name)
        if drafter is None:
            names.namespace_name(name)
            raise NotFound(f"unknown namespace {name!r}")
        if vocab_size and not one_tokenizer(vocab_size, drafter.namespace.vocab_size):
            raise FailedPrecondition(
                f"namespace {name!r} has vocab_size {drafter.namespace.vocab_size}, the caller's model {vocab_size}: "
                "another tokenizer's ids, never drafted from nor committed to by this model"
            )
        registered = self._tokenizers.get(name, "")
        if tokenizer and registered and tokenizer != registered:
            raise FailedPrecondition(
                f"namespace {name!r} holds the ids of tokenizer {registered}, the caller's is {tokenizer}: "
                "another tokenizer of the same size, never drafted from nor committed to by this model"
            )
        return drafter

    def tokenizer(self, name: str) -> str:
        """The fingerprint registered with the namespace ("": none)."""
        return self._tokenizers.get(name, "")

    def set_tokenizer(self, name: str, drafter: NamespaceDrafter, fingerprint: str) -> None:
        """Record the namespace's registered tokenizer, while ``drafter`` still serves it (one
        deleted and created again meanwhile is another namespace)."""
        with self._lock:
            if self._drafters.get(name) is drafter:
                if fingerprint:
                    self._tokenizers[name] = fingerprint
                else:
                    self._tokenizers.pop(name, None)

    def remove(self, name: str) -> bool:
        """Forget a namespace (its drafter goes once no session holds it); whether it was here."""
        with self._lock:
            self._prior_versions.pop(name, None)
            self._tokenizers.pop(name, None)
            return self._drafters.pop(name, None) is not None

    def current(self, name: str, drafter: NamespaceDrafter) -> bool:
        """Whether ``drafter`` still serves ``name`` (not removed, nor removed and created again)."""
        return self._drafters.get(name) is drafter

    def names(self) -> list[str]:
        return sorted(self._drafters)

    def drafters(self) -> dict[str, NamespaceDrafter]:
        """The drafter serving each namespace now (a copy)."""
        with self._lock:
            return dict(self._drafters)

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        """No namespace is created or removed by another thread inside (the holder may remove
        one: the lock is re-entrant), so what :meth:`current` said holds until the block ends."""
        with self._lock:
            yield

    def set_prior(self, name: str, prior: StaticPrior | None, version: int) -> None:
        """Swap a namespace's static prior (one reference assignment: drafts never wait).
        ``ValueError`` (the prior not swapped) when it holds ids outside the vocabulary."""
        drafter = self.get(name)
        if prior is not None:
            prior.check_vocab(drafter.namespace.vocab_size)
        drafter.prior = prior
        self._prior_versions[name] = version

    def prior_version(self, name: str) -> int:
        return self._prior_versions.get(name, 0)

    def stats(self, name: str, sessions: int) -> NamespaceStats:
        """The namespace's figures, with the ``sessions`` it has open."""
        d = self.get(name)
        built = d.memory.indexes
        return NamespaceStats(
            name=name,
            vocab_size=d.namespace.vocab_size,
            buffered_tokens=d.memory.buffered_tokens,
            requests=d.memory.requests,
            index_tokens=0 if built is None else built.suffix.size,
            last_rebuild_seconds=0.0 if built is None else built.build_seconds,
            prior_version=self.prior_version(name),
            sessions=sessions,
            tokenizer=self.tokenizer(name),
        )

    def mark_logged(self, logged: Iterable[Logged]) -> None:
        """Record where requests committed here fall in their namespace's lifetime log."""
        for ns, requests, ids in logged:
            memory = self.get(ns).memory
            for request, log_id in zip(requests, ids, strict=True):
                memory.mark_logged(request, log_id)
