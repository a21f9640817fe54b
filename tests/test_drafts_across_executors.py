"""The three executors draft the same tokens, step for step: torch (the reference), onnxruntime and the TensorRT
executor (its bindings run by onnxruntime stand-ins of TensorRT's contexts, which keep the plans' profile:
tests/tensorrt_standin.py), with `--block-size auto`'s decoding path (prompt features held back, plain AR steps,
the drafter's context flushed for some requests only) and requests of different lengths joining mid-run.

Tokens alone would not show a wrong draft: a damaged drafter cache only lowers acceptance (issue 27: a flush for
some rows wrote padding into the drafter cache of the running request between them). So the drafts are compared,
and a call on rows with a gap is checked against the caches of the row it skips."""

from __future__ import annotations

import random

import pytest
import torch

from tests.tensorrt_standin import standin_executor
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.speculative.schedule import AutoBlockSize

pytest.importorskip("onnxruntime")
pytestmark = [pytest.mark.slow,  # every test here needs an engine with ONNX graphs (conftest: ~1 min to export)
              pytest.mark.usefixtures("one_torch_thread")]
LONG_PROMPT = 300  # longer than a TensorRT plan's pass (PASS_TOKENS 256): the prefill runs in two passes


@pytest.fixture
def engine(biased_ort_engine):
    """A biased pair (drafts often accepted) with ONNX graphs, 4 slots, max_seq_len 512 (passes of 256)."""
    return biased_ort_engine


def executor(engine, name: str):
    return standin_executor(engine) if name == "tensorrt" else Engine.load(engine, backend=name).executor


class Recorder:
    """An executor, unchanged, that also keeps every draft it returns and the cache rows of every append_context."""

    def __init__(self, executor):
        self._executor, self.drafts, self.context_rows = executor, [], []

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None):
        out = self._executor.draft(anchors, starts, slots, num_drafts, context, rows=rows, width=width)
        self.drafts.append(out.clone())
        return out

    def append_context(self, hidden, starts, slots, rows=None):
        cache_rows = getattr(self._executor, "_rows", None)
        if cache_rows is not None:  # the rows these slots hold now (a new request has none yet)
            self.context_rows.append(sorted(cache_rows._row.get(s) for s in slots.tolist() if s in cache_rows._row))
        self._executor.append_context(hidden, starts, slots, rows=rows)


class ScriptedAuto(AutoBlockSize):
    """`--block-size auto` with its choices scripted instead of priced from measured costs (which differ from run to
    run): `first`, then a seeded random sequence; every executor gets the same verify lengths, 1 (an AR step) included."""

    def __init__(self, block_size: int, first: tuple[int, ...], seed: int = 3):
        super().__init__(costs=None, block_size=block_size)
        self.first, self.rng = list(first), random.Random(seed)

    def choose(self, batch, context, requests=(), pending=0.0, remaining=None) -> int:
        return self.first.pop(0) if self.first else self.rng.choice([1, 1, 2, 4, self.block_size])

    def observe_time(self, batch, context, k, seconds, pending=0.0) -> None:
        pass


def requests(vocab: int) -> list[Request]:
    """11 requests for 4 slots, prompts of 9 .. LONG_PROMPT tokens, greedy and sampled. With SCRIPT's verify lengths
    and request 0 cancelled before step 3, the first six make a flush for rows with a gap, whatever the drafts:
      step 1: 0 1 2 3 in rows 0-3, a speculative step (their prompts reach the drafter); 2 and 3 end (2 tokens)
      step 2: 4 and 5 in rows 2 and 3, an AR step (their prompts are held back: 21 positions each after it)
      step 3: 0 is cancelled: 5 moves from row 3 to row 0; 6 comes in; the drafter gets the features of 5 and 4 in one
              call (21 positions each; rows 0 and 2), while row 1 holds request 1, whose drafter cache holds its prompt
              since step 1."""
    g = torch.Generator().manual_seed(5)
    lengths = [20, 20, 20, 20, 20, 20, 9, LONG_PROMPT, 17, 33, 11]
    new_tokens = [60, 40, 2, 2, 36, 25, 9, 14, 20, 12, 27]
    return [Request(id=i, prompt_token_ids=torch.randint(4, vocab, (n,), generator=g).tolist(),
                    max_new_tokens=new_tokens[i], temperature=0.8 if i in (1, 6, 9) else 0.0, seed=40 + i)
            for i, n in enumerate(lengths)]


SCRIPT, CANCEL = (8, 1, 8), {3: 0}  # verify lengths of the first steps; step -> the request cancelled before it


