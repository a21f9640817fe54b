"""The Triton Python-backend model (imported by the `1/model.py` that `serve` writes).

Decoupled: `execute` checks each request, hands it to the ServingLoop and returns at once; the
loop's thread answers through the request's response sender. A non-streaming request gets one
response (the whole text and the metrics) flagged final; a streaming request gets one response per
decoding step that committed text (its new text) and a last one with the rest and the metrics. A bad
request gets an error response of its own; the others are not affected. A request that Triton reports
cancelled (the client cancelled the call or its gRPC stream, or went away) leaves the batch at the
next step, freeing its slot, and gets a final CANCELLED error response.

Only the Triton Python-backend stub can import this module (`triton_python_backend_utils`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from trtllm_dflash.checkpoint.tokenizer import check_prompt_chars
from trtllm_dflash.engine_dir import read_engine_config
from trtllm_dflash.runtime.decoding import Request, check_stop, check_top_k, check_top_p
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.serve.repository import SERVE_CONFIG, ServeConfig, check_serve_config, read_serve_config
from trtllm_dflash.serve.scheduler import Event, ServingLoop
from trtllm_dflash.serve.tensor_parallel import join_as_rank0
from trtllm_dflash.speculative.core import request_seed
from trtllm_dflash.stats import accepted_tokens, draft_acceptance_rate, drafted_tokens, mean_acceptance_length


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    default_max_new_tokens: int
    default_seed: int


def _scalar(request, name: str):
    """The one value of an optional input, or None when the request does not have it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"input '{name}' must hold one value, got {values.size}")
    return values[0]


def _strings(request, name: str) -> list[str]:
    """The UTF-8 strings of an optional BYTES input of any length ([] when absent)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    strings = []
    for raw in tensor.as_numpy().reshape(-1):
        try:
            strings.append(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
        except UnicodeDecodeError as exc:
            raise ValueError(f"input '{name}' is not valid UTF-8 (byte {exc.start})") from None
    return strings


def parse_request(request, tokenizer, limits: Limits, request_id: int) -> tuple[Request, bool]:
    """A Triton request -> (our Request, streaming); ValueError names what is wrong."""
    raw = _scalar(request, "text_input")
    if raw is None:
        raise ValueError("input 'text_input' is missing")
    try:
        prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as exc:
        raise ValueError(f"input 'text_input' is not valid UTF-8 (byte {exc.start})") from None
    if not prompt:
        raise ValueError("input 'text_input' is empty")
    max_new = _scalar(request, "sampling_param_max_tokens")
    max_new = limits.default_max_new_tokens if max_new is None else int(max_new)
    if max_new < 1:
        raise ValueError(f"'sampling_param_max_tokens' must be a positive integer, got {max_new}")
    temperature = _scalar(request, "sampling_param_temperature")
    temperature = 0.0 if temperature is None else float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"'sampling_param_temperature' must be a number >= 0, got {temperature}")
    top_k = _scalar(request, "sampling_param_top_k")
    top_k = check_top_k(0 if top_k is None else int(top_k), "sampling_param_top_k")
    top_p = _scalar(request, "sampling_param_top_p")
    top_p = check_top_p(1.0 if top_p is None else float(top_p), "sampling_param_top_p")
    stop = check_stop(_strings(request, "sampling_param_stop"), "sampling_param_stop")
    seed = _scalar(request, "sampling_param_seed")
    seed = limits.default_seed if seed is None else int(seed)
    streaming = _scalar(request, "streaming")
    check_prompt_chars(tokenizer, len(prompt), limits.max_seq_len, "input 'text_input'")
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("input 'text_input' has no tokens")
    if len(ids) + max_new > limits.max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + sampling_param_max_tokens ({max_new}) exceeds the "
                         f"engine's max_seq_len {limits.max_seq_len}")
    # As in `run`, the sampling seed depends on the seed and the request's id (Triton's request id here).
    return Request(id=request_id, prompt_token_ids=list(ids), max_new_tokens=max_new, temperature=temperature,
                   seed=request_seed(seed, request.request_id()), top_k=top_k, top_p=top_p,
                   stop=stop), bool(streaming)


def _tensor(name: str, value, dtype) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype).reshape(-1))


def response(event: Event, block_size: int) -> pb_utils.InferenceResponse:
    """An Event as a Triton response: text and token count; on the last event, the metrics too."""
    if event.error is not None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error))
    result = event.result
    if result is not None and result.finish_reason == "cancelled":
        error = pb_utils.TritonError(f"request cancelled after {event.num_output_tokens} tokens",
                                     pb_utils.TritonError.CANCELLED)
        return pb_utils.InferenceResponse(error=error)
    out = [_tensor("text_output", [event.text.encode("utf-8")], object),
           _tensor("num_output_tokens", [event.num_output_tokens], np.int32)]
    if result is not None:
        steps = result.acceptance_lengths
        accepted = accepted_tokens(result)
        # --block-size auto verifies k - 1 drafts per step (k = 1: none); a fixed block, block_size - 1.
        drafted = drafted_tokens(result, block_size)
        rate = draft_acceptance_rate(accepted, drafted)
        out += [
            _tensor("finish_reason", [result.finish_reason.encode()], object),
            _tensor("stop_reason", [(result.stop_reason or "").encode("utf-8")], object),
            _tensor("acceptance_lengths", steps, np.int32),
            # Without verify steps (ar mode, or done at prefill) every step commits one token: 1.0.
            _tensor("mean_acceptance_length", [mean_acceptance_length(steps)], np.float32),
            # An FP32 tensor cannot carry stats' None (nothing drafted): 0.0 then.
            _tensor("acceptance_rate", [0.0 if rate is None else rate], np.float32),
            _tensor("total_accepted_draft_tokens", [accepted], np.int32),
            _tensor("total_draft_tokens", [drafted], np.int32),
            _tensor("batch_size_max", [event.batch_size_max], np.int32),
        ]
    return pb_utils.InferenceResponse(output_tensors=out)


class _StepMetrics:
    """Triton custom metrics (on the metrics port, /metrics) of the scheduler's batching."""

    def __init__(self, model_name: str):
        labels = {"model": model_name}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # A Metric is usable only while its MetricFamily object lives: keep both.
        self.families = [
            pb_utils.MetricFamily("trtllm_dflash_decoder_steps", "Decoding steps run by the scheduler", counter),
            pb_utils.MetricFamily("trtllm_dflash_decoder_request_steps", "Sum over decoding steps of the requests "
                                  "decoded in the step (divided by the steps: the mean batch size)", counter),
            pb_utils.MetricFamily("trtllm_dflash_batch_size_max", "Most requests decoded together in one step", gauge),
            pb_utils.MetricFamily("trtllm_dflash_requests_cancelled", "Requests ended because their client "
                                  "cancelled them", counter),
        ]
        self.steps, self.request_steps, self.batch_max, self.cancelled = (f.Metric(labels) for f in self.families)
        self._max = 0

    def cancel(self) -> None:
        self.cancelled.increment(1)

    def __call__(self, batch_size: int) -> None:
        self.steps.increment(1)
        self.request_steps.increment(batch_size)
        if batch_size > self._max:
            self._max = batch_size
            self.batch_max.set(batch_size)


