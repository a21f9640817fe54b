"""The DFlash acceptance step as ONNX, in its two forms.

`accept_step` is `speculative/core.py`'s sampling + acceptance over one verify pass, written with ops
that export to plain ONNX (ArgMax, Equal, CumSum, ReduceSum, GatherElements, Where): onnxruntime and
TensorRT-RTX run it as is (CumProd would be the natural op, but it is opset 26 only and TensorRT-RTX
rejects it; a cumulative sum of mismatches that is still 0 says the same). `export_accept_graph` writes it.

`plugin_accept_graph` writes the same step as ONE node of op type `DFlashAccept` with the attribute
`plugin_namespace = "trtllm_dflash"`: TensorRT's ONNX parser turns such a node into our registered plugin
(plugins/dflash/, the same inputs, outputs and attributes, in int32), which onnxruntime cannot run.

Inputs (B = batch, K = block_size - 1, V = vocabulary):
    draft_tokens    int64   [B, K]      d_1 .. d_K
    target_logits   float32 [B, K+1, V] the verify pass's logits
    temperature     float32 [B]         0: greedy
    gumbel_noise    float32 [B, K+1, V] gumbel_noise(seed, start + j + 1, V) for row j (unused where greedy)
    context_lengths int64   [B]         start: the anchor's position
Outputs:
    accepted        int64 [B]           a, 0 .. K
    committed_tokens int64 [B, K+1]     t_0 .. t_a, then -1
    next_block      int64 [B, block_size]  [bonus, MASK x K]
    next_positions  int64 [B, block_size]  start + a + 1 + arange
    new_context_lengths int64 [B]       start + a + 1
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

INPUTS = ("draft_tokens", "target_logits", "temperature", "gumbel_noise", "context_lengths")
OUTPUTS = ("accepted", "committed_tokens", "next_block", "next_positions", "new_context_lengths")
PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION = "DFlashAccept", "trtllm_dflash", "1"


def accept_step(draft: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor,
                starts: torch.Tensor, mask_token_id: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """core.sample_tokens + accepted_lengths + bonus_tokens + block_input, batched, branch-free."""
    assert draft.ndim == 2 and logits.shape[:2] == (draft.shape[0], draft.shape[1] + 1)
    sampled = (temperature > 0)[:, None, None]
    # Greedy rows take the logits themselves (their division by 0 is computed, then discarded).
    scores = torch.where(sampled, logits / temperature[:, None, None] + noise, logits)
    target = scores.argmax(dim=-1)  # [B, K+1]: first index of the maximum, as torch and ONNX ArgMax agree
    mismatches = (draft != target[:, :-1]).long().cumsum(dim=1)  # [B, K]: 0 while every draft so far matched
    accepted = (mismatches == 0).long().sum(dim=1)  # [B]
    columns = torch.arange(target.shape[1], device=target.device)
    committed = torch.where(columns[None, :] <= accepted[:, None], target, torch.full_like(target, -1))
    bonus = target.gather(1, accepted[:, None])  # [B, 1]
    next_block = torch.cat([bonus, torch.full_like(bonus, mask_token_id).expand(-1, block_size - 1)], dim=1)
    new_lengths = starts + accepted + 1
    next_positions = new_lengths[:, None] + torch.arange(block_size, device=target.device)
    return accepted, committed, next_block, next_positions, new_lengths


class _AcceptStep(nn.Module):
    """accept_step with the block length taken from the drafts (K + 1), so one graph serves every run-time
    block size (`--block-size` may be shorter than the drafter's trained block)."""

    def __init__(self, mask_token_id: int):
        super().__init__()
        self.mask_token_id = mask_token_id

    def forward(self, draft, logits, temperature, noise, starts):
        return accept_step(draft, logits, temperature, noise, starts, self.mask_token_id, draft.shape[1] + 1)


def export_accept_graph(path: Path, mask_token_id: int) -> Path:
    """The plain-op form, for onnxruntime and TensorRT-RTX; batch, drafts (K) and vocabulary are dynamic."""
    B, K, V = 2, 5, 7
    example = (torch.zeros(B, K, dtype=torch.long), torch.zeros(B, K + 1, V), torch.zeros(B),
               torch.zeros(B, K + 1, V), torch.zeros(B, dtype=torch.long))
    batch, drafts, vocab = (torch.export.Dim(n, min=m) for n, m in (("batch", 1), ("drafts", 1), ("vocab", 2)))
    shapes = ({0: batch, 1: drafts}, {0: batch, 1: drafts + 1, 2: vocab}, {0: batch},
              {0: batch, 1: drafts + 1, 2: vocab}, {0: batch})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)  # the exporter's notes on renaming the dynamic axes
        program = torch.onnx.export(_AcceptStep(mask_token_id).eval(), example, dynamo=True, opset_version=23,
                                    input_names=list(INPUTS), output_names=list(OUTPUTS), dynamic_shapes=shapes,
                                    verbose=False)
    path = Path(path)
    program.save(str(path))
    return path


def plugin_accept_graph(path: Path, mask_token_id: int, block_size: int):
    """The plugin form: one `DFlashAccept` node (int32 tensors, as the plugin takes them) for TensorRT."""
    import onnx
    from onnx import TensorProto, helper

    K = block_size - 1
    ints = {"draft_tokens": ["batch", K], "context_lengths": ["batch"]}
    floats = {"target_logits": ["batch", K + 1, "vocab"], "temperature": ["batch"],
              "gumbel_noise": ["batch", K + 1, "vocab"]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n in ints else TensorProto.FLOAT,
                                            ints.get(n) or floats[n]) for n in INPUTS]
    out_shapes = {"accepted": ["batch"], "committed_tokens": ["batch", K + 1], "next_block": ["batch", block_size],
                  "next_positions": ["batch", block_size], "new_context_lengths": ["batch"]}
    outputs = [helper.make_tensor_value_info(n, TensorProto.INT32, out_shapes[n]) for n in OUTPUTS]
    node = helper.make_node(PLUGIN_NAME, list(INPUTS), list(OUTPUTS), domain=PLUGIN_NAMESPACE,
                            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION,
                            block_size=block_size, mask_token_id=mask_token_id)
    model = helper.make_model(helper.make_graph([node], "dflash_accept", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(PLUGIN_NAMESPACE, 1)])
    onnx.save(model, str(path))
    return Path(path)
