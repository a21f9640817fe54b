"""KV read in place and bucketed lengths on the CPU: the torch executor's passes, side by side in one process.

    python benchmarks/kv_in_place.py --engine /tmp/kv/demo --rounds 5

Four ways to run the same pass over the same caches (issue 28 item 3):
  copy-exact   the slots' K/V rows copied by index_select, exactly max(position) + 1 keys (before issue 28)
  view-exact   the caches read as views (the slots are one run), exact length
  view-16      views, the length rounded up to a multiple of 16 (executor.KV_BUCKET)
  view-64      views, a multiple of 64 (the bucket first chosen)
for a target decode pass (1 token per row), a verify pass (a block per row, hidden states captured), a drafter
pass, and the target's K/V reads of a decode pass alone (KVCache.read over every layer: the most a view can save), at batch 1 and 8 and at contexts where the bucket pads most (65 -> 128 keys) and little (300 -> 320). Every pass
writes the same K/V again, so all variants see the same caches. The four variants run call by call in a rotated
order (a slow spell of a shared machine falls on all of them); the table gives each variant's median time and the
median of the per-call ratios view-exact / copy-exact (what views save) and view-16 / view-exact, view-64 / view-exact
(what the buckets cost). Load (/proc/loadavg) is printed
before and after. One torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.runner import Engine

VARIANTS = ("copy-exact", "view-exact", "view-16", "view-64")


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def passes(ex: TorchExecutor, batch: int, context: int) -> dict[str, Callable[[str], None]]:
    """The passes of one (batch, context), each a function of the variant. Slots 0 .. batch - 1, prefilled."""
    g = torch.Generator().manual_seed(batch * 1000 + context)
    slots = torch.arange(batch)
    prompt = torch.randint(4, ex.vocab_size, (batch, context), generator=g)
    zeros = torch.zeros(batch, dtype=torch.long)
    out = ex.target_forward(prompt, zeros, slots, capture=True)
    ex.append_context(out.hidden, zeros, slots)
    starts = torch.full((batch,), context)
    block = ex.block_size
    tokens = torch.randint(4, ex.vocab_size, (batch, block), generator=g)
    features = out.hidden[:, -3:]  # three committed positions' features, as a step's draft context
    layers = ex.drafter.params.target_layer_ids

    def lengths(variant: str, exact: int) -> tuple[int, slice | None]:
        bucket = 1 if variant.endswith("exact") else int(variant.split("-")[1])
        length = min(-(-exact // bucket) * bucket, ex.target_cache.capacity)
        return length, (slice(0, batch) if variant.startswith("view") else None)

    def target(T: int, capture: bool) -> Callable[[str], None]:
        positions = starts[:, None] + torch.arange(T)

        def run(variant: str) -> None:
            kv_len, run_ = lengths(variant, context + T)
            ex.target(tokens[:, :T], positions, slots, ex.target_cache, layers if capture else (), None, kv_len, run_)
        return run

    def draft(variant: str) -> None:
        kv_len, run_ = lengths(variant, context + 3)
        ex._draft_pass(tokens[:, 0], starts + 3, slots, block - 1, block, features, starts, kv_len, run_)

    def reads(variant: str) -> None:  # the target's K/V reads of a decode pass alone: what a view saves at most
        kv_len, run_ = lengths(variant, context + 1)
        for i in range(len(ex.target_cache.k)):
            ex.target_cache.read(i, slots, kv_len, run_)

    return {"target T=1": target(1, False), f"verify T={block}": target(block, True), "draft": draft,
            "KV reads": reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/demo"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[65, 300])
    args = ap.parse_args()
    engine = Engine.load(args.engine, threads=1, backend="torch")
    ex = engine.executor
    print(f"engine {args.engine}; torch {torch.__version__}, {torch.get_num_threads()} thread; "
          f"load before: {load()}", flush=True)
    cases = {(b, c, name): fn for b in args.batches for c in args.contexts for name, fn in passes(ex, b, c).items()}
    times: dict[tuple, list[float]] = {(*case, v): [] for case in cases for v in VARIANTS}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            for v in VARIANTS:
                fn(v)
        for r in range(args.rounds):
            for case, fn in cases.items():
                for i in range(args.calls):  # the variants call by call, in a rotated order: pairs a slow spell shares
                    k = (r * args.calls + i) % 4
                    for v in VARIANTS[k:] + VARIANTS[:k]:
                        t0 = time.perf_counter()
                        fn(v)
                        times[(*case, v)].append(time.perf_counter() - t0)
    print(f"load after: {load()}; ms per pass: median of {args.rounds} rounds x {args.calls} calls; ratios: median of "
          "the per-call ratios (calls made side by side)")
    print(f"{'batch':>5} {'context':>7} {'pass':<12}" + "".join(f"{v:>13}" for v in VARIANTS)
          + f"{'view/copy':>11}{'16/exact':>10}{'64/exact':>10}")
    for case in cases:
        t = {v: times[(*case, v)] for v in VARIANTS}
        ms = {v: 1e3 * statistics.median(t[v]) for v in VARIANTS}
        ratios = [statistics.median(a / b for a, b in zip(t[x], t[y]))
                  for x, y in (("view-exact", "copy-exact"), ("view-16", "view-exact"), ("view-64", "view-exact"))]
        print(f"{case[0]:>5} {case[1]:>7} {case[2]:<12}" + "".join(f"{ms[v]:>13.3f}" for v in VARIANTS)
              + "".join(f"{r:>10.3f}" for r in ratios))

if __name__ == "__main__":
    main()
