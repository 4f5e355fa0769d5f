"""What a vLLM verification step costs by the number of draft tokens it checks: the curve the
proposer's step cost (:mod:`decoder_client.engines.step_cost`) fits.

A proposer of its own (:class:`CurveProposer`, vLLM's ``custom_class``) proposes ``k`` tokens
that the model never produces at each step, ``k`` going round a list, and times each step from
its call to the next: every step verifies exactly ``k`` drafts, rejects them all and yields one
token, so the times differ by ``k`` only. One request at a time, on a real prompt (an agent
task's, ~1,600 tokens, or any token ids given), ``--steps`` steps per ``k``; the figures are
medians and quartiles by ``k``, one JSON line each, then one line with the knee and slope the
proposer's fit finds on the same steps.

    .venv-vllm/bin/python -m benchmarks.step_curve --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

KS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24)
OUT_ENV = "DRAFTCACHE_STEP_CURVE_OUT"  # where the proposer writes its step times (vLLM's worker process)


class CurveProposer:
    """vLLM's custom proposer: ``k`` never-accepted tokens per row, ``k`` cycling through
    :data:`KS` (those up to ``num_speculative_tokens``); the step times by ``k`` go to the JSON
    file named by :data:`OUT_ENV` after every step."""

    def __init__(self, vllm_config: Any) -> None:
        k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.ks = [k for k in KS if k <= k_max]
        vocab = int(vllm_config.model_config.get_vocab_size())
        self.never = list(range(vocab - 1, vocab - 1 - k_max, -1))  # ids the model does not produce
        self.out = Path(os.environ[OUT_ENV])
        self.times: dict[int, list[float]] = defaultdict(list)
        self.calls = 0
        self.last: tuple[float, int] | None = None  # the last call's time and what it proposed

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        now = time.perf_counter()
        decoding = bool(sampled_token_ids) and all(len(s) for s in sampled_token_ids)
        if self.last is not None and decoding:
            self.times[self.last[1]].append(now - self.last[0])
        k = self.ks[self.calls % len(self.ks)]
        self.calls += 1
        self.last = (now, k) if decoding else None  # a prompt's evaluation is not a step of the curve
        self.out.write_text(json.dumps({str(key): v for key, v in self.times.items()}))
        return [self.never[:k] if len(s) else [] for s in sampled_token_ids]


def curve(times: dict[int, list[float]]) -> list[dict[str, Any]]:
    """Median and quartiles (ms) of the step times by ``k``.

    >>> curve({2: [0.05, 0.06, 0.07], 0: [0.05]})[1]
    {'proposed': 2, 'steps': 3, 'median_ms': 60.0, 'p25_ms': 55.0, 'p75_ms': 65.0}
    """
    rows = []
    for k in sorted(times):
        ms = 1e3 * np.array(times[k])
        p25, median, p75 = np.percentile(ms, [25, 50, 75])
        rows.append(
            {
                "proposed": k,
                "steps": int(ms.size),
                "median_ms": round(float(median), 2),
                "p25_ms": round(float(p25), 2),
                "p75_ms": round(float(p75), 2),
            }
        )
    return rows


def fitted(times: dict[int, list[float]]) -> dict[str, Any]:
    """What the proposer's step cost makes of these steps (one row, nothing accepted)."""
    from decoder_client.engines.step_cost import WINDOW, StepCost

    cost = StepCost(prior=0.3, window=max(WINDOW, sum(len(v) for v in times.values())))
    n = max(len(v) for v in times.values())
    for i in range(n):  # interleaved, as the steps ran
        for k, v in times.items():
            if i < len(v):
                cost.record(v[i], k, rows=1, produced=1)
    s = cost.summary()
    return {key: s[key] for key in ("step_base_ms", "step_drafting_ms", "step_per_token_ms", "step_free_tokens")}


def prompt_ids(path: str | None) -> list[int]:
    """Token ids to decode after: a JSON list from ``path``, else the first agent task of the
    engines benchmark's workload (SmolLM2's tokenizer, the shared data folder)."""
    if path:
        ids = json.loads(Path(path).read_text())
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise SystemExit(f"{path}: a JSON list of token ids was expected")
        return ids
    from transformers import AutoTokenizer

    from benchmarks.engine_workloads import agent_repeat

    data = Path(os.environ.get("DRAFTCACHE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data"
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizers/smollm2")
    return list(agent_repeat(data / "traces/swe_agent_dev.jsonl.gz", tokenizer, 1, 1500)[0].ids)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: SmolLM2 made from its GGUF)")
    p.add_argument("--prompt", help="a JSON list of token ids (default: an agent task's prompt)")
    p.add_argument("--steps", type=int, default=40, help="steps per number of proposed tokens")
    p.add_argument("--k", type=int, default=24, help="the most tokens proposed (num_speculative_tokens)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="data/step-curve.json", help="the proposer's step times")
    a = p.parse_args(argv)
    if a.steps < 1 or not 1 <= a.k <= max(KS):
        p.error(f"--steps must be >= 1 and --k in [1, {max(KS)}]")
    from vllm import LLM, SamplingParams

    from decoder_client.models import smollm2_hf_folder

    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ[OUT_ENV] = str(out)
    ids = prompt_ids(a.prompt)
    llm = LLM(
        model=a.model or str(smollm2_hf_folder()),
        max_model_len=len(ids) + a.steps * len(KS) + 8,
        dtype=a.dtype,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={
            "method": "custom_class",
            "model": f"{__name__}.CurveProposer",
            "num_speculative_tokens": a.k,
        },
    )
    steps = a.steps * len([k for k in KS if k <= a.k])
    sampling = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
    times = {int(k): v for k, v in json.loads(out.read_text()).items()}
    for row in curve(times):
        print(json.dumps({"context_tokens": len(ids), "dtype": a.dtype, **row}))
    print(json.dumps({"fit": fitted(times)}))


if __name__ == "__main__":
    main()
