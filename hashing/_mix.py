"""The 64-bit mix every hash in this package is built on, as numba kernels plus
a pure-Python reference that tests compare against.

``mix64(id, key)`` reinterprets the int64 id as uint64 (two's complement, so
``-1 -> 2**64 - 1``), XORs in a 64-bit key and runs splitmix64's finaliser
(Stafford's "mix13" variant)::

    z = uint64(id) ^ key
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9      (mod 2**64)
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB      (mod 2**64)
    z =  z ^ (z >> 31)

Each step is a bijection of uint64, so distinct ids never collide before the
final range reduction, and every output bit depends on every input bit. The
key comes from the user's seed through ``seed_key`` (one splitmix64 step), so
seeds 0, 1, 2, ... give unrelated functions. Only integer arithmetic is used:
ids near +-2**63 map exactly.

Numba pitfall kept in mind here: mixing uint64 and int64 operands promotes to
float64, so every constant and shift count below is an explicit ``np.uint64``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB

_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def fmix_py(z: int) -> int:
    """splitmix64's finaliser on a Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def seed_key(seed: int) -> int:
    """The 64-bit key a seed stands for: one splitmix64 step of the seed."""
    return fmix_py((seed + GOLDEN) & MASK64)


def mix64_py(x: int, key: int) -> int:
    """Reference of :func:`mix64` on Python ints (x any int64, key in [0, 2**64))."""
    return fmix_py((x & MASK64) ^ key)


@njit(cache=True, inline="always")
def mix64(x: np.int64, key: np.uint64) -> np.uint64:
    z = np.uint64(x) ^ key
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True)
def mix_mod_kernel(ids, key, buckets, out):  # pragma: no cover - numba
    """out[i] = mix64(ids[i], key) % buckets (unsigned), written as int64."""
    b = np.uint64(buckets)
    for i in range(ids.shape[0]):
        out[i] = np.int64(mix64(ids[i], key) % b)
