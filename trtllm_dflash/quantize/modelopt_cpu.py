"""Drive NVIDIA ModelOpt (nvidia-modelopt 0.47) on a CPU-only machine: calibrate, export, read back.

ModelOpt entry points used:
  modelopt.torch.quantization.quantize(model, NVFP4_DEFAULT_CFG | FP8_DEFAULT_CFG, forward_loop)
  modelopt.torch.export.export_hf_checkpoint(model, export_dir=...)   (unified HF checkpoint)
  modelopt.torch.quantization.tensor_quant.dynamic_block_quantize_op    (replaced by the CPU shim)

CPU caveat: ModelOpt's NVFP4 fake quantization (`dynamic_block_quantize_op`) has only CUDA/Triton
kernels and asserts "amax must be a CUDA tensor for dynamic block quantization". Max calibration itself
only records amax, so it runs without it, but every forward of the quantized model (evaluation, or a
calibration algorithm that runs quantized forwards) needs it. `cpu_nvfp4_fake_quant()` swaps in the
pure-torch `fake_quant_nvfp4_activation` for the NVFP4 case while the context is open.

ModelOpt is imported inside the functions, so `read_quantized_linear` works without it installed.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch

from trtllm_dflash.quantize.fp8 import FP8Weight
from trtllm_dflash.quantize.nvfp4 import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, NVFP4Weight, fake_quant_nvfp4_activation

QuantFormat = Literal["nvfp4", "fp8"]
_CONFIG_NAMES = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG"}
# dynamic_block_quantize_op's (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) for NVFP4:
# E2M1 values (4 bits, 2 exponent bits) with E4M3 block scales (8 bits, 4 exponent bits).
_NVFP4_OP_BITS = (4, 2, 8, 4)


@contextlib.contextmanager
def cpu_nvfp4_fake_quant() -> Iterator[None]:
    """Run ModelOpt's NVFP4 fake quantization on CPU tensors while the context is open.

    ModelOpt looks `tensor_quant.dynamic_block_quantize_op` up at call time, so replacing the module
    attribute is enough; other formats and CUDA tensors still go to the original op.
    """
    tensor_quant = importlib.import_module("modelopt.torch.quantization.tensor_quant")
    original = tensor_quant.dynamic_block_quantize_op

    def dynamic_block_quantize_op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits,
                                  scale_exponent_bits):
        bits = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        if inputs.is_cuda or amax is None or bits != _NVFP4_OP_BITS:
            return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        assert block_size == BLOCK_SIZE, f"NVFP4 shim supports block size {BLOCK_SIZE}, got {block_size}"
        # ModelOpt's kernel takes the max if amax is not a scalar, then global scale = amax / (6 * 448).
        input_scale = amax.float().amax() / (E2M1_MAX * E4M3_MAX)
        return fake_quant_nvfp4_activation(inputs, input_scale)

    tensor_quant.dynamic_block_quantize_op = dynamic_block_quantize_op
    try:
        yield
    finally:
        tensor_quant.dynamic_block_quantize_op = original


def calibrate(model: torch.nn.Module, cfg_name: QuantFormat, batches: Iterable[torch.Tensor],
              exclude: tuple[str, ...] = ()) -> None:
    """Insert ModelOpt quantizers into a transformers causal LM and calibrate them (max algorithm), in place.

    `batches`: token ids, each [batch, seq] int64. The default configs quantize every Linear's weight and
    input; lm_head, embeddings and routers stay unquantized. Afterwards the model runs fake-quantized
    (inside `cpu_nvfp4_fake_quant()` on CPU for NVFP4) and can be written with `export_unified`. `exclude`: module
    name patterns (ModelOpt's wildcards) left unquantized besides the config's own.
    The shim is open during calibration too; max calibration only records amax and does not need it.
    """
    assert cfg_name in _CONFIG_NAMES, f"cfg_name must be one of {sorted(_CONFIG_NAMES)}, got {cfg_name!r}"
    assert not model.training, "call model.eval() before calibrating (dropout would distort the amax)"
    batches = list(batches)
    assert batches, "calibration needs at least one batch"
    for b in batches:
        assert b.dtype == torch.long and b.ndim == 2, (
            f"batches must be [batch, seq] int64 token ids, got {b.dtype} {tuple(b.shape)}")

    device = next(model.parameters()).device

    def forward_loop(m: torch.nn.Module) -> None:
        for b in batches:
            m(input_ids=b.to(device), use_cache=False)

    calibrate_module(model, cfg_name, forward_loop, exclude)


def calibrate_module(model: torch.nn.Module, cfg_name: QuantFormat,
                     forward_loop: Callable[[torch.nn.Module], None], exclude: tuple[str, ...] = ()) -> None:
    """`mtq.quantize` of any torch module with the default config of `cfg_name` (and the `exclude` patterns turned
    off), on the CPU as well."""
    mtq = importlib.import_module("modelopt.torch.quantization")
    config = getattr(mtq, _CONFIG_NAMES[cfg_name])
    if exclude:
        config = {**config, "quant_cfg": [*config["quant_cfg"],
                                          *({"quantizer_name": p, "enable": False} for p in exclude)]}
    with torch.no_grad(), cpu_nvfp4_fake_quant():
        mtq.quantize(model, config, forward_loop)


def export_unified(model: torch.nn.Module, export_dir: str | Path) -> None:
    """Write a calibrated model as ModelOpt's unified HF checkpoint (model.safetensors, config.json with
    `quantization_config`, hf_quant_config.json) via `export_hf_checkpoint`.

    Needs a bf16 model (fp32 fails inside ModelOpt with "Invalid device string: 'float32'"). Sets
    `config.architectures` to the model class if missing, as `save_pretrained` would (ModelOpt crashes
    without it). Export packs the weights in place: the model is not usable for inference afterwards.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(f"export_unified needs a bf16 model (ModelOpt fails on others), got parameter dtypes {dtypes}")
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    export = importlib.import_module("modelopt.torch.export")
    export.export_hf_checkpoint(model, export_dir=Path(export_dir))


