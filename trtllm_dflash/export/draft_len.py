"""TensorRT-LLM's `draft_len_schedule` for an exported DFlash engine: how many drafts to verify at each batch size.

TensorRT-LLM's DFlash worker drafts a whole block in one pass and verifies the first `draft_len` drafts of it; the
schedule maps batch-size thresholds to that length ({1: 15, 32: 7, 64: 3} = 15 drafts from batch 1, 7 from batch 32,
3 from 64; 0 = plain decoding). Its rules (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py at commit
0004396720054fd8e205cbf616f21f0b57c6b412: `DecodingBaseConfig.validate_draft_len_schedule_and_sort`,
`TorchLlmArgs.validate_speculative_config`):

  * keys (batch sizes) >= 1, values (draft lengths) >= 0 and <= max_draft_len;
  * the value of the smallest key equals max_draft_len (older releases: key 1 must be present and map to
    max_draft_len; we always start at key 1, which satisfies both);
  * draft_len_schedule and max_concurrency are mutually exclusive;
  * a schedule forces cuda_graph_config.enable_padding to true and adds its keys to cuda_graph_config.batch_sizes.

Where the schedule comes from (`schedule_for`):
  * measured: the engine's cached `--block-size auto` cost profile (runtime/costs.py; the newest one of this
    engine's exact files, any backend) and its acceptance record (the last run's rates; else the chooser's prior).
    At each CUDA-graph batch size B the draft length is k* - 1 for the k that `--block-size auto` would choose
    there (speculative/schedule.py: most expected committed tokens per second of a step), at the profile's longest
    measured context. The profile was measured where it was measured (a CPU here): it says where long blocks stop
    paying on that machine, not on the GPU TensorRT-LLM runs on. Measure on the deployment GPU for a schedule that
    fits it.
  * default, without a profile: at most TOKEN_BUDGET tokens verified per step (B x (draft_len + 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Default schedule: a step verifies at most this many tokens over the batch (B x (draft_len + 1)). A decode GEMM
# over M token rows reads the weights once and does 2*M flops per weight element, so it stays memory-bound (as
# cheap as one token) while M is below the GPU's flops-per-byte ridge point: about 200-300 for bf16 on H100 / H200 /
# B200 (and about the same in tokens for FP8 and NVFP4, whose weights shrink as their flops grow). Past it, every
# verified token costs compute, and drafts that are rarely accepted cost more than they commit.
TOKEN_BUDGET = 256


@dataclass(frozen=True)
class DraftLenSchedule:
    max_draft_len: int
    schedule: dict[int, int]  # batch-size threshold -> draft length, sorted, TensorRT-LLM's rules
    source: str  # one sentence: how it was derived (the YAML comment and the README say it)


def check_schedule(schedule: dict[int, int], max_draft_len: int, block_size: int) -> None:
    """TensorRT-LLM's rules for `draft_len_schedule` and ours (max_draft_len <= block_size - 1); ValueError if broken."""
    if not 1 <= max_draft_len <= block_size - 1:
        raise ValueError(f"max_draft_len {max_draft_len} is outside 1 .. block_size - 1 = {block_size - 1}")
    if not schedule:
        raise ValueError("the schedule is empty")
    for batch, draft_len in schedule.items():
        if not (isinstance(batch, int) and batch >= 1):
            raise ValueError(f"batch size threshold {batch!r} is not an integer >= 1")
        if not (isinstance(draft_len, int) and 0 <= draft_len <= max_draft_len):
            raise ValueError(f"draft length {draft_len!r} at batch {batch} is outside 0 .. max_draft_len {max_draft_len}")
    if 1 not in schedule or schedule[min(schedule)] != max_draft_len:
        raise ValueError(f"the smallest key must be 1 and map to max_draft_len {max_draft_len}: {schedule}")
    if list(schedule) != sorted(schedule):
        raise ValueError(f"keys are not sorted: {list(schedule)}")


def thresholds(per_batch: list[tuple[int, int]]) -> dict[int, int]:
    """The schedule of (batch size, draft length) points: the first point and every change, clipped to the first
    point's length (max_draft_len). Example: [(1, 15), (2, 15), (4, 7), (8, 7), (16, 0)] -> {1: 15, 4: 7, 16: 0}."""
    top = per_batch[0][1]
    schedule: dict[int, int] = {}
    for batch, draft_len in per_batch:
        draft_len = min(draft_len, top)
        if not schedule or draft_len != schedule[next(reversed(schedule))]:
            schedule[batch] = draft_len
    return schedule


