"""The counter-based sampling noise (speculative/noise.py): the same bits as its pure-Python statement, the CPU's
logarithms within the stated ulp bound of exact arithmetic (so a CUDA run can be held to the same reference),
Gumbel-distributed, independent across seeds, positions and indices; and the samplers read nothing back from the
device when the batch says what it knows."""

from __future__ import annotations

import math
import random

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from tests.test_decode_step import HostReads
from trtllm_dflash.speculative import noise
from trtllm_dflash.speculative.core import (
    AcceptPlanInputs, Sampling, acceptance_inputs, sample_tokens, truncate_logits, verify_block,
)
from trtllm_dflash.speculative.noise import (
    _bits, _key, gumbel, gumbel64, hash_reference, uniform, uniform_reference,
)


def _cases(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    edge = [(0, 0, 0), ((1 << 63) - 1, 2**31 - 1, 151_935), (1 << 32, 1, 1), (0xFFFFFFFF, 7, 4095),
            ((1 << 63) - 1, (1 << 32) + 5, 0), (-5, 3, 9)]  # positions keep their low 32 bits; any int64 seed
    return edge + [(rng.getrandbits(63), rng.randrange(2**20), rng.randrange(262_144)) for _ in range(n)]


def test_the_hashes_are_their_python_statement_bit_for_bit():
    """The int64 tensor arithmetic (products below 2^63, no overflow) equals the same hash on Python ints, so any
    device that computes int64 exactly gives these bits."""
    for s, pos, idx in _cases(300):
        seeds, positions = torch.tensor([s]), torch.tensor([[pos]])
        a = int(_bits(_key(seeds, positions, noise._STREAM_A), idx + 1)[0, 0, idx])
        b = int(_bits(_key(seeds, positions, noise._STREAM_B), idx + 1)[0, 0, idx])
        assert (a, b) == hash_reference(s, pos, idx), (s, pos, idx)


def test_uniforms_are_their_python_statement_over_a_batch():
    """Many (seed, position, index) at once, through the vectorised path (pieces of the vocabulary included)."""
    rng = random.Random(1)
    seeds = [rng.getrandbits(63) for _ in range(4)]
    positions = [[rng.randrange(2**31) for _ in range(3)] for _ in seeds]
    u = uniform(torch.tensor(seeds), torch.tensor(positions), 70_000)
    for b, t, v in [(rng.randrange(4), rng.randrange(3), rng.randrange(70_000)) for _ in range(2000)]:
        assert u[b, t, v].item() == uniform_reference(seeds[b], positions[b][t], v), (b, t, v)


def test_uniforms_are_52_bit_and_in_the_open_interval():
    u = uniform(torch.tensor([3, 1 << 62]), torch.arange(8).expand(2, 8), 4096)
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    k = u * 2.0**52 - 0.5  # (k + 0.5) / 2^52 exactly
    assert torch.equal(k, k.round())
    assert (0 + 0.5) / 2**52 == 2.0**-53 and (2**52 - 1 + 0.5) / 2**52 == 1 - 2.0**-53  # the extremes: exact, open


def test_pieces_of_the_vocabulary_do_not_change_the_noise(monkeypatch):
    seeds, positions = torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [4, 5, 6]])
    whole = gumbel(seeds, positions, 10_000)
    monkeypatch.setattr(noise, "CPU_PIECE_ELEMENTS", 1)  # pieces of 1024 indices
    assert torch.equal(gumbel(seeds, positions, 10_000), whole)
    assert torch.equal(gumbel64(seeds, positions, 10_000).float(), whole)


def _ulp(x: float) -> float:
    return math.ulp(abs(x))


def _samples() -> tuple[list[float], list[float], list[float]]:
    """(u, float64 -log(u), float64 g) for 6,000 (seed, position, index) of spread-out seeds and positions."""
    rng = random.Random(2)
    seeds = torch.tensor([rng.getrandbits(63) for _ in range(6)])
    positions = torch.tensor([[rng.randrange(2**24) for _ in range(2)] for _ in range(6)])
    u = uniform(seeds, positions, 500)
    return u.flatten().tolist(), (-u.log()).flatten().tolist(), gumbel64(seeds, positions, 500).flatten().tolist()


def test_cpu_log_is_within_one_ulp():
    """torch's float64 log on this CPU (MKL's vdLn in HA mode, or SLEEF u10 / glibc) against mpmath at 50 digits, on
    the arguments the noise gives it (u, and -log(u)): within 1 ulp, CUDA's documented bound for `log` too."""
    mpmath.mp.dps = 50
    u, inner, _ = _samples()
    args = u + inner
    logs = torch.tensor(args, dtype=torch.float64).log().tolist()  # one call: the vectorised kernel the noise uses
    for x, got in zip(args, logs):
        exact = mpmath.log(mpmath.mpf(x))
        assert abs(mpmath.mpf(got) - exact) <= _ulp(float(exact)), (x, got)


def test_float64_noise_is_within_the_stated_bound_of_exact_arithmetic():
    """g within 2^-52 (1 + |g|) of -log(-log(u)) at 50 digits: what 1-ulp logs guarantee on any device (noise.py)."""
    mpmath.mp.dps = 50
    u, _, g = _samples()
    for ui, gi in zip(u, g):
        exact = -mpmath.log(-mpmath.log(mpmath.mpf(ui)))
        assert abs(mpmath.mpf(gi) - exact) <= 2.0**-52 * (1 + abs(gi)), (ui, gi)


