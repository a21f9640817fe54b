"""Sampling noise as a function of (request seed, absolute position, vocabulary index), computed on any device.

Sampling draws t = argmax(logits / T + g) with standard Gumbel noise g (speculative/core.py). g must be a function of
(seed, position, index) alone, so that a token does not depend on how many tokens a step verified or on the batch,
and it should be computed where the logits are: drawing it on the CPU costs a GPU a copy and a synchronization per
step. So the noise comes from a counter-based generator: two 32-bit integer hashes of (seed, position, index) give a
53-bit uniform u in (0, 1), and g = -log(-log(u)).

The hashes use only int64 additions, xors, shifts and products of a 16-bit by a 32-bit number (below 2^48), so no
operation overflows and CPU and CUDA compute the same bits (`hash_reference` is the same function on Python ints;
tests/test_noise.py holds them equal). The logarithms are the only inexact step: they run in float64, where torch's
CPU kernels (SLEEF's 1.0-ulp `log`) and CUDA's `log` (1 ulp, CUDA Math API) each stay within 1 ulp of the exact
value, so g differs between devices by at most ~2^-52 (1 + |g|) before it is rounded to float32; the float32 noise
is then the same unless the float64 value falls that close to a float32 rounding boundary (about 1 element in 2^27,
and a 1-ulp float32 difference can change a token only at a near-tie of ~1e-7 of a logit). tests/test_noise.py
checks the float64 noise against mpmath at 1 ulp of g plus the inner log's propagated ulp.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants: murmur3's finaliser (fmix32) and the golden ratio's (Weyl sequence steps).
_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
_STREAM_A, _STREAM_B = 0x243F6A88, 0xB7E15162  # the two hashes' keys (digits of pi and e)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """h * c mod 2^32 for h in [0, 2^32): h = a * 2^16 + b, so h * c = (a * c mod 2^16) * 2^16 + b * c (mod 2^32),
    with every product below 2^48."""
    a, b = h >> 16, h & 0xFFFF
    return ((((a * c) & 0xFFFF) << 16) + b * c) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def _key(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """[B, T] 32-bit keys of (seed, position) for one stream; seeds [B] (63-bit, >= 0), positions [B, T] (>= 0)."""
    lo, hi = (seeds & _MASK32)[:, None], (seeds >> 32)[:, None]
    h = _fmix32(lo ^ stream)
    h = _fmix32(h ^ hi)
    return _fmix32(h ^ (positions & _MASK32))


def _bits(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T, V] 32-bit hashes of each key with each vocabulary index."""
    index = torch.arange(vocab_size, device=key.device, dtype=torch.int64)
    return _fmix32(key[..., None] ^ _mul32(index + 1, _GOLDEN))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T, V] float64 uniforms in the open interval (0, 1), 53 bits each, for seeds [B] and positions [B, T]."""
    a = _bits(_key(seeds, positions, _STREAM_A), vocab_size) >> 5  # 27 bits
    b = _bits(_key(seeds, positions, _STREAM_B), vocab_size) >> 6  # 26 bits
    return ((a << 26) + b).double().add_(0.5).mul_(2.0**-53)  # exact: (k + 0.5) / 2^53, k < 2^53


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, T, V] float32 for seeds [B] int64 and positions [B, T] int64, on their device."""
    return gumbel64(seeds, positions, vocab_size).float()


def gumbel64(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`gumbel` before its rounding to float32."""
    return uniform(seeds, positions, vocab_size).log_().neg_().log_().neg_()


def hash_reference(seed: int, position: int, index: int) -> tuple[int, int]:
    """The two 32-bit hashes `uniform` combines, for one (seed, position, index), on Python ints."""

    def mix(h: int) -> int:
        h ^= h >> 16
        h = (h * _M1) & _MASK32
        h ^= h >> 13
        h = (h * _M2) & _MASK32
        return h ^ (h >> 16)

    def one(stream: int) -> int:
        h = mix((seed & _MASK32) ^ stream)
        h = mix(h ^ (seed >> 32))
        h = mix(h ^ (position & _MASK32))
        return mix(h ^ (((index + 1) * _GOLDEN) & _MASK32))

    return one(_STREAM_A), one(_STREAM_B)
