"""`trtllm-dflash bench`: closed-loop throughput / latency / acceptance benchmarks with trtllm-bench's metrics.

datasets.py  prompt sets (SPEED-Bench JSONL, {"id", "prompt"} JSONL, {"prompt"} JSONL), detected per file
runner.py    the closed loop at a given concurrency, warm-up, repeats, the speedup bound
metrics.py   one run's results -> trtllm-bench's metrics; medians over repeats
report.py    the markdown tables and the machine description
plot.py      the PNG: per-user vs total throughput, acceptance per block position
machine.py   what a benchmark ran on (CPU, cores, torch threads, load), for every report
"""
