"""Peak memory of `trtllm-dflash build` on a random ~1 GB target checkpoint (issue 4, item 6).

Writes a random bf16 Qwen3 target (hidden 2048, 8 layers, intermediate 8192: ~1.0 GB of safetensors in
two shards) and a 1-layer DFlash drafter, builds it at tp_size 1 and 8 in fresh processes, and reports
each build's peak resident memory (`/usr/bin/time`'s maximum RSS) next to the checkpoint size and to
the RSS of a process that only imports the builder (torch + transformers).

    python benchmarks/build_peak_memory.py [--workdir DIR] [--output benchmarks/results/build_peak_memory.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

from trtllm_dflash.checkpoint.formats import drafter_tensor_shapes, save_drafter, target_tensor_shapes
from trtllm_dflash.engine.safetensors_stream import SafetensorsWriter
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams
from trtllm_dflash.stats import cpu_name
from trtllm_dflash.train.random_pair import write_random_pair

DIMS = dict(vocab_size=512, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def write_pair(root: Path) -> int:
    """Random target (two shards + index) and drafter under root; returns the target's safetensors bytes."""
    write_random_pair(root / "small")  # for its tokenizer (vocab 512, with the MASK token)
    target = root / "target"
    target.mkdir()
    for f in (root / "small" / "target").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, target / f.name)
    config = Qwen3Config(**DIMS, architectures=["Qwen3ForCausalLM"])
    config.to_json_file(str(target / "config.json"))
    spec = DecoderSpec.from_hf(config)
    shapes = list(target_tensor_shapes(spec).items())
    half = len(shapes) // 2
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for n, part in enumerate((shapes[:half], shapes[half:])):
        name = f"model-{n + 1:05d}-of-00002.safetensors"
        with SafetensorsWriter(target / name, {"format": "pt"}) as out:
            for key, shape in part:
                out.add(key, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
                weight_map[key] = name
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    small_drafter = json.loads((root / "small" / "drafter" / "config.json").read_text())
    params = DFlashParams(8, small_drafter["dflash_config"]["mask_token_id"], (1, 4, 7))
    draft_spec = DecoderSpec(**{**spec.__dict__, "num_layers": 1})
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in drafter_tensor_shapes(draft_spec, params).items()}
    save_drafter(root / "drafter", draft_spec, params, spec.num_layers, state, "bfloat16")
    return sum(f.stat().st_size for f in target.glob("*.safetensors"))


def peak_rss_mib(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of cmd."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True, check=True)
    return int(proc.stderr.strip().splitlines()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, help="where to write the checkpoint and engines (default: a temp dir)")
    ap.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "build_peak_memory.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        ckpt = write_pair(root)
        baseline, _ = peak_rss_mib([sys.executable, "-c", "import trtllm_dflash.engine.builder"])
        runs = []
        for tp in (1, 8):
            config = root / f"tp{tp}.yaml"
            config.write_text(f"target: target\ndrafter: drafter\ndtype: bfloat16\ntp_size: {tp}\n"
                              "max_batch_size: 8\nmax_seq_len: 4096\n")
            rss, wall = peak_rss_mib([sys.executable, "-m", "trtllm_dflash.cli", "build", str(config),
                                      "--output", str(root / f"engine_tp{tp}")])
            engine_bytes = sum(f.stat().st_size for f in (root / f"engine_tp{tp}").glob("rank*.safetensors"))
            runs.append({"tp_size": tp, "peak_rss_mib": round(rss), "build_s": round(wall, 1),
                         "engine_weight_bytes": engine_bytes,
                         "peak_over_checkpoint": round(rss * 2**20 / ckpt, 3),
                         "peak_minus_import_over_checkpoint": round((rss - baseline) * 2**20 / ckpt, 3)})
            shutil.rmtree(root / f"engine_tp{tp}")
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_name()}, "
              f"{torch.get_num_threads()} threads", "checkpoint_bytes": ckpt, "target_dims": DIMS,
              "import_only_peak_rss_mib": round(baseline), "builds": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