def test_float32_noise_is_the_exact_value_rounded_except_near_a_boundary():
    """The float32 noise equals the correctly rounded exact Gumbel value unless that value lies within 2^-52 (1 + |g|)
    of a float32 rounding boundary: a device held to the same 1-ulp logs (CUDA) gives the same float32 noise except
    there, and such windows hold ~8.5e-8 of the elements (noise.py)."""
    mpmath.mp.dps = 50
    u, _, g = _samples()
    near = 0
    for ui, gi in zip(u, g):
        exact = -mpmath.log(-mpmath.log(mpmath.mpf(ui)))
        rounded = float(np.float32(float(exact)))  # float64 then float32: exact is far from a float64 midpoint here
        window = 2.0**-52 * (1 + abs(gi))
        if float(np.float32(gi)) != rounded:
            lo, hi = np.float32(gi), np.float32(rounded)
            boundary = (float(min(lo, hi)) + float(max(lo, hi))) / 2
            assert abs(exact - boundary) <= window, (ui, gi)
            near += 1
    assert near <= 1, near  # 6,000 elements at ~8.5e-8: a mismatch here at all would be a surprise


def test_noise_is_standard_gumbel_and_independent():
    g = gumbel(torch.tensor([7]), torch.arange(16)[None], 8192).flatten().double().numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > 1e-3
    counts, edges = np.histogram(g, bins=stats.gumbel_r.ppf(np.linspace(0, 1, 41)))  # 40 equiprobable bins
    assert stats.chisquare(counts).pvalue > 1e-3
    rows = gumbel(torch.tensor([7, 8]), torch.tensor([[10, 11], [10, 11]]), 8192)
    for a, b in [(rows[0, 0], rows[0, 1]), (rows[0, 0], rows[1, 0])]:  # adjacent positions, adjacent seeds
        assert abs(stats.pearsonr(a.numpy(), b.numpy())[0]) < 0.05
        assert not bool((a == b).any())
    assert not torch.equal(rows[0, 0, :-1], rows[0, 0, 1:])  # nor shifted by one index
    assert abs(stats.pearsonr(rows[0, 0, :-1].numpy(), rows[0, 0, 1:].numpy())[0]) < 0.05


def test_noise_depends_on_seed_position_and_index_only():
    """The same (seed, position) gives the same row in any batch and at any place in it (a request's tokens do not
    depend on its neighbours or on how many tokens a step verified)."""
    alone = gumbel(torch.tensor([99]), torch.tensor([[42]]), 1000)[0, 0]
    batch = gumbel(torch.tensor([5, 99]), torch.tensor([[40, 41, 42], [40, 41, 42]]), 1000)
    assert torch.equal(batch[1, 2], alone)


def _batch(sampled: bool, truncated: bool) -> tuple[torch.Tensor, Sampling, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits, starts = torch.randn(3, 4, 50), torch.tensor([5, 0, 9])
    temperature = torch.tensor([0.0, 0.8, 1.3]) if sampled else torch.zeros(3)
    top_k = torch.tensor([0, 5, 0]) if truncated else torch.zeros(3, dtype=torch.long)
    top_p = torch.tensor([1.0, 1.0, 0.7]) if truncated else torch.ones(3)
    sampling = Sampling(temperature, top_k, top_p, [1, 2, 3], sampled=sampled, truncated=truncated)
    return logits, sampling, starts, starts[:, None] + 1 + torch.arange(4)


@pytest.mark.parametrize("sampled, truncated", [(False, False), (True, False), (True, True)],
                         ids=["greedy", "sampled", "top-k/top-p"])
def test_samplers_read_nothing_back_when_the_batch_says_what_it_knows(sampled, truncated):
    """With Sampling.sampled / truncated given (the host knows them), no sampler reads a tensor on the host: on a GPU
    each such read would wait for the device."""
    logits, sampling, starts, positions = _batch(sampled, truncated)
    with HostReads() as reads:
        tokens = sample_tokens(logits, sampling, positions)
        truncate_logits(logits, sampling)
        acceptance_inputs(logits, sampling, positions)
        AcceptPlanInputs.make(logits, sampling, positions)
        verify_block(tokens[:, :3], logits, sampling, starts)
    assert reads.count == 0, reads.where
    unknown = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seeds)  # flags from tensors
    assert torch.equal(sample_tokens(logits, unknown, positions), tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
def test_cuda_noise_equals_the_cpus():
    seeds, positions = torch.tensor([3, 1 << 62]), torch.arange(16).expand(2, 16)
    cpu = gumbel(seeds, positions, 151_936)
    cuda = gumbel(seeds.cuda(), positions.cuda(), 151_936).cpu()
    assert torch.equal(uniform(seeds.cuda(), positions.cuda(), 151_936).cpu(), uniform(seeds, positions, 151_936))
    differ = (cpu != cuda).sum().item()
    assert differ <= cpu.numel() * 2**-20, differ  # ~8.5e-8 of the elements at most (noise.py): expected 0 here
    assert (cpu - cuda).abs().max().item() <= 2 * torch.finfo(torch.float32).eps * max(1.0, cpu.abs().max().item())
