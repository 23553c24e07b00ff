"""Frequency-balanced bisecting k-means: n weighted points -> exactly k rows.

Plain k-means with k in the hundreds of thousands costs O(n k) per round and
lets one cluster swallow a heavy tail. Bisecting instead costs O(n log n) per
level and log2(k) levels, and balancing each cut by weight bounds every row's
access mass. A node holding ``r`` rows is split in two:

1. direction: the top principal axis of its points (weights + 1, so ids seen
   rarely still count), then ``refine`` rounds of 2-means along the line
   through the two halves' centroids;
2. cut: sort the points by their projection and cut where the left part's
   access mass is nearest ``mass * (r // 2) / r`` (each side keeps at least as
   many points as rows, so no row is left empty);
3. recurse into ``(left, r // 2)`` and ``(right, r - r // 2)``.

Each cut misses its target by at most one point's weight, so a row's mass is
at most ``mass / k + ceil(log2 k) * max_weight`` (tests check this bound).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _direction(x, wd, seg):  # pragma: no cover - numba
    d = x.shape[1]
    tot = 0.0
    mu = np.zeros(d)
    for s in seg:
        tot += wd[s]
        for j in range(d):
            mu[j] += wd[s] * x[s, j]
    mu /= tot
    cov = np.zeros((d, d))
    for s in seg:
        for a in range(d):
            da = x[s, a] - mu[a]
            for b in range(a, d):
                cov[a, b] += wd[s] * da * (x[s, b] - mu[b])
    for a in range(d):
        for b in range(a):
            cov[a, b] = cov[b, a]
    _, vecs = np.linalg.eigh(cov)
    return vecs[:, d - 1].copy()


@njit(cache=True)
def _cut(wseg, r_left, r):  # pragma: no cover - numba
    """Index j so the first j points' mass is nearest the left target, with
    r_left <= j <= m - (r - r_left)."""
    m = wseg.shape[0]
    lo = r_left
    hi = m - (r - r_left)
    total = wseg.sum()
    if total <= 0.0:
        j = (m * r_left) // r
        return min(max(j, lo), hi)
    target = total * r_left / r
    acc = 0.0
    best = lo
    best_err = np.inf
    for j in range(m + 1):
        if j >= lo:
            err = abs(acc - target)
            if err < best_err:
                best_err = err
                best = j
            elif acc > target:
                break
        if j == hi or j == m:
            break
        acc += wseg[j]
    return best


@njit(cache=True)
def balanced_bisect(x, w, k, refine):  # pragma: no cover - numba
    """Labels in [0, k) for the rows of x (n >= k), balanced by weights w."""
    n = x.shape[0]
    d = x.shape[1]
    labels = np.empty(n, np.int64)
    order = np.arange(n)
    wd = w + 1.0
    st_lo = [0]
    st_hi = [n]
    st_row = [0]
    st_r = [k]
    while len(st_lo) > 0:
        lo = st_lo.pop()
        hi = st_hi.pop()
        row0 = st_row.pop()
        r = st_r.pop()
        m = hi - lo
        if r == 1:
            for t in range(lo, hi):
                labels[order[t]] = row0
            continue
        if m <= r:
            for t in range(m):
                labels[order[lo + t]] = row0 + t
            continue
        r_left = r // 2
        seg = order[lo:hi].copy()
        v = _direction(x, wd, seg)
        cut = 0
        for it in range(refine + 1):
            proj = np.empty(m)
            for t in range(m):
                s = seg[t]
                acc = 0.0
                for j in range(d):
                    acc += x[s, j] * v[j]
                proj[t] = acc
            perm = np.argsort(proj, kind="mergesort")
            seg = seg[perm]
            cut = _cut(w[seg], r_left, r)
            if it == refine:
                break
            c0 = np.zeros(d)
            c1 = np.zeros(d)
            t0 = 0.0
            t1 = 0.0
            for t in range(m):
                s = seg[t]
                if t < cut:
                    t0 += wd[s]
                    for j in range(d):
                        c0[j] += wd[s] * x[s, j]
                else:
                    t1 += wd[s]
                    for j in range(d):
                        c1[j] += wd[s] * x[s, j]
            nv = c1 / t1 - c0 / t0
            norm = np.sqrt((nv * nv).sum())
            if not norm > 0.0:
                break
            v = nv / norm
        order[lo:hi] = seg
        st_lo.append(lo)
        st_hi.append(lo + cut)
        st_row.append(row0)
        st_r.append(r_left)
        st_lo.append(lo + cut)
        st_hi.append(hi)
        st_row.append(row0 + r_left)
        st_r.append(r - r_left)
    return labels
