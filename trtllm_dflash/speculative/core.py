"""Pure tensor functions of the DFlash step: block construction, sampling and acceptance.

Vocabulary (as in the paper and vLLM's rejection sampler):
  anchor   the last committed token of a request; it is not yet in the target's KV cache.
  block    [anchor, d_1 .. d_{K}] with K = block_size - 1 drafted tokens.
  target tokens  t_0 .. t_K: the target's choice at each block row (t_j follows block[: j+1]).
  accepted the longest prefix of drafts with d_j == t_{j-1}; 0 <= accepted <= K.
  bonus    t_accepted: the target's own token after the accepted prefix (always committed).

Lossless sampling. Drafts are greedy (deterministic), so standard speculative sampling with a one-hot
draft accepts d_j with probability p(d_j) and otherwise resamples from p with d_j removed, which is
the same as drawing t ~ p and accepting iff t == d_j (the z-lab reference scheme): every committed
token is an exact draw from the target's distribution given the committed prefix.

We draw t with the Gumbel-max trick, t = argmax(logits / T + g), where the noise g is a function of
(request seed, absolute position) only. The token at a position therefore depends only on the
prefix, the seed and the position, not on how many tokens a step verified: `dflash` and `ar` sample
the very same sequence for the same seed, and a request's output does not depend on its batch.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 63) - 1


def request_seed(seed: int, request_id: str) -> int:
    """A 63-bit seed for one request, stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK64


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] for one (request seed, absolute position)."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position) & _MASK64)
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_min(1e-300))).float()


def sample_tokens(
    logits: torch.Tensor,  # [B, T, vocab] fp32
    temperature: torch.Tensor,  # [B] fp32; 0 means greedy
    seeds: list[int],  # [B] request seeds
    positions: torch.Tensor,  # [B, T] absolute position of the token each row chooses
) -> torch.Tensor:
    """The target's token at every row: argmax where T == 0, else an exact sample of softmax(logits / T)."""
    assert logits.ndim == 3 and positions.shape == logits.shape[:2]
    tokens = logits.argmax(dim=-1)
    for b in torch.nonzero(temperature > 0).flatten().tolist():
        noise = gumbel_rows(seeds[b], positions[b], logits.shape[-1])
        tokens[b] = (logits[b] / temperature[b] + noise.to(logits.device)).argmax(dim=-1)
    return tokens


def gumbel_rows(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, vocab] float32 noise of one request for the tokens at `positions` [T] (sample_tokens' noise)."""
    return torch.stack([gumbel_noise(seed, int(p), vocab_size) for p in positions])


def block_input(anchors: torch.Tensor, mask_token_id: int, block_size: int) -> torch.Tensor:
    """[B] anchors -> [B, block_size] = [anchor, MASK, ..., MASK]: the drafter's input."""
    block = anchors.new_full((anchors.shape[0], block_size), mask_token_id)
    block[:, 0] = anchors
    return block


def accepted_lengths(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Number of drafts accepted per request.

    draft: [B, K] drafted tokens d_1..d_K; target: [B, K+1] target tokens t_0..t_K.
    d_j is accepted while d_1..d_j all equal t_0..t_{j-1}.
    Example: d = [5, 7, 9], t = [5, 7, 1, 4] -> 2 (bonus token t_2 = 1).
    """
    assert draft.ndim == 2 and target.shape == (draft.shape[0], draft.shape[1] + 1)
    return (draft == target[:, :-1]).long().cumprod(dim=1).sum(dim=1)


def bonus_tokens(target: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """t_accepted per request: the target's token right after the accepted drafts. [B]"""
    return target.gather(1, accepted[:, None]).squeeze(1)


def verify_block(draft: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, seeds: list[int],
                 starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance step of one verify pass: (accepted [B], bonus [B]).

    draft [B, K] = d_1..d_K; logits [B, K+1, vocab] of the block [anchor, d_1..d_K] at positions starts + j;
    row j chooses the token at position starts + j + 1 (sample_tokens)."""
    positions = starts[:, None] + 1 + torch.arange(logits.shape[1], device=logits.device)
    target = sample_tokens(logits, temperature, seeds, positions)  # [B, K+1]
    accepted = accepted_lengths(draft, target)
    return accepted, bonus_tokens(target, accepted)
