"""Load test: several decoder processes, each stepping a batch of real sequences against the
service, the way inference replicas use it.

Each decoder process embeds a :class:`DraftClient` and keeps ``batch`` requests in flight, taken
from a trace file in turn: one batched draft call per step, the accepted length judged against
the recorded continuation (exact for greedy decoding), the produced tokens sent with the next
call; the requests that finish in a step are closed (committed) together and replaced by the
next ones, opened in one call. ``step_interval_s`` stands for the target model's verification
time: the next draft call goes out that long after the last one was answered (the decoder's own
bookkeeping overlaps it, as an engine's CPU work overlaps its forward pass), so a step lasts the
draft's latency plus the verification, and decoders that wait on one another drift apart as real
replicas do; 0 steps back to back (the service's saturation throughput). Replicas are taken round
robin by decoder.

The parent process collects every step's client-visible latency and, for processes on this
host (``watch_pids``, the servers), samples resident memory and CPU time once a second, and
reports the server CPU one sequence-draft costs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from benchmarks.traces import Conversation, iter_traces
from decoder_client.client import ClientConfig, ClientSession, DraftClient
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    targets: tuple[str, ...]
    namespace: str
    traces: Path
    decoders: int = 8
    batch: int = 32
    seconds: float = 30.0
    step_interval_s: float = 0.0  # the target's verification time: from a draft's answer to the next call
    deadline_s: float = 0.05  # past it a step is answered by the local fallback
    params: DraftParams = field(default_factory=DraftParams)
    watch_pids: tuple[int, ...] = ()
    passes: int = 1  # times each decoder goes through its share of the requests (0: no end)
    lookahead: int = 0  # pre-speculation: outcomes drafted ahead per step
    timeline_s: float = 0.0  # also report each window of this many seconds (0: the whole run only)
    stream: bool = True  # draft calls on the client's bidirectional stream (False: unary calls)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("at least one target is needed")
        if self.decoders < 1 or self.batch < 1 or self.seconds <= 0:
            raise ValueError("decoders and batch must be >= 1 and seconds > 0")
        if self.step_interval_s < 0 or self.deadline_s <= 0 or self.passes < 0:
            raise ValueError("step_interval_s and passes must be >= 0 and deadline_s > 0")


@dataclass
class DecoderResult:
    """One decoder process's counts and step latencies (seconds)."""

    steps: int = 0
    sequence_drafts: int = 0  # trees received from the service
    fallbacks: int = 0  # trees the local drafter made instead
    tokens: int = 0  # tokens produced (accepted drafts + bonus)
    sequence_steps: int = 0
    requests: int = 0
    seconds: float = 0.0  # from the first step to the last
    first_at: float = 0.0  # time.monotonic() at the first step (the same clock in every process)
    ahead_hits: int = 0  # sequence steps whose tree had been drafted ahead
    ahead_misses: int = 0
    failures: int = 0  # client calls that failed or missed their deadline (each skips the service a while)
    lost_opens: int = 0
    cpu_seconds: float = 0.0  # this process's CPU time from the first step to the last
    latencies: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # each step's start, seconds into the run


