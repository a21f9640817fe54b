"""`trtllm-dflash export trtllm ENGINE_DIR --output DIR`: a directory TensorRT-LLM's PyTorch backend loads as-is.

    DIR/
      target/                     HF checkpoint: config.json, model.safetensors, generation_config.json, tokenizer
                                  files; a quantized engine's target in ModelOpt's unified format, with
                                  hf_quant_config.json and config.json `quantization_config` as export_hf_checkpoint
                                  writes them
      drafter/                    z-lab DFlash drafter: config.json (DFlashDraftModel, block_size, dflash_config),
                                  model.safetensors, unquantized (a quantized drafter is dequantized)
      extra_llm_api_options.yaml  LLM-API options: speculative_config (decoding_type DFlash, the drafter by its
                                  absolute path, a draft_len_schedule: export/draft_len.py), parallelism, KV cache,
                                  CUDA graphs
      README.md                   the trtllm-serve and trtllm-bench commands (absolute paths: run them from anywhere)
      .trtllm-dflash              the marker of a directory trtllm-dflash wrote (outputs.py)

Rank files are merged back into full tensors by `merge_shards`, the exact inverse of models/shard.py's split (a
gpt-oss target's experts by the split the engine was built with, `moe_parallel` tp or ep).
Upstream names and the sources they were checked against: docs/export-trtllm.md. Export reads the engine directory
(and its cached `--block-size auto` cost profile, if any), and writes the same bytes every time for the same engine,
output path and profile.

TensorRT-LLM resolves `speculative_model` against the working directory of the process that reads the YAML (and
takes a path that does not exist there for a hub model id), so the YAML and the README name the exported drafter and
target by their absolute paths: the commands work from any directory. Moved or copied elsewhere, the directory must be
exported again there (or `speculative_model` edited).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from trtllm_dflash import __version__
from trtllm_dflash.checkpoint.formats import save_drafter
from trtllm_dflash.engine.safetensors_stream import SafetensorsWriter
from trtllm_dflash.engine_dir import DRAFTER_PREFIX, TARGET_PREFIX, TOKENIZER, EngineConfig, open_engine, rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.export.draft_len import (DraftLenSchedule, check_schedule, schedule_comment, schedule_for,
                                           schedule_text)
from trtllm_dflash.models.quantized import dequantize_state_dict
from trtllm_dflash.models.shard import Split, split_for
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams, hf_config_from_dict
from trtllm_dflash.outputs import atomic_directory, check_output_dir

KIND = "trtllm export"  # the marker kind: `--force` replaces only a directory of this kind
TARGET, DRAFTER, OPTIONS, README = "target", "drafter", "extra_llm_api_options.yaml", "README.md"
# Target families TensorRT-LLM's DFlash captures hidden states for (PR #12794 tests Llama-3.1-8B, Qwen3-8B and
# gpt-oss-20b), and their HF architectures. gpt-oss is written in transformers' layout (experts fused: gate_up_proj
# [E, H, 2I] with interleaved gate / up columns, down_proj [E, I, H], biases, router, attention sinks).
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# KV cache share of the GPU memory left after the weights. Below TensorRT-LLM's 0.9 because the DFlash worker
# allocates its drafter context buffers ([max_batch_size, up to 8192, hidden] per engine) lazily, after the KV cache.
FREE_GPU_MEMORY_FRACTION = 0.8
# ModelOpt never quantizes these (its default disabled quantizers cover the LM head and MoE routers; embeddings are
# not Linear layers); export_hf_checkpoint lists them, sorted as strings, as `exclude_modules` (a gpt-oss target: every
# layer's `model.layers.<i>.mlp.router` too, by its full name since each layer's experts are quantized).
EXCLUDED_MODULES = ["lm_head", "model.embed_tokens"]
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_TARGET_LINEARS = _ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MOE_LINEARS = _ATTENTION + ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # (quantize_moe_target.py)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def merge_shards(shards: list[torch.Tensor], splits: list[Split | None], name: str) -> torch.Tensor:
    """The full tensor whose rank slices `shard_tensor(full, splits[r])` are `shards`: the exact inverse.

    Example: tp 2, k_proj.weight [32, 64] split by KV heads into [16, 64] + [16, 64] -> [32, 64]; an NVFP4
    o_proj weight [64, 32] (packed 2 per byte) split by input columns into [64, 16] + [64, 16] -> [64, 32].
    A tensor held whole or in part by several ranks (per-tensor scales, norms, KV heads shared by ranks) must be
    byte-identical on each of them, and the vocabulary's padding past `full` must be zeros: anything else means
    the rank files do not come from one tensor, and is refused.
    """
    assert len(shards) == len(splits) and shards, (name, len(shards), len(splits))

    def inconsistent(what: str) -> UserError:
        return UserError(f"{name}: the rank files disagree ({what}); the engine is inconsistent, rebuild it.")

    first, split = shards[0], splits[0]
    if split is None or first.dim() <= split.dim:  # replicated (shard_tensor leaves such tensors whole)
        if any(s.shape != first.shape or not torch.equal(_bytes(s), _bytes(first)) for s in shards[1:]):
            raise inconsistent("a replicated tensor differs between ranks")
        return first
    dim = split.dim
    factor = (split.stop - split.start) // first.shape[dim]  # logical elements per stored one (2 packed, 16 per scale)
    out_shape = list(first.shape)
    out_shape[dim] = split.full // factor
    out = first.new_zeros(out_shape)
    filled = torch.zeros(out_shape[dim], dtype=torch.bool)
    for shard, s in zip(shards, splits):
        assert s is not None and s.dim == dim and s.full == split.full, (name, s, split)
        lo, hi = s.start // factor, min(s.stop, s.full) // factor
        n = max(hi - lo, 0)
        pad = shard.narrow(dim, n, shard.shape[dim] - n)  # the vocabulary padded to a multiple of tp_size
        if pad.numel() and bool(_bytes(pad).any()):
            raise inconsistent("the vocabulary padding is not zero")
        if n == 0:
            continue
        piece, region = shard.narrow(dim, 0, n), out.narrow(dim, lo, n)
        if filled[lo:hi].any() and not torch.equal(_bytes(piece), _bytes(region)):
            raise inconsistent("a slice held by several ranks differs")
        region.copy_(piece)
        filled[lo:hi] = True
    if not filled.all():
        raise inconsistent("some rows or columns are on no rank")
    return out


def _spec(raw: dict, what: str) -> DecoderSpec:
    return DecoderSpec.from_hf(hf_config_from_dict(raw, what))


def check_exportable(cfg: EngineConfig, root: Path) -> None:
    """What TensorRT-LLM's DFlash and this export support; one sentence per refusal."""
    family = cfg.target.get("model_type")
    if family not in ARCHITECTURES:
        raise UserError(f"{root}: target model_type {family!r} is not supported by TensorRT-LLM's DFlash export; "
                        f"supported: {', '.join(ARCHITECTURES)}.")
    if cfg.dflash.draft_vocab_size is not None:
        raise UserError(f"{root}: the drafter has its own lm_head over {cfg.dflash.draft_vocab_size} tokens, which "
                        "the z-lab drafter format TensorRT-LLM loads cannot hold.")
    if cfg.dflash.dflash2 is not None:
        raise UserError(f"{root}: the drafter is DFlash2 (convolutions and a candidate selector), which TensorRT-LLM's "
                        "DFlash (DFlashDraftModel layers, argmax drafts) does not run.")
    algo = cfg.quantization.get("quant_algo")
    if algo is not None:
        quantized = set(cfg.quantization.get("quantized_modules", []))
        layers = cfg.target["num_hidden_layers"]
        linears = _MOE_LINEARS if cfg.target.get("num_local_experts") else _TARGET_LINEARS
        missing = [m for i in range(layers) for lin in linears
                   if (m := f"{TARGET_PREFIX}model.layers.{i}.{lin}") not in quantized]
        if missing:
            raise UserError(f"{root}: {missing[0][len(TARGET_PREFIX):]} is not quantized while the target is {algo}; "
                            "mixed-precision targets are not exported.")


