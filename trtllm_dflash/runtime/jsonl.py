"""`run` input and output: JSONL requests in, JSONL results and a summary out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from trtllm_dflash.checkpoint.tokenizer import check_prompt_chars
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import loads, read_lines, shown
from trtllm_dflash.runtime.decoding import Request, Result, check_stop, check_top_k, check_top_p
from trtllm_dflash.runtime.options import MAX_TEMPERATURE
from trtllm_dflash.runtime.stop_strings import output_text
from trtllm_dflash.speculative.core import request_seed
from trtllm_dflash.stats import acceptance_per_position, all_steps, mean_acceptance_length, percentiles_ms

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
KNOWN_KEYS = {"id", *PROMPT_KEYS, "max_new_tokens", "temperature", "top_k", "top_p", "stop"}


@dataclass(frozen=True)
class Defaults:
    max_new_tokens: int
    temperature: float
    seed: int
    max_seq_len: int  # prompt + max_new_tokens must fit
    vocab_size: int


@dataclass(frozen=True)
class InputError:
    line: int
    message: str


def _prompt_ids(obj: dict, tokenizer: PreTrainedTokenizerBase, d: Defaults) -> list[int]:
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError(f"needs exactly one of {', '.join(PROMPT_KEYS)}, got {given or 'none'}")
    key = given[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError("'prompt' must be a non-empty string")
        check_prompt_chars(tokenizer, len(value), d.max_seq_len, "'prompt'")
        return tokenizer(value)["input_ids"]
    if key == "messages":
        if not (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            raise ValueError("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
        if tokenizer.chat_template is None:
            raise ValueError("'messages' needs a chat template, and this engine's tokenizer has none")
        check_prompt_chars(tokenizer, sum(len(m["content"]) for m in value), d.max_seq_len, "'messages'")
        # DFlash drafters are trained on non-thinking prompts (docs/algorithm.md §Prompt format).
        ids = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=True,
                                            enable_thinking=False, return_dict=False)
        return list(ids)
    if not (isinstance(value, list) and value and all(type(t) is int for t in value)):
        raise ValueError("'prompt_token_ids' must be a non-empty list of integers")
    bad = [t for t in value if not 0 <= t < d.vocab_size]
    if bad:
        raise ValueError(f"'prompt_token_ids' has {shown(bad[0])}, outside the vocabulary 0..{d.vocab_size - 1}")
    return value


def _parse(obj, lineno: int, tokenizer, d: Defaults) -> Request:
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown key {shown(unknown[0])}")
    rid = obj.get("id", lineno)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"'id' must be a string or an integer, got {shown(rid)}")
    max_new = obj.get("max_new_tokens", d.max_new_tokens)
    if type(max_new) is not int or max_new < 1:
        raise ValueError(f"'max_new_tokens' must be a positive integer, got {shown(max_new)}")
    temperature = obj.get("temperature", d.temperature)
    if type(temperature) not in (int, float) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"'temperature' must be a number from 0 to {MAX_TEMPERATURE:g}, got {shown(temperature)}")
    top_k = check_top_k(obj.get("top_k", 0), "top_k")
    top_p = check_top_p(obj.get("top_p", 1.0), "top_p")
    stop = check_stop(obj.get("stop", []), "stop")
    ids = _prompt_ids(obj, tokenizer, d)
    if len(ids) + max_new > d.max_seq_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the engine's max_seq_len {d.max_seq_len}"
        )
    return Request(id=rid, prompt_token_ids=list(ids), max_new_tokens=max_new,
                   temperature=float(temperature), seed=request_seed(d.seed, str(rid)), top_k=top_k, top_p=top_p,
                   stop=stop)


def read_requests(path: Path, tokenizer: PreTrainedTokenizerBase,
                  defaults: Defaults) -> tuple[list[Request], list[InputError]]:
    """Parse every line; a bad line (bad bytes, bad JSON, bad fields) becomes an InputError and the
    others still run. A file without any request is an error."""
    requests, errors, seen = [], [], set()
    lines = list(read_lines(path, "input file"))
    if not lines:
        raise UserError(f"{path}: the input file has no requests (it is empty).")
    for line in lines:
        lineno = line.number
        if line.text is None:
            errors.append(InputError(lineno, line.error))
            continue
        try:
            req = _parse(loads(line.text), lineno, tokenizer, defaults)
            if req.id in seen:
                raise ValueError(f"duplicate id {shown(req.id)}")
            seen.add(req.id)
            requests.append(req)
        except json.JSONDecodeError as exc:
            errors.append(InputError(lineno, f"not valid JSON ({exc.msg})"))
        except ValueError as exc:
            errors.append(InputError(lineno, str(exc)))
    return requests, errors


def result_record(result: Result, tokenizer: PreTrainedTokenizerBase, mode: str) -> dict:
    """One line of `run`'s output. The request's settings are repeated so that `--resume` can tell
    whether a line was made by the same run (RESUME_KEYS)."""
    return {
        "id": result.request.id,
        "mode": mode,
        "max_new_tokens": result.request.max_new_tokens,
        "temperature": result.request.temperature,
        "seed": result.request.seed,
        "top_k": result.request.top_k,
        "top_p": result.request.top_p,
        "stop": list(result.request.stop),
        "text": output_text(tokenizer, result.output_token_ids, result.request.stop),
        "output_token_ids": result.output_token_ids,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "num_prompt_tokens": len(result.request.prompt_token_ids),
        "num_output_tokens": len(result.output_token_ids),
        "acceptance_lengths": result.acceptance_lengths,
        "ttft_ms": round(result.ttft_s * 1e3, 3),
        "tpot_ms": None if result.tpot_s is None else round(result.tpot_s * 1e3, 3),
        "e2e_latency_ms": round(result.e2e_s * 1e3, 3),
    }


def summarize(mode: str, results: list[Result], wall_time_s: float, block_size: int) -> dict:
    """Run summary. Acceptance rate at block position k: share of verify steps whose k-th draft was accepted."""
    num_out = sum(len(r.output_token_ids) for r in results)
    per_position = acceptance_per_position(results, block_size)
    return {
        "mode": mode,
        "num_requests": len(results),
        "num_output_tokens": num_out,
        "wall_time_s": round(wall_time_s, 4),
        "output_tokens_per_s": round(num_out / wall_time_s, 3) if wall_time_s > 0 else None,
        "mean_acceptance_length": round(mean_acceptance_length(all_steps(results)), 4),
        "acceptance_rate_per_position": [None if x is None else round(x, 4) for x in per_position],
        "ttft_ms": percentiles_ms([r.ttft_s for r in results]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in results if r.tpot_s is not None]),
        "request_latency_ms": percentiles_ms([r.e2e_s for r in results]),
    }
