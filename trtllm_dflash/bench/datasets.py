"""Benchmark prompt sets, in one of three JSONL shapes, detected from the file's first record.

    {"question_id": "q1", "category": "coding", "turns": ["Write ...", "Now ..."], ...}   SPEED-Bench
    {"id": "_pyio.py:1892:errors", "prompt": "    @property\n    def errors(self):..."}   our held-out prompts
    {"prompt": "def fibonacci(n):"}                                                       plain prompts

SPEED-Bench records (nvidia/SPEED-Bench: `question_id`, `category`, `turns`, plus metadata such as
`sub_category`, `source`, `difficulty`, which are ignored) are chat questions: the first turn goes
through the tokenizer's chat template as a user message; with `bench --multi-turn` each later turn follows
the engine's own answer to the one before (`Conversations`), as a chat client would send it. Prompt records are raw
text, tokenized as is; they may carry a `category` too. Every line must have the shape of the first; anything else
is a UserError naming the file and line.

A shared prefix (`bench --system-prompt FILE`): the file's text goes before every request, as the chat's system
message (SPEED-Bench records, through the template) or as text before the prompt (prompt records): the workload of
an agent or a product whose requests share a long system prompt and tools.
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
from trtllm_dflash.runtime.decoding import Request, Result

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
    turns: tuple[str, ...] = ()  # SPEED-Bench: every turn (text is the first)


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
    return BenchPrompt(rid, text, category, lineno, tuple(obj["turns"]) if fmt == "speed-bench" else ())


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


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """A chat's prompt ids through the tokenizer's template (DFlash drafters are trained on non-thinking prompts, as in
    `run`)."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              enable_thinking=False, return_dict=False))


def first_messages(prompt: BenchPrompt, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt.text}]


def prompt_token_ids(dataset: Dataset, prompt: BenchPrompt, tokenizer: PreTrainedTokenizerBase,
                     system: str | None = None) -> list[int]:
    """SPEED-Bench turns go through the chat template (when there is one), after the `system` message if given;
    prompt records are raw text, after the `system` text if given."""
    if dataset.format == "speed-bench" and tokenizer.chat_template is not None:
        return chat_ids(tokenizer, first_messages(prompt, system))
    return tokenizer((system or "") + prompt.text)["input_ids"]


def read_system_prompt(path: Path) -> str:
    """--system-prompt's text: UserError in one sentence when the file cannot be read, is not UTF-8 or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--system-prompt {path}: not UTF-8 text (byte {exc.start}).") from None
    except OSError as exc:
        raise UserError(f"--system-prompt {path}: {exc.strerror or exc}.") from None
    if not text.strip():
        raise UserError(f"--system-prompt {path}: the file is empty.")
    return text


def to_requests(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, max_seq_len: int,
                num_requests: int | None = None, system: str | None = None) -> list[Request]:
    """The first `num_requests` prompts (all by default) as greedy requests of `max_new_tokens` tokens, each after the
    shared `system` prompt if given."""
    if num_requests is not None and num_requests > len(dataset.prompts):
        raise UserError(f"--num-requests {num_requests}: {dataset.path} has only {len(dataset.prompts)} prompts.")
    requests = []
    for prompt in dataset.prompts[:num_requests]:
        try:
            check_prompt_chars(tokenizer, len(prompt.text) + len(system or ""), max_seq_len, "the prompt")
        except ValueError as exc:
            raise UserError(f"{dataset.path}:{prompt.line}: {exc}.") from None
        ids = prompt_token_ids(dataset, prompt, tokenizer, system)
        if len(ids) + max_new_tokens > max_seq_len:
            shared = " (with the --system-prompt)" if system else ""
            raise UserError(f"{dataset.path}:{prompt.line}: prompt ({len(ids)} tokens{shared}) + --max-new-tokens "
                            f"{max_new_tokens} exceeds the engine's max_seq_len {max_seq_len}.")
        requests.append(Request(id=prompt.id, prompt_token_ids=ids, max_new_tokens=max_new_tokens))
    return requests


class Conversations:
    """`bench --multi-turn`: SPEED-Bench conversations turn by turn. A turn's request is the chat so far (the system
    prompt if any, every earlier user turn and the engine's own answer to it, decoded) and the next user turn, through
    the chat template, submitted when the answer before it is done (`follow_up`): each turn's prompt begins with the
    one before it, as a chat client's requests do. Turn n of question q has the id "q#n" (the first turn: q's own id).
    A conversation whose next turn would not fit the engine's max_seq_len ends there (`cut`)."""

    def __init__(self, dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, max_seq_len: int,
                 system: str | None = None):
        self.check(dataset)
        if tokenizer.chat_template is None:
            raise UserError("--multi-turn: the engine's tokenizer has no chat template to join the turns with.")
        self.tokenizer, self.max_new_tokens, self.max_seq_len = tokenizer, max_new_tokens, max_seq_len
        self._prompts = {p.id: p for p in dataset.prompts}
        self._chat: dict[str | int, tuple[str | int, int, list[dict]]] = {
            p.id: (p.id, 0, first_messages(p, system)) for p in dataset.prompts}  # request id -> (question, turn, chat)
        self.categories = dict(dataset.categories)
        self.cut = 0

    @staticmethod
    def check(dataset: Dataset) -> None:
        if dataset.format != "speed-bench":
            raise UserError(f"--multi-turn: needs SPEED-Bench records (with 'turns'), and {dataset.path} has "
                            f"{dataset.format} records.")

    def follow_up(self, result: Result) -> Request | None:
        """The next turn of `result`'s conversation, or None when it has no more (or the next would not fit)."""
        question, turn, chat = self._chat[result.request.id]
        turns = self._prompts[question].turns
        if turn + 1 >= len(turns):
            return None
        answer = self.tokenizer.decode(result.output_token_ids, skip_special_tokens=True)
        chat = chat + [{"role": "assistant", "content": answer}, {"role": "user", "content": turns[turn + 1]}]
        ids = chat_ids(self.tokenizer, chat)
        if len(ids) + self.max_new_tokens > self.max_seq_len:
            self.cut += 1
            return None
        rid = f"{question}#{turn + 2}"
        self._chat[rid] = (question, turn + 1, chat)
        if question in self.categories:
            self.categories[rid] = self.categories[question]
        return Request(id=rid, prompt_token_ids=ids, max_new_tokens=self.max_new_tokens)
