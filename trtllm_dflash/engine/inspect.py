"""`trtllm-dflash inspect ENGINE_DIR`: what an engine holds, and a full integrity check."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table
from safetensors import safe_open

from trtllm_dflash.engine_dir import DRAFTER_PREFIX, GRAPHS, MANIFEST, TARGET_PREFIX, open_engine, rank_file


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def inspect_engine(root: Path, console: Console | None = None) -> dict:
    """Verify every file against the manifest (raises UserError naming the file) and print a summary."""
    console = console or Console()
    root = Path(root)
    cfg = open_engine(root)  # manifest: every file's size and sha256
    manifest = json.loads((root / MANIFEST).read_text())["files"]
    per_rank = []
    for rank in range(cfg.mapping.tp_size):
        stats: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0})
        with safe_open(str(root / rank_file(rank)), framework="pt") as f:
            for name in f.keys():
                part = "target" if name.startswith(TARGET_PREFIX) else "drafter" if name.startswith(DRAFTER_PREFIX) else "other"
                stats[part]["tensors"] += 1
                stats[part]["parameters"] += _count(f.get_slice(name).get_shape())
        per_rank.append({"rank": rank, "bytes": manifest[rank_file(rank)]["size"], **stats})

    t, d = cfg.target, cfg.drafter
    console.print(f"[bold]{root}[/] (trtllm-dflash {cfg.trtllm_dflash_version}, format {cfg.format_version})")
    console.print(f"target   {t['model_type']}: {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, "
                  f"heads {t['num_attention_heads']}/{t['num_key_value_heads']} kv, vocab {t['vocab_size']}")
    console.print(f"drafter  {d['num_hidden_layers']} layers, hidden {d['hidden_size']}, "
                  f"heads {d['num_attention_heads']}/{d['num_key_value_heads']} kv")
    console.print(f"dflash   block_size {cfg.dflash.block_size}, mask_token_id {cfg.dflash.mask_token_id}, "
                  f"target_layer_ids {cfg.dflash.target_layer_ids}")
    console.print(f"dtype {cfg.dtype}, quantization {cfg.quantization.get('quant_algo') or 'none'}, "
                  f"tp_size {cfg.mapping.tp_size}, max_batch_size {cfg.max_batch_size}, max_seq_len {cfg.max_seq_len}, "
                  f"eos_token_ids {cfg.eos_token_ids}")
    graphs = sorted((rel, meta["size"]) for rel, meta in manifest.items() if rel.startswith(GRAPHS + "/"))
    console.print(f"backend  {cfg.backend}" + ("" if not graphs else ": " + ", ".join(
        f"{rel} ({size:,} bytes)" for rel, size in graphs)))
    table = Table()
    for col in ("rank", "file bytes", "target tensors", "target parameters", "drafter tensors", "drafter parameters"):
        table.add_column(col, justify="right")
    for r in per_rank:
        table.add_row(str(r["rank"]), f"{r['bytes']:,}", str(r["target"]["tensors"]), f"{r['target']['parameters']:,}",
                      str(r["drafter"]["tensors"]), f"{r['drafter']['parameters']:,}")
    console.print(table)
    console.print(f"integrity: all {len(manifest)} files match {MANIFEST}")
    return {"config": cfg.model_dump(mode="json"), "ranks": per_rank, "files": len(manifest),
            "graphs": [rel for rel, _ in graphs]}
