"""Measured pass costs of one engine on one machine and backend (`--block-size auto`'s cost model).

A DFlash step of a batch of B requests verifying k tokens each costs
    t_step(B, L, k) = t_target(B, k, L) + t_accept(B, k) [+ t_draft(B, L, k) for k > 1]
where L is the batch's longest context (the attention reads that many positions) and the drafter pass, over
the whole block, first adds k positions of features to the drafter's context (what the step before committed,
at most k) and reads out k - 1 drafts (the torch executor runs the lm_head over those only). t_context(B, n), the
drafter's context update in a pass of its own, prices the hand-over of the features plain AR steps held back. Each term is measured
on a small grid (batch 1, 2, 4 .. slots; tokens 1, 2, 4 .. block_size; two context lengths) and
interpolated linearly in between; beyond the longest measured context, linearly extrapolated.

The measurement takes seconds (31.8 s for the 32-slot demo engine on one CPU thread; 26.2 s on onnxruntime) and
is cached as JSON, keyed by what changes the numbers: the engine's manifest (its exact files), the backend, the CPU or GPU, the
torch threads, the block size and slots. A profile whose key differs (another machine, other threads, a rebuilt
engine copied over) is re-measured and replaced; a file that is not a profile at all is refused with one
sentence (delete it to re-measure).
The cache cannot live in the engine directory, whose manifest admits no extra file: it lives under
$TRTLLM_DFLASH_CACHE_DIR, else $XDG_CACHE_HOME/trtllm-dflash, else ~/.cache/trtllm-dflash.

Next to the profiles, `acceptance/<engine>.json` records the engine's acceptance rates per block position as the
last run left them (every few hundred steps and at the end of a run): the next run with this engine starts from
them instead of a flat guess (speculative/schedule.py). They depend on the engine and the prompts, not on the
machine, so they are keyed by the engine's manifest alone; a record of another engine or block size is ignored,
one that is not a record at all is refused with one sentence, like a profile.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trtllm_dflash.engine_dir import MANIFEST
from trtllm_dflash.errors import UserError
from trtllm_dflash.outputs import reason, write_text_atomic
from trtllm_dflash.runtime.executor import DraftContext, Executor
from trtllm_dflash.speculative.core import Sampling, sample_tokens
from trtllm_dflash.stats import cpu_name

# 2: the drafter pass per verify length (its lm_head reads out k - 1 drafts); 3: timed in rounds; 4: the drafter pass
# adds the context rows of the step before (one drafter pass a step)
PROFILE_VERSION = 4
REPEATS = 3  # timed calls per grid point after one warm-up; the fastest is kept (other work only adds time)


@dataclass(frozen=True)
class ProfileKey:
    """What a profile's numbers depend on; a cached profile with another key is re-measured."""

    version: int
    manifest_sha256: str  # the engine's manifest.json: its exact files
    backend: str
    device: str  # CPU model or GPU name
    threads: int  # torch intra-op threads
    block_size: int
    num_slots: int


@dataclass(frozen=True)
class PassCosts:
    """Seconds per pass on a grid; `step_seconds` interpolates (speculative/schedule.py's StepCostModel)."""

    batches: tuple[int, ...]  # batch sizes measured, increasing
    tokens: tuple[int, ...]  # tokens per request measured, increasing, 1 .. block_size
    contexts: tuple[int, ...]  # context lengths measured, increasing
    target_s: tuple[tuple[tuple[float, ...], ...], ...]  # [context][batch][tokens] target pass, hidden captured
    # [context][batch][tokens] drafter pass adding `tokens` context rows and reading out tokens - 1 drafts (at least 1)
    draft_s: tuple[tuple[tuple[float, ...], ...], ...]
    context_s: tuple[tuple[float, ...], ...]  # [batch][tokens] append_context of that many positions, a pass of its own
    accept_s: tuple[tuple[float, ...], ...]  # [batch][tokens] acceptance (k = 1: sampling) of a k-token pass

    def step_seconds(self, batch: int, context: float, k: int) -> float:
        """One decoding step of `batch` requests, longest context `context`, verifying k tokens per request."""
        target = _interp(self.contexts, [_grid2(self.batches, self.tokens, t, batch, k) for t in self.target_s],
                         context, extrapolate=True)
        rest = _grid2(self.batches, self.tokens, self.accept_s, batch, k)
        if k > 1:  # plain AR steps (k = 1) hand their features to the drafter later (context_seconds)
            rest += _interp(self.contexts, [_grid2(self.batches, self.tokens, d, batch, k) for d in self.draft_s],
                            context, extrapolate=True)
        return max(target + rest, 1e-9)

    def context_seconds(self, batch: int, positions: float) -> float:
        """Handing the drafter `positions` held-back positions of features per request (the flush before a
        speculative step that follows plain AR steps): the measured append_context, continued linearly past the
        largest block measured."""
        if positions <= 0:
            return 0.0
        return _grid2(self.batches, self.tokens, self.context_s, batch, positions, extrapolate_cols=True)


