"""`run`'s options and the decoding modes (torch-free, so that `trtllm-dflash --help` starts at once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trtllm_dflash.config import Backend
from trtllm_dflash.errors import UserError

Mode = Literal["dflash", "ar"]  # dflash: speculative decoding; ar: plain autoregressive decoding
# Tokens per DFlash block: 2 .. the engine's trained block_size, or "auto" (each step verifies the k in
# 1 .. block_size that maximises expected tokens/s from measured pass costs: runtime/costs.py).
BlockSize = int | Literal["auto"]
# Above this, softmax(logits / T) is uniform to float32 precision: a larger value is a typo, not a choice.
MAX_TEMPERATURE = 1e6


@dataclass(frozen=True)
class RunOptions:
    """`run`'s options; per-line `max_new_tokens` / `temperature` override the defaults here."""

    mode: Mode = "dflash"
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids
    threads: int | None = None  # torch CPU threads per rank (None: torch's choice, shared out among ranks)
    block_size: BlockSize | None = None  # tokens per block, <= the engine's trained one, or "auto" (None: trained)
    device: str = "cpu"  # "cpu" or "cuda" (a rank drives the GPU of its local rank on its node: parallel/world.py)
    resume: bool = False  # keep the output file's finished requests and run only the others
    progress: bool | None = None  # live progress on stderr (None: when stderr is a terminal)
    backend: Backend | None = None  # "torch" or "onnxruntime" (None: what the engine was compiled for)
    cuda_graphs: bool | None = None  # torch on CUDA, tensorrt: decode passes as CUDA graphs (None: on where they can)
    kv_cache_memory: str | None = None  # a paged KV cache of this size (torch executor; None: a static slot each)
    prefix_cache: bool = True  # prompt blocks reused across requests by prefix (shared when paged, else copied)
    tree_budget: int | None = None  # dflash: verify a DDTree of this many draft nodes a step (None: a chain)
    prefix_states: int | None = None  # a hybrid target's recurrent states kept for prefix reuse (None: one a slot)



def check_tree_options(tree_budget: int | None, mode: Mode, block_size: BlockSize | None) -> None:
    """--tree-budget with what it cannot go with, in one sentence (`run`, `serve` and `compare`)."""
    if tree_budget is not None and (mode != "dflash" or block_size not in (None, "auto")):
        raise UserError("--tree-budget drafts a tree every step of --mode dflash (or, with --block-size auto, where it "
                        "pays); it does not take --mode ar or a fixed --block-size.")
