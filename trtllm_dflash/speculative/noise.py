"""Sampling noise as a function of (request seed, absolute position, vocabulary index), computed on any device.

Sampling draws t = argmax(logits / T + g) with standard Gumbel noise g (speculative/core.py). g must be a function of
(seed, position, index) alone, so that a token does not depend on how many tokens a step verified or on the batch,
and it should be computed where the logits are: drawing it on the CPU costs a GPU a copy and a synchronization per
step. So the noise comes from a counter-based generator: two 32-bit murmur3 finalisers (fmix32) of (seed, position,
index), keyed apart, give 26 bits each; k = (a << 26) | b is a 52-bit integer, u = (k + 0.5) / 2^52 lies in the open
interval [2^-53, 1 - 2^-53] (exact in float64: k + 0.5 needs 53 bits), and g = -log(-log(u)).

Integers. Only int64 xors, shifts, masks and products h * c' with h < 2^32 and |c'| <= 2^31 (c' = c - 2^32 for a
constant c >= 2^31, which is the same multiplier mod 2^32), so |h * c'| < 2^63: no operation overflows, nothing relies
on wraparound, and every device that computes int64 exactly gives the same bits. `hash_reference` is the same function
on Python ints; tests/test_noise.py holds them equal.

Logarithms (the only inexact step; float64). Each device's log is within 1 ulp: torch's CPU kernel is MKL's vdLn in
its high-accuracy mode (torch's x86 builds with MKL; Intel documents HA functions to 1 ulp), else SLEEF's u10 kernels
(1.0 ulp) or glibc's log (< 1 ulp; its libm-test-ulps lists 0-1 for x86_64); CUDA's double `log` has a documented
maximum error of 1 ulp (CUDA Math API; `logf` too, not used here). Carried through g = -log(L), L = -log(u): each
device's float64 g is within 2^-52 (1 + |g|) of the exact value (1 ulp of g, and L's relative 2^-52 becomes an
absolute 2^-52 through the outer log). Two devices' float64 values thus differ by at most 2^-51 (1 + |g|), and their
float32 roundings can differ only when a float32 rounding boundary lies in that window: over the Gumbel density that
is at most ~8.5e-8 of the elements (2^-23.5; about one element in 77 rows at V = 151,936), each then 1 float32 ulp
apart, which changes a token only if that element is the winner of a near-tie within 1 ulp. tests/test_noise.py checks
the CPU's logs and g against mpmath at these bounds; CPU and CUDA have not been compared on a GPU here (no GPU).

Cost: ~20 elementwise passes over int64 [2, B, T, V] and two float64 logs. On the CPU, tensors of a whole verify
block (16 x 151,936) leave the cache and each pass then runs at memory speed, about 3x slower than over cache-sized
pieces, so the vocabulary is done in pieces of CPU_PIECE_ELEMENTS (a loop over vocabulary pieces, no host reads;
benchmarks/noise_cost.py). Other devices take pieces of DEVICE_PIECE_ELEMENTS (512 MiB of int64), which bounds the
temporary memory of a large batch (32 x 16 x 151,936 would need 1.2 GiB at once) at a few launches more.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants: murmur3's finaliser (fmix32) and the golden ratio's (Weyl sequence steps).
_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
_STREAM_A, _STREAM_B = 0x243F6A88, 0xB7E15162  # the two hashes' keys (digits of pi and e)
CPU_PIECE_ELEMENTS = 1 << 17  # int64 elements of [2, B, T, piece] per vocabulary piece on the CPU: 1 MiB, L2-sized
DEVICE_PIECE_ELEMENTS = 1 << 26  # the same elsewhere (512 MiB): a bound on temporary memory, not a cache size


def _signed(c: int) -> int:
    """The multiplier congruent to c mod 2^32 in [-2^31, 2^31): h * _signed(c) fits int64 for any h < 2^32."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 of every element of h (int64 in [0, 2^32)), in place."""
    h ^= h >> 16
    h *= _signed(_M1)
    h &= _MASK32  # two's complement: the product mod 2^32, also for a negative product
    h ^= h >> 13
    h *= _signed(_M2)
    h &= _MASK32
    h ^= h >> 16
    return h


def _key(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """[B, T] 32-bit keys of (seed, position) for one stream; seeds [B] (63-bit, >= 0), positions [B, T] (>= 0)."""
    lo, hi = (seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None]  # 32 bits each, whatever the sign
    h = _fmix32_(lo ^ stream)
    h = _fmix32_(h ^ hi)
    return _fmix32_(h ^ (positions & _MASK32))


def _index_hash(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """[stop - start] the vocabulary indices' Weyl steps (index + 1) * golden mod 2^32."""
    index = torch.arange(start + 1, stop + 1, device=device, dtype=torch.int64)
    return (index * _signed(_GOLDEN)) & _MASK32


def _bits(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V] 32-bit hashes of each key [...] with each vocabulary index."""
    return _fmix32_(key[..., None] ^ _index_hash(0, vocab_size, key.device))


def _uniform_piece(keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """[B, T, stop - start] float64 uniforms of vocabulary indices start .. stop - 1; keys [2, B, T] (the streams)."""
    h = _fmix32_(keys[..., None] ^ _index_hash(start, stop, keys.device))  # [2, B, T, piece]
    k = h[0] >> 6
    k <<= 26
    k |= h[1] >> 6  # 52 bits
    return k.double().add_(0.5).mul_(2.0**-52)  # exact: (k + 0.5) / 2^52


def _pieces(keys: torch.Tensor, vocab_size: int) -> list[tuple[int, int]]:
    """[(start, stop)] vocabulary pieces for keys [2, B, T] (host arithmetic on shapes only)."""
    elements = CPU_PIECE_ELEMENTS if keys.device.type == "cpu" else DEVICE_PIECE_ELEMENTS
    width = max(1024, elements // max(1, keys.numel()))
    return [(s, min(s + width, vocab_size)) for s in range(0, vocab_size, width)]


def _streams(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    assert seeds.ndim == 1 and positions.ndim == 2 and positions.shape[0] == seeds.shape[0], (seeds.shape,
                                                                                              positions.shape)
    assert seeds.dtype == positions.dtype == torch.int64, (seeds.dtype, positions.dtype)
    assert seeds.device == positions.device, (seeds.device, positions.device)
    return torch.stack([_key(seeds, positions, _STREAM_A), _key(seeds, positions, _STREAM_B)])  # [2, B, T]


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, T, V] float64 uniforms in the open interval (0, 1), 52 bits each, for seeds [B] and positions [B, T]."""
    keys = _streams(seeds, positions)
    return torch.cat([_uniform_piece(keys, s, e) for s, e in _pieces(keys, vocab_size)], dim=-1)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, T, V] float32 for seeds [B] int64 and positions [B, T] int64, on their device."""
    keys = _streams(seeds, positions)
    out = torch.empty(positions.shape + (vocab_size,), dtype=torch.float32, device=seeds.device)
    for s, e in _pieces(keys, vocab_size):
        out[..., s:e] = _uniform_piece(keys, s, e).log_().neg_().log_().neg_()
    return out


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
        h = mix(h ^ ((seed >> 32) & _MASK32))
        h = mix(h ^ (position & _MASK32))
        return mix(h ^ (((index + 1) * _GOLDEN) & _MASK32))

    return one(_STREAM_A), one(_STREAM_B)


def uniform_reference(seed: int, position: int, index: int) -> float:
    """`uniform` for one (seed, position, index), on Python ints and floats."""
    a, b = hash_reference(seed, position, index)
    return (((a >> 6) << 26 | (b >> 6)) + 0.5) / 2**52
