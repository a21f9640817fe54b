"""Measurements of benchmarks/gpu_check.py's `decoder` stage: what the real Decoder loop costs on a GPU.

Each function takes the objects it measures (a TorchExecutor, requests) and returns a JSON-able dict; gpu_check.py
makes them (a random pair of Qwen3-8B layer shapes) and records the results. They run on the CPU too (the tests and
`gpu_check.py --device cpu`), where what needs CUDA says so instead of a number.

- host_and_syncs: host synchronizations per decoding step (torch.cuda.set_sync_debug_mode counts every op that
  waits for the device) and, from torch.profiler, the host's time per step outside those waits.
- decoder_throughput: tokens/s of Decoder.generate, AR and DFlash, DFlash also with every draft forced correct
  (OracleDrafts: the drafter, verify and acceptance passes still run, then the drafts are the AR run's continuation
  and all of them are accepted), the upper bound of what acceptance can give.
- sdpa: which scaled_dot_product_attention kernels the verify pass really launches (profiler kernel names), and
  which SDPA backends accept the executor's call (a boolean mask, grouped KV heads).
- kv_read_ms: KVCache.read (an index_select copy of every attended row) against the context length.
- prefill_peak_memory: the allocator's peak over a long prefill (target pass + the drafter's context).
- tf32_settings: the float32 matmul / cuDNN precision settings in effect.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tf32_settings() -> dict:
    out = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
           "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
           "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    for name in ("fp32_precision",):  # torch >= 2.9's per-backend precision API, where present
        for where, backend in (("cuda.matmul", torch.backends.cuda.matmul), ("cudnn", torch.backends.cudnn)):
            if hasattr(backend, name):
                out[f"{where}.{name}"] = str(getattr(backend, name))
    return out


# ---------------------------------------------------------------- host syncs and host time per step

# CUDA runtime / driver calls (as torch.profiler names them) during which the host waits for the device: .item(),
# .tolist() and a copy to the host end in a stream synchronization.
SYNC_EVENTS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                         "cuStreamSynchronize", "cuCtxSynchronize"})


def host_and_syncs(make_decoder: Callable[[], object], requests: Sequence, warmup_steps: int, steps: int,
                   device: torch.device) -> dict:
    """Run `steps` decoding steps of a Decoder (after `warmup_steps`), twice: under torch.cuda.set_sync_debug_mode
    ("warn": one warning per synchronizing op, counted per step) and under torch.profiler (time in CUDA runtime calls
    that wait: cudaStreamSynchronize, blocking cudaMemcpy, ...). Host time per step = wall time - that waiting."""
    out: dict = {"steps": steps, "warmup_steps": warmup_steps}

    def fresh():
        decoder = make_decoder()
        for r in requests:
            decoder.submit(r)
        for _ in range(warmup_steps):
            decoder.step()
        _sync(device)
        return decoder

    decoder = fresh()
    counts, walls = [], []
    for _ in range(steps):
        if not decoder.has_work:
            break
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    start = time.perf_counter()
                    decoder.step()
                    _sync(device)
                    walls.append(time.perf_counter() - start)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        else:
            start = time.perf_counter()
            decoder.step()
            walls.append(time.perf_counter() - start)
    out["wall_ms_per_step"] = round(1e3 * statistics.median(walls), 3) if walls else None
    out["syncs_per_step"] = ({"median": statistics.median(counts), "max": max(counts), "per_step": counts}
                             if counts else "not counted: torch.cuda.set_sync_debug_mode needs a CUDA device")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    decoder = fresh()
    done = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            if not decoder.has_work:
                break
            decoder.step()
            done += 1
        _sync(device)
        wall = time.perf_counter() - start
    events = prof.events()
    waits = [e for e in events if e.name in SYNC_EVENTS]
    wait_us = sum(e.cpu_time_total for e in waits if e.device_type.name == "CPU")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    if done:
        out["profiled"] = {"steps": done, "wall_ms_per_step": round(1e3 * wall / done, 3),
                           "waiting_ms_per_step": round(wait_us / 1e3 / done, 3),
                           "host_ms_per_step": round((1e6 * wall - wait_us) / 1e3 / done, 3),
                           "gpu_kernel_ms_per_step": round(gpu_us / 1e3 / done, 3) if device.type == "cuda" else None,
                           "waiting_calls_per_step": round(len(waits) / done, 2),
                           "note": "profiler overhead included; waiting = CUDA runtime calls that block the host"}
    return out


# ---------------------------------------------------------------- end-to-end throughput

class OracleDrafts:
    """An executor whose drafts are the target's own continuation (from an AR run of the same requests) and whose
    acceptance takes them all: the real drafter pass, verify pass and acceptance step still run (their cost stays),
    then the drafts are replaced by the continuation and the acceptance by "all of them, then the continuation's next
    token". The committed tokens are then the AR run's by construction (what is checked is the Decoder's
    bookkeeping under full acceptance), and the speed is what acceptance could give at most.

    Why not let the real acceptance judge the continuation: in bf16 a verify pass over k tokens rounds its logits
    differently from the AR run's one-token passes, and a random model's near-ties then reject the continuation
    early (the first GPU run accepted 1.52 tokens per step that way). `agreed()` says how many of the forced drafts
    the real acceptance took too. Everything here is host bookkeeping from the Decoder's HostRows: no extra reads
    of device tensors per step."""

    def __init__(self, executor, continuations: dict[tuple[int, ...], list[int]]):
        """`continuations`: prompt token ids -> prompt + the AR output of that prompt."""
        self._executor, self._continuations = executor, continuations
        self._by_slot: dict[int, list[int]] = {}
        self._forced: tuple[list[int], list[int]] = ([], [])  # the last draft pass's (accepted, bonus) per row
        self._forced_drafts = 0
        self._agreed = None  # device tensor: the real acceptance's drafts taken, summed over the run

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None):
        if last_index is not None:  # a prefill: which sequence each slot holds from now on
            for row, (slot, last) in enumerate(zip(slots.tolist(), last_index.tolist())):
                self._by_slot[slot] = self._continuations[tuple(token_ids[row, : last + 1].tolist())]
        return self._executor.target_forward(token_ids, starts, slots, capture, last_index, rows=rows)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None):
        real = self._executor.draft(anchors, starts, slots, num_drafts, context, rows=rows, width=width)
        k = real.shape[1]
        host = (rows.slots, rows.starts) if rows is not None else (slots.tolist(), starts.tolist())
        drafts, accepted, bonus = [], [], []
        for slot, start in zip(*host):
            following = self._by_slot[slot][start + 1 : start + 2 + k]  # the k drafts, then the bonus
            n = max(min(k, len(following) - 1), 0)  # the continuation ends: the Decoder stops there anyway
            drafts.append(following[:n] + [0] * (k - n))
            accepted.append(n)
            bonus.append(following[n] if following else 0)
        self._forced = (accepted, bonus)
        self._forced_drafts += sum(accepted)
        return torch.tensor(drafts, dtype=real.dtype).to(real.device, non_blocking=True)

    def accept(self, draft, logits, sampling, starts):
        real_accepted, _ = self._executor.accept(draft, logits, sampling, starts)
        taken = real_accepted.sum()
        self._agreed = taken if self._agreed is None else self._agreed + taken
        accepted, bonus = (torch.tensor(values, dtype=real_accepted.dtype).to(real_accepted.device, non_blocking=True)
                           for values in self._forced)
        return accepted, bonus

    def agreed(self) -> dict:
        """Of the drafts forced so far, how many the real acceptance step took too (one read, after the run)."""
        taken = int(self._agreed) if self._agreed is not None else 0
        return {"forced_drafts": self._forced_drafts, "also_accepted_by_the_target": taken,
                "fraction": round(taken / self._forced_drafts, 4) if self._forced_drafts else None}


def decoder_throughput(executor, requests: Sequence, make_decoder: Callable[[object, str], object],
                       device: torch.device) -> dict:
    """tokens/s and mean acceptance length of AR, DFlash and DFlash with forced-correct drafts, one batch each
    (after one untimed warm-up run of each)."""
    from trtllm_dflash.stats import all_steps, mean_acceptance_length

    def run(ex, mode: str) -> tuple[dict, list]:
        list(make_decoder(ex, mode).generate(requests[:1]))  # warm-up
        _sync(device)
        start = time.perf_counter()
        results = list(make_decoder(ex, mode).generate(requests))
        _sync(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_token_ids) for r in results)
        return ({"seconds": round(seconds, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                 "mean_acceptance_length": round(mean_acceptance_length(all_steps(results)), 3)}, results)

    out = {"requests": len(requests), "max_new_tokens": max(r.max_new_tokens for r in requests)}
    out["ar"], ar = run(executor, "ar")
    out["dflash"], _ = run(executor, "dflash")
    continuations = {tuple(r.request.prompt_token_ids): [*r.request.prompt_token_ids, *r.output_token_ids] for r in ar}
    oracle = OracleDrafts(executor, continuations)
    out["dflash_drafts_forced_correct"], forced = run(oracle, "dflash")
    out["dflash_drafts_forced_correct"]["real_acceptance_agreed"] = oracle.agreed()
    out["forced_equals_ar"] = ({r.request.id: r.output_token_ids for r in forced}
                               == {r.request.id: r.output_token_ids for r in ar})
    for key in ("dflash", "dflash_drafts_forced_correct"):
        out[key]["speedup_over_ar"] = round(out[key]["tokens_per_s"] / out["ar"]["tokens_per_s"], 3)
    return out


# ---------------------------------------------------------------- attention

def sdpa(run_verify: Callable[[], object], q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype: torch.dtype,
         device: torch.device) -> dict:
    """The attention kernels a verify pass launches (profiler), and which SDPA backends take the executor's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trtllm_dflash.models.layers import attend

    out: dict = {}
    q = torch.randn(q_shape, dtype=dtype, device=device)
    k = torch.randn(kv_shape, dtype=dtype, device=device)
    v = torch.randn(kv_shape, dtype=dtype, device=device)
    mask = torch.ones(q_shape[0], q_shape[1], kv_shape[1], dtype=torch.bool, device=device).tril(kv_shape[1] - q_shape[1])
    usable = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]), torch.inference_mode():
                attend(q, k, v, mask)
            usable[backend.name] = True
        except RuntimeError as exc:
            usable[backend.name] = " ".join(str(exc).split())[:200]
    out["backends_taking_the_call"] = usable
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
            run_verify()
            _sync(device)
        names: dict[str, int] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                names[e.name] = names.get(e.name, 0) + 1
        keys = ("attention", "flash", "fmha", "sdpa", "softmax", "cudnn", "efficient")
        out["attention_kernels_in_a_verify_pass"] = {n: c for n, c in names.items()
                                                      if any(w in n.lower() for w in keys)}
    else:
        out["attention_kernels_in_a_verify_pass"] = "not profiled: needs a CUDA device"
    return out


