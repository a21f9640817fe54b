"""What a benchmark ran on: CPU model, cores, torch threads, GPU, library versions."""

from __future__ import annotations

import os
import platform

import torch

from trtllm_dflash.stats import cpu_name


def machine_info() -> dict:
    return {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        # Other work on the same cores changes every timing; the load when a run starts hints at it
        # (on an idle machine it is about the number of threads that just ran, ours included).
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def describe(machine: dict) -> str:
    """One line for a caption, e.g. 'AMD EPYC, 2 cores, 2 torch threads, no GPU, torch 2.13.0+cpu, load average 0.1
    at start'."""
    gpu = machine["gpu"] or "no GPU"
    load = machine.get("load_average_1min")
    return (f"{machine['cpu']}, {machine['cpu_cores']} cores, {machine['torch_threads']} torch threads, {gpu}, "
            f"torch {machine['torch']}" + ("" if load is None else f", load average {load} at start"))
