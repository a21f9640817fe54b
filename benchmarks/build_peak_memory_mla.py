"""Peak memory of `trtllm-dflash build` on a random DeepSeek-V3 / Kimi K2-shaped checkpoint (issue 30).

Writes a random bf16 deepseek_v3 target with Kimi K2's latent attention (q rank 1536, latent 512 + 64 roped dims, 128
unroped and 128 value dims per head) at a narrower width (hidden 2048, 16 heads) and K2's layer pattern in small:
layer 0 dense (intermediate 8192), the others (2 by default: ~1.7 GB; `--layers`) with 64 routed experts of 1024 in 8
groups (4 eligible, top 6) and a shared expert; vocabulary 512. Builds it at tp_size 8 with moe_parallel ep (8 whole
experts a rank) in a fresh process and compares the build's peak resident memory (`/usr/bin/time`'s maximum RSS) with

    bound = 1.5 x the largest decoder layer's weights (bytes in the checkpoint) + the import-only baseline

(the baseline: a process that only imports the builder, i.e. torch + transformers): unquantized, the build streams the
checkpoint a tensor at a time into the eight rank files. With `--quantization nvfp4` ModelOpt quantizes the target a
layer at a time (engine/quantize_layers.py), so the peak should stay flat as layers are added (`--layers 3,7`: one
checkpoint of each depth), and the script also measures, in a fresh process on the same prompts, ModelOpt's PTQ of the
whole model loaded by transformers (engine/quantize_target.py `quantize_target`), whose peak grows with the checkpoint.
The baseline then imports ModelOpt too.

    python benchmarks/build_peak_memory_mla.py [--quantization nvfp4] [--layers N[,N...]] [--workdir DIR] [--output F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config

from build_peak_memory_gpt_oss import peak_rss_mib  # (this directory: the script's own)
from trtllm_dflash.checkpoint.formats import drafter_tensor_shapes, save_drafter, target_tensor_shapes
from trtllm_dflash.engine.safetensors_stream import SafetensorsWriter
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams
from trtllm_dflash.stats import cpu_name
from trtllm_dflash.train.random_pair import write_random_pair

DIMS = dict(vocab_size=512, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4,
            routed_scaling_factor=2.827, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=131072,
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096},
            num_mtp_layers=0, tie_word_embeddings=False)
TP_SIZE = 8


def write_pair(root: Path, dims: dict) -> tuple[int, int]:
    """Random target of `dims` and a 1-layer drafter under root; returns (checkpoint bytes, largest layer's bytes)."""
    write_random_pair(root / "small", "deepseek_v3")  # for its tokenizer (vocab 512, with the MASK token)
    target = root / "target"
    target.mkdir()
    for f in (root / "small" / "target").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, target / f.name)
    config = DeepseekV3Config(**dims, architectures=["DeepseekV3ForCausalLM"])
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
    draft_spec = DecoderSpec(model_type="qwen3", vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                             intermediate_size=4096, num_layers=1, num_heads=16, num_kv_heads=8, head_dim=128,
                             rms_norm_eps=1e-6, qk_norm=True, attention_bias=False, mlp_bias=False,
                             tie_word_embeddings=False, hidden_act="silu",
                             rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                             max_position_embeddings=131072)
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in drafter_tensor_shapes(draft_spec, params).items()}
    save_drafter(root / "drafter", draft_spec, params, spec.num_layers, state, "bfloat16")
    return (target / "model.safetensors").stat().st_size, max(layer_bytes)


# What the nvfp4 build calibrates on (the builder's default prompts, Python standard library code)
CALIBRATION = {"calibration_samples": 8, "calibration_max_tokens": 64}
WHOLE_MODEL = """
import sys
from pathlib import Path
from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.engine.quantize_target import LATENT_ATTENTION, calibration_batches, quantize_target
target = Path(sys.argv[1])
batches = calibration_batches(load_tokenizer(target), None, int(sys.argv[2]), int(sys.argv[3]))
quantize_target(target, "nvfp4", batches, LATENT_ATTENTION)
"""


def measure(root: Path, dims: dict, quantization: str, baseline: float) -> dict:
    """One checkpoint of `dims`: the build's peak (and, quantized, ModelOpt's on the whole model)."""
    nvfp4 = quantization == "nvfp4"
    ckpt, layer = write_pair(root, dims)
    config = root / "build.yaml"
    config.write_text(f"target: target\ndrafter: drafter\ndtype: bfloat16\nquantization: {quantization}\n"
                      f"tp_size: {TP_SIZE}\nmoe_parallel: ep\nmax_batch_size: 8\nmax_seq_len: 4096\n"
                      + "".join(f"{k}: {v}\n" for k, v in CALIBRATION.items() if nvfp4))
    rss, wall = peak_rss_mib([sys.executable, "-m", "trtllm_dflash.cli", "build", str(config),
                              "--output", str(root / "engine")])
    run = {"num_hidden_layers": dims["num_hidden_layers"], "checkpoint_bytes": ckpt, "largest_layer_bytes": layer,
           "build": {"quantization": quantization, "tp_size": TP_SIZE, "moe_parallel": "ep",
                     "peak_rss_mib": round(rss), "build_s": round(wall, 1),
                     "engine_weight_bytes": sum(f.stat().st_size for f in (root / "engine").glob("rank*.safetensors"))}
           | (CALIBRATION if nvfp4 else {}),
           "peak_minus_import_over_largest_layer": round((rss - baseline) * 2**20 / layer, 3)}
    if nvfp4:
        whole, whole_s = peak_rss_mib([sys.executable, "-c", WHOLE_MODEL, str(root / "target"),
                                       *(str(v) for v in CALIBRATION.values())])
        run["whole_model_modelopt"] = {
            "peak_rss_mib": round(whole), "wall_s": round(whole_s, 1),
            "peak_minus_import_over_checkpoint": round((whole - baseline) * 2**20 / ckpt, 3),
            "build_peak_over_whole_model_peak": round(rss / whole, 3)}
    else:
        bound = 1.5 * layer / 2**20 + baseline
        run |= {"bound_mib": round(bound), "within_bound": rss <= bound}
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=("none", "nvfp4"), default="none")
    ap.add_argument("--layers", default=str(DIMS["num_hidden_layers"]),
                    help="decoder layers (1 dense), or several checkpoints' counts: 3,7")
    ap.add_argument("--workdir", type=Path, help="where to write the checkpoints and engines (default: a temp dir)")
    ap.add_argument("--output", type=Path, help="default: results/build_peak_memory_mla[_nvfp4].json")
    args = ap.parse_args()
    output = args.output or Path(__file__).parent / "results" / (
        f"build_peak_memory_mla{'_nvfp4' * (args.quantization == 'nvfp4')}.json")
    # (the import-only baseline: what the build imports before it reads a tensor; ModelOpt too when it quantizes)
    imports = "import trtllm_dflash.engine.builder" + (
        ", modelopt.torch.quantization, modelopt.torch.export" if args.quantization == "nvfp4" else "")
    baseline, _ = peak_rss_mib([sys.executable, "-c", imports])
    runs = []
    for layers in (int(n) for n in args.layers.split(",")):
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            runs.append(measure(Path(tmp), DIMS | {"num_hidden_layers": layers}, args.quantization, baseline))
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
              "target_dims": DIMS | {"num_hidden_layers": "per run"}, "import_only": imports,
              "import_only_peak_rss_mib": round(baseline), "runs": runs}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
