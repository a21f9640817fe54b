"""Train the demo target: a small Qwen3 causal LM on the Python standard library's source (seeded).

    python -m trtllm_dflash.train.demo_target --output trtllm_dflash/assets/demo/target

Writes an HF directory (config.json, model.safetensors in bfloat16, tokenizer with a reserved
`<|MASK|>` token, generation_config.json) loadable by `AutoModelForCausalLM.from_pretrained`, and
`training.json` with the numbers for the model card. Held-out modules (corpus.is_held_out) are never
seen, neither by the tokenizer nor by the model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from trtllm_dflash.stats import cpu_name
from trtllm_dflash.train.corpus import stdlib_modules, train_bpe_tokenizer

# Deep and narrow, so that the pair costs like a published one: a 2-layer drafter for a 16-layer target (Qwen3-8B's
# drafter has 5 layers for 36), which on a CPU puts a 16-token draft pass at ~0.3 of an AR step (a 6-layer target
# of width 256 had it at ~1.0; assets/demo/README.md).
ARCH = dict(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rope_theta=10_000.0,
            tie_word_embeddings=True, rms_norm_eps=1e-6)


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files, each followed by <|endoftext|>, as one int32 tensor."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids += enc + [eos]
    return torch.tensor(ids, dtype=torch.int32)


def windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()]).long()


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows x [B, length + 1]."""
    logits = model(x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, length: int, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same windows at every evaluation
    return sum(_loss(model, windows(stream, 8, length, gen)).item() for _ in range(batches)) / batches


def train(output: Path, steps: int, batch: int, length: int, lr: float, seed: int) -> dict:
    torch.manual_seed(seed)
    started = time.time()
    train_files = stdlib_modules(held_out=False)
    tokenizer = train_bpe_tokenizer(ARCH["vocab_size"], tuple(stdlib_modules(held_out=False, include_tests=False)))
    train_stream = token_stream(tokenizer, train_files)
    held_stream = token_stream(tokenizer, stdlib_modules(held_out=True, include_tests=False))
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = Qwen3Config(**ARCH, eos_token_id=eos_ids, bos_token_id=None, pad_token_id=eos_ids[0])
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 25)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    gen = torch.Generator().manual_seed(seed)
    log = []
    columns = [TextColumn("training demo target"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=steps, loss=float("nan"))
        for step in range(steps):
            loss = _loss(model, windows(train_stream, batch, length, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(task, advance=1, loss=loss.item())
            if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
                model.eval()
                log.append({"step": step + 1, "train_loss": round(loss.item(), 4),
                            "held_out_loss": round(held_out_loss(model, held_stream, length), 4)})
                model.train()
                bar.console.print(log[-1])
    model.eval()
    output.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(output))
    tokenizer.save_pretrained(str(output))
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0]).save_pretrained(str(output))
    stats = {
        "architecture": ARCH,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_modules": len(train_files), "train_tokens_available": len(train_stream),
        "held_out_tokens": len(held_stream),
        "steps": steps, "batch": batch, "sequence_length": length, "tokens_seen": steps * batch * length,
        "lr": lr, "seed": seed, "log": log, "wall_time_min": round((time.time() - started) / 60, 1),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} torch threads, CPU only",
        "torch": torch.__version__,
    }
    (output / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    train(args.output, args.steps, args.batch, args.length, args.lr, args.seed)


if __name__ == "__main__":
    main()