def _interp(xs: tuple[int, ...], ys, x: float, extrapolate: bool = False) -> float:
    """Piecewise-linear y(x) through (xs, ys); clamped outside xs, or with `extrapolate` continued past the
    last point with the last segment's slope (never below the last value). Example: xs (1, 3), ys (2, 4): x 2 -> 3."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    if x > xs[-1] and not extrapolate:
        return float(ys[-1])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, float(ys[-1])) if x > xs[-1] else y


def _grid2(rows: tuple[int, ...], cols: tuple[int, ...], table, r: float, c: float,
           extrapolate_cols: bool = False) -> float:
    return _interp(rows, [_interp(cols, row, c, extrapolate=extrapolate_cols) for row in table], r)


def _doubling(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit` itself: (1, 2, 4, 8, 12) for 12."""
    values = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return (*values, limit)


class _Rounds:
    """Calls to time, each REPEATS times after a warm-up, in rounds over all of them; each keeps its fastest time.

    A shared machine drifts by a third over seconds (seen here: the same AR step at batch 32 took 54 ms in one run
    and 94 ms in the next). Timed back to back, one call's repeats would all fall in the same spell and a whole
    row of the grid with them, skewing the very ratios between verify lengths that the choice rests on; in
    rounds, a call's repeats lie a round apart (seconds) and a slow spell spoils one round, not one row.

    `sync`: waits for the device's queued work (CUDA: torch.cuda.synchronize), before each timed call and after it,
    so that a call is timed by its kernels, not by their launches (a CUDA pass returns once it is queued)."""

    def __init__(self, sync: Callable[[], None] = lambda: None):
        self._calls: list[Callable[[], object]] = []
        self._sync = sync

    def add(self, fn: Callable[[], object]) -> int:
        self._calls.append(fn)
        return len(self._calls) - 1

    def run(self) -> list[float]:
        for fn in self._calls:
            fn()  # warm-up (first call of a shape: allocations, onnxruntime's kernel choice, CUDA graph captures)
        best = [float("inf")] * len(self._calls)
        for _ in range(REPEATS):
            for i, fn in enumerate(self._calls):
                self._sync()
                start = time.perf_counter()
                fn()
                self._sync()
                best[i] = min(best[i], time.perf_counter() - start)
        return best


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work: torch.cuda.synchronize on CUDA, nothing on the CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _fastest(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """One call's fastest time (a round of one)."""
    rounds = _Rounds(sync)
    rounds.add(fn)
    return rounds.run()[0]


def measure(executor: Executor, contexts: tuple[int, ...] | None = None) -> PassCosts:
    """Time the executor's passes on the grid (slots 0 .. batch - 1; their cache rows past position 0 are
    overwritten, which is harmless before any request runs: a slot's positions past its start are never read)."""
    ex = executor
    block = ex.block_size
    batches, tokens = _doubling(ex.num_slots), _doubling(block)
    limit = ex.max_seq_len - block
    contexts = contexts or tuple(sorted({max(1, min(64, limit)), max(1, min(512, limit))}))
    dev = ex.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, ex.vocab_size, (batches[-1], contexts[-1] + block), generator=g).to(dev)
    slots = torch.arange(batches[-1], device=dev)
    zeros = torch.zeros(batches[-1], dtype=torch.long, device=dev)
    # Fill every slot's context once: the drafter's cache rows then hold numbers, not leftovers. Logits at the last
    # position only, as a request's prefill reads them (an executor whose passes are shorter, TensorRT's, runs passes).
    last = torch.full((batches[-1],), contexts[-1] - 1, device=dev)
    prefill = ex.target_forward(ids[:, : contexts[-1]], zeros, slots, capture=True, last_index=last)
    ex.append_context(prefill.hidden, zeros, slots)
    hidden = prefill.hidden[:, :block]  # [slots, block, F]
    greedy = {b: Sampling.greedy(b, dev) for b in batches}

    # The passes that make up a step, timed in rounds (_Rounds); the table of each holds indices into its times.
    sync = device_sync(torch.device(dev))
    rounds = _Rounds(sync)
    target_at, draft_at = [], []
    for c in contexts:
        starts = torch.full((batches[-1],), c, device=dev)
        target_at.append([[rounds.add(lambda b=b, t=t, c=c, starts=starts: ex.target_forward(
            ids[:b, c:c + t], starts[:b], slots[:b], capture=True)) for t in tokens] for b in batches])
        # A step's drafter pass first adds what the step before committed: t positions here, the most it can be.
        draft_at.append([[rounds.add(lambda b=b, t=t, c=c, starts=starts: ex.draft(
            ids[:b, c], starts[:b], slots[:b], max(1, t - 1),
            DraftContext(hidden[:b, :t], (starts[:b] - t).clamp(min=0)))) for t in tokens] for b in batches])
    c = contexts[0]
    starts = torch.full((batches[-1],), c, device=dev)
    context_at = [[rounds.add(lambda b=b, t=t: ex.append_context(hidden[:b, :t], starts[:b], slots[:b]))
                   for t in tokens] for b in batches]
    times = rounds.run()

    def table(at):
        return tuple(table(row) for row in at) if isinstance(at, list) else times[at]

    # The acceptance reads one pass's logits ([batch, tokens, vocab]: too many to hold for the whole grid at once),
    # so each is timed on its own; it is a small part of a step.
    accept = []
    for b in batches:
        row = []
        for t in tokens:
            logits = ex.target_forward(ids[:b, c:c + t], starts[:b], slots[:b], capture=False).logits
            if t == 1:
                row.append(_fastest(lambda b=b, logits=logits: sample_tokens(
                    logits, greedy[b], (starts[:b] + 1)[:, None]), sync))
            else:
                row.append(_fastest(lambda b=b, t=t, logits=logits: ex.accept(
                    ids[:b, c + 1:c + t], logits, greedy[b], starts[:b]), sync))
        accept.append(tuple(row))
    return PassCosts(batches, tokens, contexts, table(target_at), table(draft_at), table(context_at), tuple(accept))