class TritonPythonModel:
    """Loads the engine named by serve.json and runs the ServingLoop for all of Triton's requests."""

    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        cfg: ServeConfig = read_serve_config(Path(args["model_repository"]) / args["model_version"] / SERVE_CONFIG)
        check_serve_config(cfg, read_engine_config(Path(cfg.engine_dir)))  # Engine.load verifies the files
        self.world = None
        if read_engine_config(Path(cfg.engine_dir)).mapping.tp_size > 1:  # rank 0 of `mpirun -n N ... serve`
            engine, stepper, self.world = join_as_rank0(cfg)
        else:
            engine = Engine.load(Path(cfg.engine_dir), block_size=cfg.block_size, command="serve", backend=cfg.backend,
                                 threads=cfg.threads, kv_cache_memory=cfg.kv_cache_memory,
                                 prefix_cache=cfg.prefix_cache, tree_budget=cfg.tree_budget,
                                 prefix_states=cfg.prefix_states)
            stepper = engine.decoder(cfg.mode)
        self.tokenizer = engine.tokenizer
        self.block_size = engine.executor.block_size
        self.limits = Limits(engine.config.max_seq_len, cfg.max_new_tokens, cfg.seed)
        self.ids = itertools.count()
        max_batch = cfg.max_batch_size or engine.config.max_batch_size
        metrics = _StepMetrics(args["model_name"])
        self.loop = ServingLoop(stepper, engine.tokenizer, max_batch, on_step=metrics, on_cancel=metrics.cancel)
        self.loop.start()
        pb_utils.Logger.log_info(f"trtllm-dflash: {cfg.engine_dir} loaded, mode {cfg.mode}, block size "
                                 f"{self.block_size}, up to {max_batch} requests per step")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                req, streaming = parse_request(request, self.tokenizer, self.limits, next(self.ids))
                if streaming and not self.decoupled:
                    raise ValueError("'streaming' needs a decoupled model (written by `serve` without --no-streaming)")
            except ValueError as exc:
                error = pb_utils.TritonError(f"bad request: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.loop.submit(req, self._answer(sender), streaming, sender.is_cancelled)
        return None

    def _answer(self, sender):
        def send(event: Event) -> None:
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.last else 0
            sender.send(response(event, self.block_size), flags=flags)
        return send

    def finalize(self) -> None:
        self.loop.stop()
        if self.world is not None:  # release the follower ranks
            self.loop.decoder.close()
            self.world.close()
        sizes = dict(sorted(self.loop.stats.batch_sizes.items()))
        pb_utils.Logger.log_info(f"trtllm-dflash: {self.loop.stats.steps} steps; steps per batch size: {sizes}; "
                                 f"{self.loop.stats.cancelled} requests cancelled")
