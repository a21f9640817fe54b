"""`trtllm-dflash compare`: a side-by-side DFlash / AR run, printed for people."""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trtllm_dflash.config import Backend
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import require_file
from trtllm_dflash.runtime.compare import side_by_side
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.options import BlockSize
from trtllm_dflash.runtime.runner import Engine


def compare_and_print(engine_dir: Path, input_path: Path, num_prompts: int, max_new_tokens: int, show: int,
                      repeats: int, threads: int | None, block_size: BlockSize | None = None,
                      backend: Backend | None = None, tree_budget: int | None = None) -> None:
    """`compare`: both modes side by side; dflash with a tree of `tree_budget` draft nodes a step when given."""
    require_file(input_path, "input file")
    console = Console()
    engine = Engine.load(engine_dir, block_size=block_size, command="compare", backend=backend,
                         report=lambda line: console.print(line, markup=False, highlight=False), threads=threads,
                         tree_budget=tree_budget)
    cfg = engine.config
    defaults = Defaults(max_new_tokens, 0.0, 0, cfg.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(input_path, engine.tokenizer, defaults)
    if errors:
        raise UserError(f"{input_path}:{errors[0].line}: {errors[0].message}.")
    requests = [r for r in requests if r.temperature == 0][:num_prompts]
    if not requests:
        raise UserError(f"{input_path}: no greedy prompts (compare runs the lines without a temperature > 0).")
    blocks = f"auto (k = 1 .. {engine.executor.block_size})" if engine.auto_block else engine.executor.block_size
    blocks = f"a tree of {tree_budget} draft nodes a step" if tree_budget else f"block_size {blocks}"
    console.print(f"[bold]{engine_dir}[/]: {blocks}, {len(requests)} prompts, "
                  f"batch size 1, greedy, up to {max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    cmp = side_by_side(engine, requests, repeats)
    tok = engine.tokenizer
    for result in cmp.results[:show]:
        prompt = tok.decode(result.request.prompt_token_ids, skip_special_tokens=True)
        completion = tok.decode(result.output_token_ids, skip_special_tokens=True)
        console.rule(str(result.request.id))
        console.print(prompt[-300:], style="dim", end="", markup=False, highlight=False)
        console.print(completion, style="green", markup=False, highlight=False)
    table = Table(title="same engine, same prompts, measured side by side")
    for col in ("mode", "output tokens", "seconds", "tokens/s", "mean acceptance length"):
        table.add_column(col, justify="right")
    table.add_row("ar", str(cmp.ar.output_tokens), f"{cmp.ar.seconds:.2f}", f"{cmp.ar.tokens_per_s:.1f}", "1.00")
    table.add_row("dflash", str(cmp.dflash.output_tokens), f"{cmp.dflash.seconds:.2f}",
                  f"{cmp.dflash.tokens_per_s:.1f}", f"{cmp.mean_acceptance_length:.2f}")
    console.rule()
    console.print(table)
    console.print(f"DFlash / AR speedup: [bold]{cmp.speedup:.2f}x[/]; outputs identical: "
                  f"[bold]{'yes' if cmp.identical else 'NO'}[/]")
    if not cmp.identical:
        raise UserError("DFlash and AR outputs differ; this is a bug, please report it with this engine.")
