"""`bench`'s options (torch-free, so that `trtllm-dflash --help` starts at once)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.config import Backend
from trtllm_dflash.runtime.options import Mode


@dataclass(frozen=True)
class BenchOptions:
    concurrency: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_batch_size and the request count
    modes: tuple[Mode, ...] = ("ar", "dflash")
    block_sizes: tuple[int | str, ...] | None = None  # DFlash block sizes and/or "auto" (None: the engine's)
    num_requests: int | None = None  # the first N prompts of the dataset (None: all)
    max_new_tokens: int = 128
    warmup: int = 2  # requests run through every configuration before timing, not measured
    repeats: int = 3  # timed runs per point; the report gives medians
    threads: int | None = None  # CPU threads (None: Engine.load's default, runtime/runner.py cpu_threads)
    backend: Backend | None = None  # the executor (None: what the engine was compiled for)
    kv_cache_memory: str | None = None  # a paged KV cache of this size (None: a static slot per request)
    prefix_cache: bool = True  # prompt blocks reused across requests by prefix (shared when paged, else copied)
    system_prompt: Path | None = None  # a text file every request begins with (a shared prefix)
    multi_turn: bool = False  # SPEED-Bench: every turn of a conversation, each after the engine's answer
    prefix_states: int | None = None  # a hybrid target's recurrent states kept for prefix reuse (None: one a slot)
