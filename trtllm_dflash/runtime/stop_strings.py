"""Stop strings: a request's text ends right before the first occurrence of any of its stop strings.

As in OpenAI's API and vLLM, the stop string itself is not part of the text. The request stops at the
token that completes the first occurrence (a token that completes one and starts more text is kept, and
the text is cut inside it); tokens after it, e.g. the rest of a DFlash block, are dropped, as after EOS.

Detection is on the detokenized output (`tokenizer.decode(ids, skip_special_tokens=True)`, as `run`
writes the text), so a stop string may span tokens. The output is decoded after every committed token,
as plain decoding would check it; a block that commits several tokens at once is checked token by token,
so `dflash` and `ar` stop at the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class StopMatch:
    num_tokens: int  # output tokens kept: the one that completes the stop string is the last
    stop: str  # the stop string found (the one listed first, of those found at the same place)


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest occurrence of any stop string in text, or None.
    Example: find_stop("a = 1\\n\\nb", ["\\n\\n", "="]) -> (2, "=")."""
    hits = [(i, n, s) for n, s in enumerate(stop) if (i := text.find(s)) >= 0]
    if not hits:
        return None
    i, _, s = min(hits)
    return i, s


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def output_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], stop: Sequence[str]) -> str:
    """A request's text: its tokens decoded, cut before the first stop string."""
    text = decode(tokenizer, token_ids)
    hit = find_stop(text, stop)
    return text if hit is None else text[: hit[0]]


def first_stop(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], checked: int,
               stop: Sequence[str]) -> StopMatch | None:
    """The first n > `checked` such that token_ids[:n] decodes to a text with a stop string, or None.

    `checked`: the tokens already known to decode to a text without one (those committed before this step)."""
    if not stop:
        return None
    for n in range(checked + 1, len(token_ids) + 1):
        hit = find_stop(decode(tokenizer, token_ids[:n]), stop)
        if hit is not None:
            return StopMatch(n, hit[1])
    return None