def decode(executor, policy, reqs: list[Request], cancel: dict[int, int]) -> dict:
    """Every request through a Decoder, step by step, cancelling cancel[s] before step s: id -> (tokens, ALs)."""
    decoder = Decoder.for_mode(executor, "dflash", (), policy)
    for r in reqs:
        decoder.submit(r)
    results, step = {}, 0
    while decoder.has_work:
        step += 1
        if step in cancel:
            decoder.cancel(cancel[step])
        for update in decoder.step():
            if update.result is not None:
                results[update.request.id] = (update.result.output_token_ids, update.result.acceptance_lengths)
    return results


@pytest.mark.parametrize("auto", [True, False], ids=["block-size-auto", "fixed-block"])
def test_every_executor_drafts_the_same_tokens_step_for_step(engine, auto):
    runs = {}
    for name in ("torch", "onnxruntime", "tensorrt"):
        recorder = Recorder(executor(engine, name))
        policy = ScriptedAuto(recorder.block_size, SCRIPT) if auto else None
        runs[name] = (recorder, decode(recorder, policy, requests(recorder.vocab_size), CANCEL))
    reference, expected = runs["torch"]
    assert len(reference.drafts) > 20 and len(expected) == 11
    assert sum(n > 1 for _, lengths in expected.values() for n in lengths) >= 2  # drafts were accepted
    for name in ("onnxruntime", "tensorrt"):
        recorder, got = runs[name]
        assert len(recorder.drafts) == len(reference.drafts), name
        for step, (a, b) in enumerate(zip(recorder.drafts, reference.drafts)):
            assert torch.equal(a, b), f"{name}: the drafts of draft pass {step} differ"
        assert got == expected, name
    if auto:  # the case of issue 27 happened: a flush for rows 0 and 2 while row 1 runs
        assert [0, 2] in runs["onnxruntime"][0].context_rows, runs["onnxruntime"][0].context_rows


@pytest.mark.parametrize("name", ["onnxruntime", "tensorrt"])
def test_a_call_on_rows_with_a_gap_leaves_the_row_between_as_it_was(engine, name):
    ex = executor(engine, name)
    F = ex._features if name == "tensorrt" else ex._hidden_features
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 1, 2])
    ex.append_context(torch.randn(3, 10, F, generator=g), torch.zeros(3, dtype=torch.long), slots)  # rows 0..2
    before = [k.clone() for k in ex._drafter.keys + ex._drafter.values]
    hidden, starts = torch.randn(2, 4, F, generator=g), torch.tensor([10, 10])
    ex.append_context(hidden, starts, torch.tensor([2, 0]))  # rows 2 and 0: row 1 is a running request's
    after = ex._drafter.keys + ex._drafter.values
    for b, a in zip(before, after):
        assert torch.equal(a[1], b[1])  # the row in the gap: untouched
        assert torch.equal(a[:, :, :10], b[:, :, :10])  # positions before the written ones: untouched
        assert not torch.equal(a[0, :, 10:14], b[0, :, 10:14]) and not torch.equal(a[2, :, 10:14], b[2, :, 10:14])
    # and rows 0 and 2 hold what a call for each alone writes
    alone = executor(engine, name)
    alone.append_context(torch.randn(3, 10, F, generator=torch.Generator().manual_seed(0)),
                         torch.zeros(3, dtype=torch.long), slots)
    for row, slot in ((0, 2), (1, 0)):
        alone.append_context(hidden[row:row + 1], starts[row:row + 1], torch.tensor([slot]))
    for a, b in zip(alone._drafter.keys + alone._drafter.values, after):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_prompt_longer_than_a_plan_pass_is_prefilled_in_passes(engine):
    """The plans' profile ends at 256 positions per row: a 300-token prompt runs in two passes, and gives the torch
    executor's logits at its last position and its features at every position."""
    trt = standin_executor(engine)
    reference = executor(engine, "torch")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, trt.vocab_size, (2, LONG_PROMPT), generator=g)
    last = torch.tensor([LONG_PROMPT - 1, 120])  # the second prompt is shorter (padded), its last token in pass 1
    zeros, slots = torch.zeros(2, dtype=torch.long), torch.tensor([0, 1])
    got = trt.target_forward(tokens, zeros, slots, capture=True, last_index=last)
    want = reference.target_forward(tokens, zeros, slots, capture=True, last_index=last)
    assert got.logits.shape == (2, 1, trt.vocab_size)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
    assert trt._contexts["target_step"].calls == 2
    trt.append_context(got.hidden, zeros, slots)  # 300 positions of features: two drafter_context passes
    assert trt._contexts["drafter_context"].calls == 2