# ------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    if os.environ.get("TRTLLM_DFLASH_CACHE_DIR"):
        return Path(os.environ["TRTLLM_DFLASH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtllm-dflash"


def device_name(executor: Executor) -> str:
    dev = executor.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()


def profile_key(engine_dir: Path, executor: Executor, backend: str) -> ProfileKey:
    return ProfileKey(PROFILE_VERSION, engine_sha256(engine_dir), backend, device_name(executor), torch.get_num_threads(),
                      executor.block_size, executor.num_slots)


def profile_path(key: ProfileKey) -> Path:
    return cache_dir() / "cost_profiles" / f"{key.manifest_sha256[:16]}-{key.backend}.json"


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def read_profile(path: Path) -> tuple[ProfileKey, PassCosts | None]:
    """The profile in `path` (costs None if written by another PROFILE_VERSION, whose tables may have another
    shape: it is measured again), or a UserError in one sentence if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        key = ProfileKey(**data["key"])
        if key.version != PROFILE_VERSION:
            return key, None
        costs = PassCosts(**{k: _tuples(v) for k, v in data["costs"].items()})
        _check(costs)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UserError(f"{path}: not a readable cost profile ({type(exc).__name__}: {exc}); delete it and "
                        "`--block-size auto` measures the engine again.") from None
    return key, costs


def _check(costs: PassCosts) -> None:
    """Grids increasing and tables of their shape, every time finite and positive (else ValueError)."""
    for name in ("batches", "tokens", "contexts"):
        grid = getattr(costs, name)
        if not (grid and all(isinstance(x, int) and x > 0 for x in grid) and list(grid) == sorted(set(grid))):
            raise ValueError(f"{name} is not an increasing list of positive integers")
    nb, nt, nc = len(costs.batches), len(costs.tokens), len(costs.contexts)
    shapes = {"target_s": (nc, nb, nt), "draft_s": (nc, nb, nt), "context_s": (nb, nt), "accept_s": (nb, nt)}
    for name, shape in shapes.items():
        _check_table(getattr(costs, name), shape, name)


def _check_table(table, shape: tuple[int, ...], name: str) -> None:
    if not shape:
        if not (isinstance(table, (int, float)) and 0 < table < float("inf")):
            raise ValueError(f"{name} holds {table!r}, not a positive time")
        return
    if not isinstance(table, tuple) or len(table) != shape[0]:
        raise ValueError(f"{name} does not have the shape of the grids {shape}")
    for row in table:
        _check_table(row, shape[1:], name)


def write_profile(path: Path, key: ProfileKey, costs: PassCosts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"key": asdict(key), "costs": asdict(costs)}) + "\n")


def cache_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold cache files ("... is a file, not a directory"), or None when it can: checked
    before minutes of measuring, whose results a run needs whether or not they can be kept."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except FileExistsError:
        return f"{directory} is a file, not a directory"
    except OSError as exc:
        return f"cannot write in {directory} ({reason(exc)})"
    return None


def load_or_measure(engine_dir: Path, executor: Executor, backend: str, remeasure: bool = False,
                    report: Callable[[str], None] = lambda line: None) -> tuple[PassCosts, Path]:
    """The engine's cost profile for this machine and backend: cached, or measured now (and cached when the cache
    can be written; a cache that cannot be costs the next run a measurement, never this run its results)."""
    costs, path = cached_costs(engine_dir, executor, backend, remeasure, report)
    if costs is not None:
        return costs, path
    return measure_and_cache(engine_dir, executor, backend, report), path


def cached_costs(engine_dir: Path, executor: Executor, backend: str, remeasure: bool = False,
                 report: Callable[[str], None] = lambda line: None) -> tuple[PassCosts | None, Path]:
    """The cached profile if it was measured for this engine, machine and backend (else None, and a profile of
    something else is reported), and where it is kept."""
    key = profile_key(engine_dir, executor, backend)
    path = profile_path(key)
    if path.is_file() and not remeasure:
        cached_key, costs = read_profile(path)
        if cached_key == key:
            return costs, path
        changed = next(f for f in ProfileKey.__dataclass_fields__ if getattr(cached_key, f) != getattr(key, f))
        report(f"{path}: measured with another {changed} ({getattr(cached_key, changed)!r}, now "
               f"{getattr(key, changed)!r}); measuring the pass costs again.")
    return None, path


def measure_and_cache(engine_dir: Path, executor: Executor, backend: str,
                      report: Callable[[str], None] = lambda line: None) -> PassCosts:
    """Measure the pass costs now (`measure`) and cache them where the cache can be written."""
    key = profile_key(engine_dir, executor, backend)
    path = profile_path(key)
    problem = cache_problem(path.parent)
    if problem:
        report(f"warning: the pass-cost cache {problem}: measuring the pass costs of {engine_dir} for this run only "
               "(set TRTLLM_DFLASH_CACHE_DIR to a writable directory to keep them) ...")
    else:
        report(f"measuring the pass costs of {engine_dir} for --block-size auto (cached in {path}) ...")
    start = time.perf_counter()
    costs = measure(executor)
    if not problem:
        try:
            write_profile(path, key, costs)
        except (OSError, UserError) as exc:  # the cache changed while we measured (a full disk, say)
            report(f"warning: the pass costs were not cached ({exc}); the next run measures them again.")
    report(f"pass costs measured in {time.perf_counter() - start:.1f} s.")
    return costs


def costs_table(costs: PassCosts, context: int | None = None) -> list[str]:
    """Markdown: step cost per batch size and verify length k, and the cost of k relative to k = 1."""
    c = context if context is not None else costs.contexts[0]
    head = "| batch | " + " | ".join(f"k={k} ms" for k in costs.tokens) + f" | draft ms (k={costs.tokens[-1]}) |"
    lines = [f"Step cost (ms) at context {c}: draft + verify + context + accept (k = 1: an AR step, no draft)", "",
             head, "|---|" + "---|" * (len(costs.tokens) + 1)]
    for b in costs.batches:
        cells = [f"{costs.step_seconds(b, c, k) * 1e3:.2f}" for k in costs.tokens]
        k = costs.tokens[-1]
        draft = _interp(costs.contexts, [_grid2(costs.batches, costs.tokens, d, b, k) for d in costs.draft_s], c,
                        extrapolate=True)
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {draft * 1e3:.2f} |")
    return lines


# ------------------------------------------------------------------------------------------------
# The acceptance record (the last run's rates: the next run's prior)
# ------------------------------------------------------------------------------------------------

def engine_sha256(engine_dir: Path) -> str:
    return hashlib.sha256((Path(engine_dir) / MANIFEST).read_bytes()).hexdigest()


def acceptance_path(engine_dir: Path) -> Path:
    return cache_dir() / "acceptance" / f"{engine_sha256(engine_dir)[:16]}.json"


def read_acceptance(engine_dir: Path, positions: int) -> list[float] | None:
    """The rates the last run of this engine recorded (P(d_j accepted | d_1..d_{j-1} accepted), j = 1..positions),
    or None when there is none for this engine and block size; a file that is not a record: one sentence."""
    path = acceptance_path(engine_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        rates = data["rates"]
        if not (isinstance(rates, list) and all(isinstance(q, (int, float)) and 0 <= q <= 1 for q in rates)):
            raise ValueError("rates is not a list of probabilities")
        same = data["manifest_sha256"] == engine_sha256(engine_dir) and len(rates) == positions
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{path}: not a readable acceptance record ({type(exc).__name__}: {exc}); delete it and "
                        "`--block-size auto` starts from its default prior.") from None
    return [float(q) for q in rates] if same else None


def write_acceptance(engine_dir: Path, rates: list[float]) -> None:
    """Record `rates` for the next run. A cache that cannot be written costs the next run its prior, not this run
    its results: the error is dropped."""
    path = acceptance_path(engine_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"manifest_sha256": engine_sha256(engine_dir), "rates": rates}) + "\n")
    except (OSError, UserError):  # write_text_atomic says a file system's refusal as a UserError
        pass
