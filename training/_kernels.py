"""CPU kernels of the fused backward: bag gradients -> unique-row gradients -> optimizer, in place.

They work on numpy views of the working set's CPU tensors, so a step touches
each unique row once (no autograd over a dense weight, no gather/scatter copies).
"""

from __future__ import annotations

import numba
import numpy as np

from embstore.prefetch import PREFETCH_DISTANCE, prefetch_row_lines

# Let LLVM reorder float sums: the row-wise mean of squared gradients is then a
# vectorised reduction instead of a 64-add dependency chain per row (6.7x on
# the fused step here); results stay within float tolerance of torch's.
_FAST = {"reassoc", "contract"}  # no "nnan"/"ninf"/"nsz": ``_apply_row``'s x * 0 check must not fold to 0

# A finite float32 x minus any y with |y| < 2**103 (half an ulp of the top binade) cannot round to inf, even
# fused into one FMA; 1e30 leaves a wide margin for the rounding of the bound itself.
_SAFE_STEP = np.float32(1e30)


def step_rows(kind, rows, state, slots, g, lr, eps, b1, b2, wd, global_step, parts) -> int:
    """``_step_rows``; returns how many rows it left as they were because their step overflowed."""
    skipped = np.zeros(parts, np.int64)
    _step_rows(kind, rows, state, slots, g, lr, eps, b1, b2, wd, global_step, parts, skipped)
    return int(skipped.sum())


def fused_bag_step(kind, rows, state, slots, inv, offsets, grad_out, mean, lr, eps, b1, b2, wd, global_step,
                   parts) -> int:
    """``_fused_bag_step``; returns how many rows it left as they were because their step overflowed."""
    skipped = np.zeros(parts, np.int64)
    _fused_bag_step(kind, rows, state, slots, inv, offsets, grad_out, mean, lr, eps, b1, b2, wd, global_step,
                    parts, skipped)
    return int(skipped.sum())


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _step_rows(kind, rows, state, slots, g, lr, eps, b1, b2, wd, global_step, parts, skipped):
    """Apply optimizer ``kind`` (0 sgd, 1 rowwise_adagrad, 2 adagrad, 3 adam) to rows[slots] in place.

    ``rows`` may be wider than the gradient (a contiguous slab with the state
    after the embedding); only its first ``g.shape[1]`` columns are updated.
    ``parts``: how many slices run in parallel (the thread count
    ``embstore.kernels.kernel_threads`` set for the call; passed in because
    asking numba inside a kernel defeats its cache).
    ``skipped[p]`` (zeros, one per part) counts the rows part ``p`` left as they were because their step
    overflowed (see ``_apply_row``); an output argument, not a return value: returning the count from
    the kernel made it about 2x slower here (numba's parallel loop).
    """
    dim = g.shape[1]
    scratch = np.zeros((parts, dim), np.float32)
    new = np.empty((parts, 2 * dim), np.float32)
    chunk = (slots.shape[0] + parts - 1) // parts
    for p in numba.prange(parts):  # static partition: one scratch row per part
        gi = scratch[p]
        end = min(slots.shape[0], (p + 1) * chunk)
        for i in range(p * chunk, end):
            if i + PREFETCH_DISTANCE < end:
                _prefetch_slot(rows, state, slots[i + PREFETCH_DISTANCE], dim)
            for d in range(dim):
                gi[d] = g[i, d]
            if not _apply_row(kind, rows, state, slots[i], gi, lr, eps, b1, b2, np.float32(wd), global_step, new[p]):
                skipped[p] += 1


@numba.njit(cache=True, nogil=True)
def _occurrences(inv, n_uniq, offsets):
    """CSR of each unique row's ids (ascending) and the bag of every id."""
    n = inv.shape[0]
    start = np.zeros(n_uniq + 1, np.int64)
    for j in range(n):
        start[inv[j] + 1] += 1
    for u in range(n_uniq):
        start[u + 1] += start[u]
    fill = start[:-1].copy()
    order = np.empty(n, np.int64)
    for j in range(n):
        u = inv[j]
        order[fill[u]] = j
        fill[u] += 1
    bag = np.empty(n, np.int64)
    for b in range(offsets.shape[0] - 1):
        for j in range(offsets[b], offsets[b + 1]):
            bag[j] = b
    return start, order, bag


@numba.njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _fused_bag_step(kind, rows, state, slots, inv, offsets, grad_out, mean, lr, eps, b1, b2, wd, global_step,
                   parts, skipped):
    """Bag gradients -> each unique row's gradient -> optimizer, row by row in parallel, in place.

    Each unique row sums its ids' bag gradients (in id order, scaled by
    1/bag length for mean) into a scratch row, then ``_apply_row`` updates it:
    the (unique rows, dim) gradient array is never materialised.
    ``skipped[p]`` (zeros, one per part) counts the rows part ``p`` left as they were because their step
    overflowed (see ``_apply_row``); an output argument, not a return value: returning the count from
    the kernel made it about 2x slower here (numba's parallel loop).
    """
    dim = grad_out.shape[1]
    n_uniq = slots.shape[0]
    start, order, bag = _occurrences(inv, n_uniq, offsets)
    w = np.float32(wd)
    chunk = (n_uniq + parts - 1) // parts
    for p in numba.prange(parts):  # static partition, no thread ids needed
        gi = np.empty(dim, np.float32)  # this part's gradient scratch row
        new = np.empty(2 * dim, np.float32)  # and its new adagrad / adam state, checked before stored
        end = min(n_uniq, (p + 1) * chunk)
        for u in range(p * chunk, end):
            if u + PREFETCH_DISTANCE < end:
                _prefetch_slot(rows, state, slots[u + PREFETCH_DISTANCE], dim)
            if not _fused_row(kind, rows, state, slots[u], start[u], start[u + 1], order, bag, offsets, grad_out,
                              mean, lr, eps, b1, b2, w, global_step, gi, new):
                skipped[p] += 1


