"""Static shapes on the torch executor (issue 28, items 3 and 4): attended lengths from the host rounded up to
buckets, caches read as views when the slots are one run, and the padded static passes the CUDA graphs replay.

None of it may change a token: the masks are built from positions on the device, so keys past a row's own positions
are masked whatever the bucket, and a padding row writes only the scratch slot. Three executors are compared through
the real Decoder: the default (rows from the host: buckets + views), `WithoutRows` (the legacy path: lengths read from
the positions, caches copied by index_select) and the static passes of runtime/cuda_graphs.py run eagerly (what a
CUDA graph replays; the capture itself needs a GPU).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import build
from trtllm_dflash.models.layers import attend, attend_groups_as_rows
from trtllm_dflash.parallel.group import SINGLE
from trtllm_dflash.runtime.cuda_graphs import PassKey, batch_bucket, length_bucket
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.executor import DraftContext, HostRows, TorchExecutor
from trtllm_dflash.runtime.runner import Engine

# Calls that read a tensor's values on the host (on a GPU: a synchronisation), as tests/test_decode_step.py counts.
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
              torch.Tensor.numpy}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


class IndexSelects(TorchDispatchMode):
    """Counts aten.index_select (KVCache.read's copy path)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket == torch.ops.aten.index_select
        return func(*args, **(kwargs or {}))


class WithoutRows:
    """An executor told nothing by the host (rows=None): the models read the attended length from the positions and
    copy the caches' rows by index, as before issue 28."""

    def __init__(self, executor):
        self.executor = executor

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None):
        return self.executor.target_forward(token_ids, starts, slots, capture, last_index)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None):
        return self.executor.draft(anchors, starts, slots, num_drafts, context, width=width)

    def append_context(self, hidden, starts, slots, rows=None):
        return self.executor.append_context(hidden, starts, slots)


@pytest.fixture(scope="module")
def engine_dir(biased_pairs, tmp_path_factory) -> Path:
    return build(biased_pairs[8], tmp_path_factory.mktemp("static") / "b8", max_batch_size=4)


def _executor(engine_dir: Path, cuda_graphs: bool | None = None) -> TorchExecutor:
    engine = Engine.load(engine_dir)
    return TorchExecutor.from_engine(engine_dir, engine.config, 0, SINGLE, "cpu", None, cuda_graphs=cuda_graphs)


def _requests(sampled: bool) -> list[Request]:
    """Prompts of 3 .. 70 tokens and outputs that cross a 64-key bucket, five requests on four slots: request 0 ends
    first and request 4 takes its slot 0; as the others end, batches of 3 (slots 0, 1, 2: padded to 4) and 2 run,
    and slots 1, 2 alone (a run not from 0) while request 4 waits for its prefill group."""
    lengths, new = [5, 70, 3, 20, 8], [6, 80, 60, 40, 70]
    return [Request(i, [(7 * i + 3 * j) % 90 + 4 for j in range(n)], m, temperature=1.0 if sampled else 0.0,
                    seed=11 + i, top_k=20 if sampled else 0)
            for i, (n, m) in enumerate(zip(lengths, new))]


def _tokens(engine: Engine, executor, mode: str, sampled: bool) -> dict:
    decoder = dataclasses.replace(engine, executor=executor).decoder(mode)
    return {r.request.id: r.output_token_ids for r in decoder.generate(_requests(sampled))}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_tokens_are_the_same_with_and_without_buckets_views_and_static_passes(engine_dir, mode, sampled):
    engine = Engine.load(engine_dir)
    bucketed = _tokens(engine, engine.executor, mode, sampled)
    legacy = _tokens(engine, WithoutRows(_executor(engine_dir)), mode, sampled)
    static = _executor(engine_dir, cuda_graphs=True)
    graphed = _tokens(engine, static, mode, sampled)
    assert bucketed == legacy == graphed
    assert sum(map(len, bucketed.values())) > 60
    kinds = {(k.kind, k.views) for k in static.graphs.passes}
    # decode passes of both slot layouts went through the static passes; some lengths crossed a bucket
    assert ("target", True) in kinds and ("target", False) in kinds, kinds
    assert len({k.length for k in static.graphs.passes}) >= 2
    if mode == "dflash":
        assert {"draft"} <= {k.kind for k in static.graphs.passes}
        assert any(k.context for k in static.graphs.passes)


def _prefilled(executor: TorchExecutor, prompts: list[list[int]], slots: list[int]) -> tuple[torch.Tensor, ...]:
    """Prompts prefilled into these slots (left-aligned, padded), their hidden given to the drafter; returns
    (starts, slots) tensors of the next position."""
    T = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    zeros, slot_t = torch.zeros(len(prompts), dtype=torch.long), torch.tensor(slots)
    out = executor.target_forward(ids, zeros, slot_t, capture=True, last_index=torch.tensor([len(p) - 1 for p in prompts]))
    executor.append_context(out.hidden, zeros, slot_t)
    return torch.tensor([len(p) for p in prompts]), slot_t


