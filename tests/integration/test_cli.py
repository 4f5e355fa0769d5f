"""The ``draftcache`` command end to end, in-process, on small real inputs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from cache_service.cli import main
from indexer.prior import StaticPrior
from tests.integration.conftest import sharegpt

CONVERSATIONS = [
    {
        "id": "a",
        "namespace": "toy",
        "category": "copy",
        "segments": [
            {"kind": "input", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
            {"kind": "output", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
        ],
    },
    {
        "id": "b",
        "namespace": "toy",
        "category": "repeat",
        "segments": [
            {"kind": "input", "tokens": [20, 21]},
            {"kind": "output", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]},
        ],
    },
]


def _write_traces(path: Path, conversations: list[dict]) -> Path:
    with gzip.open(path, "wt") as fh:
        for conv in conversations:
            fh.write(json.dumps(conv) + "\n")
    return path


def test_replay_json_reports_every_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", CONVERSATIONS)
    assert main(["replay", str(traces), "--baselines", "prompt-lookup", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ours, pld = out["results"]
    assert ours["drafter"] == "draftcache" and pld["drafter"].startswith("prompt-lookup")
    assert ours["output_tokens"] == pld["output_tokens"] == 18  # both outputs, once each
    # Request "b" repeats request "a"'s output: the lifetime buffer drafts it, prompt lookup can't.
    assert ours["mat_by_category"]["repeat"] > pld["mat_by_category"]["repeat"]
    assert ours["mat"] > 1.0


def test_budget_from_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", CONVERSATIONS)
    monkeypatch.setenv("DRAFTCACHE_BUDGET", "2")
    assert main(["replay", str(traces), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["drafted_per_step"] <= 2  # DRAFTCACHE_BUDGET caps every tree


def test_replay_rejects_a_corrupt_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"namespace": "toy", "segments": [{"kind": "output", "tokens": [1, -5]}]}\n')
    assert main(["replay", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err  # the error names the file and line


# A second tokenizer's traffic: its ids overlap toy's but mean other things. Its request "c"
# repeats toy's output ids, which only a memory shared across namespaces could draft.
OTHER = {
    "id": "c",
    "namespace": "other",
    "category": "repeat",
    "segments": [{"kind": "input", "tokens": [30, 31]}, {"kind": "output", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]}],
}
MIXED = [CONVERSATIONS[0], OTHER, CONVERSATIONS[1], {**OTHER, "id": "d"}]


def _replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["replay", *args, "--baselines", "prompt-lookup", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _drafts(by_namespace: dict) -> dict:
    """What the drafters drafted, without their timings."""
    return {ns: [{k: v for k, v in r.items() if "_us_" not in k} for r in rows] for ns, rows in by_namespace.items()}


def test_replay_of_several_namespaces_keeps_them_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", MIXED)
    out = _replay_json(capsys, str(traces))
    alone = {name: _replay_json(capsys, str(traces), "--namespace", name)["results"] for name in ("toy", "other")}
    # Each namespace replays as it would alone, on drafters of its own: "other" draws nothing
    # from toy's memory, though its first request repeats toy's ids.
    assert list(out["by_namespace"]) == ["toy", "other"]  # in the order they first appear
    assert _drafts(out["by_namespace"]) == _drafts(alone)
    other = alone["other"][0]
    assert other["requests"] == 2 and other["mat_by_category"]["repeat"] < 9 / 2  # its own history only
    # The merged rows add the namespaces' tokens and steps up.
    for j, row in enumerate(out["results"]):
        parts = [alone[name][j] for name in ("toy", "other")]
        assert row["drafter"] == parts[0]["drafter"]
        assert row["output_tokens"] == sum(p["output_tokens"] for p in parts) == 36
        assert row["steps"] == sum(p["steps"] for p in parts)
        assert row["mat"] == pytest.approx(36 / row["steps"], abs=1e-4)
    assert main(["replay", str(traces), "--baselines", "prompt-lookup"]) == 0
    text = capsys.readouterr().out
    assert "MAT by namespace" in text and "  other" in text


def test_replay_options_for_one_tokenizer_need_one_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", MIXED)
    for extra in (["--vocab-size", "100"], ["--prior", str(tmp_path / "p")], ["--warm-corpus", str(tmp_path / "c")]):
        assert main(["replay", str(traces), *extra]) == 2
        err = capsys.readouterr().err
        assert extra[0] in err and "--namespace" in err and "'other'" in err
    assert main(["replay", str(traces), "--namespace", "toy", "--vocab-size", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["output_tokens"] == 18
    assert main(["replay", str(traces), "--namespace", "nope"]) == 2
    assert "no conversations in namespace 'nope'" in capsys.readouterr().err


def test_warm_writes_a_loadable_prior(
    tmp_path: Path, llama_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox jumps over the lazy dog."] * 3)
    out = tmp_path / "prior.npz"
    args = [
        "warm",
        "--namespace",
        "llama2",
        "--tokenizer",
        str(llama_tokenizer),
        "--corpus",
        str(corpus),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    prior = StaticPrior.from_bytes(out.read_bytes())
    assert prior.source_tokens > 0
    # Every text occurred three times, so its n-grams pass min_count and the prior knows them.
    assert any(t.leaders > 0 for t in prior.tables)


def test_warm_lifetime_appends_documents_to_the_log(
    tmp_path: Path, llama_tokenizer: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cache_service.storage.connect import connect
    from cache_service.storage.redis_store import RedisStore

    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox.", "Jumps over the lazy dog."])
    args = ["warm", "--namespace", "llama2", "--tokenizer", str(llama_tokenizer), "--corpus", str(corpus)]
    assert main([*args, "--lifetime", "--redis-url", redis_url]) == 0
    store = RedisStore(connect(redis_url))
    entries = store.read_log("llama2")
    assert [e.tokens.size for e in entries] == [6, 7]  # one request per answer, in order
    assert store.namespaces()["llama2"] == 32000
    assert "2 documents appended" in capsys.readouterr().out
    assert main([*args, "--lifetime", "--redis-url", redis_url, "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize(
    ("name", "payload", "fmt"),
    [
        ("truncated.json.gz", None, "sharegpt"),
        ("notalist.json", '{"conversations": []}', "sharegpt"),
        ("bad.jsonl", '{"text": "ok"}\nnot json\n', "jsonl"),
        ("notext.jsonl", '{"body": "x"}\n', "jsonl"),
    ],
)
def test_warm_rejects_corrupt_corpora(
    tmp_path: Path, llama_tokenizer: Path, capsys: pytest.CaptureFixture[str], name: str, payload: str | None, fmt: str
) -> None:
    corpus = tmp_path / name
    if payload is None:  # a gzip stream cut in half
        full = gzip.compress(json.dumps([{"conversations": [{"from": "gpt", "value": "x" * 5000}]}]).encode())
        corpus.write_bytes(full[: len(full) // 2])
    else:
        corpus.write_text(payload)
    out = tmp_path / "prior.npz"
    args = ["warm", "--namespace", "llama2", "--tokenizer", str(llama_tokenizer), "--corpus", str(corpus)]
    assert main([*args, "--format", fmt, "--out", str(out)]) == 2
    assert str(corpus.name) in capsys.readouterr().err  # the error names the corpus
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()  # nothing published


def test_warm_refuses_to_publish_a_prior_outside_the_namespace_vocabulary(
    tmp_path: Path, llama_tokenizer: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cache_service.storage.connect import connect
    from cache_service.storage.redis_store import RedisStore
    from indexer.prior import PriorConfig

    # Followers of "5 6" are ids of a bigger vocabulary than llama2's 32000.
    tokens = np.array([5, 6, 40000, 40001, 40002, 40003, 7] * 50, dtype=np.int32)
    foreign = tmp_path / "foreign.npz"
    foreign.write_bytes(StaticPrior.build(tokens, PriorConfig(orders=(1, 2), follower_len=4)).to_bytes())
    args = ["warm", "--namespace", "llama2", "--tokenizer", str(llama_tokenizer), "--redis-url", redis_url]
    assert main([*args, "--from-prior", str(foreign)]) == 2
    assert "follower id 40003 is outside the vocabulary [0, 32000)" in capsys.readouterr().err
    store = RedisStore(connect(redis_url))
    assert store.namespaces() == {} and store.prior_version("llama2") is None  # nothing published
    own = tmp_path / "own.npz"  # the same shape inside the vocabulary is published
    own.write_bytes(StaticPrior.build(tokens % 32000, PriorConfig(orders=(1, 2), follower_len=4)).to_bytes())
    assert main([*args, "--from-prior", str(own)]) == 0
    assert store.namespaces() == {"llama2": 32000} and store.prior_version("llama2") == 1


def test_warm_publishes_into_a_namespace_registered_with_the_models_padded_vocabulary(
    tmp_path: Path, llama_tokenizer: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine created the namespace with its model's vocabulary, padded past the tokenizer's
    32,000 ids (32,064, as Phi-3 pads the same tokenizer): a prior and a lifetime corpus warmed
    with the tokenizer go into it; a namespace of another tokenizer's size is refused."""
    from cache_service.storage.connect import connect
    from cache_service.storage.redis_store import RedisStore

    store = RedisStore(connect(redis_url))
    store.register_namespace("padded", 32064)
    store.register_namespace("mistral", 32768)
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox."] * 3)
    for name, code in (("padded", 0), ("mistral", 2)):
        args = ["warm", "--namespace", name, "--tokenizer", str(llama_tokenizer), "--corpus", str(corpus)]
        assert main([*args, "--redis-url", redis_url]) == code, name
        assert main([*args, "--redis-url", redis_url, "--lifetime"]) == code, name
    assert store.namespaces() == {"padded": 32064, "mistral": 32768}
    assert store.prior_version("padded") == 1 and store.prior_version("mistral") is None
    assert len(store.read_log("padded")) == 3 and store.read_log("mistral") == []
    assert "registered with vocab_size 32768, not 32000" in capsys.readouterr().err


