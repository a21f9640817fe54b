"""Benchmark prompt sets, in one of three JSONL shapes, detected from the file's first record.

    {"question_id": "q1", "category": "coding", "turns": ["Write ...", "Now ..."], ...}   SPEED-Bench
    {"id": "_pyio.py:1892:errors", "prompt": "    @property\n    def errors(self):..."}   our held-out prompts
    {"prompt": "def fibonacci(n):"}                                                       plain prompts

SPEED-Bench records (nvidia/SPEED-Bench: `question_id`, `category`, `turns`, plus metadata such as
`sub_category`, `source`, `difficulty`, which are ignored) are chat questions: the first turn goes
through the tokenizer's chat template as a user message (later turns would need the model's own
answers, so a benchmark request is the first turn only). Prompt records are raw text, tokenized as
is; they may carry a `category` too. Every line must have the shape of the first; anything else is a
UserError naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from trtllm_dflash.checkpoint.tokenizer import check_prompt_chars
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import loads, shown, strict_lines
from trtllm_dflash.runtime.decoding import Request

Format = Literal["speed-bench", "prompt"]
PROMPT_KEYS = {"id", "prompt", "category"}
EXPECTED = ("a SPEED-Bench record ({\"question_id\", \"category\", \"turns\": [str, ...]}), "
            "an {\"id\", \"prompt\"} record or a {\"prompt\"} record")


@dataclass(frozen=True)
class BenchPrompt:
    id: str | int
    text: str
    category: str | None
    line: int  # 1-based line in the dataset file, for messages


@dataclass(frozen=True)
class Dataset:
    path: Path
    format: Format
    prompts: list[BenchPrompt]

    @property
    def categories(self) -> dict[str | int, str]:
        """Request id -> category, for the prompts that have one."""
        return {p.id: p.category for p in self.prompts if p.category is not None}


def _detect(obj: dict) -> Format | None:
    if "turns" in obj:
        return "speed-bench"
    if "prompt" in obj and set(obj) <= PROMPT_KEYS:
        return "prompt"
    return None


def _non_empty_str(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: {key!r} must be a non-empty string, got {shown(value)}.")
    return value


def _record(obj: dict, fmt: Format, lineno: int, where: str) -> BenchPrompt:
    if fmt == "speed-bench":
        turns = obj["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise UserError(f"{where}: 'turns' must be a non-empty list of non-empty strings.")
        category = _non_empty_str(obj, "category", where)
        rid = obj.get("question_id", lineno)
        text = turns[0]
    else:
        text = _non_empty_str(obj, "prompt", where)
        category = _non_empty_str(obj, "category", where) if "category" in obj else None
        rid = obj.get("id", lineno)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise UserError(f"{where}: the id must be a string or an integer, got {shown(rid)}.")
    return BenchPrompt(rid, text, category, lineno)


def load_dataset(path: Path) -> Dataset:
    """Read and check every line of a benchmark dataset (no tokenizer needed)."""
    path = Path(path)
    fmt: Format | None = None
    first_line = 0
    prompts: list[BenchPrompt] = []
    seen: set[str | int] = set()
    for lineno, line in strict_lines(path, "dataset file"):
        where = f"{path}:{lineno}"
        try:
            obj = loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not valid JSON ({exc.msg}).") from None
        except ValueError as exc:
            raise UserError(f"{where}: {exc}.") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: a record must be a JSON object, got {type(obj).__name__}.")
        shape = _detect(obj)
        if shape is None:
            raise UserError(f"{where}: unrecognized record with keys {shown(sorted(obj))}; expected {EXPECTED}.")
        if fmt is None:
            fmt, first_line = shape, lineno
        elif shape != fmt:
            raise UserError(f"{where}: a {shape} record in a file whose first record (line {first_line}) is "
                            f"a {fmt} record.")
        prompt = _record(obj, fmt, lineno, where)
        if prompt.id in seen:
            raise UserError(f"{where}: duplicate id {shown(prompt.id)}.")
        seen.add(prompt.id)
        prompts.append(prompt)
    if fmt is None:
        raise UserError(f"{path}: the dataset has no records; expected JSONL lines, each {EXPECTED}.")
    return Dataset(path, fmt, prompts)


def prompt_token_ids(dataset: Dataset, prompt: BenchPrompt, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """SPEED-Bench turns go through the chat template (when there is one); prompt records are raw text."""
    if dataset.format == "speed-bench" and tokenizer.chat_template is not None:
        # DFlash drafters are trained on non-thinking prompts, as in `run`.
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=True,
                                                  add_generation_prompt=True, enable_thinking=False,
                                                  return_dict=False))
    return tokenizer(prompt.text)["input_ids"]


def to_requests(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, max_seq_len: int,
                num_requests: int | None = None) -> list[Request]:
    """The first `num_requests` prompts (all by default) as greedy requests of `max_new_tokens` tokens."""
    if num_requests is not None and num_requests > len(dataset.prompts):
        raise UserError(f"--num-requests {num_requests}: {dataset.path} has only {len(dataset.prompts)} prompts.")
    requests = []
    for prompt in dataset.prompts[:num_requests]:
        try:
            check_prompt_chars(tokenizer, len(prompt.text), max_seq_len, "the prompt")
        except ValueError as exc:
            raise UserError(f"{dataset.path}:{prompt.line}: {exc}.") from None
        ids = prompt_token_ids(dataset, prompt, tokenizer)
        if len(ids) + max_new_tokens > max_seq_len:
            raise UserError(f"{dataset.path}:{prompt.line}: prompt ({len(ids)} tokens) + --max-new-tokens "
                            f"{max_new_tokens} exceeds the engine's max_seq_len {max_seq_len}.")
        requests.append(Request(id=prompt.id, prompt_token_ids=ids, max_new_tokens=max_new_tokens))
    return requests
