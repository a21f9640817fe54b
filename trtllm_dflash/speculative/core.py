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
(request seed, absolute position, vocabulary index) only: a counter-based hash computed on the logits' device, the
same on a CPU and a GPU (speculative/noise.py states the bound). The token at a position therefore depends only on the
prefix, the seed and the position, not on how many tokens a step verified: `dflash` and `ar` sample
the very same sequence for the same seed, and a request's output does not depend on its batch.

Top-k / top-p stay lossless with respect to the truncated target distribution. `truncate_logits` sets
the logits outside the kept set to -inf (top-k, then top-p over softmax(logits / T) renormalised to the
top-k set, as HF transformers and vLLM order them), so argmax(truncated / T + g) is an exact draw from
the renormalised truncated distribution q (Gumbel-max over the kept tokens; the others score -inf).
The kept set is a function of the target's logits at that position alone, so t is still a function of
(prefix, seed, position, sampling settings): a draft is accepted iff it equals that draw, which is the
one-hot-draft speculative sampling argument above with p replaced by q. Every committed token is an
exact sample of q given the committed prefix, and `dflash` == `ar` token for token. Greedy rows (T = 0)
ignore top-k / top-p: the argmax is always kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from trtllm_dflash.speculative.noise import gumbel

_MASK64 = (1 << 63) - 1


def request_seed(seed: int, request_id: str) -> int:
    """A 63-bit seed for one request, stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK64


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] for one (request seed, absolute position), on the CPU (speculative/noise.py;
    the samplers call `gumbel` on the logits' device, which gives the same values)."""
    return gumbel(torch.tensor([seed]), torch.tensor([[position]]), vocab_size)[0, 0]


@dataclass(frozen=True)
class Sampling:
    """How each request of a batch chooses its tokens. `sampled` / `truncated`: what the host already knows (whoever
    builds the batch from its requests): whether any row samples, and whether any sampled row has top-k / top-p.
    Given, the sampling functions read nothing back from the device; None: they read it from the tensors."""

    temperature: torch.Tensor  # [B] float32; 0: greedy (top_k and top_p then change nothing)
    top_k: torch.Tensor  # [B] int64; 0: no limit
    top_p: torch.Tensor  # [B] float32 in (0, 1]; 1: no limit
    seeds: torch.Tensor  # [B] int64 request seeds (request_seed; a list of ints is taken too)
    sampled: bool | None = None
    truncated: bool | None = None

    @classmethod
    def plain(cls, temperature: torch.Tensor, seeds: list[int] | torch.Tensor) -> "Sampling":
        """Temperature only: no top-k / top-p."""
        ones = torch.ones_like(temperature, dtype=torch.float32)
        return cls(temperature, torch.zeros_like(temperature, dtype=torch.long), ones, seeds, truncated=False)

    @classmethod
    def greedy(cls, batch: int, device: torch.device | str = "cpu") -> "Sampling":
        zeros = torch.zeros(batch, device=device)
        return cls(zeros, zeros.long(), torch.ones_like(zeros), zeros.long(), sampled=False, truncated=False)

    def __post_init__(self):
        if not isinstance(self.seeds, torch.Tensor):
            object.__setattr__(self, "seeds", torch.tensor(self.seeds, dtype=torch.int64,
                                                           device=self.temperature.device))
        assert self.temperature.shape == self.top_k.shape == self.top_p.shape == self.seeds.shape, (
            self.temperature.shape, self.seeds.shape)

    def any_sampled(self) -> bool:
        return self.sampled if self.sampled is not None else bool((self.temperature > 0).any())

    def any_truncated(self) -> bool:
        if self.truncated is not None:
            return self.truncated
        return bool(((self.temperature > 0) & ((self.top_k > 0) | (self.top_p < 1))).any())


def truncate_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [B, T, vocab] with -inf outside each sampled row's top-k / top-p set (the same tensor if no row
    truncates). Top-k keeps the k largest logits (ties with the k-th included); top-p then keeps the smallest
    prefix of the remaining tokens, by decreasing probability under softmax(logits / T), whose mass reaches p
    (a token is kept while the mass before it is < p, so the most likely token always is).
    Example: probs [0.5, 0.3, 0.15, 0.05], top_p 0.8 -> the first two; top_k 1 -> the first only.
    Every row is computed alike (no row is picked out on the host); rows that do not truncate keep their logits."""
    assert logits.ndim == 3 and logits.shape[0] == sampling.seeds.shape[0]
    if not sampling.any_truncated():
        return logits
    vocab = logits.shape[-1]
    sampled = sampling.temperature > 0
    truncates = sampled & ((sampling.top_k > 0) | (sampling.top_p < 1))  # [B]
    top_k = torch.where(sampling.top_k > 0, sampling.top_k, vocab).clamp(max=vocab)  # [B]
    top_p = sampling.top_p[:, None, None]  # [B, 1, 1]
    temperature = torch.where(sampled, sampling.temperature, 1.0)[:, None, None]  # greedy rows: any T, dropped below
    scores, order = (logits.float() / temperature).sort(dim=-1, descending=True, stable=True)  # [B, T, vocab]
    kth = scores.gather(-1, (top_k - 1)[:, None, None].expand(-1, scores.shape[1], 1))  # [B, T, 1]
    keep = scores >= kth  # the top k, and the tokens tied with the k-th
    probs = scores.masked_fill(~keep, -torch.inf).softmax(dim=-1)
    keep &= (mass_before(probs) < top_p_units(top_p)) | (top_p >= 1)  # top_p 1: no rounding may drop the tail
    drop = torch.zeros_like(keep).scatter(-1, order, ~keep) & truncates[:, None, None]  # back to vocabulary order
    return logits.masked_fill(drop, -torch.inf)


# Top-p adds probabilities as integers in units of 2**-MASS_BITS: integer sums are exact, so the mass before a token,
# and the kept set, are the same whichever order a device adds them in. A float cumsum is not: CUDA scans one row
# with another algorithm than several, so a request verified alone and in a batch, or by an AR step of one token and
# a verify pass of several, could keep different sets at the top-p boundary, and dflash would no longer equal ar.
# 2**40 units: a vocabulary of 2**23 tokens sums below 2**63; probabilities under 2**-41 count as 0.
MASS_BITS = 40


def mass_before(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities in decreasing order -> [..., V] int64: the mass of the tokens before each one, in units
    of 2**-MASS_BITS (every probability rounded to that unit first; exact and order-free from there).
    Example: [0.5, 0.25, 0.25] -> [0, 2**39, 2**39 + 2**38]."""
    units = torch.round(probs.double() * 2.0**MASS_BITS).long()  # exact: a float32 times a power of two
    return units.cumsum(dim=-1) - units


