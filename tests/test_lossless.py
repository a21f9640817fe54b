"""Greedy DFlash output == greedy autoregressive output == HF generate(), token for token (fp32)."""

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import BIAS_TOKEN
from trtllm_dflash.runtime.decoding import Decoder, Request, prefill_groups

MAX_NEW = [1, 5, 17, 40, 33, 64]  # per request; 6 requests on 4 slots: requests join mid-run


def requests(vocab_size: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 30, 9, 17, 1, 24]
    return [Request(id=i, prompt_token_ids=torch.randint(4, vocab_size, (n,), generator=g).tolist(), max_new_tokens=m)
            for i, (n, m) in enumerate(zip(lengths, MAX_NEW))]


def run(engine, mode, reqs, stop_ids=()):
    results = Decoder.for_mode(engine.executor, mode, stop_ids).generate(reqs)
    return {r.request.id: r for r in results}


@pytest.fixture(scope="module")
def hf_outputs(biased_pairs):
    hf = AutoModelForCausalLM.from_pretrained(str(biased_pairs[8] / "target"), dtype=torch.float32).eval()
    out = {}
    for req in requests(hf.config.vocab_size):
        ids = torch.tensor([req.prompt_token_ids])
        gen = hf.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
        out[req.id] = gen[0, ids.shape[1]:].tolist()
    return out


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_dflash_equals_ar_equals_hf_generate(biased_engines, hf_outputs, block_size):
    engine = biased_engines[block_size]
    reqs = requests(engine.executor.vocab_size)
    dflash, ar = run(engine, "dflash", reqs), run(engine, "ar", reqs)
    for req in reqs:
        assert dflash[req.id].output_token_ids == ar[req.id].output_token_ids == hf_outputs[req.id], req.id
        assert dflash[req.id].finish_reason == "length"
        assert len(dflash[req.id].output_token_ids) == req.max_new_tokens
    steps = [n for r in dflash.values() for n in r.acceptance_lengths]
    # The pair accepts some drafts and rejects others, so both branches ran.
    assert all(1 <= n <= block_size for n in steps)
    assert {1, block_size} <= set(steps)
    if block_size > 2:
        assert any(1 < n < block_size for n in steps)


def test_stop_token_inside_an_accepted_block_ends_the_request(biased_engines):
    engine = biased_engines[16]
    reqs = requests(engine.executor.vocab_size)
    plain = run(engine, "ar", reqs)
    # Stop at the first occurrence of the frequent token, often in the middle of an accepted block.
    stopped_ar, stopped_dflash = run(engine, "ar", reqs, [BIAS_TOKEN]), run(engine, "dflash", reqs, [BIAS_TOKEN])
    hits = 0
    for req in reqs:
        full = plain[req.id].output_token_ids
        if BIAS_TOKEN in full:
            hits += 1
            want, reason = full[: full.index(BIAS_TOKEN) + 1], "stop"
        else:
            want, reason = full, "length"
        for got in (stopped_ar[req.id], stopped_dflash[req.id]):
            assert (got.output_token_ids, got.finish_reason) == (want, reason)
    assert hits >= 3


def test_batching_does_not_change_a_request(biased_engines):
    engine = biased_engines[8]
    reqs = requests(engine.executor.vocab_size)
    together = run(engine, "dflash", reqs)
    for req in reqs:
        alone = run(engine, "dflash", [req])[req.id]
        assert alone.output_token_ids == together[req.id].output_token_ids
        assert alone.acceptance_lengths == together[req.id].acceptance_lengths


@pytest.mark.parametrize("block_size", [2, 5])
def test_shorter_blocks_of_a_trained_drafter_stay_lossless(biased_pairs, hf_outputs, tmp_path, block_size):
    """A drafter trained at block 16 drafting fewer tokens per block (run-time --block-size)."""
    from tests.conftest import build
    from trtllm_dflash.runtime.runner import Engine

    engine = Engine.load(build(biased_pairs[16], tmp_path / "engine", max_batch_size=4), block_size=block_size)
    reqs = requests(engine.executor.vocab_size)
    dflash = run(engine, "dflash", reqs)
    assert all(dflash[r.id].output_token_ids == hf_outputs[r.id] for r in reqs)
    steps = [n for r in dflash.values() for n in r.acceptance_lengths]
    assert max(steps) == block_size


def test_prefill_groups_pad_only_where_a_pass_costs_more():
    # By increasing length; the next prompt joins while n x (its length - the group's longest) <= pass_tokens.
    assert prefill_groups([10, 100, 12, 95, 11, 300], pass_tokens=32) == [[0, 4, 2], [3, 1], [5]]
    assert prefill_groups([40, 8, 40], pass_tokens=32) == [[1, 0, 2]]  # 1 x 32 joins, then 2 x 0
    assert prefill_groups([41, 8, 41], pass_tokens=32) == [[1], [0, 2]]  # 1 x 33 does not
    assert prefill_groups([1, 2, 3], pass_tokens=0) == [[0], [1], [2]]
    assert prefill_groups([1, 2, 300], pass_tokens=10**6) == [[0, 1, 2]]
    assert prefill_groups([], pass_tokens=32) == []


def test_admitted_prompts_prefill_in_length_groups(biased_engines):
    """On the CPU, the first step's 4 prompts (3, 30, 9 and 17 tokens) prefill as [3, 9, 17] padded to 17 and [30]
    alone, and the outputs stay AR's (test_greedy_dflash_equals_ar_equals_hf_generate runs the same requests)."""
    engine = biased_engines[8]
    ex, shapes = engine.executor, []
    forward = ex.target_forward
    ex.target_forward = lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or forward(ids, *a, **k)
    try:
        decoder = Decoder.for_mode(ex, "ar", ())
        for req in requests(ex.vocab_size):
            decoder.submit(req)
        decoder.step()
    finally:
        del ex.target_forward
    assert shapes[:2] == [(3, 17), (1, 30)]


class CountingExecutor:
    """The real executor, its passes counted by kind (instrumentation: every call runs the real pass)."""

    def __init__(self, executor):
        self.executor, self.calls = executor, Counter()

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None):
        self.calls["prefill" if last_index is not None else "verify"] += 1
        return self.executor.target_forward(token_ids, starts, slots, capture, last_index, rows=rows)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None):
        self.calls["draft"] += 1
        self.calls["draft adding context"] += context is not None
        return self.executor.draft(anchors, starts, slots, num_drafts, context, rows=rows, width=width)

    def append_context(self, hidden, starts, slots, rows=None):
        self.calls["append_context"] += 1
        return self.executor.append_context(hidden, starts, slots, rows=rows)


def test_a_step_runs_one_drafter_pass(biased_engines):
    """The features a step commits join the next draft pass: after its prefill, a request costs the drafter one
    pass a step (no context update of its own), and its tokens are AR's."""
    engine = biased_engines[8]
    reqs = requests(engine.executor.vocab_size)
    counting = CountingExecutor(engine.executor)
    dflash = {r.request.id: r for r in Decoder.for_mode(counting, "dflash", ()).generate(reqs)}
    ar = run(engine, "ar", reqs)
    assert all(dflash[r.id].output_token_ids == ar[r.id].output_token_ids for r in reqs)
    calls = counting.calls
    assert calls["append_context"] == calls["prefill"]  # the prompts' features only
    assert calls["draft"] == calls["verify"] > 0
    # Every draft but one right after a prefill adds what the step before committed.
    assert calls["draft adding context"] >= calls["draft"] - calls["prefill"]