@numba.njit(cache=True, inline="always")
def _prefetch_slot(rows, state, s, dim):
    """Prefetch, for writing, every cache line of a slot's row and of its optimizer state (when that
    is not inside the row, as in a wider slab). The step reads and writes the whole row, and a row
    with its state (260 bytes at dim 64) spans five lines at any offset. Prefetching only the first
    line and leaving the rest to the core's adjacent-line prefetcher measured faster in session 6's
    sweep over one 1M-row slab (260 MB: inside session 19's machine's 300 MB last-level cache); in
    whole training steps over 8 such slabs, every line took a step from ~98 to ~70-84 ms there
    (BENCHMARKS.md, session 19)."""
    prefetch_row_lines(rows, s)
    if rows.shape[1] == dim and state.shape[1]:
        prefetch_row_lines(state, s)


@numba.njit(cache=True, inline="always")
def _fused_row(kind, rows, state, s, lo, hi, order, bag, offsets, grad_out, mean, lr, eps, b1, b2, w, global_step,
               gi, new):
    dim = grad_out.shape[1]
    if mean:
        for d in range(dim):
            gi[d] = 0.0
        for k in range(lo, hi):
            b = bag[order[k]]
            scale = np.float32(1.0) / np.float32(offsets[b + 1] - offsets[b])
            for d in range(dim):
                gi[d] += grad_out[b, d] * scale
    else:  # most rows occur once: copy the first bag gradient, add the rest
        b = bag[order[lo]]
        for d in range(dim):
            gi[d] = grad_out[b, d]
        for k in range(lo + 1, hi):
            b = bag[order[k]]
            for d in range(dim):
                gi[d] += grad_out[b, d]
    return _apply_row(kind, rows, state, s, gi, lr, eps, b1, b2, w, global_step, new)


@numba.njit(cache=True, inline="always")
def _apply_row(kind, rows, state, s, gi, lr, eps, b1, b2, w, global_step, new):
    """One row's update from its gradient ``gi`` (a scratch row, overwritten with weight decay added).

    A row whose step would overflow float32 (a huge lr, a gradient whose
    square is inf, 0/0 with eps = 0) keeps its row and state, and the call
    returns False. sgd and rowwise Adagrad first bound the step with scalars:
    when ``|lr * g_d|`` (at most ``lr * sqrt(sum g^2)``) is below
    :data:`_SAFE_STEP` and the state is finite, no finite row can overflow,
    and the row is updated in one pass as before. Otherwise, and always for
    adagrad and adam (per-element state), a first loop computes the new
    values without storing them and sums ``x * 0`` over them (0 when all are
    finite, NaN otherwise); only then does a second loop, over the row now in
    L1, store them. ``new``: scratch for adagrad's sums and adam's m and v.
    """
    dim = gi.shape[0]
    zero = np.float32(0.0)
    if w != 0.0:
        for d in range(dim):
            gi[d] += w * rows[s, d]
    bad = zero  # x * 0 summed: NaN as soon as one new value is inf or NaN
    if kind == 0:
        acc = zero
        for d in range(dim):
            acc += gi[d] * gi[d]
        if np.float32(lr) * np.sqrt(acc) < _SAFE_STEP:  # False for inf and NaN too
            for d in range(dim):
                rows[s, d] -= np.float32(lr) * gi[d]
            return True
        for d in range(dim):
            bad += (rows[s, d] - np.float32(lr) * gi[d]) * zero
        if bad == zero:
            for d in range(dim):
                rows[s, d] -= np.float32(lr) * gi[d]
    elif kind == 1:
        acc = np.float32(0.0)
        for d in range(dim):
            acc += gi[d] * gi[d]
        total = state[s, 0] + acc / np.float32(dim)
        mult = np.float32(lr) / (np.sqrt(total) + np.float32(eps))
        if total * zero == zero and mult * np.sqrt(acc) < _SAFE_STEP:
            state[s, 0] = total
            for d in range(dim):
                rows[s, d] -= mult * gi[d]
            return True
        bad += total * zero
        for d in range(dim):
            bad += (rows[s, d] - mult * gi[d]) * zero
        if bad == zero:
            state[s, 0] = total
            for d in range(dim):
                rows[s, d] -= mult * gi[d]
    elif kind == 2:
        for d in range(dim):
            total = state[s, d] + gi[d] * gi[d]
            new[d] = total
            bad += (total + (rows[s, d] - np.float32(lr) * gi[d] / (np.sqrt(total) + np.float32(eps)))) * zero
        if bad == zero:
            for d in range(dim):
                state[s, d] = new[d]
                rows[s, d] -= np.float32(lr) * gi[d] / (np.sqrt(new[d]) + np.float32(eps))
    else:
        count = state[s, 2 * dim] + np.float32(1.0)
        t = np.float64(count) if global_step <= 0 else np.float64(global_step)
        step = np.float32(lr * np.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t))
        for d in range(dim):
            m = state[s, d] * np.float32(b1) + np.float32(1.0 - b1) * gi[d]
            v = state[s, dim + d] * np.float32(b2) + np.float32(1.0 - b2) * gi[d] * gi[d]
            new[d] = m
            new[dim + d] = v
            bad += (m + v + (rows[s, d] - step * new[d] / (np.sqrt(v) + np.float32(eps)))) * zero
        if bad == zero:
            state[s, 2 * dim] = count
            for d in range(dim):
                state[s, d] = new[d]
                state[s, dim + d] = new[dim + d]
                rows[s, d] -= step * new[d] / (np.sqrt(new[dim + d]) + np.float32(eps))
    return bad == zero
