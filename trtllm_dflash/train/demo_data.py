"""Prompt sets of the demo: complete a function's body from its signature and docstring.

    python -m trtllm_dflash.train.demo_data --held-out benchmarks/prompts/heldout_code.jsonl \
        --train DIR/drafter_prompts.jsonl

Held-out prompts come only from held-out modules (corpus.is_held_out), which the demo target, its
tokenizer and its drafter never saw. Drafter training prompts come from training modules: the same kind
of function prompts plus runs of lines starting at random places.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

from trtllm_dflash.train.corpus import code_prompts, stdlib_modules, stdlib_root


def function_prompts(files: list[Path], max_chars: int = 1500) -> list[tuple[str, str]]:
    """(id, prompt) for every function with a docstring: its source up to and including the docstring.

    The prompt ends with a newline and the body's indentation, so the model continues with the body.
    """
    out = []
    root = stdlib_root()
    for path in files:
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            doc, body = node.body[0], node.body[1:]
            if not body or body[0].lineno <= doc.end_lineno:
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            prompt = "".join(lines[start : doc.end_lineno])
            indent = lines[body[0].lineno - 1][: body[0].col_offset]
            prompt = prompt + indent
            if len(prompt) <= max_chars:
                out.append((f"{path.relative_to(root)}:{node.lineno}:{node.name}", prompt))
    return out


def write_jsonl(path: Path, rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": rid, "prompt": prompt}) + "\n" for rid, prompt in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--held-out", type=Path, required=True, help="held-out prompt set to write")
    p.add_argument("--held-out-count", type=int, default=80)
    p.add_argument("--train", type=Path, help="drafter training prompts to write")
    p.add_argument("--train-count", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    held = function_prompts(stdlib_modules(held_out=True, include_tests=False))
    write_jsonl(args.held_out, sorted(rng.sample(held, min(args.held_out_count, len(held)))))
    if args.train:
        train_files = stdlib_modules(held_out=False, include_tests=False)
        funcs = function_prompts(train_files)
        half = args.train_count // 2
        rows = rng.sample(funcs, min(half, len(funcs)))
        windows = code_prompts(train_files, args.train_count - len(rows), 600, args.seed)
        rows += [(f"window-{i}", text) for i, text in enumerate(windows)]
        write_jsonl(args.train, rows)


if __name__ == "__main__":
    main()