def test_warm_registers_its_tokenizer_and_refuses_another_of_the_same_size(
    tmp_path: Path, shared_data: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tokenizer's fingerprint goes with the namespace (the one engines of it state); a
    tokenizer of the same size that is another (two pieces trade ids) publishes nothing there."""
    from cache_service.storage.connect import connect
    from cache_service.storage.redis_store import RedisStore

    smollm2 = shared_data / "tokenizers" / "smollm2"
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    vocab[by_id[300]], vocab[by_id[301]] = 301, 300
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(spec))
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox."] * 3)
    store = RedisStore(connect(redis_url))
    for tokenizer, code in ((smollm2, 0), (other, 2)):
        args = ["warm", "--namespace", "smol", "--tokenizer", str(tokenizer), "--corpus", str(corpus)]
        assert main([*args, "--redis-url", redis_url]) == code, tokenizer
        assert main([*args, "--redis-url", redis_url, "--lifetime"]) == code, tokenizer
    assert store.namespaces() == {"smol": 49152} and store.tokenizers(["smol"]) == {"smol": "9f9b052c2dfc9277"}
    assert store.prior_version("smol") == 1 and len(store.read_log("smol")) == 3  # the first tokenizer's only
    assert "holds the ids of tokenizer 9f9b052c2dfc9277" in capsys.readouterr().err


def test_warm_rejects_a_wrong_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = sharegpt(tmp_path / "c.json.gz", ["hello"])
    fake = tmp_path / "tok"
    fake.mkdir()
    (fake / "tokenizer.json").write_text("{not a tokenizer")
    out = tmp_path / "prior.npz"
    args = ["warm", "--namespace", "x", "--tokenizer", str(fake), "--corpus", str(corpus), "--out", str(out)]
    assert main(args) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert not out.exists()


def _tokens(tokenizer: Path, text: str) -> list[int]:
    from cache_service.admin.warm import load_tokenizer

    return load_tokenizer(tokenizer)[0]([text])[0]


def test_replay_beside_rest_builds_its_datastore_from_every_turn(
    tmp_path: Path, llama_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("draftretriever")
    story = "Once upon a time there was a little cache that remembered every token it had ever seen."
    question = "Please tell me the story about the little cache and what it remembered."
    corpus = tmp_path / "c.json.gz"
    with gzip.open(corpus, "wt") as fh:  # the story only as a user's turn: REST keeps every turn
        turns = [{"from": "human", "value": story}, {"from": "gpt", "value": "ok"}]
        json.dump([{"id": "0", "conversations": turns}], fh)
    traces = _write_traces(
        tmp_path / "t.jsonl.gz",
        [
            {
                "id": "s",
                "namespace": "llama2",
                "category": "story",
                "segments": [
                    {"kind": "input", "tokens": _tokens(llama_tokenizer, question)},
                    {"kind": "output", "tokens": _tokens(llama_tokenizer, story)},
                ],
            }
        ],
    )
    store = tmp_path / "rest.idx"
    args = ["replay", str(traces), "--baselines", "prompt-lookup,rest", "--rest-datastore", str(store)]
    args += ["--warm-corpus", str(corpus), "--tokenizer", str(llama_tokenizer), "--json"]
    assert main(args) == 0
    assert store.exists() and not store.with_name(store.name + ".tmp").exists()
    results = {r["drafter"].split("(")[0]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(results) == {"draftcache", "prompt-lookup", "rest"}
    # The output is the corpus's text: REST drafts it, prompt lookup has nothing to copy from.
    assert results["rest"]["mat"] > 1.5 > results["prompt-lookup"]["mat"]
    assert main([*args[:-1], "--json"]) == 0  # a second run reads the datastore it built


def test_replay_with_the_corpus_in_lifetime_memory_drafts_what_it_holds_once(
    tmp_path: Path, llama_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    story = "Once upon a time there was a little cache that remembered every token it had ever seen."
    corpus = tmp_path / "c.json.gz"
    with gzip.open(corpus, "wt") as fh:  # the story once: too rare for the prior's tables
        turns = [{"from": "human", "value": "Tell me a story."}, {"from": "gpt", "value": story}]
        json.dump([{"id": "0", "conversations": turns}], fh)
    question = _tokens(llama_tokenizer, "Please tell me the story about the little cache.")
    traces = _write_traces(
        tmp_path / "t.jsonl.gz",
        [
            {
                "id": "s",
                "namespace": "llama2",
                "segments": [
                    {"kind": "input", "tokens": question},
                    {"kind": "output", "tokens": _tokens(llama_tokenizer, story)},
                ],
            }
        ],
    )
    args = ["replay", str(traces), "--warm-corpus", str(corpus), "--tokenizer", str(llama_tokenizer), "--json"]
    mat = {}
    for flags in ([], ["--corpus-lifetime"]):
        assert main([*args, *flags]) == 0
        mat[bool(flags)] = json.loads(capsys.readouterr().out)["results"][0]["mat"]
    assert mat[True] > 2.0 and mat[True] > 1.5 * mat[False]
    # Without the corpus, or through a service (warmed with 'draftcache warm --lifetime'), it says so.
    assert main(["replay", str(traces), "--corpus-lifetime", "--tokenizer", str(llama_tokenizer)]) == 2
    assert "--warm-corpus" in capsys.readouterr().err
    assert main([*args, "--corpus-lifetime", "--target", "127.0.0.1:1"]) == 2
    assert "warm --lifetime" in capsys.readouterr().err


def test_rest_needs_a_datastore_or_a_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("draftretriever")
    traces = _write_traces(tmp_path / "t.jsonl.gz", CONVERSATIONS)
    assert main(["replay", str(traces), "--baselines", "rest"]) == 2
    assert "--rest-datastore" in capsys.readouterr().err
    missing = tmp_path / "none.idx"
    assert main(["replay", str(traces), "--baselines", "rest", "--rest-datastore", str(missing)]) == 2
    assert "--warm-corpus" in capsys.readouterr().err and not missing.exists()


def test_rest_datastore_from_a_corrupt_corpus_is_refused(tmp_path: Path, llama_tokenizer: Path) -> None:
    pytest.importorskip("draftretriever")
    from benchmarks.replay_bench import build_rest_datastore
    from cache_service.admin.warm import CorpusError

    corpus = tmp_path / "c.json.gz"
    full = gzip.compress(json.dumps([{"conversations": [{"from": "gpt", "value": "x" * 5000}]}]).encode())
    corpus.write_bytes(full[: len(full) // 2])
    out = tmp_path / "rest.idx"
    with pytest.raises(CorpusError, match=r"c\.json\.gz"):
        build_rest_datastore(corpus, "sharegpt", llama_tokenizer, out)
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


def test_replay_chain_reports_chains_of_every_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", CONVERSATIONS)
    assert main(["replay", str(traces), "--chain", "4", "--baselines", "prompt-lookup", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [r["drafter"] for r in out["results"]]
    # Ours in chain mode, beside our tree cut to its best path and prompt lookup of 4 tokens.
    assert names == ["draftcache", "draftcache-tree/best_chain(4)", "prompt-lookup(n=1..3,k=4)"]
    for r in out["results"]:
        # No drafter proposes more than 4 tokens a step.
        assert r["drafted_per_step"] <= 4
    # Request "b" repeats request "a"'s output: in chains of 4 it still takes fewer steps.
    assert out["results"][0]["mat_by_category"]["repeat"] > 1.0


def test_replay_step_cost_reports_tokens_per_step_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _write_traces(tmp_path / "t.jsonl.gz", CONVERSATIONS)
    assert main(["replay", str(traces), "--chain", "4", "--step-cost", "0.1", "--json"]) == 0
    for r in json.loads(capsys.readouterr().out)["results"]:
        # What an engine paying a tenth of a step per proposed token gets from the drafter.
        assert r["step_cost"] == 0.1
        assert r["tokens_per_step_time"] == pytest.approx(r["mat"] / (1 + 0.1 * r["drafted_per_step"]), rel=0.01)
        assert r["tokens_per_step_time"] < r["mat"]
    assert main(["replay", str(traces), "--chain", "4", "--step-cost", "0.1"]) == 0
    assert "per cost" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="step-cost"):
        main(["replay", str(traces), "--step-cost", "-1"])


def test_serve_flags_default_to_the_service_configs_own() -> None:
    from cache_service.cli import build_parser
    from cache_service.config import ServiceConfig

    a = build_parser().parse_args(["serve"])
    config = ServiceConfig()
    assert (a.rebuild_interval, a.follow_interval, a.flush_interval, a.session_ttl) == (
        config.rebuild_interval_s,
        config.follow_interval_s,
        config.flush_interval_s,
        config.session_ttl_s,
    )
    tuned = build_parser().parse_args(["serve", "--follow-interval", "2", "--flush-interval", "5"])
    assert (tuned.follow_interval, tuned.flush_interval) == (2.0, 5.0)
