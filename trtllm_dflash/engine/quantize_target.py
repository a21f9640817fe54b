"""ModelOpt PTQ of a target on the CPU (the whole model: `quantize_target`), and the calibration prompts.

`quantize_target` defines what a quantized build writes; the build computes the same tensors one decoder layer at a
time (engine/quantize_layers.py; tests/test_quantize_layers.py compares them byte for byte). The target is loaded with
transformers in bfloat16 (ModelOpt's unified export needs bf16), calibrated with NVFP4_DEFAULT_CFG or FP8_DEFAULT_CFG
(max calibration) on a prompt set, and exported with `export_hf_checkpoint`. Quantized linears come back in the
unified format (NVFP4: uint8 weight [out, in/2], float8_e4m3fn weight_scale [out, in/16], fp32 weight_scale_2 and
input_scale; FP8: float8_e4m3fn weight, fp32 weight_scale and input_scale); embedding, lm_head and norms stay
unquantized. The drafter is not quantized here: it keeps the engine's compute dtype. A Qwen3.5 directory (multimodal)
loads as its text model (Qwen3_5ForCausalLM): its Gated DeltaNet layers' in_proj_qkv / in_proj_z / out_proj are
quantized like any linear; in_proj_a / in_proj_b (a row per value head), the conv and the norms stay unquantized. A
DeepSeek-V3 / Kimi K2 target keeps its latent attention unquantized (`LATENT_ATTENTION`): the engine's absorbed form
multiplies kv_b_proj's weight into the query and the output instead of applying it to an input (docs/models.md); its
dense MLPs, routed and shared experts are quantized.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import read_json_object
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.train.corpus import code_prompts, stdlib_modules

QUANT_ALGOS = {"nvfp4": "NVFP4", "fp8": "FP8"}


def calibration_batches(tokenizer, path: Path | None, samples: int, max_tokens: int) -> list[torch.Tensor]:
    """Token-id batches [1, T] for calibration: the prompts of `path` (JSONL, as for `run`), or by default
    code from the Python standard library (present on every machine)."""
    if path is None:
        texts = code_prompts(stdlib_modules(held_out=False, include_tests=False), samples, 4 * max_tokens, seed=0)
        ids = [tokenizer(t)["input_ids"] for t in texts]
    else:
        requests, errors = read_requests(path, tokenizer, Defaults(1, 0.0, 0, 1 << 30, len(tokenizer)))
        if errors:
            raise UserError(f"{path}:{errors[0].line}: {errors[0].message}.")
        ids = [r.prompt_token_ids for r in requests[:samples]]
    ids = [i[:max_tokens] for i in ids if i]
    if not ids:
        raise UserError(f"{path}: no calibration prompts.")
    return [torch.tensor([i]) for i in ids]


def quantize_target(target_dir: Path, fmt: Literal["nvfp4", "fp8"], batches: list[torch.Tensor],
                    exclude: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Calibrate and export with ModelOpt (the `exclude` module patterns left unquantized); returns the exported
    tensors under their HF names."""
    from transformers import AutoModelForCausalLM

    require_modelopt()
    from trtllm_dflash.quantize.modelopt_cpu import calibrate

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).eval()
    calibrate(model, fmt, batches, exclude)
    return export_tensors(model, fmt)


def require_modelopt() -> None:
    try:
        import modelopt.torch.quantization  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise UserError(f"quantization needs NVIDIA ModelOpt: pip install 'trtllm-dflash[quantize]' ({exc}).") from None


def export_tensors(model: torch.nn.Module, fmt: Literal["nvfp4", "fp8"]) -> dict[str, torch.Tensor]:
    """ModelOpt's `export_hf_checkpoint` of a calibrated model (packed in place: unusable afterwards), read back: the
    tensors under their HF names."""
    from trtllm_dflash.quantize.modelopt_cpu import export_unified

    with tempfile.TemporaryDirectory() as tmp:
        export_unified(model, tmp)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors |= load_file(str(f))
        quant = read_json_object(Path(tmp) / "hf_quant_config.json", "hf_quant_config.json")["quantization"]
    if quant.get("quant_algo") != QUANT_ALGOS[fmt]:
        raise RuntimeError(f"ModelOpt exported quant_algo {quant.get('quant_algo')!r}, expected {QUANT_ALGOS[fmt]!r}")
    # A multimodal directory's text model (Qwen3.5) is exported under the names it was read from
    return {("model." + k[len(TEXT_MODEL):] if k.startswith(TEXT_MODEL) else k): v for k, v in tensors.items()}


# Where transformers keeps a multimodal model's text decoder (as its checkpoints store it)
TEXT_MODEL = "model.language_model."
# ModelOpt patterns of the modules a latent-attention target leaves unquantized
LATENT_ATTENTION = ("*self_attn*",)
