"""Experts in the onnxruntime graphs: one com.microsoft.MoE node against the dense form (every expert over every token,
weighted 0 where not routed), side by side (issue 30 item 4).

    python benchmarks/moe_op.py --rounds 60

One gpt-oss MLP of experts (models/moe.py MoEMLP: router, clamped SwiGLU, biases) at hidden = intermediate = 512,
exported both ways through the same exporter as the engines' graphs (compile/onnx_export.py's translations), run by
onnxruntime's CPU execution provider on 1 thread, fp32, at 32 experts top 4 (gpt-oss-20b's ratio) and 128 top 4
(gpt-oss-120b's), and DeepSeek-V3 / Kimi K2's routed experts (models/moe.py SparseMoE: group routing in plain ops
before the node) at 256 top 8 in 8 groups and 384 top 8, intermediate hidden / 4, for 1, 16 and 128 tokens (a decode
step, a verify block, a prefill chunk); the two forms alternate in chunks, medians. Both outputs are checked against
the torch module first. Results: benchmarks/results/moe_op.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from trtllm_dflash.compile.onnx_ops import TRANSLATIONS
from trtllm_dflash.models.moe import MoEMLP, SparseMoE
from trtllm_dflash.models.spec import DecoderSpec

ROOT = Path(__file__).resolve().parents[1]


def spec(experts: int, top_k: int, width: int) -> DecoderSpec:
    return DecoderSpec(model_type="gpt_oss", vocab_size=16, hidden_size=width, intermediate_size=width, num_layers=1,
                       num_heads=8, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, qk_norm=False, attention_bias=True,
                       mlp_bias=False, tie_word_embeddings=False, hidden_act="silu", rope_parameters={},
                       max_position_embeddings=128, num_experts=experts, num_experts_per_tok=top_k)


def deepseek_spec(experts: int, top_k: int, groups: int, top_groups: int, width: int) -> DecoderSpec:
    """DeepSeek-V3 / Kimi K2 routed experts (models/moe.py SparseMoE: sigmoid scores, group-limited choice, weights
    renormalized x 2.5), moe_intermediate_size a quarter of hidden (DeepSeek-V3: 2048 / 7168), no shared expert."""
    return dataclasses.replace(spec(experts, top_k, width), model_type="deepseek_v3", num_experts=0,
                               routed_experts=experts, moe_intermediate_size=width // 4, norm_topk_prob=True,
                               n_group=groups, topk_group=top_groups, routed_scaling_factor=2.5)


# (name, module maker): gpt-oss-20b's and -120b's expert ratios; DeepSeek-V3's (256 experts top 8 in 8 groups, 4
# eligible) and Kimi K2's (384 top 8, one group)
FAMILIES = (
    ("gpt-oss 32 experts top 4", lambda w: MoEMLP(spec(32, 4, w))),
    ("gpt-oss 128 experts top 4", lambda w: MoEMLP(spec(128, 4, w))),
    ("DeepSeek-V3 256 experts top 8, 8 groups", lambda w: SparseMoE(deepseek_spec(256, 8, 8, 4, w))),
    ("Kimi K2 384 experts top 8", lambda w: SparseMoE(deepseek_spec(384, 8, 1, 1, w))),
)


def session(module: MoEMLP | SparseMoE, one_op: bool, path: Path) -> ort.InferenceSession:
    module.export_experts_op = "onnxruntime" if one_op else None
    x = torch.zeros(1, 5, (module.router if isinstance(module, MoEMLP) else module.gate).weight.shape[1])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, (x,), dynamic_shapes=({1: torch.export.Dim("tokens", min=1)},))
        torch.onnx.export(program, dynamo=True, opset_version=24, custom_translation_table=TRANSLATIONS,
                          input_names=["x"], output_names=["y"], optimize=True, verbose=False).save(str(path))
    module.export_experts_op = None
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "moe_op.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f, (family, make) in enumerate(FAMILIES):
            module = make(args.width).eval()
            with torch.no_grad():
                for p in module.parameters():
                    p.normal_(0.0, 0.05)
            sessions = {name: session(module, name == "one MoE node", Path(tmp) / f"{f}_{i}.onnx")
                        for i, name in enumerate(("dense form", "one MoE node"))}
            for tokens in (1, 16, 128):
                x = torch.randn(1, tokens, args.width)
                with torch.no_grad():
                    want = module(x).numpy()
                feeds = {"x": x.numpy()}
                for name, s in sessions.items():
                    err = float(np.abs(s.run(None, feeds)[0] - want).max())
                    assert err < 1e-3 * max(1.0, float(np.abs(want).max())), (name, err)
                times: dict[str, list[float]] = {name: [] for name in sessions}
                for _ in range(4):
                    for name, s in sessions.items():
                        for _ in range(args.rounds // 4):
                            start = time.perf_counter()
                            s.run(None, feeds)
                            times[name].append(time.perf_counter() - start)
                ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in times.items()}
                row = {"family": family, "tokens": tokens, "dense_ms": ms["dense form"],
                       "moe_node_ms": ms["one MoE node"],
                       "dense_over_moe_node": round(ms["dense form"] / ms["one MoE node"], 2)}
                rows.append(row)
                print(row, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load,
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
              "onnxruntime": ort.__version__, "threads": 1, "hidden": args.width,
              "intermediate": {"gpt-oss": args.width, "DeepSeek-V3 / Kimi K2": args.width // 4},
              "rounds": args.rounds, "rows": rows}
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