def top_p_units(top_p: torch.Tensor) -> torch.Tensor:
    """top_p in units of 2**-MASS_BITS (int64), for comparison with mass_before."""
    return torch.round(top_p.double() * 2.0**MASS_BITS).long()


def sample_tokens(
    logits: torch.Tensor,  # [B, T, vocab] fp32
    sampling: Sampling,
    positions: torch.Tensor,  # [B, T] absolute position of the token each row chooses
) -> torch.Tensor:
    """The target's token at every row: argmax where T == 0, else an exact sample of softmax(logits / T)
    truncated to the row's top-k / top-p set."""
    assert logits.ndim == 3 and positions.shape == logits.shape[:2]
    tokens = logits.argmax(dim=-1)
    if not sampling.any_sampled():
        return tokens
    sampled = torch.where(sampling.temperature > 0, sampling.temperature, 1.0)[:, None, None]
    noise = gumbel(sampling.seeds.to(logits.device), positions, logits.shape[-1])
    drawn = (truncate_logits(logits, sampling) / sampled + noise).argmax(dim=-1)
    return torch.where((sampling.temperature > 0)[:, None], drawn, tokens)


def acceptance_inputs(logits: torch.Tensor, sampling: Sampling, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What an acceptance graph that scores argmax(logits / T + noise) (compile/accept_graph.py) needs to choose
    sample_tokens' tokens: (the truncated logits [B, T, vocab], the Gumbel noise [B, T, vocab], zeros in greedy
    rows), on the logits' device."""
    if not sampling.any_sampled():
        return logits, torch.zeros_like(logits)
    noise = gumbel(sampling.seeds.to(logits.device), positions, logits.shape[-1])
    noise = noise.masked_fill(~(sampling.temperature > 0)[:, None, None], 0.0)
    return truncate_logits(logits, sampling), noise


@dataclass(frozen=True)
class AcceptPlanInputs:
    """What an acceptance plan or graph that scores argmax(where(T > 0, logits / T + noise, logits)) is given
    (compile/accept_graph.py's plain ops, the DFlashAccept plugin), so that it chooses sample_tokens' tokens exactly.

    A compiler may evaluate logits / T + noise in another form than torch does (TensorRT: a multiply by 1 / T, a
    fused multiply-add), which rounds differently and can turn a near-tie of a sampled row the other way. So the
    sampled rows' scores are computed here, by sample_tokens' own expression, and the plan gets them with T = 1 and
    noise 0, for which every such form is exact (x / 1 + 0 = x * (1 / 1) + 0 = fma(x, 1, 0) = x). Greedy rows: the
    logits, T = 0 (argmax, no arithmetic)."""

    scores: torch.Tensor  # [B, T, V] float32
    temperature: torch.Tensor  # [B] float32: 1 where sampled, 0 where greedy
    noise: torch.Tensor  # [B, T, V] float32 zeros

    @classmethod
    def make(cls, logits: torch.Tensor, sampling: Sampling, positions: torch.Tensor) -> "AcceptPlanInputs":
        """From the verify pass's logits [B, T, V] and positions [B, T] (block_positions), on the logits' device."""
        assert logits.ndim == 3 and positions.shape == logits.shape[:2]
        scores = logits.float()
        if sampling.any_sampled():  # the sampled rows' scores, by sample_tokens' own expression
            divide = torch.where(sampling.temperature > 0, sampling.temperature, 1.0)[:, None, None]
            noise = gumbel(sampling.seeds.to(logits.device), positions, logits.shape[-1])
            drawn = truncate_logits(logits, sampling) / divide + noise
            scores = torch.where((sampling.temperature > 0)[:, None, None], drawn, scores)
        temperature = (sampling.temperature > 0).to(device=logits.device, dtype=torch.float32)
        return cls(scores.contiguous(), temperature, torch.zeros_like(scores))


def gumbel_rows(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, vocab] float32 noise of one request for the tokens at `positions` [T] (sample_tokens' noise)."""
    return gumbel(torch.tensor([seed], device=positions.device), positions[None], vocab_size)[0]


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


def verify_block(draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
                 starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance step of one verify pass: (accepted [B], bonus [B]).

    draft [B, K] = d_1..d_K; logits [B, K+1, vocab] of the block [anchor, d_1..d_K] at positions starts + j;
    row j chooses the token at position starts + j + 1 (sample_tokens)."""
    target = sample_tokens(logits, sampling, block_positions(starts, logits.shape[1]))  # [B, K+1]
    accepted = accepted_lengths(draft, target)
    return accepted, bonus_tokens(target, accepted)


def block_positions(starts: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows]: the position of the token that verify row j chooses, starts + j + 1."""
    return starts[:, None] + 1 + torch.arange(rows, device=starts.device)
