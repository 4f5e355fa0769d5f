"""The admin subcommands under bad input and faults: real Redis, real files, real sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import migrations
from cache_service.admin.commands import write_atomic
from cache_service.cli import main
from cache_service.storage.connect import connect
from cache_service.storage.redis_store import RedisStore
from tests.integration.conftest import sharegpt


def _warm(tokenizer: Path, corpus: Path, *more: str) -> list[str]:
    return ["warm", "--namespace", "llama2", "--tokenizer", str(tokenizer), "--corpus", str(corpus), *more]


@pytest.mark.parametrize("fmt", ["sharegpt", "jsonl"])
def test_a_corpus_of_empty_documents_leaves_the_prior_in_place(
    tmp_path: Path, llama_tokenizer: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    out = tmp_path / "prior.npz"
    good = sharegpt(tmp_path / "good.json.gz", ["The quick brown fox jumps over the lazy dog."] * 3)
    assert main(_warm(llama_tokenizer, good, "--out", str(out))) == 0
    before = out.read_bytes()
    if fmt == "sharegpt":
        empty = sharegpt(tmp_path / "empty.json.gz", ["", "", ""])
    else:
        empty = tmp_path / "empty.jsonl"
        empty.write_text('{"text": ""}\n' * 3)
    capsys.readouterr()
    assert main([*_warm(llama_tokenizer, empty, "--out", str(out)), "--format", fmt]) == 2
    err = capsys.readouterr().err
    assert empty.name in err and "3 documents are all empty" in err
    assert out.read_bytes() == before  # an empty prior does not replace a good one
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("prior")] == ["prior.npz"]


def test_a_lifetime_warm_run_again_appends_each_document_once(
    tmp_path: Path, llama_tokenizer: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A rerun after a failure midway, or by mistake: the log takes only what it lacks.
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox.", "Jumps over the lazy dog."])
    args = [*_warm(llama_tokenizer, corpus, "--lifetime"), "--redis-url", redis_url]
    assert main(args) == 0
    assert "2 documents appended;" in capsys.readouterr().out
    assert main(args) == 0
    assert "0 documents appended, 2 were in it already" in capsys.readouterr().out
    store = RedisStore(connect(redis_url))
    assert [e.tokens.size for e in store.read_log("llama2")] == [6, 7]  # each once, in order
    other = sharegpt(tmp_path / "d.json.gz", ["The quick brown fox."])  # another corpus is its own
    assert main([*_warm(llama_tokenizer, other, "--lifetime"), "--redis-url", redis_url]) == 0
    assert [e.tokens.size for e in store.read_log("llama2")] == [6, 7, 6]


def test_warm_writes_nothing_into_a_newer_key_schema(
    tmp_path: Path, llama_tokenizer: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = connect(redis_url)
    client.set("draftcache:schema_version", 99)  # written by a newer build
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox jumps over the lazy dog."] * 3)
    for mode in ([], ["--lifetime"]):
        assert main([*_warm(llama_tokenizer, corpus, *mode), "--redis-url", redis_url]) == 2
        assert "newer than this build knows" in capsys.readouterr().err
    assert client.keys("*") == [b"draftcache:schema_version"]


def test_sessions_reads_only_the_key_schema_it_serves(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "--redis-url", redis_url]) == 0  # an empty Redis holds none
    assert "0 sessions in storage" in capsys.readouterr().out
    client = connect(redis_url)
    client.set("draftcache:schema_version", 99)  # written by a newer build: its records are not ours to read
    assert main(["sessions", "--redis-url", redis_url]) == 2
    assert "newer than this build knows" in capsys.readouterr().err
    assert client.keys("*") == [b"draftcache:schema_version"]


def test_warm_initialises_an_empty_redis_as_serve_does(tmp_path: Path, llama_tokenizer: Path, redis_url: str) -> None:
    corpus = sharegpt(tmp_path / "c.json.gz", ["The quick brown fox jumps over the lazy dog."] * 3)
    assert main([*_warm(llama_tokenizer, corpus), "--redis-url", redis_url]) == 0
    assert migrations.check(connect(redis_url)) == migrations.LATEST


def test_writers_of_one_prior_file_at_once_each_replace_it_whole(tmp_path: Path) -> None:
    out = tmp_path / "prior.npz"
    blobs = [bytes([i]) * (8 << 20) for i in range(4)]
    errors: list[BaseException] = []

    def write(blob: bytes) -> None:
        try:
            for _ in range(3):
                write_atomic(out, blob)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert out.read_bytes() in blobs  # one writer's file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["prior.npz"]  # no temporary file left


@pytest.fixture
def frozen_target() -> Iterator[str]:
    """An address whose kernel takes connections that nothing ever answers, as a stopped service."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("command", [["stats"], ["rebuild"], ["namespaces", "list"], ["namespaces", "delete", "x"]])
def test_admin_calls_to_a_frozen_service_end_at_the_timeout(
    frozen_target: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    assert main([*command, "--target", frozen_target, "--timeout", "1"]) == 2
    assert time.monotonic() - start < 10
    assert "DEADLINE_EXCEEDED" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_timeout_is_a_positive_number_of_seconds(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["stats", "--timeout", value])
    assert "must be a number of seconds above 0" in capsys.readouterr().err
