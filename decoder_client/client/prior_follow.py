"""The namespace's static prior, read from the service for a near copy, and kept current.

A near copy (:mod:`decoder_client.client.near`) drafts with the namespace's static prior as the
service does. Rather than a file shipped beside every engine, it can read the prior the
operator published (``draftcache warm`` without ``--out``) from the service: page by page
(``ReadPrior``), the reassembled blob checked against the digest the service stored with it.
A :class:`PriorFollower` does that on a thread of its own, at start and then now and then, and
hands each new version to the near copy (a reference swap: a draft never waits on it). A
version gone while it was read (two publishes since) is read again from the current one; the
service down or slow costs nothing but the prior: the near copy drafts without it, or with the
version it has, and the next look tries again.

>>> asked = []  # a service holding version 7 of a 6-byte blob
>>> def read(version, offset, max_bytes):
...     asked.append((version, offset, max_bytes))
...     return 7, 6, blob_digest(b"abcdef"), b"abcdef"[offset : offset + max_bytes]
>>> read_blob(read, known=0, page_bytes=4)
(7, bytearray(b'abcdef'))
>>> asked  # one byte to learn the version, then pages of that version
[(0, 0, 1), (7, 1, 4), (7, 5, 4)]
>>> read_blob(read, known=7) is None  # nothing new: one call of one byte
True
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from indexer.prior import StaticPrior, blob_digest

logger = logging.getLogger(__name__)

CHECK_S = 60.0  # how often the service is asked whether a new version was published
PAGE_BYTES = 3 << 20  # bytes one read asks for (the service's most)
ATTEMPTS = 3  # reads started again when the version went under them

# (version, offset, max_bytes) -> (version, size, digest, data): one ReadPrior call
PageRead = Callable[[int, int, int], tuple[int, int, str, bytes]]


class PriorChanged(Exception):
    """The version being read went (later publishes dropped it), or its pages disagree."""


def read_blob(read: PageRead, *, known: int, page_bytes: int = PAGE_BYTES) -> tuple[int, bytearray] | None:
    """The current prior's version and blob, checked against its digest; ``None`` when it is
    version ``known`` or the namespace has none. ``PriorChanged`` when the version went while it
    was read, or the blob does not match its digest; ``grpc.RpcError`` as the calls raise it."""
    # A look that finds the version held costs one small call: the first asks for one byte.
    version, size, expected, first = read(0, 0, 1)
    if version == 0 or version == known:
        return None
    if len(first) > size:
        raise PriorChanged(f"prior version {version}: its first page is longer than the blob")
    blob = bytearray(size)  # filled in place: the blob is held once, not once more to join its pages
    blob[: len(first)] = first
    got = len(first)
    while got < size:
        try:
            v, s, d, data = read(version, got, page_bytes)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise PriorChanged(f"prior version {version} went while it was read") from exc
            raise
        if (v, s, d) != (version, size, expected) or not data or got + len(data) > size:
            raise PriorChanged(f"prior version {version}: a page disagrees with the first")
        blob[got : got + len(data)] = data
        got += len(data)
    if blob_digest(blob) != expected:
        raise PriorChanged(f"prior version {version}: the blob read does not match its digest")
    return version, blob


class PriorFollower:
    """Reads the namespace's current prior through ``read`` at start and every ``every_s``
    seconds, on a thread of its own, and calls ``apply(prior, version)`` with each new version;
    ``version`` is the one held so far (0: none)."""

    def __init__(self, read: PageRead, apply: Callable[[StaticPrior, int], None], *, every_s: float = CHECK_S) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self._read = read
        self._apply = apply
        self._every_s = every_s
        self.version = 0
        self.loaded = threading.Event()  # set once the first look ended, a prior found or not
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftcache-near-prior", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def check(self) -> bool:
        """Look once: whether a new version was applied."""
        for _ in range(ATTEMPTS):
            try:
                found = read_blob(self._read, known=self.version)
            except PriorChanged as exc:
                logger.info("near copy: %s; reading the current one", exc)
                continue
            if found is None:
                return False
            version, blob = found
            try:
                prior = StaticPrior.from_bytes(blob)
                self._apply(prior, version)  # ValueError: ids outside the namespace's vocabulary
            except ValueError as exc:  # the service checked the digest: a blob that is no usable prior
                logger.warning("near copy: prior version %d of the service refused (%s)", version, exc)
                self.version = version  # not read again; the prior drafted with stays
                return False
            self.version = version
            logger.info("near copy: static prior version %d read from the service (%.1f MB)", version, len(blob) / 1e6)
            return True
        return False

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:  # another vocabulary: it stays so
                    logger.error("near copy: the service refuses its prior (%s); it is not read", exc.details())
                    self.loaded.set()
                    return
                logger.warning("near copy: the service's prior could not be read (%s); trying again later", exc.code())
            except Exception:  # the thread keeps looking whatever one look hit
                logger.exception("near copy: reading the service's prior failed")
            self.loaded.set()
            if self._stopping.wait(self._every_s):
                return
