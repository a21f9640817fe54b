"""Top-p decides on exact sums: the kept set cannot depend on the order a device adds the probabilities in (CUDA's
cumsum takes another scan for one row than for several, so an AR step of one row and a verify pass of many could keep
different sets at the boundary, and sampled dflash would no longer equal ar: issue 27)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from trtllm_dflash.speculative.core import MASS_BITS, Sampling, mass_before, top_p_units, truncate_logits


def sampling(rows: int, top_p: float, device: str = "cpu") -> Sampling:
    return Sampling(torch.ones(rows, device=device), torch.zeros(rows, dtype=torch.long, device=device),
                    torch.full((rows,), top_p, device=device), [0] * rows)


def exact_kept(probs: torch.Tensor, top_p: float) -> int:
    """How many tokens (by decreasing probability) have an exact mass before them below top_p."""
    p = sorted((Fraction(float(x)) for x in probs), reverse=True)
    before, kept = Fraction(0), 0
    for x in p:
        if before >= Fraction(top_p):
            break
        kept, before = kept + 1, before + x
    return kept


def test_mass_before_is_exact_in_its_units():
    assert mass_before(torch.tensor([0.5, 0.25, 0.25])).tolist() == [0, 2**39, 2**39 + 2**38]
    assert top_p_units(torch.tensor([0.75])).tolist() == [3 * 2**38]
    probs = torch.rand(3, 1000).softmax(-1).sort(descending=True).values
    units = torch.round(probs.double() * 2.0**MASS_BITS).long()
    for row in range(3):  # any order of adding gives the same integers
        assert mass_before(probs[row]).tolist() == (units[row].cumsum(0) - units[row]).tolist()
        assert int(units[row].flip(0).sum()) == int(units[row].sum())


def test_the_kept_set_is_the_exact_one_at_the_boundary():
    """A top_p equal to a float32 sum that rounded up past the exact mass before a token: the exact rule keeps the
    token (its mass before is below top_p); a float32 cumsum compares equal and drops it."""
    g = torch.Generator().manual_seed(0)
    for attempt in range(50):
        logits = torch.randn(4000, generator=g) * 0.5
        probs = logits.softmax(-1).sort(descending=True).values
        rounded = probs.cumsum(-1) - probs  # the float32 rule, as the CPU computes it
        exact = (mass_before(probs).double() / 2.0**MASS_BITS)
        above = torch.nonzero((rounded.double() > exact + 1e-12) & (probs > 1e-7)).flatten()
        if len(above):
            j = int(above[len(above) // 2])
            break
    else:
        pytest.fail("no float32 sum rounded up in 50 rows")
    top_p = float(rounded[j])  # a float32: exactly what the float rule compares with
    out = truncate_logits(logits[None, None], sampling(1, top_p))[0, 0]
    kept = int(torch.isfinite(out).sum())
    assert kept == exact_kept(probs, top_p) == j + 1  # the float rule would keep j


def test_one_row_and_the_same_row_in_a_batch_keep_the_same_set():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3, 2000, generator=g) * 2
    batch = truncate_logits(logits, sampling(6, 0.9))
    for b in range(6):
        assert torch.equal(truncate_logits(logits[b:b + 1], sampling(1, 0.9))[0], batch[b])
        for t in range(3):
            assert torch.equal(truncate_logits(logits[b:b + 1, t:t + 1], sampling(1, 0.9))[0, 0], batch[b, t])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_one_row_and_a_batch_keep_the_same_set():
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(32, 16, 151936, generator=g, device="cuda") * 3
    batch = truncate_logits(logits, sampling(32, 0.9, "cuda"))
    for b in range(32):
        for t in (0, 7, 15):
            one = truncate_logits(logits[b:b + 1, t:t + 1], sampling(1, 0.9, "cuda"))
            assert torch.equal(torch.isfinite(one[0, 0]), torch.isfinite(batch[b, t])), (b, t)
