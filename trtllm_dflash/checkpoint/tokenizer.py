"""Tokenizers of HF checkpoints (fast tokenizers only; no remote code)."""

from __future__ import annotations

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
