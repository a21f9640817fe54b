"""The CPU thread default (runtime/runner.py cpu_threads): one thread for a small model, the CPUs shared out among
the ranks for a large one, and the user's --threads always."""

from __future__ import annotations

import os

import torch

from trtllm_dflash.runtime.runner import SMALL_MODEL_BYTES, Engine, cpu_threads


def test_small_models_run_on_one_thread_and_large_ones_share_the_cpus(tmp_path):
    small, large = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    small.write_bytes(b"\0" * 1024)
    with large.open("wb") as f:  # sparse: the size is what counts
        f.truncate(SMALL_MODEL_BYTES)
    cpus = len(os.sched_getaffinity(0))
    assert cpu_threads(small, 1) == 1
    assert cpu_threads(large, 1) == cpus
    assert cpu_threads(large, 2) == max(1, cpus // 2)
    assert cpu_threads(large, 64) == 1


def test_engine_load_sets_the_default_unless_threads_are_given(qwen3_engine_dir):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Engine.load(qwen3_engine_dir)
        assert torch.get_num_threads() == 1  # a random test pair is far below SMALL_MODEL_BYTES
        Engine.load(qwen3_engine_dir, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
