"""The benchmark's PNG: per-user vs total output throughput (one curve per mode), and acceptance per block position.

Left: every point of a curve is one concurrency (labelled); further right is faster for each user,
higher is more tokens for the machine. Right: for each DFlash block size, the share of verify
steps whose k-th draft was accepted (non-increasing in k by construction).
Needs matplotlib: `pip install 'trtllm-dflash[bench]'`.
"""

from __future__ import annotations

from pathlib import Path

from trtllm_dflash.errors import UserError
from trtllm_dflash.outputs import atomic_file


def require_matplotlib():
    """matplotlib.pyplot on the non-interactive Agg backend, or a UserError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'trtllm-dflash[bench]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curves(report: dict) -> dict[str, list[dict]]:
    curves: dict[str, list[dict]] = {}
    for p in report["points"]:
        name = p["mode"] if p["block_size"] is None else f"{p['mode']} (block {p['block_size']})"
        curves.setdefault(name, []).append(p)
    return curves


def plot_report(report: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, points in _curves(report).items():
        points = sorted(points, key=lambda p: p["concurrency"])
        x = [p["streaming_metrics"]["token_output_speed_tok_s"] or 0.0 for p in points]
        y = [p["performance"]["system_output_throughput_tok_s"] for p in points]
        left.plot(x, y, marker="o", label=name)
        for p, xi, yi in zip(points, x, y):
            left.annotate(f"C={p['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    left.set_xlabel("Per User Output Speed (tps/user)")
    left.set_ylabel("Total Output Throughput (tokens/sec)")
    left.set_title("throughput vs per-user speed (C = concurrency)")
    left.grid(alpha=0.3)
    left.legend()

    seen = set()
    for p in report["points"]:
        if p["mode"] != "dflash" or p["block_size"] in seen:
            continue
        seen.add(p["block_size"])
        dec = p["decoding_stats"]
        rates = dec["acceptance_rate_per_position"]
        rates = [float("nan") if r is None else r for r in rates]  # auto: positions no step verified
        right.plot(range(1, len(rates) + 1), rates, marker=".",
                   label=f"block {p['block_size']} (AL {dec['acceptance_length'] or 0:.2f})")
    right.set_xlabel("block position k (k-th draft token)")
    right.set_ylabel("acceptance rate")
    right.set_ylim(0, 1.02)
    right.set_title("share of verify steps accepting the k-th draft")
    right.grid(alpha=0.3)
    if seen:
        right.legend()
    else:
        right.text(0.5, 0.5, "no dflash runs", ha="center", va="center", transform=right.transAxes)
    fig.suptitle(f"{Path(report['engine']).name} on {Path(report['dataset']).name}, "
                 f"{report['num_requests']} requests, {report['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    with atomic_file(path, "wb") as out:
        fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
