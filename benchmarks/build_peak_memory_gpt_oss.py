"""Peak memory of `trtllm-dflash build` with NVFP4 on a random gpt-oss-shaped checkpoint (issue 13).

Writes a random bf16 gpt-oss target of gpt-oss-20b's width and expert count (hidden 2880, 32 experts of
intermediate 2880, top 4, 64 query / 8 KV heads; 2 layers, sliding + full; vocabulary 512): ~3.3 GB of
safetensors, ~1.6 GB per layer. Builds it with `quantization: nvfp4` at tp_size 8 (moe_parallel ep: 2880 / 8 = 360
intermediate rows per rank would cut NVFP4's 16-value blocks) in a fresh process and compares the build's peak
resident memory (`/usr/bin/time`'s maximum RSS) with

    bound = 1.5 x the largest decoder layer's weights (bytes in the checkpoint) + the import-only baseline

(the baseline: a process that only imports the builder, i.e. torch + transformers).

    python benchmarks/build_peak_memory_gpt_oss.py [--workdir DIR] [--output FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GptOssConfig

from trtllm_dflash.checkpoint.formats import drafter_tensor_shapes, save_drafter, target_tensor_shapes
from trtllm_dflash.engine.safetensors_stream import SafetensorsWriter
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams
from trtllm_dflash.stats import cpu_name
from trtllm_dflash.train.random_pair import write_random_pair

DIMS = dict(vocab_size=512, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 4096, "truncate": False}, rope_theta=150000.0,
            attention_bias=True, tie_word_embeddings=False)
TP_SIZE = 8
CALIBRATION = dict(calibration_samples=8, calibration_max_tokens=64)


def write_pair(root: Path) -> tuple[int, int]:
    """Random target and a 1-layer drafter under root; returns (checkpoint bytes, largest layer's bytes)."""
    write_random_pair(root / "small", "gpt_oss")  # for its tokenizer (vocab 512, with the MASK token)
    target = root / "target"
    target.mkdir()
    for f in (root / "small" / "target").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, target / f.name)
    config = GptOssConfig(**DIMS, architectures=["GptOssForCausalLM"])
    config.to_json_file(str(target / "config.json"))
    spec = DecoderSpec.from_hf(config)
    g, layer_bytes = torch.Generator().manual_seed(0), [0] * spec.num_layers
    with SafetensorsWriter(target / "model.safetensors", {"format": "pt"}) as out:
        for name, shape in target_tensor_shapes(spec).items():
            tensor = torch.empty(shape, dtype=torch.bfloat16)
            for part in tensor.view(-1, shape[-1]).split(4096):  # (randn in pieces: no full-size fp32 copy)
                part.copy_(torch.randn(part.shape, generator=g) * 0.02)
            out.add(name, tensor)
            if name.startswith("model.layers."):
                layer_bytes[int(name.split(".")[2])] += tensor.nbytes
            del tensor

    small_drafter = json.loads((root / "small" / "drafter" / "config.json").read_text())
    params = DFlashParams(8, small_drafter["dflash_config"]["mask_token_id"], (0, 1))
    draft_spec = dataclasses.replace(spec, model_type="qwen3", num_layers=1, num_experts=0, num_experts_per_tok=0,
                                     layer_types=None, sliding_window=None, attention_sinks=False, qk_norm=True,
                                     attention_bias=False, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 150000.0})
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in drafter_tensor_shapes(draft_spec, params).items()}
    save_drafter(root / "drafter", draft_spec, params, spec.num_layers, state, "bfloat16")
    return (target / "model.safetensors").stat().st_size, max(layer_bytes)


def peak_rss_mib(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of cmd."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return int(proc.stderr.strip().splitlines()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, help="where to write the checkpoint and engine (default: a temp dir)")
    ap.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "build_peak_memory_gpt_oss.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        ckpt, layer = write_pair(root)
        baseline, _ = peak_rss_mib([sys.executable, "-c", "import trtllm_dflash.engine.builder"])
        config = root / "build.yaml"
        config.write_text(f"target: target\ndrafter: drafter\ndtype: bfloat16\nquantization: nvfp4\n"
                          f"tp_size: {TP_SIZE}\nmoe_parallel: ep\nmax_batch_size: 8\nmax_seq_len: 4096\n"
                          + "".join(f"{k}: {v}\n" for k, v in CALIBRATION.items()))
        rss, wall = peak_rss_mib([sys.executable, "-m", "trtllm_dflash.cli", "build", str(config),
                                  "--output", str(root / "engine")])
        engine_bytes = sum(f.stat().st_size for f in (root / "engine").glob("rank*.safetensors"))
    bound = 1.5 * layer / 2**20 + baseline
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_name()}, "
              f"{torch.get_num_threads()} threads", "target_dims": DIMS, "checkpoint_bytes": ckpt,
              "largest_layer_bytes": layer, "import_only_peak_rss_mib": round(baseline),
              "build": {"quantization": "nvfp4", "tp_size": TP_SIZE, "moe_parallel": "ep", **CALIBRATION,
                        "peak_rss_mib": round(rss), "build_s": round(wall, 1), "engine_weight_bytes": engine_bytes},
              "bound_mib": round(bound), "within_bound": rss <= bound,
              "peak_minus_import_over_largest_layer": round((rss - baseline) * 2**20 / layer, 3)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
