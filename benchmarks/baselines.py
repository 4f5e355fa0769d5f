"""Drafters to replay side by side: ours in-process, prompt lookup, and the peers SuffixDecoding
(``arctic-inference``) and REST (``draftretriever``), both optional."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
from multiprocessing.connection import Connection

import numpy as np

from indexer.drafter import DraftParams, NamespaceDrafter, Session
from indexer.prespeculation import Prefetched
from indexer.prompt_lookup import prompt_lookup
from indexer.tree_builder import DraftTree, Tier


class EngineDrafter:
    """draftcache's engine, in-process."""

    def __init__(
        self,
        engine: NamespaceDrafter,
        params: DraftParams,
        *,
        rebuild: bool = True,
        name: str = "draftcache",
        lookahead: int = 0,
    ) -> None:
        self.name = name
        self.lookahead = lookahead  # outcomes drafted ahead per step (0: no pre-speculation)
        self.last_was_ahead = False
        self.ahead: Prefetched = {}  # trees drafted ahead for the tree last proposed
        self._engine = engine
        self._params = params
        self._rebuild = rebuild
        self._session: Session | None = None

    def start(self, prompt: np.ndarray) -> None:
        self._session = self._engine.open(prompt)

    def _active(self) -> Session:
        if self._session is None:
            raise RuntimeError("no request in progress: call start() first")
        return self._session

    def propose(self) -> DraftTree:
        session = self._active()
        # After an outcome that was drafted ahead, the session already holds the next tree.
        ahead = self.lookahead > 0 and session.last_tree is not None
        self.last_was_ahead = ahead
        if ahead:
            assert session.last_tree is not None
            return session.last_tree
        return self._engine.draft(session, self._params)

    def draft_ahead(self) -> None:
        """Pre-speculation, run while the target would verify the proposed tree."""
        if self.lookahead:
            self.ahead = self._engine.prespeculate(self._active(), self.lookahead, self._params)

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        """The step's tokens; ``topk``, the target's top-k where they were verified, feeds the
        successor tier first (its row 0 follows the context as it was)."""
        session = self._active()
        if topk is not None:
            self._engine.observe_topk(session, tokens, topk)
        self._engine.accept(session, tokens)

    def finish(self, commit_from: int) -> None:
        self._engine.close(self._active(), commit=True, commit_from=commit_from)
        self._session = None
        # The service rebuilds on a schedule; replay rebuilds when the delta asks for it.
        if self._rebuild and self._engine.memory.needs_rebuild():
            self._engine.memory.rebuild()


class PromptLookupDrafter:
    """vLLM / transformers prompt lookup over the request's own context."""

    def __init__(self, *, max_n: int = 3, min_n: int = 1, num_tokens: int = 10) -> None:
        self.name = f"prompt-lookup(n={min_n}..{max_n},k={num_tokens})"
        self._args = {"max_n": max_n, "min_n": min_n, "num_tokens": num_tokens}
        self._ctx = np.zeros(0, dtype=np.int32)

    def start(self, prompt: np.ndarray) -> None:
        self._ctx = prompt.copy()

    def propose(self) -> DraftTree:
        return DraftTree.chain(prompt_lookup(self._ctx, **self._args))

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:  # peers: no use for topk
        self._ctx = np.concatenate((self._ctx, tokens))

    def finish(self, commit_from: int) -> None:
        self._ctx = np.zeros(0, dtype=np.int32)


class SuffixDecodingDrafter:
    """SuffixDecoding (arctic-inference): per-request and global suffix trees. Trees of at most
    ``max_spec_tokens`` nodes, or with ``chain`` > 0 its own chains of at most that many tokens
    (``use_tree_spec=False``, as vLLM's suffix method drafts): it then picks the match length by
    the chain's score, where a cut tree follows the match length whose whole tree scored best."""

    def __init__(
        self,
        *,
        max_spec_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
        max_depth: int = 64,
        chain: int = 0,
    ) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # optional extra

        if chain < 0:
            raise ValueError(f"chain must be >= 0, got {chain}")
        shape = f"/chain({chain})" if chain else ""
        self.name = f"suffix-decoding(factor={max_spec_factor},p={min_token_prob}){shape}"
        self._cache = SuffixDecodingCache(max_tree_depth=max_depth)
        self._tree = not chain
        self._args = {
            "max_spec_tokens": chain or max_spec_tokens,
            "max_spec_factor": max_spec_factor,
            "min_token_prob": min_token_prob,
        }
        self._ctx = np.zeros(0, dtype=np.int32)
        self._req = 0
        self._active = False

    def start(self, prompt: np.ndarray) -> None:
        self._req += 1
        self._cache.start_request(self._req, prompt)
        self._active = True
        self._ctx = prompt.copy()

    def propose(self) -> DraftTree:
        d = self._cache.speculate(self._req, self._ctx, use_tree_spec=self._tree, **self._args)
        tokens = np.asarray(d.token_ids, dtype=np.int32)
        if tokens.size == 0:
            return DraftTree.empty()
        return DraftTree(
            tokens,
            np.asarray(d.parents, dtype=np.int32),
            np.zeros(tokens.size, dtype=np.uint8),
            np.asarray(d.probs, dtype=np.float32),
        )

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:  # peers: no use for topk
        self._cache.add_active_response(self._req, tokens)
        self._ctx = np.concatenate((self._ctx, tokens))

    def finish(self, commit_from: int) -> None:
        self._cache.stop_request(self._req)
        self._active = False


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def suffix_decoding_available() -> bool:
    return _importable("arctic_inference.suffix_decoding")