def kv_read_ms(contexts: Sequence[int], batches: Sequence[int], kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, repeats: int) -> dict:
    """KVCache.read of one layer (what every attention call of the torch executor copies) by context and batch."""
    from trtllm_dflash.models.layers import KVCache

    cache = KVCache(1, max(batches), max(contexts), kv_heads, head_dim, dtype, device)
    out = {}
    for batch in batches:
        slots = torch.arange(batch, device=device)
        for context in contexts:
            samples = []
            for i in range(repeats + 2):
                _sync(device)
                start = time.perf_counter()
                cache.read(0, slots, context)
                _sync(device)
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            out[f"batch {batch}, context {context}"] = round(1e3 * statistics.median(samples), 4)
    del cache
    return out


def prefill_peak_memory(executor, tokens: int, batch: int, device: torch.device) -> dict:
    """The allocator's peak over one prefill of `batch` prompts of `tokens` tokens (target pass with the drafter's
    features, then the drafter's context), above what was allocated before (weights and caches)."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, executor.vocab_size, (batch, tokens), generator=g, device=device)
    zeros, slots = torch.zeros(batch, dtype=torch.long, device=device), torch.arange(batch, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = executor.target_forward(ids, zeros, slots, capture=True, last_index=torch.full_like(zeros, tokens - 1))
    executor.append_context(out.hidden, zeros, slots)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return {"batch": batch, "tokens": tokens, "allocated_before_gib": round(before / 2**30, 3),
            "peak_gib": round(peak / 2**30, 3), "peak_above_before_gib": round((peak - before) / 2**30, 3)}
