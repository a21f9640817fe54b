"""`train-drafter`'s settings (torch-free, so that `trtllm-dflash --help` starts at once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trtllm_dflash.errors import UserError

MAX_BLOCK_SIZE = 64  # published DFlash drafters use 10 to 16; the training batch grows with the block
MAX_SEED = 2**63 - 1  # torch.manual_seed's range


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; a resumed run must have the same values."""

    block_size: int = 16
    num_layers: int = 3
    target_layer_ids: tuple[int, ...] | None = None  # default: the reference's spacing for num_layers
    steps: int = 500
    batch_size: int = 8  # sequences per step
    anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    gamma: float | None = None  # loss decay; default 7 for block 16, 4 for block 8 (block_size / 2 - 1)
    response_tokens: int = 128  # length of the target's own responses
    held_out: int = 16  # prompts kept aside for the acceptance estimate
    eval_every: int = 50
    save_every: int = 50
    seed: int = 0
    dtype: str = "float32"  # dtype of the written drafter
    cache_features: bool = False  # compute the target's features of every sequence once, keep them in memory
    arch: str = "dflash"  # "dflash2": convolutions around each sublayer and a candidate selector (DFlash2Params)
    init_from: str | None = None  # a drafter for this target to start from (a DFlash one to continue, or to upgrade)

    def __post_init__(self) -> None:
        """Refuse, before any work, settings that cannot train (each message names the option)."""
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise UserError(f"--block-size {self.block_size}: a DFlash block has 2 to {MAX_BLOCK_SIZE} tokens.")
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise UserError(f"--lr {self.lr}: the learning rate must be a number in (0, 1].")
        if not (math.isfinite(self.warmup_ratio) and 0 <= self.warmup_ratio <= 1):
            raise UserError(f"--warmup-ratio {self.warmup_ratio}: must be a number from 0 to 1.")
        if self.gamma is not None and not (math.isfinite(self.gamma) and self.gamma > 0):
            raise UserError(f"--gamma {self.gamma}: the loss decay must be a finite number > 0.")
        if self.anchors > self.response_tokens:
            raise UserError(f"--anchors {self.anchors}: more blocks per sequence than --response-tokens "
                            f"{self.response_tokens} has positions to anchor them.")
        if self.arch not in ("dflash", "dflash2"):
            raise UserError(f"--arch {self.arch!r}: must be dflash or dflash2.")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed {self.seed}: must be from 0 to {MAX_SEED}.")

    @property
    def decay(self) -> float:
        return self.gamma if self.gamma is not None else max(1.0, self.block_size / 2 - 1)