class RestDrafter:
    """REST (retrieval-based speculative decoding) over a ``draftretriever`` datastore built from
    a static corpus, driven as REST drives it: the context's last ``max_span`` tokens are looked
    up, then one fewer, down to ``min_span``, until the retriever returns paths, and the trie of
    those paths (at most ``choices`` nodes) is the tree. The datastore does not learn from the
    requests. (PyPI's ``draftretriever`` 0.1.1 is ADED's build of REST's retriever: a tri-gram
    table searched by MCTS, same interface.)

    The retriever runs in a child process replaced between requests once it has searched
    ``recycle`` times: the library keeps ~75 KB per search for good (measured), which a long
    replay would pile up into tens of GB. A draft's time includes the round trip to the child.
    """

    def __init__(
        self, datastore: str, *, choices: int = 64, max_span: int = 16, min_span: int = 2, recycle: int = 20_000
    ) -> None:
        if not 2 <= min_span <= max_span or choices < 1 or recycle < 1:  # a 1-token query aborts the retriever
            raise ValueError("REST needs 2 <= min_span <= max_span, choices >= 1 and recycle >= 1")
        self.name = f"rest(choices={choices},span={max_span}..{min_span})"
        self._reader = _ChildReader(datastore)
        self._span = (max_span, min_span)
        self._choices = choices
        self._recycle = recycle
        self._ctx = np.zeros(0, dtype=np.int32)

    def start(self, prompt: np.ndarray) -> None:
        if self._reader.searches >= self._recycle:
            self._reader.restart()
        self._ctx = prompt.copy()

    def propose(self) -> DraftTree:
        max_span, min_span = self._span
        for span in range(min(max_span, self._ctx.size), min_span - 1, -1):
            try:
                paths = self._reader.search(self._ctx[-span:].tolist(), self._choices)
            except ValueError:  # too many prefixes tied at the cut: try a shorter span
                continue
            if paths:
                return tree_of_paths(paths)
        return DraftTree.empty()

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:  # peers: no use for topk
        self._ctx = np.concatenate((self._ctx, tokens))

    def finish(self, commit_from: int) -> None:
        self._ctx = np.zeros(0, dtype=np.int32)

    def close(self) -> None:
        self._reader.close()


class _ChildReader:
    """A ``draftretriever.Reader`` in a child process, searched over a pipe."""

    def __init__(self, datastore: str) -> None:
        self._datastore = datastore
        self._ctx = mp.get_context("spawn")
        self.searches = 0
        self._start()

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve_reader, args=(self._datastore, child), daemon=True)
        self._proc.start()
        child.close()
        try:
            ok, msg = self._conn.recv()  # the datastore loaded, or why not
        except EOFError:  # the library aborts its process on a file it cannot parse
            ok, msg = False, "not a draftretriever datastore (the retriever died loading it)"
        if not ok:
            self.close()
            raise OSError(f"{self._datastore}: {msg}")
        self.searches = 0

    def search(self, query: list[int], choices: int) -> list[list[int]]:
        self.searches += 1
        try:
            self._conn.send((query, choices))
            ok, out = self._conn.recv()
        except (EOFError, OSError) as exc:  # the retriever aborted: its panics end the process
            self.restart()
            raise RuntimeError(f"the REST retriever died searching {query[-4:]}...") from exc
        if not ok:
            raise ValueError(out)
        return out

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a child that died reads nothing
            self._conn.send(None)
        self._conn.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _serve_reader(datastore: str, conn: Connection) -> None:
    """The child: load the datastore, then answer searches until told to stop."""
    try:
        import draftretriever

        reader = draftretriever.Reader(index_file_path=datastore)
    except Exception as exc:  # reported to the parent, which raises it
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        query, choices = msg
        try:
            conn.send((True, reader.search(query, choices=choices)[0]))
        except ValueError as exc:
            conn.send((False, str(exc)))


def tree_of_paths(paths: list[list[int]]) -> DraftTree:
    """The trie of token paths (negative ids pad a path's end), nodes in first-seen order, so a
    parent precedes its children.

    >>> t = tree_of_paths([[5, 6, -2], [5, 7, 8], [9, -2, -2]])
    >>> t.tokens.tolist(), t.parents.tolist()
    ([5, 6, 7, 8, 9], [-1, 0, 0, 2, -1])
    """
    nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    for path in paths:
        at = -1
        for tok in path:
            if tok < 0:
                break
            node = nodes.get((at, tok))
            if node is None:
                node = nodes[(at, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(at)
            at = node
    n = len(tokens)
    return DraftTree(
        np.asarray(tokens, dtype=np.int32),
        np.asarray(parents, dtype=np.int32),
        np.full(n, Tier.PRIOR, dtype=np.uint8),
        np.ones(n, dtype=np.float32),
    )


def rest_available() -> bool:
    return _importable("draftretriever")
