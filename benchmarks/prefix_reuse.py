"""Prefix reuse on a shared-prefix workload (issue 29): TTFT and total time with and without it, side by side.

    python benchmarks/prefix_reuse.py --engine /tmp/kv/demo --prefix-tokens 1536 --rounds 3
    python benchmarks/prefix_reuse.py --engine /tmp/kv/demo --prefix-tokens 1968 --rounds 3 --burst

The workload: one long system prompt (--prefix-tokens tokens of held-out code, the demo tokenizer's) followed by a
short user turn (a held-out prompt's first 32 tokens), --num-requests requests submitted one after another at
concurrency 1 (an agent's turns), greedy, --max-new-tokens each, dflash, 1 thread. `--backend torch`: the torch
executor with a paged cache of --kv-cache-memory (blocks shared); `--backend onnxruntime` (an engine built for it,
such as build_configs/demo.yaml's): its static rows, the prompt blocks copied from a pool
(runtime/cache_rows.PrefixRows). With reuse the first request prefills the whole prompt and publishes its blocks, the
others prefill only their own turn; without (--no-prefix-cache) every request prefills everything. A fresh executor
per run (no blocks cached from an earlier run), the two alternating by round, medians. Reported: TTFT of the first
request and the median of the rest, total time, and whether the tokens are the same. Results:
benchmarks/results/prefix_reuse.json (torch), prefix_reuse_onnxruntime.json.

`--burst`: the requests submitted together (a batch job over prompts with one system prompt), up to the engine's
max_batch_size at once. With reuse the first prefills the prefix and the others, admitted in the same step's second
wave, only their turns; without, every request prefills everything (as reuse did in a burst before 2026-12-05, when
requests admitted in one step could not see each other's blocks). Results: prefix_reuse_burst[_onnxruntime].json.

`--policy auto` (with --burst and more requests than the engine's rows, e.g. --num-requests 24 --prefix-tokens 480):
`--block-size auto` (the engine loaded with it, its measured pass costs), which at 8 requests in flight on this CPU
runs plain steps and holds a prompt of up to 512 tokens back from the drafter. Its prompt blocks are published when a
request ends (since 2026-12-05; before, never: the "reuse" side then equalled "no reuse"), so the requests admitted
after the first ones finish find the system prompt. Results: prefix_reuse_auto[_onnxruntime].json.

`--random-family qwen3_5` (with --engine DIR, which it builds if it is not there): a random Qwen3.5 pair of the demo
target's width (hidden 192, 16 layers of which every fourth is full attention and the rest Gated DeltaNet, vocabulary
4096; train/random_pair.py), float32, max_seq_len 2048: prefix reuse of a hybrid target, which resumes the recurrent
states kept at checkpoints (runtime/prefix_states.py). Results: prefix_reuse_qwen3_5.json.

`--unique`: no prompt shares a block with another (request i's "system prompt" starts i + 1 tokens further into the
held-out code, so even its first block differs): what prefix caching costs when it never hits (hashing, the pool's
copies on onnxruntime, and under --policy auto the drafter's pass over a prompt at its request's end, paid for
nothing here). Results: prefix_reuse[_auto]_unique[_onnxruntime].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.kv_blocks import parse_size
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.verify import FixedBlock

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(engine: Engine, root: Path, requests: list[Request], budget: int, reuse: bool, backend: str,
        burst: bool = False, auto: bool = False) -> dict:
    if auto:  # (loading, untimed: the pass costs were measured once, by the warm-up's load)
        loaded = Engine.load(root, backend=backend, threads=1, prefix_cache=reuse, block_size="auto",
                             kv_cache_memory=str(budget) if backend == "torch" else None,
                             report=lambda line: print(line, flush=True))
        executor = loaded.executor
        prefix = executor.kv_blocks if backend == "torch" else executor.prefix_rows
        decoder = loaded.decoder("dflash")
    elif backend == "torch":
        ex = engine.executor
        executor = TorchExecutor(ex.target, ex.drafter, engine.config.max_batch_size, engine.config.max_seq_len,
                                 kv_cache_memory=budget, prefix_cache=reuse)
        prefix = executor.kv_blocks
    else:  # (loading, untimed)
        executor = Engine.load(root, backend=backend, threads=1, prefix_cache=reuse).executor
        prefix = executor.prefix_rows
    if not auto:
        decoder = Decoder(executor, FixedBlock(executor.block_size), engine.config.eos_token_ids)
    start = time.perf_counter()
    if burst:
        results = sorted(decoder.generate(requests), key=lambda r: r.request.id)
    else:
        results = [r for q in requests for r in decoder.generate([q])]
    return {"seconds": time.perf_counter() - start, "ttft_ms": [round(r.ttft_s * 1e3, 2) for r in results],
            "outputs": [r.output_token_ids for r in results],
            "speculative_steps": sum(len(r.acceptance_lengths) for r in results),
            "prefix_hit_rate": prefix.prefix_blocks_hit / max(1, prefix.prefix_blocks_looked_up) if prefix else 0.0}


def build_random(engine: Path, family: str) -> None:
    """A random `family` pair of the demo target's width, built into `engine`."""
    import tempfile

    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.train.random_pair import write_random_pair

    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = write_random_pair(Path(tmp), family, vocab_size=4096, hidden_size=192, num_layers=16,
                                            num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                                            block_size=16)
        build_engine(BuildConfig(target=target, drafter=drafter, output=engine, dtype="float32", max_batch_size=8,
                                 max_seq_len=2048), force=False, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/demo"))
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=("torch", "onnxruntime"), default="torch")
    ap.add_argument("--burst", action="store_true", help="submit the requests together, not one after another")
    ap.add_argument("--policy", choices=("dflash", "auto"), default="dflash",
                    help="dflash: blocks of the engine's block_size; auto: --block-size auto")
    ap.add_argument("--unique", action="store_true",
                    help="no shared prefix: what prefix caching costs when it never hits")
    ap.add_argument("--random-family", choices=("qwen3_5",),
                    help="build --engine from a random pair of this family at the demo target's width, if not there")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.random_family and not args.engine.exists():
        build_random(args.engine, args.random_family)
    auto = args.policy == "auto"
    suffix = (("_auto" if auto else "_burst" if args.burst else "") + ("_unique" if args.unique else "")
              + ("" if args.backend == "torch" else f"_{args.backend}")
              + (f"_{args.random_family}" if args.random_family else ""))
    args.output = args.output or ROOT / "benchmarks" / "results" / f"prefix_reuse{suffix}.json"
    engine = Engine.load(args.engine, backend="torch", threads=1)
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl")
               if line.strip()]
    corpus = [t for p in prompts for t in engine.tokenizer(p)["input_ids"]]
    shift = args.num_requests if args.unique else 0
    if len(corpus) < args.prefix_tokens + shift:
        raise SystemExit(f"the held-out prompts have {len(corpus)} tokens, fewer than --prefix-tokens (+ "
                         "--num-requests with --unique)")
    system = corpus[: args.prefix_tokens]
    turns = [engine.tokenizer(p)["input_ids"][:32] for p in prompts[-args.num_requests:]]
    # --unique: request i's prefix starts i + 1 tokens in: no block of it is any other request's
    requests = [Request(i, (corpus[i + 1: i + 1 + args.prefix_tokens] if args.unique else system) + turn,
                        args.max_new_tokens) for i, turn in enumerate(turns)]
    budget = parse_size(args.kv_cache_memory)
    load_before = load()
    print(f"{len(requests)} requests: a {len(system)}-token {'unique' if args.unique else 'shared'} prefix + 32-token "
          f"turns, {args.max_new_tokens} new tokens each, {'submitted together' if args.burst else 'concurrency 1'}; "
          f"load before: {load_before}", flush=True)
    run(engine, args.engine, requests[:2], budget, True, args.backend, args.burst, auto)  # warm-up
    runs: dict[str, list[dict]] = {"reuse": [], "no reuse": []}
    for r in range(args.rounds):
        for name in (("reuse", "no reuse") if r % 2 == 0 else ("no reuse", "reuse")):
            runs[name].append(run(engine, args.engine, requests, budget, name == "reuse", args.backend, args.burst,
                                  auto))
            x = runs[name][-1]
            print(f"round {r + 1} {name}: {x['seconds']:.2f} s, TTFT first {x['ttft_ms'][0]} ms, rest median "
                  f"{statistics.median(x['ttft_ms'][1:])} ms", flush=True)
    table = {name: {"total_s": round(statistics.median(x["seconds"] for x in rs), 3),
                    "ttft_first_ms": round(statistics.median(x["ttft_ms"][0] for x in rs), 2),
                    "ttft_rest_median_ms": round(statistics.median(statistics.median(x["ttft_ms"][1:]) for x in rs), 2),
                    "prefix_hit_rate": round(rs[0]["prefix_hit_rate"], 4),
                    "speculative_steps": [x["speculative_steps"] for x in rs]}
             for name, rs in runs.items()}
    same = all(x["outputs"] == runs["no reuse"][0]["outputs"] for rs in runs.values() for x in rs)
    kv_cache = args.kv_cache_memory if args.backend == "torch" else "static rows"
    report = {"engine": str(args.engine), "backend": args.backend, "prefix_tokens": len(system),
              "prefix": "unique per request" if args.unique else "shared",
              "num_requests": len(requests), "max_new_tokens": args.max_new_tokens, "kv_cache_memory": kv_cache,
              "rounds": args.rounds, "submitted": "together" if args.burst else "one after another",
              "policy": "--block-size auto" if auto else f"blocks of {engine.executor.block_size}",
              "threads": 1, "load_before": load_before, "load_after": load(), "results": table,
              "outputs_identical": same,
              "ttft_no_reuse_over_reuse": round(table["no reuse"]["ttft_rest_median_ms"]
                                                / table["reuse"]["ttft_rest_median_ms"], 2),
              "total_no_reuse_over_reuse": round(table["no reuse"]["total_s"] / table["reuse"]["total_s"], 2)}
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