def hf_quant_config(cfg: EngineConfig) -> dict:
    """hf_quant_config.json as ModelOpt's export_hf_checkpoint writes it (key order included)."""
    algo = cfg.quantization["quant_algo"]
    quantization: dict = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if algo == "NVFP4":
        quantization["group_size"] = cfg.quantization.get("group_size") or 16
    routers = [f"model.layers.{i}.mlp.router" for i in range(cfg.target["num_hidden_layers"])
               ] if cfg.target.get("num_local_experts") else []
    quantization["exclude_modules"] = sorted(EXCLUDED_MODULES + routers)
    # The engine does not record the ModelOpt version that calibrated it: the one installed here, if any.
    try:
        version = metadata.version("nvidia-modelopt")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"producer": {"name": "modelopt", "version": version}, "quantization": quantization}


def quantization_config(hf_quant: dict) -> dict:
    """config.json `quantization_config`: ModelOpt's convert_hf_quant_config_format for FP8 and NVFP4."""
    q = hf_quant["quantization"]
    if q["quant_algo"] == "FP8":
        scheme = {"dynamic": False, "num_bits": 8, "type": "float"}
        group = {"input_activations": dict(scheme), "weights": dict(scheme), "targets": ["Linear"]}
    elif q["quant_algo"] == "NVFP4":
        scheme = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
        group = {"input_activations": dict(scheme), "weights": dict(scheme), "targets": ["Linear"]}
    else:
        raise AssertionError(f"quant_algo {q['quant_algo']!r}")
    return {"config_groups": {"group_0": group}, "ignore": q["exclude_modules"], "quant_algo": q["quant_algo"],
            "producer": hf_quant["producer"], "quant_method": "modelopt"}