@pytest.mark.parametrize("slots", [[0, 1, 2], [1, 2], [2, 0]], ids=["run-from-0", "run-from-1", "not-a-run"])
def test_executor_passes_equal_the_legacy_path(engine_dir, slots):
    """Logits within fp32 rounding, the same argmax, hidden states and drafts, with rows (bucketed lengths, views
    where the slots are a run) and without (exact lengths read from the positions, index copies). Every pass writes
    the same K/V again, so both see the same caches."""
    ex = _executor(engine_dir)
    prompts = [[5, 9, 13, 17, 21, 25, 29][: 3 + 2 * i] for i in range(len(slots))]
    starts, slot_t = _prefilled(ex, prompts, slots)
    rows = HostRows(tuple(slots), tuple(starts.tolist()))
    block = torch.randint(0, ex.vocab_size, (len(slots), 8), generator=torch.Generator().manual_seed(0))
    legacy = ex.target_forward(block, starts, slot_t, capture=True)
    host = ex.target_forward(block, starts, slot_t, capture=True, rows=rows)
    torch.testing.assert_close(host.logits, legacy.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(host.hidden, legacy.hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(host.logits.argmax(-1), legacy.logits.argmax(-1))
    context = DraftContext(legacy.hidden[:, :3], starts)
    anchors, draft_starts = block[:, 2], starts + 3
    draft_rows = HostRows(tuple(slots), tuple(draft_starts.tolist()))
    assert torch.equal(ex.draft(anchors, draft_starts, slot_t, context=context, rows=draft_rows),
                       ex.draft(anchors, draft_starts, slot_t, context=context))


def test_slots_in_one_run_are_read_in_place(engine_dir):
    """No index_select when the slots are one run (the caches are read as views); the copy when they are not."""
    ex = _executor(engine_dir)
    starts, slot_t = _prefilled(ex, [[5, 9, 13], [4, 8, 12, 16]], [1, 2])
    block = torch.tensor([[3, 4], [5, 6]])

    def selects(slots: tuple[int, ...]) -> int:
        rows = HostRows(slots, tuple(starts.tolist()))
        with IndexSelects() as counted:
            out = ex.target_forward(block, starts, torch.tensor(slots), capture=True, rows=rows)
            ex.draft(block[:, 0], starts + 2, torch.tensor(slots), context=DraftContext(out.hidden, starts),
                     rows=HostRows(slots, tuple((starts + 2).tolist())))
        return counted.count

    assert selects((1, 2)) == 0
    assert selects((2, 1)) > 0  # (the same rows in the other order: not a run)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static-passes"])
def test_no_host_reads_when_rows_are_given(engine_dir, cuda_graphs):
    """target_forward, draft (with context) and append_context read nothing back from the device when told the rows;
    without rows the models read the attended length (the counter's own check)."""
    ex = _executor(engine_dir, cuda_graphs)
    starts, slot_t = _prefilled(ex, [[5, 9, 13], [4, 8, 12, 16]], [0, 1])
    rows, block = HostRows((0, 1), tuple(starts.tolist())), torch.tensor([[3, 4, 7], [5, 6, 7]])
    draft_rows = HostRows((0, 1), tuple((starts + 3).tolist()))
    with HostReads() as reads:
        out = ex.target_forward(block, starts, slot_t, capture=True, rows=rows)
        ex.draft(block[:, 0], starts + 3, slot_t, context=DraftContext(out.hidden, starts), rows=draft_rows)
        ex.append_context(out.hidden, starts, slot_t, rows=rows)
        ex.target_forward(block[:, :1], starts, slot_t, capture=False, rows=rows)
    assert reads.count == 0
    with HostReads() as reads:
        ex.target_forward(block, starts, slot_t, capture=True)
    assert reads.count > 0


def test_buckets():
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [batch_bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert [length_bucket(n, 4112) for n in (0, 1, 64, 65, 300, 512, 513, 1100, 4100)] == \
        [64, 64, 64, 128, 512, 512, 1024, 1536, 4096 + 16]
    assert length_bucket(300, 200) == 200  # never past the cache


def test_static_passes_pad_with_the_scratch_slot_and_drop_the_padding(engine_dir):
    """A batch of 3 in a bucket of 4, after a batch of 4 in the same bucket: the fourth row is padding again (it
    writes only the scratch slot, which no request owns), its outputs are dropped, and the results equal the eager
    pass's."""
    ex = _executor(engine_dir, cuda_graphs=True)
    scratch = ex.num_slots
    assert ex.target_cache.k[0].shape[0] == ex.num_slots + 1
    prompts = [[5, 9, 13], [4, 8, 12, 16], [6, 10], [7, 11, 15]]
    starts, slot_t = _prefilled(ex, prompts, [0, 1, 2, 3])
    block = torch.tensor([[3], [5], [7], [9]])
    ex.target_forward(block, starts, slot_t, capture=False, rows=HostRows((0, 1, 2, 3), tuple(starts.tolist())))
    slot3 = ex.target_cache.k[0][3].clone()
    rows = HostRows((0, 1, 2), tuple(starts[:3].tolist()))
    out = ex.target_forward(block[:3], starts[:3], slot_t[:3], capture=True, rows=rows)
    assert out.logits.shape[0] == 3 and out.hidden.shape[0] == 3
    assert torch.equal(ex.target_cache.k[0][3], slot3)  # request 3's cache untouched by the padding row
    key = PassKey("target", 4, 64, 1, True, capture=True)
    static = ex.graphs.passes[key]
    assert static.inputs["slots"].tolist() == [0, 1, 2, scratch] and static.inputs["starts"][3] == 0
    eager = ex.target_forward(block[:3], starts[:3], slot_t[:3], capture=True)  # rows=None: the eager legacy pass
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden, eager.hidden, atol=1e-5, rtol=1e-5)


def test_static_outputs_are_copies(engine_dir):
    """What a static pass returns stays as it was after the next replay of the same pass (the Decoder keeps hidden
    rows across steps)."""
    ex = _executor(engine_dir, cuda_graphs=True)
    starts, slot_t = _prefilled(ex, [[5, 9, 13], [4, 8, 12, 16]], [0, 1])
    rows = HostRows((0, 1), tuple(starts.tolist()))
    first = ex.target_forward(torch.tensor([[3], [5]]), starts, slot_t, capture=True, rows=rows)
    kept = first.hidden.clone()
    ex.target_forward(torch.tensor([[8], [9]]), starts, slot_t, capture=True, rows=rows)
    assert torch.equal(first.hidden, kept)


def test_grouped_query_heads_as_rows_equal_enable_gqa():
    """The CUDA form of masked GQA (query groups folded into rows, K/V kept as views) equals SDPA's enable_gqa, on
    cache views with per-row positions, with and without a scale. (Which backend runs it on CUDA is not checked
    here: no GPU.)"""
    g = torch.Generator().manual_seed(0)
    B, Tq, heads, kv, hd, Tk = 3, 5, 8, 2, 16, 70
    q = torch.randn(B, Tq, heads, hd, generator=g)
    k_cache, v_cache = torch.randn(6, 128, kv, hd, generator=g), torch.randn(6, 128, kv, hd, generator=g)
    k, v = k_cache[1:4, :Tk], v_cache[1:4, :Tk]  # views, as KVCache.read's run path gives
    positions = torch.tensor([[10, 11, 12, 13, 14], [60, 61, 62, 63, 64], [0, 1, 2, 3, 4]])
    mask = torch.arange(Tk)[None, None, :] <= positions[:, :, None]
    for scale in (None, 1.0):
        torch.testing.assert_close(attend_groups_as_rows(q, k, v, mask, scale), attend(q, k, v, mask, scale=scale),
                                   atol=1e-6, rtol=1e-5)


no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (never run: no GPU here)")


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_gqa_runs_a_fused_backend_on_cuda(dtype):
    """With only the fused backends allowed (memory-efficient, cuDNN), `attend` on CUDA runs (SDPA raises "No
    available kernel" if its form needs the math kernel) and equals the CPU's result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(1)
    q, k_cache = torch.randn(2, 16, 32, 128, generator=g), torch.randn(4, 256, 8, 128, generator=g)
    v_cache = torch.randn(4, 256, 8, 128, generator=g)
    positions = torch.tensor([[40 + i for i in range(16)], [100 + i for i in range(16)]])
    mask = torch.arange(128)[None, None, :] <= positions[:, :, None]
    expected = attend(q, k_cache[1:3, :128], v_cache[1:3, :128], mask)
    dev = [t.to("cuda", dtype) for t in (q, k_cache, v_cache)]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = attend(dev[0], dev[1][1:3, :128], dev[2][1:3, :128], mask.cuda())
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("paged", [False, True], ids=["static-cache", "paged-cache"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_captured_cuda_graphs_give_the_eager_executors_tokens(engine_dir, sampled, paged):
    """(paged: the block tables are read inside each replay, and the rows computed inside the capture)"""
    engine = Engine.load(engine_dir)
    budget = 64 * 2**20 if paged else None

    def on_cuda(cuda_graphs: bool) -> TorchExecutor:
        return TorchExecutor.from_engine(engine_dir, engine.config, 0, SINGLE, "cuda", None, cuda_graphs=cuda_graphs,
                                         kv_cache_memory=budget)

    graphed = on_cuda(True)
    assert _tokens(engine, graphed, "dflash", sampled) == _tokens(engine, on_cuda(False), "dflash", sampled)
    assert all(p.graph is not None for p in graphed.graphs.passes.values())
