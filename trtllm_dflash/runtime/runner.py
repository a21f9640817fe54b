"""Engine directory -> ready-to-run Decoder (torch executor), and the batch `run` job."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.config import EngineConfig
from trtllm_dflash.engine.engine_dir import DRAFTER_PREFIX, TARGET_PREFIX, TOKENIZER, open_engine, rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.models.quantized import dequantize_state_dict, quantize_inputs
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams, hf_config_from_dict
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoding import Decoder, Mode, Result
from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.jsonl import Defaults, read_requests, result_record, summarize


def engine_specs(cfg: EngineConfig) -> tuple[DecoderSpec, DecoderSpec, DFlashParams]:
    target = DecoderSpec.from_hf(hf_config_from_dict(cfg.target, "engine target"))
    drafter = DecoderSpec.from_hf(hf_config_from_dict(cfg.drafter, "engine drafter"))
    d = cfg.dflash
    return target, drafter, DFlashParams(d.block_size, d.mask_token_id, tuple(d.target_layer_ids))


@dataclass
class Engine:
    """A loaded engine: its config, tokenizer and torch executor."""

    config: EngineConfig
    tokenizer: object
    executor: TorchExecutor

    @classmethod
    def load(cls, root: Path, device: str = "cpu", block_size: int | None = None) -> "Engine":
        """`block_size`: draft this many tokens per block (2 .. the trained block size); default: trained."""
        root = Path(root)
        cfg = open_engine(root)
        if block_size is not None and not 2 <= block_size <= cfg.dflash.block_size:
            raise UserError(f"--block-size {block_size}: must be between 2 and the engine's trained block_size "
                            f"{cfg.dflash.block_size}.")
        if cfg.mapping.tp_size != 1:
            raise UserError(f"{root}: tp_size {cfg.mapping.tp_size} engines are not yet supported by `run`.")
        target_spec, drafter_spec, params = engine_specs(cfg)
        weights = load_file(str(root / rank_file(0)), device=device)
        split = {p: {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}
                 for p in (TARGET_PREFIX, DRAFTER_PREFIX)}
        dtype = getattr(torch, cfg.dtype)
        target_state, quantized_inputs = dequantize_state_dict(split[TARGET_PREFIX], dtype)
        target = TargetModel.from_state_dict(target_spec, target_state)
        quantize_inputs(target, quantized_inputs)
        drafter = DFlashDrafter.from_state_dict(drafter_spec, params, split[DRAFTER_PREFIX])
        executor = TorchExecutor(target, drafter, cfg.max_batch_size, cfg.max_seq_len, block_size)
        return cls(cfg, load_tokenizer(root / TOKENIZER), executor)

    def decoder(self, mode: Mode, stop_token_ids: tuple[int, ...] = ()) -> Decoder:
        """A decoder that stops at the engine's EOS ids and `stop_token_ids`."""
        return Decoder(self.executor, mode, [*self.config.eos_token_ids, *stop_token_ids])


@dataclass(frozen=True)
class RunOptions:
    """`run`'s options; per-line `max_new_tokens` / `temperature` override the defaults here."""

    mode: Mode = "dflash"
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids
    threads: int | None = None  # torch CPU threads (None: torch's default)
    block_size: int | None = None  # tokens per block, <= the engine's trained block_size (None: trained)


def run_jsonl(engine_dir: Path, input_path: Path, output_path: Path, summary_path: Path | None,
              opts: RunOptions) -> int:
    """The `run` command: returns the number of bad input lines (reported on stderr)."""
    if not Path(input_path).is_file():
        raise UserError(f"{input_path}: input file does not exist.")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    engine = Engine.load(engine_dir, block_size=opts.block_size)
    cfg = engine.config
    bad_stop = [t for t in opts.stop_token_ids if not 0 <= t < engine.executor.vocab_size]
    if bad_stop:
        raise UserError(f"--stop-token-ids: {bad_stop[0]} is outside the vocabulary 0..{engine.executor.vocab_size - 1}.")
    defaults = Defaults(opts.max_new_tokens, opts.temperature, opts.seed, cfg.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(input_path, engine.tokenizer, defaults)
    for err in errors:
        print(f"{input_path}:{err.line}: {err.message}; line skipped.", file=sys.stderr)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    mode = opts.mode
    decoder = engine.decoder(mode, opts.stop_token_ids)
    results: list[Result] = []
    start = time.perf_counter()
    with output_path.open("w") as out:
        for result in decoder.generate(requests):
            results.append(result)
            out.write(json.dumps(result_record(result, engine.tokenizer)) + "\n")
            out.flush()
    wall = time.perf_counter() - start
    summary = summarize(mode, results, wall, engine.executor.block_size)
    summary["num_failed"] = len(errors)
    if summary_path is not None:
        Path(summary_path).write_text(json.dumps(summary, indent=2) + "\n")
    al = summary["mean_acceptance_length"]
    print(f"{mode}: {summary['num_requests']} requests, {summary['num_output_tokens']} output tokens in "
          f"{wall:.2f} s ({summary['output_tokens_per_s']} tokens/s), mean acceptance length "
          f"{al if al is None else f'{al:.2f}'}; results in {output_path}", file=sys.stderr)
    return len(errors)
