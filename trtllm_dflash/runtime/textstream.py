"""Incremental detokenization for streaming (`run --stream` and the Triton model)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for a UTF-8 character whose bytes are not all there yet


class TextStream:
    """Incremental detokenization whose pieces concatenate to `tokenizer.decode(all ids)`.

    Each push decodes the whole output so far (exactly as `run` decodes the final text) and returns
    what extends the text already emitted. A trailing U+FFFD is held back, because it usually is
    a multi-byte character split across tokens:
    ids for "a" + first bytes of "é"  -> "a" (not "a\\ufffd");  + the last byte -> "é".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        text = self._text().rstrip(REPLACEMENT_CHAR)
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