def read_quantized_linear(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Weight | FP8Weight | None:
    """The quantized linear `prefix` of a unified HF checkpoint, or None if it is stored unquantized.

    Reads `<prefix>.weight`, `.weight_scale`, `.weight_scale_2` and `.input_scale` (optional: absent for
    weight-only formats). NVFP4: uint8 weight + weight_scale_2; FP8: float8_e4m3fn weight. Scalars stored
    as [1] are returned as 0-dim tensors.
    """
    def scalar(name: str) -> torch.Tensor | None:
        t = tensors.get(f"{prefix}.{name}")
        if t is None:
            return None
        assert t.numel() == 1, f"{prefix}.{name} must be a scalar, got shape {tuple(t.shape)}"
        return t.reshape(())

    weight = tensors.get(f"{prefix}.weight")
    if weight is None:
        raise KeyError(f"{prefix}.weight not found")
    weight_scale = tensors.get(f"{prefix}.weight_scale")
    if weight.dtype == torch.uint8 and f"{prefix}.weight_scale_2" in tensors:
        if weight_scale is None:
            raise KeyError(f"{prefix}.weight_scale not found for NVFP4 weight")
        return NVFP4Weight(weight=weight, weight_scale=weight_scale, weight_scale_2=scalar("weight_scale_2"),
                           input_scale=scalar("input_scale"))
    if weight.dtype == torch.float8_e4m3fn:
        if weight_scale is None:
            raise KeyError(f"{prefix}.weight_scale not found for FP8 weight")
        return FP8Weight(weight=weight, weight_scale=scalar("weight_scale"), input_scale=scalar("input_scale"))
    if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight_scale is None:
        return None
    raise ValueError(f"{prefix}: unsupported quantized format (weight {weight.dtype}, "
                     f"scales {sorted(k for k in tensors if k.startswith(prefix + '.') and 'scale' in k)})")
