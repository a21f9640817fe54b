"""The decode step as an engine runs it: one host read per step, one verify policy per decoder.

Host reads are counted with a TorchFunctionMode over every tensor call the step makes (Decoder, executor, models,
sampling): on a GPU each read of a device tensor on the host (tolist, item, bool(), int(), nonzero, ...) waits for
the device's queue to drain, so the budget is what a CUDA run would synchronise, counted on the CPU.
"""

from __future__ import annotations

import traceback
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.verify import AutoBlock, FixedBlock, PlainDecoding, StepShape, verify_policy
from trtllm_dflash.speculative.schedule import AcceptanceEstimate, AutoBlockSize

# Calls that read a tensor's values on the host (on a GPU: a synchronisation).
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
              torch.Tensor.numpy}


class HostReads(TorchFunctionMode):
    """Counts HOST_READS calls, and torch.where given the condition alone (a nonzero inside: MoE routing loops), and
    keeps where each was made (for the failure message)."""

    def __init__(self):
        super().__init__()
        self.count, self.where = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS or (func is torch.where and len(args) + len(kwargs or {}) == 1):
            self.count += 1
            ours = [f for f in traceback.extract_stack() if "trtllm_dflash" in f.filename]
            at = f"{ours[-1].filename.rsplit('/', 2)[-1]}:{ours[-1].lineno}" if ours else "?"
            self.where.append(f"{func.__name__} at {at}")
        return func(*args, **(kwargs or {}))


def _requests(n: int, new_tokens: int = 24, temperature: float = 0.0) -> list[Request]:
    return [Request(i, [3 + i, 17, 42 + 2 * i, 5, 9][: 3 + i % 3], new_tokens, temperature=temperature, seed=7 + i)
            for i in range(n)]


def _reads_per_step(decoder: Decoder, requests: list[Request]) -> list[tuple[int, bool, list[str]]]:
    """(host reads, whether the step admitted requests, where) for every step of decoding `requests` to the end."""
    for r in requests:
        decoder.submit(r)
    steps = []
    while decoder.has_work:
        admitting = bool(decoder._pending)
        with HostReads() as reads:
            decoder.step()
        steps.append((reads.count, admitting, reads.where))
    return steps


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-top-k-top-p"])
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_one_host_read_per_decode_step(biased_engines, mode, sampled):
    """Every decoding step reads the device once (its results); a step that admits requests reads once more per
    prefill group (the prompts' first tokens). Fails while any host value is read back from the device (a
    model's int(positions.max()), a per-row int(bonus[row]), a sampling loop over nonzero())."""
    ex = biased_engines[8].executor
    requests = [replace(r, top_k=20, top_p=0.9) for r in _requests(3, temperature=1.0)] if sampled else _requests(3)
    steps = _reads_per_step(Decoder.for_mode(ex, mode), requests)
    decode_only = [(n, where) for n, admitting, where in steps if not admitting]
    assert len(decode_only) > 5
    assert all(n == 1 for n, _ in decode_only), decode_only
    first, admitting, where = steps[0]
    assert admitting and first == 2, where  # one prefill group (similar lengths) + the step


@pytest.mark.parametrize("policy", ["ar", 4, 8, "auto"])
def test_every_policy_of_one_executor_gives_the_same_tokens(biased_engines, policy):
    """Plain, fixed-k and auto decoders over one loaded executor commit the same tokens (greedy and sampled):
    the policy changes how many tokens a step verifies, never which."""
    ex = biased_engines[8].executor
    reference = {r.request.id: r.output_token_ids
                 for r in Decoder(ex, PlainDecoding(), ()).generate(_requests(4, 32) + _requests(2, 32, 1.0))}
    if policy == "auto":
        decoder_policy = AutoBlock(AutoBlockSize(_FlatCosts(), ex.block_size, AcceptanceEstimate(ex.block_size - 1)))
    else:
        decoder_policy = verify_policy("ar" if policy == "ar" else "dflash", policy if policy != "ar" else 0)
    results = {r.request.id: r for r in Decoder(ex, decoder_policy, ()).generate(_requests(4, 32)
                                                                                 + _requests(2, 32, 1.0))}
    assert {i: r.output_token_ids for i, r in results.items()} == reference
    if isinstance(decoder_policy, FixedBlock):
        assert all(set(r.verify_lengths) == {policy} for r in results.values())
    if isinstance(decoder_policy, PlainDecoding):
        assert all(r.verify_lengths == [] and r.acceptance_lengths == [] for r in results.values())


class _FlatCosts:
    """Pass costs that make every verify length cost the same: auto then verifies the most tokens it expects to
    commit, and steps of several lengths occur."""

    def step_seconds(self, batch: int, context: float, k: int) -> float:
        return 1e-3 * (1 + 0.05 * k)

    def context_seconds(self, batch: int, positions: float) -> float:
        return 1e-4 * positions


def test_policies_say_what_they_verify():
    shape = StepShape(batch=2, context=10, estimates=[None, None], pending=0.0, remaining=5.0)
    assert PlainDecoding().choose(shape) == 1 and not PlainDecoding().drafts
    assert FixedBlock(5).choose(shape) == 5 and FixedBlock(5).longest == 5
    with pytest.raises(ValueError, match="at least 2 tokens"):
        FixedBlock(1)


def test_a_policy_longer_than_the_executors_block_is_refused(biased_engines):
    ex = biased_engines[8].executor
    with pytest.raises(ValueError, match="more than the executor's block of 8"):
        Decoder(ex, FixedBlock(9), ())


def test_running_requests_keep_slot_order_and_take_the_lowest_free_slot(biased_engines):
    """The batch's slots stay one run where they can (the caches then read them as views)."""
    ex = biased_engines[8].executor
    decoder = Decoder.for_mode(ex, "dflash")
    for r in [Request(0, [3, 4, 5], 4), Request(1, [3, 4, 5], 40), Request(2, [3, 4, 5], 40)]:
        decoder.submit(r)
    while any(a.request.id == 0 for a in decoder._active) or decoder._pending:
        decoder.step()
    assert [a.slot for a in decoder._active] == [1, 2]
    decoder.submit(Request(3, [3, 4], 40))
    decoder.step()
    assert [(a.request.id, a.slot) for a in decoder._active] == [(3, 0), (1, 1), (2, 2)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_one_host_read_per_decode_step_on_onnxruntime(ort_engine_dir, sampled):
    """The onnxruntime executor takes the batch's slots from HostRows (its cache rows are chosen on the host), so a
    step reads the device once there too."""
    from trtllm_dflash.runtime.runner import Engine

    ex = Engine.load(ort_engine_dir("qwen3")).executor
    requests = _requests(3, temperature=1.0 if sampled else 0.0)
    for mode in ("ar", "dflash"):
        steps = _reads_per_step(Decoder.for_mode(ex, mode), requests)
        decode_only = [(n, where) for n, admitting, where in steps if not admitting]
        assert decode_only and all(n == 1 for n, _ in decode_only), (mode, decode_only)