def requests_of(conversations: list[Conversation], passes: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(prompt, output)`` for every output segment, ``passes`` times over (0: forever)."""
    pairs = []
    for conv in conversations:
        parts: list[np.ndarray] = []
        for seg in conv.segments:
            if seg.kind == "output" and parts and seg.tokens.size > 1:
                pairs.append((np.concatenate(parts), seg.tokens))
            parts.append(seg.tokens)
    if not pairs:
        raise ValueError("the traces hold no output segments with a prompt")
    done = 0
    while passes == 0 or done < passes:
        yield from pairs
        done += 1


H = TypeVar("H")


@dataclass
class Replayed(Generic[H]):
    """A recorded output produced again step by step, as a decoder verifying drafts would:
    ``handle`` names the sequence to whatever drafts for it, ``pending`` holds the tokens
    produced since its last draft."""

    handle: H
    output: np.ndarray
    pos: int = 0
    pending: list[int] = field(default_factory=list)

    def verify(self, tree: DraftTree) -> int:
        """Produce what the target would after ``tree``: its accepted nodes and the bonus token.
        Returns the step's length, accepted nodes plus one, as replay counts it: a tree accepted
        to the output's end yields its accepted tokens only (the output holds no bonus token
        after them)."""
        n = len(tree.accept(self.output[self.pos :])) + 1
        self.pending = self.output[self.pos : self.pos + n].tolist()
        self.pos += len(self.pending)
        return len(self.pending)

    @property
    def finished(self) -> bool:
        return self.pos >= self.output.size


def run_decoder(config: LoadConfig, index: int) -> DecoderResult:
    """One decoder: ``batch`` sequences stepped until ``seconds`` have passed."""
    conversations = [c for i, c in enumerate(iter_traces(config.traces)) if i % config.decoders == index]
    source = requests_of(conversations or list(iter_traces(config.traces)), config.passes)
    target = config.targets[index % len(config.targets)]
    client = DraftClient(
        ClientConfig(
            target=target,
            namespace=config.namespace,
            params=config.params,
            deadline_s=config.deadline_s,
            lookahead=config.lookahead,
            stream=config.stream,
        )
    )
    result = DecoderResult()
    slots = _open_many(client, source, config.batch)
    result.requests = len(slots)
    first, cpu = time.monotonic(), time.process_time()
    stop = first + config.seconds
    while slots and time.monotonic() < stop:
        result.started.append(time.monotonic() - first)
        began = time.perf_counter()
        before = client.stats.fallback
        trees = client.draft([s.handle for s in slots], [s.pending for s in slots])
        answered = time.perf_counter()
        result.latencies.append(answered - began)
        result.steps += 1
        result.fallbacks += client.stats.fallback - before
        result.sequence_drafts += len(slots) - (client.stats.fallback - before)
        still: list[Replayed[ClientSession]] = []
        done: list[Replayed[ClientSession]] = []
        for slot, tree in zip(slots, trees, strict=True):
            slot.verify(tree)
            result.tokens += len(slot.pending)
            result.sequence_steps += 1
            (done if slot.finished else still).append(slot)
        if done:  # requests that finished this step end together, and their successors open together
            client.add_tokens([d.handle for d in done], [d.pending for d in done])
            client.close([d.handle for d in done])
            following = _open_many(client, source, len(done))
            still.extend(following)
            result.requests += len(following)
        slots = still
        if config.step_interval_s:
            time.sleep(max(0.0, answered + config.step_interval_s - time.perf_counter()))
    result.seconds = time.monotonic() - first
    result.cpu_seconds = time.process_time() - cpu
    result.first_at = first
    client.close([s.handle for s in slots], commit=False)
    client.shutdown()
    result.ahead_hits, result.ahead_misses = client.stats.ahead_hits, client.stats.ahead_misses
    result.failures, result.lost_opens = client.stats.failures, client.stats.lost_opens
    return result


def _open_many(
    client: DraftClient, source: Iterator[tuple[np.ndarray, np.ndarray]], count: int
) -> list[Replayed[ClientSession]]:
    """Up to ``count`` next requests, opened in one call."""
    requests = [r for r in (next(source, None) for _ in range(count)) if r is not None]
    if not requests:
        return []
    sessions = client.open([prompt for prompt, _ in requests])
    return [Replayed(session, output) for session, (_, output) in zip(sessions, requests, strict=True)]


def _worker(config: LoadConfig, index: int, results: mp.Queue) -> None:
    results.put((index, run_decoder(config, index)))


_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's clock ticks per second


def _sample(pids: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    """Resident MiB and CPU seconds of each process (Linux /proc)."""
    out = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (rss_kb / 1024, (int(stat[11]) + int(stat[12])) / _TICKS)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return out


def _host_busy_seconds() -> float | None:
    """CPU seconds every core of this host has spent busy since boot (Linux /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        user, nice, system, _idle, _iowait, irq, softirq = fields  # steal: another guest's
        return (user + nice + system + irq + softirq) / _TICKS
    except (OSError, ValueError):
        return None


def _server_drafts(targets: tuple[str, ...]) -> int:
    total = 0
    for target in targets:
        with grpc.insecure_channel(target) as channel:
            total += pb_grpc.AdminStub(channel).Stats(pb.StatsRequest(), timeout=5).drafts
    return total


def _final_drafts(targets: tuple[str, ...]) -> tuple[int | None, str | None]:
    """The servers' draft count at the end of the run, or why it could not be read: a server
    gone by then leaves the run's own measurements standing, and the report says so."""
    try:
        return _server_drafts(targets), None
    except grpc.RpcError as exc:
        return None, f"{exc.code().name}: {exc.details()}"


def run_load(config: LoadConfig) -> dict:
    """Start the decoders, wait for them, and summarise."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(config, i, results), daemon=True) for i in range(config.decoders)]
    drafts_before = _server_drafts(config.targets)
    began = time.monotonic()
    for p in procs:
        p.start()
    samples: list[tuple[float, dict[int, tuple[float, float]]]] = []
    host: list[tuple[float, float]] = []
    collected: list[DecoderResult] = []
    while len(collected) < len(procs):
        samples.append((time.monotonic() - began, _sample(config.watch_pids)))
        busy = _host_busy_seconds()
        if busy is not None:
            host.append((samples[-1][0], busy))
        try:
            collected.append(results.get(timeout=1.0)[1])
        except Exception:  # queue.Empty: keep sampling
            if not any(p.is_alive() for p in procs) and results.empty():
                raise RuntimeError("a decoder process died without a result") from None
    elapsed = time.monotonic() - began
    for p in procs:
        p.join(timeout=10)
    window = (min(r.first_at for r in collected) - began, max(r.first_at + r.seconds for r in collected) - began)
    drafts_after, stats_error = _final_drafts(config.targets)
    drafts = None if drafts_after is None else drafts_after - drafts_before
    out = summarise(config, collected, samples, drafts, elapsed, window=window, host=host, began=began)
    if stats_error is not None:
        out["server_stats_error"] = stats_error
    return out


def summarise(
    config: LoadConfig,
    results: list[DecoderResult],
    samples: list[tuple[float, dict[int, tuple[float, float]]]],
    server_drafts: int | None,
    elapsed: float,
    *,
    window: tuple[float, float] | None = None,
    host: list[tuple[float, float]] | None = None,
    began: float | None = None,
) -> dict:
    """The run's report. ``samples`` are taken at seconds into the run; ``window`` is when
    the decoders stepped, on the same clock (``None``: the whole run). Server CPU is counted
    over the samples inside it: the decoders start and wind down for seconds on either side,
    and the server's idle CPU then would make a sequence-draft look cheaper than it is.
    ``host`` holds the host's busy CPU seconds at seconds into the run: with the decoders'
    own CPU, it tells whether the load generator shared the server's cores. ``server_drafts``
    ``None``: the servers could not be asked at the end (their figures are then ``None``).
    ``began``: the run's start (``time.monotonic()``), which puts each decoder's steps, timed
    from its own first step, on the run's clock for the timeline (``None``: they started with it)."""
    lat = np.array([x for r in results for x in r.latencies]) * 1e3
    steps = sum(r.steps for r in results)
    stepping = max((r.seconds for r in results), default=config.seconds) or config.seconds
    out: dict = {
        "decoders": config.decoders,
        "transport": "stream" if config.stream else "unary",
        "batch": config.batch,
        "replicas": len(config.targets),
        "step_interval_ms": config.step_interval_s * 1e3,
        "seconds": round(elapsed, 1),
        "steps": steps,
        "step_ms_p50": round(float(np.percentile(lat, 50)), 3) if lat.size else None,
        "step_ms_p99": round(float(np.percentile(lat, 99)), 3) if lat.size else None,
        "step_ms_mean": round(float(lat.mean()), 3) if lat.size else None,  # steps drafted ahead count, at ~0
        "sequence_drafts_per_s": round(sum(r.sequence_drafts for r in results) / stepping, 1),
        "server_drafts_per_s": None if server_drafts is None else round(server_drafts / stepping, 1),
        "fallback_share": round(sum(r.fallbacks for r in results) / max(1, steps * config.batch), 4),
        "mat": round(sum(r.tokens for r in results) / max(1, sum(r.sequence_steps for r in results)), 3),
        "requests": sum(r.requests for r in results),
        "client_failures": sum(r.failures for r in results),
        "lost_opens": sum(r.lost_opens for r in results),
        # what the decoder processes themselves cost, stepping (client library and replay)
        "decoder_cpu_cores": round(sum(r.cpu_seconds for r in results) / stepping, 2),
        "decoder_cpu_us_per_sequence_step": round(
            sum(r.cpu_seconds for r in results) * 1e6 / max(1, sum(r.sequence_steps for r in results)), 1
        ),
    }
    busy = _within(host or [], window)
    if len(busy) >= 2:
        (t0, b0), (t1, b1) = busy[0], busy[-1]
        out["host_cpu_cores_used"] = round((b1 - b0) / max(t1 - t0, 1e-9), 2)
        out["host_cores"] = os.cpu_count()
    hits, misses = sum(r.ahead_hits for r in results), sum(r.ahead_misses for r in results)
    if config.lookahead:
        out["lookahead"] = config.lookahead
        out["prespeculation_hit_rate"] = round(hits / max(1, hits + misses), 4)
    if samples and config.watch_pids:
        out["processes"] = _process_report(samples, config.watch_pids, window)
        # The watched processes are the servers: the CPU a sequence-draft costs them, and so
        # how many one fully used core serves (what a server process can reach with a core
        # to itself, however the machine is shared during the run).
        cores = sum(p["cpu_cores_used"] for p in out["processes"].values())
        if cores > 0 and out["server_drafts_per_s"]:
            out["server_cpu_us_per_draft"] = round(cores * 1e6 / out["server_drafts_per_s"], 1)
            out["drafts_per_server_core_s"] = round(out["server_drafts_per_s"] / cores, 1)
    if config.timeline_s > 0:
        out["timeline"] = _timeline(config, results, samples, began)
    return out


def _timeline(
    config: LoadConfig,
    results: list[DecoderResult],
    samples: list[tuple[float, dict[int, tuple[float, float]]]],
    began: float | None,
) -> list[dict]:
    """Per window of the run's clock: step latency p50/p99, sequence drafts/s, fallback-free
    share, and the watched processes' largest resident size (does memory plateau, does p99 stay
    put)."""
    starts = np.array([t + (0.0 if began is None else r.first_at - began) for r in results for t in r.started])
    lat = np.array([x for r in results for x in r.latencies]) * 1e3
    rows = []
    edge = 0.0
    while edge < (starts.max() if starts.size else 0.0):
        inside = (starts >= edge) & (starts < edge + config.timeline_s)
        row: dict = {"from_s": edge, "steps": int(inside.sum())}
        if inside.any():
            row["step_ms_p50"] = round(float(np.percentile(lat[inside], 50)), 3)
            row["step_ms_p99"] = round(float(np.percentile(lat[inside], 99)), 3)
            row["sequence_steps_per_s"] = round(float(inside.sum()) * config.batch / config.timeline_s, 1)
        for pid in config.watch_pids:
            rss = [s[pid][0] for t, s in samples if edge <= t < edge + config.timeline_s and pid in s]
            row[f"rss_mib_{pid}"] = round(max(rss), 1) if rss else None
        rows.append(row)
        edge += config.timeline_s
    return rows


def _within(series: list[tuple[float, float]], window: tuple[float, float] | None) -> list[tuple[float, float]]:
    """The points of ``series`` (seconds into the run, value) inside ``window``, or all of them
    when fewer than two fall inside."""
    inside = series if window is None else [(t, x) for t, x in series if window[0] <= t <= window[1]]
    return inside if len(inside) >= 2 else series


def _process_report(
    samples: list[tuple[float, dict[int, tuple[float, float]]]],
    pids: tuple[int, ...],
    window: tuple[float, float] | None = None,
) -> dict:
    """Per watched process: resident size over the run, and cores used while the decoders
    stepped (over the whole run when fewer than two samples fall inside)."""
    report = {}
    for pid in pids:
        seen = [(t, s[pid]) for t, s in samples if pid in s]
        if len(seen) < 2:
            continue
        rss = [m for _, (m, _) in seen]
        cpu = _within([(t, c) for t, (_, c) in seen], window)
        (t0, c0), (t1, c1) = cpu[0], cpu[-1]
        quarter = max(1, len(rss) // 4)
        report[str(pid)] = {
            "rss_mib_first": round(rss[0], 1),
            "rss_mib_last_quarter_max": round(max(rss[-quarter:]), 1),
            "rss_mib_max": round(max(rss), 1),
            "cpu_cores_used": round((c1 - c0) / max(t1 - t0, 1e-9), 2),
        }
    return report
