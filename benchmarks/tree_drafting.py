"""DDTree against the chain on the demo pair (issue 31): acceptance, tokens/s and the verify pass's cost per node.

    python benchmarks/tree_drafting.py --engine /tmp/kv/demo --rounds 3 [--backend onnxruntime] [--auto]

One loaded engine (the torch executor, or onnxruntime's on an engine built for it; 1 thread, greedy), sized for the
largest tree, so every policy runs the same weights and caches: the chain of the trained block (16: the anchor and 15 drafts) and trees of 16, 32 and 64
nodes built from the drafter's 8 best tokens per position (`--tree-budget`). The held-out prompts (never trained on)
decode `--max-new-tokens` each, at batch 1 (one request after another) and batch 8 (all at once); the policies
alternate within every round, medians over rounds. Reported per policy: committed tokens per step (acceptance length:
all the requests' committed tokens over all their steps; at batch 8 the steps where some requests near their end
commit fewer count alike),
tokens/s, and whether the tokens are plain decoding's. Then the target pass alone at 1 + {1, 15, 16, 32, 64} tokens a
row for batch 1 and 8 after a 256-token context, medians: what a node costs on this CPU, which decides where trees pay.
`--auto` adds `--block-size auto` over chains and auto with the tree of block_size - 1 nodes as one more choice.
Results: benchmarks/results/tree_drafting.json (torch), tree_drafting_onnxruntime.json, tree_drafting_auto*.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import HostRows
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.costs import load_or_measure
from trtllm_dflash.runtime.verify import AutoBlock, FixedBlock, PlainDecoding, TreeDrafting
from trtllm_dflash.speculative.schedule import AutoBlockSize

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (16, 32, 64)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def decode(executor, policy, stop, requests: list[Request]) -> dict:
    start = time.perf_counter()
    results = list(Decoder(executor, policy, stop).generate(requests))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_token_ids) for r in results)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds,
            "steps": sum(len(r.acceptance_lengths) for r in results),
            "committed": sum(sum(r.acceptance_lengths) for r in results),
            "outputs": {r.request.id: r.output_token_ids for r in results}}


def acceptance(run: dict) -> float:
    """Committed tokens per verify step (1.0 for a run of plain steps only, as `auto` may choose)."""
    return run["committed"] / run["steps"] if run["steps"] else 1.0


def pass_cost(executor, batch: int, tokens: int, context: int, repeats: int) -> float:
    """Median seconds of one target pass of `tokens` a row over `batch` rows after `context` cached positions."""
    ids = torch.randint(4, executor.vocab_size, (batch, tokens))
    starts = torch.full((batch,), context)
    slots = torch.arange(batch)
    rows = HostRows(tuple(range(batch)), (context,) * batch)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        executor.target_forward(ids, starts, slots, capture=True, rows=rows)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/demo"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch")
    ap.add_argument("--auto", action="store_true",
                    help="also --block-size auto over chains, and auto with a tree of block_size - 1 nodes as one more "
                         "choice (the pass costs measured or read from the cache first)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    results = ROOT / "benchmarks" / "results"
    args.output = args.output or results / ("tree_drafting" + ("_auto" if args.auto else "")
                                            + ("" if args.backend == "torch" else f"_{args.backend}") + ".json")
    engine = Engine.load(args.engine, backend=args.backend, threads=1, tree_budget=max(BUDGETS))
    cfg, executor = engine.config, engine.executor
    block = cfg.dflash.block_size
    policies = {f"chain {block}": FixedBlock(block), **{f"tree {b}": TreeDrafting(b) for b in BUDGETS}}
    if args.auto:  # each keeps learning over the rounds, as a server's would
        costs, _ = load_or_measure(args.engine, executor, args.backend)
        policies |= {"auto": AutoBlock(AutoBlockSize(costs, block)),
                     f"auto + tree {block - 1}": AutoBlock(AutoBlockSize(costs, block, tree_budget=block - 1))}
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
               if line.strip()][: args.num_prompts]
    requests = [Request(i, engine.tokenizer(p)["input_ids"], args.max_new_tokens) for i, p in enumerate(prompts)]
    stop = cfg.eos_token_ids
    load_before = load()
    with torch.inference_mode():
        plain = decode(executor, PlainDecoding(), stop, requests)["outputs"]
        for policy in policies.values():  # warm-up
            decode(executor, policy, stop, requests[:1])
        runs: dict[str, dict[str, list[dict]]] = {"batch 1": {p: [] for p in policies},
                                                  "batch 8": {p: [] for p in policies}}
        for r in range(args.rounds):
            order = list(policies) if r % 2 == 0 else list(reversed(policies))
            for name in order:
                alone = [decode(executor, policies[name], stop, [req]) for req in requests]
                seconds = sum(a["seconds"] for a in alone)
                runs["batch 1"][name].append({
                    "seconds": seconds, "tokens_per_s": sum(len(o) for a in alone for o in a["outputs"].values())
                    / seconds, "steps": sum(a["steps"] for a in alone),
                    "committed": sum(a["committed"] for a in alone),
                    "outputs": {k: v for a in alone for k, v in a["outputs"].items()}})
                runs["batch 8"][name].append(decode(executor, policies[name], stop, requests))
                b1, b8 = runs["batch 1"][name][-1], runs["batch 8"][name][-1]
                print(f"round {r + 1} {name}: batch 1 {b1['tokens_per_s']:.1f} tok/s (acceptance "
                      f"{acceptance(b1):.2f}), batch 8 {b8['tokens_per_s']:.1f} tok/s (acceptance "
                      f"{acceptance(b8):.2f})", flush=True)
        costs = {f"batch {b}": {f"1 + {t}": round(pass_cost(executor, b, 1 + t, 256, 7) * 1e3, 2)
                                for t in (1, 15, 16, 32, 64)} for b in (1, 8)}
    table = {setting: {name: {"tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rs), 1),
                              "acceptance_length": round(statistics.median(acceptance(x) for x in rs), 2),
                              "same_tokens_as_plain": all(x["outputs"] == plain for x in rs)}
                       for name, rs in by_policy.items()}
             for setting, by_policy in runs.items()}
    chain = f"chain {block}"
    report = {"engine": str(args.engine), "backend": args.backend, "threads": 1, "prompts": len(requests), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "candidates_per_position": 8, "load_before": load_before, "load_after": load(),
              "results": table,
              "tokens_per_s_over_chain": {s: {n: round(v["tokens_per_s"] / t[chain]["tokens_per_s"], 2)
                                              for n, v in t.items()} for s, t in table.items()},
              "target_pass_ms_after_256_tokens": costs}
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
