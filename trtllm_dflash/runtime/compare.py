"""DFlash vs autoregressive decoding on the same engine, measured side by side.

Each request runs alone (batch size 1) in both modes, alternating which mode goes first, `repeats`
times; times are medians. Greedy outputs of the two modes must be identical (losslessness), and the
comparison says so.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from trtllm_dflash.runtime.executor import DraftContext, Executor
from trtllm_dflash.runtime.decoding import Request, Result
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import all_steps, mean_acceptance_length


@dataclass(frozen=True)
class ModeTiming:
    seconds: float  # median over repeats of the summed per-request decode times
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass(frozen=True)
class Comparison:
    dflash: ModeTiming
    ar: ModeTiming
    results: list[Result]  # dflash results, in request order
    identical: bool  # dflash output == ar output for every request
    mean_acceptance_length: float

    @property
    def speedup(self) -> float:
        return self.dflash.tokens_per_s / self.ar.tokens_per_s


def _timed(engine: Engine, mode: str, request: Request) -> tuple[float, Result]:
    start = time.perf_counter()
    (result,) = engine.decoder(mode).generate([request])
    return time.perf_counter() - start, result


def side_by_side(engine: Engine, requests: list[Request], repeats: int = 1) -> Comparison:
    times = {"dflash": [[] for _ in range(repeats)], "ar": [[] for _ in range(repeats)]}
    outputs: dict[str, list[Result]] = {"dflash": [], "ar": []}
    for rep in range(repeats):
        for i, req in enumerate(requests):
            order = ("dflash", "ar") if (rep + i) % 2 == 0 else ("ar", "dflash")
            for mode in order:
                seconds, result = _timed(engine, mode, req)
                times[mode][rep].append(seconds)
                if rep == 0:
                    outputs[mode].append(result)
    timing = {m: ModeTiming(statistics.median(sum(t) for t in times[m]),
                            sum(len(r.output_token_ids) for r in outputs[m])) for m in times}
    identical = all(a.output_token_ids == b.output_token_ids for a, b in zip(outputs["dflash"], outputs["ar"]))
    return Comparison(timing["dflash"], timing["ar"], outputs["dflash"], identical,
                      mean_acceptance_length(all_steps(outputs["dflash"])))


@dataclass(frozen=True)
class StepCosts:
    context_len: int
    draft_s: float  # one drafter pass over a block (batch 1), adding the context rows the step before committed
    verify_s: float  # one target pass over a block
    ar_s: float  # one target pass over one token

    def speedup_bound(self, acceptance_length: float) -> float:
        """AL x t_ar / (t_verify + t_draft): DFlash's speedup if nothing else cost time."""
        return acceptance_length * self.ar_s / (self.verify_s + self.draft_s)


def step_costs(executor: Executor, context_len: int, context_rows: int, repeats: int = 60,
               block: int | None = None) -> StepCosts:
    """Median times of the three passes at one context length, batch size 1, each timed where the loop runs it: a
    drafter pass after a target pass and a verify pass after a drafter pass (as in DFlash steps), an AR pass after
    an AR pass (as in plain decoding): on a CPU, a pass that follows the other model's pass finds its weights out of
    the caches, and a pass repeated alone would not. The three are timed in rounds (draft, verify, an untimed AR
    pass, AR), so that a slow spell of a shared machine slows all three alike and leaves the bound's ratio
    t_ar / (t_verify + t_draft) as it was. The drafter pass adds `context_rows` positions to the drafter's context
    first, as a step adds those the step before committed (the acceptance length, rounded). `block`: the tokens a
    verify pass checks and the drafter's block (default: the executor's block_size)."""
    ex = executor
    block = block or ex.block_size
    slots, starts = torch.tensor([0], device=ex.device), torch.tensor([context_len], device=ex.device)
    ids = torch.randint(4, ex.vocab_size, (1, context_len + block), generator=torch.Generator().manual_seed(0))
    ids, zero = ids.to(ex.device), torch.tensor([0], device=ex.device)
    last = torch.tensor([context_len - 1], device=ex.device)  # (a context longer than a TensorRT pass runs in passes)
    hidden = ex.target_forward(ids[:, :context_len], zero, slots, capture=True, last_index=last).hidden  # [1, T, F]
    ex.append_context(hidden, zero, slots)
    rows = max(1, min(context_rows, context_len))
    new = DraftContext(hidden[:, context_len - rows:], starts - rows)
    anchor = ids[:, context_len]
    passes = {  # one round, in this order; None: run untimed
        "draft": lambda: ex.draft(anchor, starts, slots, context=new, width=block),
        "verify": lambda: ex.target_forward(ids[:, context_len:context_len + block], starts, slots, capture=True),
        None: lambda: ex.target_forward(ids[:, context_len:context_len + 1], starts, slots, capture=False),
        "ar": lambda: ex.target_forward(ids[:, context_len:context_len + 1], starts, slots, capture=False),
    }
    samples: dict[str, list[float]] = {name: [] for name in passes if name is not None}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            if name is not None and round_ > 0:
                samples[name].append(time.perf_counter() - start)
    median = {name: statistics.median(times) for name, times in samples.items()}
    return StepCosts(context_len=context_len, draft_s=median["draft"], verify_s=median["verify"], ar_s=median["ar"])