def default_schedule(block_size: int, batch_sizes: list[int]) -> dict[int, int]:
    """At most TOKEN_BUDGET verified tokens per step: draft_len(B) = min(block_size - 1, TOKEN_BUDGET // B - 1), >= 0.
    Example, block 16, batch sizes 1 .. 512: {1: 15, 32: 7, 64: 3, 128: 1, 256: 0}."""
    points = [(b, max(0, min(block_size - 1, TOKEN_BUDGET // b - 1))) for b in [1, *batch_sizes] if b >= 1]
    return thresholds(sorted(set(points)))


def measured_schedule(costs, accept_at_least: list[float], block_size: int, batch_sizes: list[int],
                      context: float) -> dict[int, int]:
    """draft_len(B) = k* - 1, k* the verify length `--block-size auto` chooses at batch B and `context` from the
    profile's step costs and these acceptance probabilities (accept_at_least[j - 1] = P(accepted >= j))."""
    from trtllm_dflash.speculative.schedule import choose_verify_length

    points = []
    for b in sorted({1, *batch_sizes}):
        seconds = [costs.step_seconds(b, context, k) for k in range(1, block_size + 1)]
        points.append((b, choose_verify_length(accept_at_least, seconds) - 1))
    return thresholds(points)


def _cached_profile(engine_dir: Path):
    """(key, costs, path) of the newest cached cost profile of exactly this engine's files, or None."""
    from trtllm_dflash.errors import UserError
    from trtllm_dflash.runtime.costs import cache_dir, engine_sha256, read_profile

    sha = engine_sha256(engine_dir)
    found = []
    for path in (cache_dir() / "cost_profiles").glob(f"{sha[:16]}-*.json"):
        try:
            key, costs = read_profile(path)
        except UserError:
            continue  # not a profile: `run --block-size auto` says so; an export does without it
        if costs is not None and key.manifest_sha256 == sha:
            found.append((path.stat().st_mtime, str(path), key, costs))
    if not found:
        return None
    _, path, key, costs = max(found)
    return key, costs, Path(path)


def schedule_for(engine_dir: Path, block_size: int, batch_sizes: list[int]) -> DraftLenSchedule:
    """The engine's schedule: from its cached cost profile when it has one, else the documented default."""
    from trtllm_dflash.runtime.costs import read_acceptance
    from trtllm_dflash.speculative.schedule import PRIOR_RATE

    cached = _cached_profile(engine_dir)
    default = default_schedule(block_size, batch_sizes)
    budget = (f"the default: at most {TOKEN_BUDGET} verified tokens per step (batch x (draft_len + 1)), "
              "trtllm_dflash/export/draft_len.py")
    if cached is None:
        return DraftLenSchedule(default[1], default, f"{budget}; the engine has no cost profile")
    key, costs, path = cached
    if key.block_size != block_size or max(costs.tokens) != block_size:
        return DraftLenSchedule(default[1], default, f"{budget}; its cost profile {path} has another block size")
    rates = read_acceptance(engine_dir, block_size - 1)
    at_least, p = [], 1.0
    for q in rates or [PRIOR_RATE] * (block_size - 1):
        p *= q
        at_least.append(p)
    context = costs.contexts[-1]
    measured = measured_schedule(costs, at_least, block_size, batch_sizes, context)
    acceptance = ("the engine's recorded acceptance rates" if rates else
                  f"a flat acceptance prior of {PRIOR_RATE} per position (no recorded run)")
    where = f"{key.backend} backend on {key.device}, {key.threads} thread{'s' * (key.threads != 1)}, context {context}"
    if measured[1] == 0:
        return DraftLenSchedule(default[1], default, f"{budget}; its cost profile ({where}) says DFlash does not pay "
                                "even at batch 1 on the machine it was measured on")
    return DraftLenSchedule(measured[1], measured,
                            f"--block-size auto's choice at each batch size from the engine's cost profile ({where}; "
                            f"{path.name}) and {acceptance}; measured there, not on the GPU TensorRT-LLM runs on")


def schedule_text(schedule: dict[int, int]) -> str:
    """{1: 15, 32: 7}, as YAML and Python write it (json.dumps would quote the keys)."""
    return "{" + ", ".join(f"{b}: {d}" for b, d in schedule.items()) + "}"


def schedule_comment(s: DraftLenSchedule) -> str:
    """The YAML's comment line on the schedule."""
    return f"# draft_len_schedule (batch size -> drafts verified): {schedule_text(s.schedule)}, {s.source}.\n"
