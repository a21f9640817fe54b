"""Reading what users give us, on purpose: UTF-8 text with errors naming the file and line, JSON
without NaN, infinities, lone surrogates or unbounded nesting, directories and files told apart in
messages, and values quoted in messages only as far as a reader can use them (`shown`).

JSON Lines are split on b"\\n" only (not on the other line breaks `str.splitlines` knows, which may
stand inside a JSON string), and each line is decoded by itself, so one line of bad bytes in a
request file is that line's error, not the whole file's.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtllm_dflash.errors import UserError


def require_file(path: Path, what: str) -> Path:
    """`path` must be an existing regular file; `what` names it ("input file", "dataset file")."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: {what} is a directory, not a file.")
    if not path.exists():
        raise UserError(f"{path}: {what} does not exist.")
    return path


def require_dir(path: Path, what: str) -> Path:
    """`path` must be an existing directory; `what` names it ("engine directory", "target checkpoint")."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: {what} is a file, not a directory.")
    if not path.exists():
        raise UserError(f"{path}: {what} does not exist.")
    return path


def _not_utf8(exc: UnicodeDecodeError, offset: int = 0) -> str:
    """"not valid UTF-8 (byte 0xff at byte offset 12)"; `offset`: where the decoded bytes start in the file."""
    return f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at byte offset {offset + exc.start})"


def argv_text(text: str, what: str) -> str:
    """A command-line argument that is text (a prompt): Python turns argv bytes that are not UTF-8 into lone
    surrogates (PEP 383), which pass every str check and fail later in the tokenizer; refuse them here."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        try:
            os.fsencode(text).decode("utf-8")
        except UnicodeDecodeError as bad:
            raise UserError(f"{what}: {_not_utf8(bad)}.") from None
        except UnicodeEncodeError:
            pass
        raise UserError(f"{what}: not text (a lone surrogate {text[exc.start]!r} at character {exc.start}).") from None


def read_text(path: Path, what: str = "file") -> str:
    """The whole file as UTF-8 text; invalid bytes are an error naming the file, line and byte offset."""
    raw = require_file(path, what).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: {_not_utf8(exc)}.") from None


@dataclass(frozen=True)
class Line:
    number: int  # 1-based
    text: str | None  # None: the line is not valid UTF-8 (see error)
    error: str | None = None


def decode_lines(raw: bytes) -> Iterator[Line]:
    """Non-blank lines of `raw`, each decoded by itself (a trailing "\\r" is dropped)."""
    offset = 0
    for number, chunk in enumerate(raw.split(b"\n"), start=1):
        start, offset = offset, offset + len(chunk) + 1
        chunk = chunk.removesuffix(b"\r")
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Line(number, None, _not_utf8(exc, start))
            continue
        if text.strip():
            yield Line(number, text)


def read_lines(path: Path, what: str = "file") -> Iterator[Line]:
    return decode_lines(require_file(path, what).read_bytes())


def strict_lines(path: Path, what: str = "file") -> Iterator[tuple[int, str]]:
    """Non-blank lines of a file in which every line must be valid UTF-8."""
    for line in read_lines(path, what):
        if line.text is None:
            raise UserError(f"{path}:{line.number}: {line.error}.")
        yield line.number, line.text


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is too large")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (JSON has no NaN or Infinity)")


# Arrays and objects inside each other. Our deepest format (a request's messages) needs 3; Python's parser recurses
# once per level and a line of 100,000 "[" ends in a RecursionError, so the depth is bounded before parsing.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[][{}]")


def _nesting(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, brackets inside strings not counted."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where `value` holds a string that is not Unicode text (a JSON "\\ud800" escape of half a UTF-16 pair),
    as a message; None if nowhere. Such a string passes json.loads and fails later in any tokenizer or encoder.
    `path` names `value` in the message: "messages[0].content"."""

    def check(text: str, where: str) -> str | None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{where} a lone surrogate {text[exc.start]!r} at character {exc.start} (half of a UTF-16 pair, "
                    "not text)")
        return None

    if isinstance(value, str):
        return check(value, f"'{path}' holds" if path else "the value is")
    if isinstance(value, dict):
        for key, item in value.items():
            found = (isinstance(key, str) and check(key, f"a key of '{path}' holds" if path else "a key holds")
                     or lone_surrogate(item, f"{path}.{key}" if path else str(key)))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{index}]")
            if found:
                return found
    return None


def loads(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and numbers that overflow a float (Python's accepts all three),
    nesting deeper than MAX_JSON_DEPTH, and strings that are not Unicode text (lone surrogates).

    Raises ValueError (json.JSONDecodeError for bad syntax)."""
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nesting(text) > MAX_JSON_DEPTH:
        raise ValueError(f"arrays and objects nested more than {MAX_JSON_DEPTH} deep")
    value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    bad = lone_surrogate(value)
    if bad:
        raise ValueError(bad)
    return value


def shown(value: Any, limit: int = 60) -> str:
    """repr(value) for a message, cut after `limit` characters: a 10,000-character value is named, not repeated.

    >>> shown("x" * 10_000, limit=8)
    "'xxxxxx... (a string of 10,000 characters)"
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"a string of {len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters"
    return f"{text[:limit - 1]}... ({size})"


def read_json(path: Path, what: str = "file") -> Any:
    """A whole JSON file, with every problem reported as one sentence naming the file."""
    text = read_text(path, what)
    try:
        return loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}).") from None
    except ValueError as exc:
        raise UserError(f"{path}: {exc}.") from None


def read_json_object(path: Path, what: str = "file") -> dict:
    """A JSON file whose top level must be an object."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise UserError(f"{path}: {what} must be a JSON object, got {type(data).__name__}.")
    return data