def target_config_json(cfg: EngineConfig) -> str:
    """config.json as transformers' save_pretrained writes it; for a quantized target, with ModelOpt's
    `quantization_config` appended and ModelOpt's 4-space indent."""
    eos = cfg.eos_token_ids
    raw = {**cfg.target, "architectures": [ARCHITECTURES[cfg.target["model_type"]]], "dtype": cfg.dtype,
           "eos_token_id": eos[0] if len(eos) == 1 else (list(eos) or None)}
    text = hf_config_from_dict(raw, "engine config target").to_json_string(use_diff=True)
    if cfg.quantization.get("quant_algo") is None:
        return text
    data = json.loads(text)
    data["quantization_config"] = quantization_config(hf_quant_config(cfg))
    return json.dumps(data, indent=4)


def cuda_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size itself: 8 -> [1, 2, 4, 8], 6 -> [1, 2, 4, 6]."""
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return sizes + [max_batch_size]


def moe_parallel(cfg: EngineConfig) -> str | None:
    """How the engine split a mixture-of-experts target's experts over its ranks ("tp": every expert by
    intermediate features, "ep": whole experts), as its build recorded; None for a dense target."""
    if not cfg.target.get("num_local_experts"):
        return None
    return cfg.build.get("moe_parallel", "tp")


def llm_api_options(cfg: EngineConfig, drafter_dir: Path, schedule: DraftLenSchedule) -> dict:
    """extra_llm_api_options.yaml: TorchLlmArgs fields (key order is the file's); `drafter_dir`: the exported drafter's
    absolute path, as TensorRT-LLM will find it."""
    check_schedule(schedule.schedule, schedule.max_draft_len, cfg.dflash.block_size)
    tp = cfg.mapping.tp_size
    # A mixture-of-experts target: the experts split as the engine split them (BaseLlmArgs fields).
    moe = {"tp": {"moe_tensor_parallel_size": tp, "moe_expert_parallel_size": 1},
           "ep": {"moe_tensor_parallel_size": 1, "moe_expert_parallel_size": tp}}.get(moe_parallel(cfg), {})
    return {
        "tensor_parallel_size": tp,
        **moe,
        "max_batch_size": cfg.max_batch_size,
        "max_seq_len": cfg.max_seq_len,
        "kv_cache_config": {"free_gpu_memory_fraction": FREE_GPU_MEMORY_FRACTION},
        # enable_padding: TensorRT-LLM turns it on anyway with a draft_len_schedule.
        "cuda_graph_config": {"batch_sizes": cuda_graph_batch_sizes(cfg.max_batch_size), "enable_padding": True},
        "speculative_config": {
            "decoding_type": "DFlash",
            # TensorRT-LLM drafts at positions 1..max_draft_len of a block of the drafter's block_size; the schedule's
            # smallest key (1) must map to max_draft_len.
            "max_draft_len": schedule.max_draft_len,
            "draft_len_schedule": dict(schedule.schedule),
            "speculative_model": str(drafter_dir),  # absolute: TensorRT-LLM resolves it against its working directory
            "mask_token_id": cfg.dflash.mask_token_id,
            "target_layer_ids": list(cfg.dflash.target_layer_ids),
        },
    }


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow lists: `batch_sizes: [1, 2, 4, 8]`."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def options_yaml(cfg: EngineConfig, engine_name: str, root: Path, schedule: DraftLenSchedule) -> str:
    header = (f"# TensorRT-LLM LLM-API options for the DFlash engine {engine_name}, written by trtllm-dflash "
              f"{__version__} export trtllm.\n# Paths are absolute ({root}): run trtllm-serve / trtllm-bench from any "
              "directory (README.md); export again if this directory moves.\n" + schedule_comment(schedule))
    return header + yaml.dump(llm_api_options(cfg, root / DRAFTER, schedule), Dumper=_Dumper, sort_keys=False)


def serve_command(cfg: EngineConfig, root: Path) -> str:
    return (f"trtllm-serve {root / TARGET} --backend pytorch --tp_size {cfg.mapping.tp_size} "
            f"--extra_llm_api_options {root / OPTIONS}")


def bench_command(cfg: EngineConfig, root: Path) -> str:
    return (f"trtllm-bench --model {root / TARGET} --model_path {root / TARGET} throughput --backend pytorch "
            f"--tp {cfg.mapping.tp_size} --dataset DATASET.jsonl --extra_llm_api_options {root / OPTIONS}")


def last_layer_note(cfg: EngineConfig) -> str | None:
    """A sentence when the drafter reads the target's last layer, which TensorRT-LLM captures before the final norm
    (DFlashSpecMetadata.maybe_capture_hidden_states folds hidden + residual at each decoder layer's output), where
    the engine (and the z-lab reference) read it after: TensorRT-LLM then accepts fewer drafts than the engine."""
    last = cfg.target["num_hidden_layers"] - 1
    if last not in cfg.dflash.target_layer_ids:
        return None
    return (f"the drafter's target_layer_ids {list(cfg.dflash.target_layer_ids)} include the target's last layer "
            f"({last}), which TensorRT-LLM captures before the final norm while this engine and the z-lab reference "
            "read it after; TensorRT-LLM will accept fewer of its drafts (docs/interop.md). A drafter trained on "
            "layers 1 .. L-3 (train-drafter's default) drafts alike in both.")


def readme_text(cfg: EngineConfig, engine_name: str, root: Path, schedule: DraftLenSchedule) -> str:
    algo = cfg.quantization.get("quant_algo")
    arch = ARCHITECTURES[cfg.target["model_type"]]
    moe = moe_parallel(cfg)
    linears = "attention linears and experts" if moe else "linear layers"
    target = (f"{arch}, {cfg.dtype}" if algo is None else
              f"{arch}, {algo} {linears} in ModelOpt's unified checkpoint format (hf_quant_config.json), "
              f"other tensors {cfg.dtype}" + ("; NVFP4 GEMMs need a Blackwell GPU" if algo == "NVFP4" else ""))
    if moe and cfg.mapping.tp_size > 1:
        target += (f"; the engine split the experts by {'whole experts' if moe == 'ep' else 'intermediate features'}"
                   f" (moe_parallel: {moe}), and the YAML asks TensorRT-LLM for the same")
    drafter_quantized = cfg.quantization.get("drafter") == "quantized"
    drafter = (f"z-lab DFlash drafter (block_size {cfg.dflash.block_size}, mask_token_id {cfg.dflash.mask_token_id}, "
               f"target_layer_ids {list(cfg.dflash.target_layer_ids)}), {cfg.dtype}")
    if drafter_quantized:
        drafter += (f". The engine's drafter was quantized to {algo}: it is written dequantized (its weights are the "
                    "engine's quantized values), because the z-lab format is unquantized; TensorRT-LLM runs its "
                    "activations unquantized, so drafts may differ slightly from the engine's")
    if (note := last_layer_note(cfg)) is not None:
        drafter += f". Note: {note}"
    tp = cfg.mapping.tp_size
    launch = (f"With tensor_parallel_size {tp}, trtllm-serve starts its {tp} workers itself (MPI); on a cluster use "
              f"`mpirun -n {tp} trtllm-llmapi-launch trtllm-serve ...`.\n\n" if tp > 1 else "")
    return (f"# TensorRT-LLM deployment of the DFlash engine {engine_name}\n\n"
            f"Written by `trtllm-dflash export trtllm` (trtllm-dflash {__version__}). TensorRT-LLM's PyTorch "
            "backend runs DFlash natively (`DFlashDecodingConfig`, `decoding_type: DFlash`).\n\n"
            f"- `{TARGET}/`: the target, an HF checkpoint ({target}), merged from {tp} rank file(s)\n"
            f"- `{DRAFTER}/`: the {drafter}\n"
            f"- `{OPTIONS}`: speculative_config (max_draft_len {schedule.max_draft_len}, draft_len_schedule "
            f"{schedule_text(schedule.schedule)}: batch size -> drafts verified, from {schedule.source}), "
            f"tensor_parallel_size {tp}, max_batch_size {cfg.max_batch_size}, max_seq_len {cfg.max_seq_len}, "
            "KV cache and CUDA graph settings\n\n"
            f"The YAML names the drafter by its absolute path ({root / DRAFTER}) and the commands below name every "
            "file by its absolute path, so they run from any directory. If this directory is moved or copied to "
            "another machine, run `trtllm-dflash export trtllm` again there (or edit `speculative_model`).\n\n"
            f"```bash\n# OpenAI-compatible server on localhost:8000 (newer releases also accept --config)\n"
            f"{serve_command(cfg, root)}\n\n"
            "# throughput benchmark; DATASET.jsonl: a dataset in trtllm-bench's format\n"
            f"{bench_command(cfg, root)}\n```\n\n{launch}"
            "Written without TensorRT-LLM: trtllm-dflash's tests check that exported targets load in transformers "
            "with the engine's logits and that these YAML fields are TensorRT-LLM's (docs/export-trtllm.md), but "
            "TensorRT-LLM itself has not loaded this directory.\n")


def _merged(files: list, names: list[str], prefix: str, spec: DecoderSpec, tp: int, moe: str = "tp"):
    """(name without prefix, full tensor) for every `prefix` tensor, one at a time; `moe`: how the experts were
    split (split_for's moe_parallel)."""
    for name in names:
        key = name[len(prefix):]
        splits = [split_for(key, spec, tp, r, moe) for r in range(tp)]
        yield key, merge_shards([f.get_tensor(name) for f in files], splits, name)


def _check_expert_split(files: list, cfg: EngineConfig, moe: str, root: Path) -> None:
    """The rank files hold the experts as the build recorded: every expert on each rank under "tp", E / tp_size
    under "ep" (what the torch executor reads from the shard itself, TargetModel.from_state_dict)."""
    name = f"{TARGET_PREFIX}model.layers.0.mlp.experts.gate_up_proj"
    experts, tp = cfg.target["num_local_experts"], cfg.mapping.tp_size
    held = files[0].get_slice(name).get_shape()[0]
    if held != (experts // tp if moe == "ep" else experts):
        raise UserError(f"{root}: rank 0 holds {held} of {experts} experts, which is not moe_parallel: {moe} at "
                        f"tp_size {tp}; the engine is inconsistent, rebuild it.")


def export_trtllm(engine_dir: Path, output: Path, force: bool = False,
                  report: Callable[[str], None] | None = None) -> Path:
    """Verify the engine, then write OUTPUT atomically (see the module docstring); returns OUTPUT."""
    engine_dir, output = Path(engine_dir), Path(output)
    cfg = open_engine(engine_dir)  # every file against the manifest: a tampered engine is refused here
    check_exportable(cfg, engine_dir)
    check_output_dir(output, KIND, "--output", inputs=(engine_dir,), force=force)
    say = report or (lambda line: None)
    tp, dtype = cfg.mapping.tp_size, getattr(torch, cfg.dtype)
    target_spec, drafter_spec = _spec(cfg.target, "engine config target"), _spec(cfg.drafter, "engine config drafter")
    name = Path(engine_dir.resolve()).name
    with atomic_directory(output, KIND, force) as tmp, ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(engine_dir / rank_file(r)), framework="pt")) for r in range(tp)]
        names = sorted(files[0].keys())
        moe = moe_parallel(cfg)
        if moe is not None:
            _check_expert_split(files, cfg, moe, engine_dir)
        target_dir, drafter_dir = tmp / TARGET, tmp / DRAFTER
        target_dir.mkdir()
        # Streamed: one full tensor in memory at a time.
        with SafetensorsWriter(target_dir / "model.safetensors", metadata={"format": "pt"}) as out:
            for key, tensor in _merged(files, [n for n in names if n.startswith(TARGET_PREFIX)], TARGET_PREFIX,
                                       target_spec, tp, moe or "tp"):
                out.add(key, tensor)
        (target_dir / "config.json").write_text(target_config_json(cfg))
        if cfg.quantization.get("quant_algo") is not None:
            (target_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(cfg), indent=4))
        if cfg.eos_token_ids:
            from transformers import GenerationConfig

            eos = cfg.eos_token_ids
            GenerationConfig(eos_token_id=eos[0] if len(eos) == 1 else list(eos)).to_json_file(
                target_dir / "generation_config.json", use_diff=True)
        for f in sorted((engine_dir / TOKENIZER).iterdir()):
            if (target_dir / f.name).exists():
                raise UserError(f"{f}: a tokenizer file named like a checkpoint file; the engine is inconsistent.")
            shutil.copyfile(f, target_dir / f.name)
        say(f"wrote the target, merged from {tp} rank file{'s' if tp > 1 else ''}")

        drafter = dict(_merged(files, [n for n in names if n.startswith(DRAFTER_PREFIX)], DRAFTER_PREFIX,
                               drafter_spec, tp))
        if any(k.endswith(".weight_scale") for k in drafter):
            drafter, _ = dequantize_state_dict(drafter, dtype)
        params = DFlashParams(cfg.dflash.block_size, cfg.dflash.mask_token_id, tuple(cfg.dflash.target_layer_ids))
        save_drafter(drafter_dir, drafter_spec, params, target_spec.num_layers, drafter, cfg.dtype)
        root = output.resolve()  # where the directory will be once written (atomic_directory renames tmp to it)
        schedule = schedule_for(engine_dir, cfg.dflash.block_size, cuda_graph_batch_sizes(cfg.max_batch_size))
        if (warning := last_layer_note(cfg)) is not None:
            say(f"warning: {warning}")
        (tmp / OPTIONS).write_text(options_yaml(cfg, name, root, schedule))
        (tmp / README).write_text(readme_text(cfg, name, root, schedule))
        say("wrote the drafter, extra_llm_api_options.yaml and README.md")
    return output
