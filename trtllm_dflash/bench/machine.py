"""What a benchmark ran on: CPU model, cores, torch threads, GPU, library versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_info() -> dict:
    return {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def describe(machine: dict) -> str:
    """One line for a table caption: 'AMD EPYC, 2 cores, 2 torch threads, no GPU, torch 2.13.0+cpu'."""
    gpu = machine["gpu"] or "no GPU"
    return (f"{machine['cpu']}, {machine['cpu_cores']} cores, {machine['torch_threads']} torch threads, {gpu}, "
            f"torch {machine['torch']}")
