"""The build's quantization of a target one decoder layer at a time: host memory holds one layer, never the model.

ModelOpt's PTQ of a whole transformers model (engine/quantize_target.py `quantize_target`) loads it in bfloat16: ~2 TB
for Kimi K2.6, ~1.3 TB for DeepSeek-V3. But max calibration records max |x| at each quantizer while the model runs
unquantized, so layer i's scales depend only on the unquantized outputs of layers 0..i-1, and the export's rules
(q/k/v sharing a global scale, experts unfused) never look past a layer. So the builder reads a `LayerByLayer` mapping
in layer order while it writes the rank files: reading a tensor of layer i quantizes layer i on the hidden states
layer i-1 left, and drops layer i-1's tensors. Two ways to quantize a layer:

- `ModelOptLayers` (Qwen3, Llama, Qwen3 MoE, Qwen3.5 dense and MoE, DeepSeek-V3 / Kimi K2, Gemma 4): ModelOpt, on a
  one-layer model of the target's own transformers class holding layer i (`one_layer_config`): `mtq.quantize` fed the
  calibration prompts' hidden states, then `export_hf_checkpoint`, the tensors renamed from layer 0 to layer i. The
  result is byte for byte what ModelOpt writes for the whole model (tests/test_quantize_layers.py). The layer's weights
  come from the checkpoint reader, so published FP8-block and INT4 checkpoints are quantized from their values.
- gpt-oss (engine/quantize_moe_target.py): the same scales recorded by hand, since ModelOpt's wrapper of its fused
  experts copies every expert weight on each forward.

Memory: one layer's weights as read plus transformers' copy of them (the experts fused), the layer's exported tensors,
and the calibration hidden states (prompts x tokens x hidden in bfloat16).
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch

from trtllm_dflash.checkpoint.formats import TargetCheckpoint
from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LayerByLayer(Mapping[str, torch.Tensor]):
    """Quantized tensors under their HF names, computed a decoder layer at a time (`_quantize_layer`).

    Invariant: layers are read in order, as `build_engine` writes them. Reading (or asking for) a tensor of layer i
    quantizes layer i (layer i-1 must be done) and drops layer i-1's tensors."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.done = -1  # last layer quantized
        self.layer: dict[str, torch.Tensor] = {}  # its tensors
        self.on_layer: Callable[[int], None] | None = None  # told each layer's index as it starts (progress)

    def _quantize_layer(self, i: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def layer_of(name: object) -> int | None:
        match = _LAYER.match(name) if isinstance(name, str) else None
        return int(match[1]) if match else None

    def _reach(self, i: int) -> None:
        if i != self.done:
            assert i == self.done + 1, f"layer {i}: layers are quantized in order; layer {self.done} is the last done"
            self.layer = {}  # (drop the previous layer's tensors before making this one's)
            if self.on_layer is not None:
                self.on_layer(i)
            self.layer = self._quantize_layer(i)
            self.done = i

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self.layer_of(name)
        if i is None:
            raise KeyError(name)
        self._reach(i)
        return self.layer[name]


class ModelOptLayers(LayerByLayer):
    """A target quantized by ModelOpt a layer at a time (module docstring): the tensors ModelOpt exports for each
    layer's quantized modules. Which modules those are is ModelOpt's choice, so asking for a name of layer i quantizes
    layer i, and the names are all known once every layer is done (the builder lists them after the rank files)."""

    def __init__(self, target: TargetCheckpoint, fmt: Literal["nvfp4", "fp8"], batches: list[torch.Tensor],
                 exclude: tuple[str, ...] = ()):
        from trtllm_dflash.engine.quantize_target import require_modelopt

        require_modelopt()
        super().__init__(target.spec.num_layers)
        self.target, self.fmt, self.batches, self.exclude = target, fmt, batches, exclude
        self.config = hf_config_from_dict(target.hf_config, str(target.directory / "config.json"))
        self.names: dict[str, None] = {}  # of the layers done, in order
        self.hidden: list[torch.Tensor] = []  # [1, T, hidden] bf16 per calibration prompt: the input of layer done + 1

    def __contains__(self, name: object) -> bool:
        i = self.layer_of(name)
        if i is None or i >= self.num_layers:
            return False
        if i > self.done:
            self._reach(i)
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self._every_name())

    def __len__(self) -> int:
        return len(self._every_name())

    def _every_name(self) -> dict[str, None]:
        assert self.done == self.num_layers - 1, f"names are known once every layer is quantized; {self.done} done"
        return self.names

    @torch.no_grad()
    def _quantize_layer(self, i: int) -> dict[str, torch.Tensor]:
        from trtllm_dflash.engine.quantize_target import export_tensors
        from trtllm_dflash.quantize.modelopt_cpu import calibrate_module

        model = self._one_layer_model(i)
        outputs: list[torch.Tensor] = []
        hook = model.model.layers[0].register_forward_hook(
            lambda _, __, out: outputs.append(out[0] if isinstance(out, tuple) else out))

        def forward_loop(m: torch.nn.Module) -> None:  # (the decoder alone: the lm_head's logits are not needed)
            outputs.clear()
            for k, batch in enumerate(self.batches):
                m.model(**({"input_ids": batch} if i == 0 else {"inputs_embeds": self.hidden[k]}), use_cache=False)

        with _quiet():
            calibrate_module(model, self.fmt, forward_loop, self.exclude)
            hook.remove()
            self.hidden = list(outputs)
            tensors = export_tensors(model, self.fmt)
        # The tensors of the layer's quantized modules (those with a scale; the rest the builder takes as stored)
        quantized = {k.rsplit(".", 1)[0] for k in tensors if "scale" in k.rsplit(".", 1)[1]}
        prefix = f"model.layers.{i}."
        out = {prefix + k.removeprefix("model.layers.0."): v for k, v in tensors.items()
               if k.startswith("model.layers.0.") and k.rsplit(".", 1)[0] in quantized}
        self.names |= dict.fromkeys(out)
        return out

    def _one_layer_model(self, i: int) -> torch.nn.Module:
        """The target's transformers class with layer i of the checkpoint as its only layer (bfloat16; layer 0 also
        gets the embedding, which the calibration prompts go through)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = one_layer_config(self.config, self.target.spec, i)
        prefix, tensors = f"model.layers.{i}.", self.target.tensors
        state = {"model.layers.0." + n[len(prefix):]: tensors.get(n) for n in tensors.names() if n.startswith(prefix)}
        if i == 0:
            state["model.embed_tokens.weight"] = tensors.get("model.embed_tokens.weight")
        with _quiet():
            model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
                None, config=config, state_dict=state, dtype=torch.bfloat16, output_loading_info=True)
        wrong = [k for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(kind, ())
                 if "layers." in str(k)]
        if wrong:  # (one_layer_config does not know this family's layer kinds)
            raise RuntimeError(f"layer {i} of the {self.config.model_type} target does not load as a one-layer model: "
                               f"{wrong[:4]}")
        return model.eval()


def one_layer_config(config, spec: DecoderSpec, i: int):
    """`config` for a model whose one layer is layer i: the fields that decide a layer's kind by its index (attention
    kind, dense or routed MLP) set for index 0, and past layer 0 (whose embedding the prompts go through) a
    vocabulary of two: the export's own trial forward reads token 1."""
    one = copy.deepcopy(config)
    one.num_hidden_layers, one.tie_word_embeddings = 1, False  # (the lm_head is not run: whatever it holds)
    if getattr(config, "layer_types", None) is not None:
        one.layer_types = [config.layer_types[i]]
    if hasattr(config, "first_k_dense_replace"):  # DeepSeek-V3 / Kimi K2
        one.first_k_dense_replace = int(i < config.first_k_dense_replace)
    if hasattr(config, "mlp_only_layers"):  # Qwen3 MoE
        one.mlp_only_layers, one.decoder_sparse_step = ([] if spec.is_sparse(i) else [0]), 1
    if i > 0:
        one.vocab_size, one.pad_token_id = 2, None
    return one


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without transformers' and ModelOpt's per-model chatter (progress bars, "Inserted N quantizers", newly
    initialized lm_head), which would repeat for every layer; warnings still reach stderr."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
