"""The demo's corpus: the Python standard library's own source, split by module into train / held-out.

A module is held out when a hash of its path (relative to the stdlib root) falls in bucket 0 of 10, so
the split is stable and needs no list. Held-out modules are never used to train the demo target, its
tokenizer or its drafter; the held-out prompt set comes from them.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HELD_OUT_BUCKETS = 10


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative: str) -> bool:
    digest = hashlib.blake2b(relative.encode(), digest_size=4).hexdigest()
    return int(digest, 16) % HELD_OUT_BUCKETS == 0


def stdlib_modules(held_out: bool, include_tests: bool = True) -> list[Path]:
    """Sorted .py files of the standard library (site-packages excluded) on one side of the split."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        if not include_tests and any(part in ("test", "tests", "idle_test") for part in rel.parts):
            continue
        if is_held_out(str(rel)) == held_out:
            files.append(path)
    return files


@functools.lru_cache(maxsize=4)
def train_bpe_tokenizer(vocab_size: int, files: tuple[Path, ...]) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `files`, special tokens first (ids 0..3), ChatML template. Deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|MASK|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def code_prompts(files: list[Path], count: int, max_chars: int, seed: int) -> list[str]:
    """`count` prompts: runs of whole lines (at most `max_chars`) starting at random lines of `files`."""
    gen = random.Random(seed)
    texts = [f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True) for f in files]
    texts = [t for t in texts if len(t) > 4]
    prompts = []
    while len(prompts) < count:
        lines = gen.choice(texts)
        start = gen.randrange(len(lines))
        chunk = ""
        for line in lines[start:]:
            if len(chunk) + len(line) > max_chars:
                break
            chunk += line
        if chunk.strip():
            prompts.append(chunk)
    return prompts
