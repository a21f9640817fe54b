"""The counter-based sampling noise (speculative/noise.py): the same bits as its pure-Python statement, within the
stated bound of exact arithmetic, Gumbel-distributed, and independent across seeds, positions and indices."""

from __future__ import annotations

import random

import mpmath
import pytest
import torch
from scipy import stats

from trtllm_dflash.speculative import noise
from trtllm_dflash.speculative.noise import _bits, _key, gumbel, gumbel64, hash_reference, uniform


def _cases(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    edge = [(0, 0, 0), ((1 << 63) - 1, 2**31 - 1, 151_935), (1 << 32, 1, 1), (0xFFFFFFFF, 7, 4095)]
    return edge + [(rng.getrandbits(63), rng.randrange(2**20), rng.randrange(262_144)) for _ in range(n)]


def test_the_hashes_are_their_python_statement_bit_for_bit():
    """The int64 tensor arithmetic (split products, no overflow) equals the same hash on Python ints, so any device
    that computes int64 exactly gives these bits."""
    for s, pos, idx in _cases(300):
        seeds, positions = torch.tensor([s]), torch.tensor([[pos]])
        a = int(_bits(_key(seeds, positions, noise._STREAM_A), idx + 1)[0, 0, idx])
        b = int(_bits(_key(seeds, positions, noise._STREAM_B), idx + 1)[0, 0, idx])
        assert (a, b) == hash_reference(s, pos, idx), (s, pos, idx)


def test_uniforms_are_53_bit_and_open():
    u = uniform(torch.tensor([3, 1 << 62]), torch.arange(8).expand(2, 8), 4096)
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    k = u * 2.0**53 - 0.5  # (k + 0.5) / 2^53 exactly
    assert torch.equal(k, k.round())


def test_float64_noise_is_within_the_stated_bound_of_exact_arithmetic():
    """Against mpmath at 50 digits from the same uniform: within ~2 ulp of the float64 Gumbel value plus the inner
    log's ulp carried through the outer one (what CPU and CUDA each guarantee: 1-ulp logs)."""
    mpmath.mp.dps = 50
    seeds, positions = torch.tensor([12345, 1 << 40]), torch.tensor([[0, 1, 99], [5, 6, 7]])
    u = uniform(seeds, positions, 2000).flatten()
    g = gumbel64(seeds, positions, 2000).flatten()
    worst = 0.0
    for ui, gi in zip(u.tolist(), g.tolist()):
        exact = -mpmath.log(-mpmath.log(mpmath.mpf(ui)))
        ulp_g = abs(gi) * 2.0**-52 + 2.0**-1074
        carried = 2.0**-52  # the inner log's relative 1 ulp becomes an absolute 2^-52 through the outer log
        worst = max(worst, abs(float(exact) - gi) / (2 * ulp_g + carried))
    assert worst <= 1.0, worst


def test_noise_is_standard_gumbel_and_independent():
    g = gumbel(torch.tensor([7]), torch.arange(16)[None], 8192).flatten().double().numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > 1e-3
    rows = gumbel(torch.tensor([7, 8]), torch.tensor([[10, 11], [10, 11]]), 8192)
    for a, b in [(rows[0, 0], rows[0, 1]), (rows[0, 0], rows[1, 0])]:  # adjacent positions, adjacent seeds
        assert abs(stats.pearsonr(a.numpy(), b.numpy())[0]) < 0.05
    assert not torch.equal(rows[0, 0, :-1], rows[0, 0, 1:])  # nor shifted by one index


def test_noise_depends_on_seed_position_and_index_only():
    """The same (seed, position) gives the same row in any batch and at any place in it (a request's tokens do not
    depend on its neighbours or on how many tokens a step verified)."""
    alone = gumbel(torch.tensor([99]), torch.tensor([[42]]), 1000)[0, 0]
    batch = gumbel(torch.tensor([5, 99]), torch.tensor([[40, 41, 42], [40, 41, 42]]), 1000)
    assert torch.equal(batch[1, 2], alone)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
def test_cuda_noise_equals_the_cpus():
    seeds, positions = torch.tensor([3, 1 << 62]), torch.arange(16).expand(2, 16)
    cpu = gumbel(seeds, positions, 151_936)
    cuda = gumbel(seeds.cuda(), positions.cuda(), 151_936).cpu()
    assert torch.equal(_bits(_key(seeds.cuda(), positions.cuda(), 1), 64).cpu(), _bits(_key(seeds, positions, 1), 64))
    differ = (cpu != cuda).sum().item()
    assert differ <= cpu.numel() * 2**-20, differ  # float32 roundings at a boundary only (module docstring)
