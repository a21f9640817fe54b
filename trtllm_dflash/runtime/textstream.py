"""Incremental detokenization for streaming (`run --stream` and the Triton model)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from trtllm_dflash.runtime.stop_strings import output_text

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for a UTF-8 character whose bytes are not all there yet


class TextStream:
    """Incremental detokenization whose pieces concatenate to the request's text (`run`'s `text`).

    Each push decodes the whole output so far (exactly as `run` decodes the final text) and returns
    what extends the text already emitted. A trailing U+FFFD is held back, because it usually is
    a multi-byte character split across tokens:
    ids for "a" + first bytes of "é"  -> "a" (not "a\\ufffd");  + the last byte -> "é".
    With stop strings, the last (longest stop string - 1) characters are held back too, as they may be
    the start of a stop string, which is not part of the text: stop "\\n\\n", text "x\\n" -> "x" until the
    next token says whether the "\\n" stays.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = ""

    def _text(self) -> str:
        return output_text(self.tokenizer, self.token_ids, self.stop)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        text = self._text().rstrip(REPLACEMENT_CHAR)
        text = text[: len(text) - self.hold_back]
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""  # nothing new yet (or the tokenizer rewrote the tail: wait for more tokens)
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def finish(self) -> str:
        """The rest of the final text."""
        text = self._text()
        if not text.startswith(self.emitted):
            raise RuntimeError("the tokenizer's decoding of a prefix is not a prefix of the final text")
        delta, self.emitted = text[len(self.emitted):], text
        return delta
