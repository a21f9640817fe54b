"""Tokenizers of HF checkpoints (fast tokenizers only; no remote code)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trtllm_dflash.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    directory = Path(directory)
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{directory}: no tokenizer files found (expected one of {', '.join(TOKENIZER_FILES)}).")
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{directory}: tokenizer cannot be loaded ({exc}).") from None


@lru_cache(maxsize=8)
def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters of text one token can stand for: its vocabulary string's length. That string is at
    least as long as the text it decodes to (a byte-level token has a character per byte, a byte-fallback token
    "<0x0A>" six for one), so a text of C characters has at least C / this many tokens."""
    return max(len(token) for token in tokenizer.get_vocab())


def check_prompt_chars(tokenizer: PreTrainedTokenizerBase, chars: int, max_tokens: int, what: str) -> None:
    """ValueError if a text of `chars` characters cannot fit in `max_tokens` tokens, found before it is tokenized:
    BPE on a 20 MB word without spaces runs for many minutes only to learn that the prompt is too long.
    The factor 2 leaves room for normalizers that join characters (NFC)."""
    limit = 2 * max_tokens * longest_token_chars(tokenizer)
    if chars > limit:
        raise ValueError(f"{what} has {chars:,} characters, more than the engine's max_seq_len of {max_tokens:,} "
                         f"tokens can hold (at most {limit:,} characters with this tokenizer)")
