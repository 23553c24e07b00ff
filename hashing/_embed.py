"""Low-dimensional id vectors from a trace: ids that co-occur get close vectors.

"Learning to Collide" wants a small embedding per id that puts ids of similar
behaviour together. Without a trained model we learn one from the trace alone
by factorising the id-by-context co-occurrence matrix (a context is a batch,
or a window of consecutive accesses), which is quick and has no
hyper-parameters worth tuning:

* ``A[i, c]`` = times id ``i`` is accessed in context ``c``;
* ``M = D_id^-1/2 A D_ctx^-1/2`` (degree normalised, as in spectral
  clustering, so hot ids and big batches do not dominate);
* the top ``dim + 1`` left singular vectors ``U`` of ``M`` come from a
  randomised subspace iteration (Halko et al. 2011), orthonormalised by
  CholeskyQR2: only sparse products
  ``M @ X`` and ``M.T @ X``, done by numba loops over the accesses, O(accesses
  * (dim + oversample)) per iteration;
* the first singular vector is the trivial degree vector and is dropped; the
  vectors are ``D_id^-1/2 U[:, 1:] * sigma[1:]**2``, a one-step diffusion map:
  Euclidean distance between two ids approximates how differently they spread
  over contexts, so ids that share contexts, or share co-occurring ids, are
  near each other.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numba import njit


@njit(cache=True)
def _m_times(inv, ctx, w, x_ctx, out_ids):  # pragma: no cover - numba
    """out_ids = M @ x_ctx, M given as (inv, ctx, w) triplets (duplicates add up)."""
    out_ids[:] = 0.0
    k = x_ctx.shape[1]
    for t in range(inv.shape[0]):
        i = inv[t]
        c = ctx[t]
        wt = w[t]
        for j in range(k):
            out_ids[i, j] += wt * x_ctx[c, j]


@njit(cache=True)
def _mt_times(inv, ctx, w, x_ids, out_ctx):  # pragma: no cover - numba
    """out_ctx = M.T @ x_ids."""
    out_ctx[:] = 0.0
    k = x_ids.shape[1]
    for t in range(inv.shape[0]):
        i = inv[t]
        c = ctx[t]
        wt = w[t]
        for j in range(k):
            out_ctx[c, j] += wt * x_ids[i, j]


def contexts(n: int, batch_offsets: np.ndarray | None, context_size: int | None) -> np.ndarray:
    """Context index of each of ``n`` accesses: its batch, cut into pieces of at
    most ``context_size`` accesses; without batches, consecutive chunks of
    ``context_size`` (1024 when None)."""
    if batch_offsets is None:
        size = context_size or 1024
        return np.arange(n, dtype=np.int64) // size
    lengths = np.diff(batch_offsets)
    batch_of = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
    if not context_size:
        return batch_of
    pos = np.arange(n, dtype=np.int64) - batch_offsets[:-1][batch_of]
    pieces = -(-lengths // context_size)  # ceil, 0 for empty batches
    base = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.int64)
    return base[batch_of] + pos // context_size


def orthonormal(y: np.ndarray) -> np.ndarray:
    """Orthonormal basis of y's columns. CholeskyQR2 (two Cholesky passes on the
    small Gram matrix, then GEMMs) is ~10x faster than LAPACK's Householder QR on
    tall-skinny matrices; Householder QR takes over if the Gram matrix is singular."""
    q = y
    try:
        for _ in range(2):
            chol = np.linalg.cholesky(q.T @ q)
            q = q @ np.linalg.inv(chol.T)
        if np.isfinite(q).all() and np.allclose(q.T @ q, np.eye(q.shape[1]), atol=1e-6):
            return q
    except np.linalg.LinAlgError:
        pass
    return np.linalg.qr(y)[0]


def cooccurrence_vectors(inverse: np.ndarray, n_ids: int, ctx: np.ndarray, dim: int, seed: int,
                         iterations: int = 10, oversample: int = 8,
                         log: Callable[[str], None] | None = None) -> np.ndarray:
    """(n_ids, dim) float64 vectors for ids ``0..n_ids-1`` accessed as ``inverse`` in contexts ``ctx``."""
    inverse = np.ascontiguousarray(inverse, np.int64)
    _, ctx = np.unique(ctx, return_inverse=True)  # drop empty contexts
    ctx = np.ascontiguousarray(ctx.reshape(-1), np.int64)
    n_ctx = int(ctx.max()) + 1 if ctx.size else 0
    d_id = np.bincount(inverse, minlength=n_ids).astype(np.float64)
    d_ctx = np.bincount(ctx, minlength=n_ctx).astype(np.float64)
    w = 1.0 / np.sqrt(d_id[inverse] * d_ctx[ctx])
    k = min(dim + 1 + oversample, n_ids, max(n_ctx, 1))
    rng = np.random.default_rng(seed)
    q = orthonormal(rng.standard_normal((n_ids, k)))
    y_ctx = np.empty((n_ctx, k))
    y_ids = np.empty((n_ids, k))
    for it in range(iterations):
        _mt_times(inverse, ctx, w, np.ascontiguousarray(q), y_ctx)
        _m_times(inverse, ctx, w, y_ctx, y_ids)
        q = orthonormal(y_ids)
        if log is not None and (it + 1) % 5 == 0:
            log(f"co-occurrence factorisation: iteration {it + 1}/{iterations}")
    _mt_times(inverse, ctx, w, np.ascontiguousarray(q), y_ctx)  # B.T = M.T @ Q
    _, sigma, vt = np.linalg.svd(y_ctx, full_matrices=False)  # B.T = W S Vt -> U = Q Vt.T
    u = q @ vt.T
    out = np.zeros((n_ids, dim))
    take = min(dim, k - 1)
    if take > 0:
        out[:, :take] = u[:, 1:1 + take] / np.sqrt(np.maximum(d_id, 1.0))[:, None] * sigma[1:1 + take] ** 2
    return out
