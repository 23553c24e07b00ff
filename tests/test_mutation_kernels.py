"""Numba kernels' behaviour no other test pinned (session 13 mutation audit of ``embstore/kernels.py``,
``training/_kernels.py`` and ``embstore/modmath.py``).

Each test names the mutants it kills (they survived every existing test) and the behaviour it pins:
``kernel_threads`` restoring the thread count it found, ``rows_finite`` as a plain finiteness test (not
only as a fast-path filter whose false negatives the slow path hides), and the scalar bounds with which
sgd and rowwise Adagrad skip their element-by-element overflow check. References are numpy / float64.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embstore import kernels
from embstore.modmath import affine_mod
from embstore.training._kernels import step_rows

FLT_MAX = float(np.finfo(np.float32).max)
SGD = 0


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads to change the count")
def test_kernel_threads_restores_the_thread_count_it_found() -> None:
    """Mutant: ``kernel_threads`` without its ``finally`` restore. The existing test reads the count it
    expects back from numba at its start, so a run after any leaking call (the mutant leaks in every
    earlier test) starts at 1 thread, takes the no-change path and passes; here the count is set first."""
    full = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(full)
    with kernels.kernel_threads(kernels.PARALLEL_MIN_ITEMS - 1) as n:
        assert n == 1 == numba.get_num_threads()
    assert numba.get_num_threads() == full


_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, 1.7e38, -1.7e38, 3e38, FLT_MAX, -FLT_MAX,
            np.inf, -np.inf, np.nan]


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 9)),
                  elements=st.one_of(st.sampled_from(_SPECIAL), st.floats(width=32))))
def test_rows_finite_is_numpys_isfinite(rows: np.ndarray) -> None:
    """Mutants: the exponent mask dropped (``max(m, bits[i])``: the sign bit makes every negative row
    "non-finite"), and the exponent bound one binade low (0x7F000000: values from 2**127 on refused).
    ``Table.update``'s fast path falls back to the slow one when ``rows_finite`` says no, so the store's
    results hid both; the function's own answer is pinned here, for every sign and binade."""
    assert kernels.rows_finite(np.ascontiguousarray(rows)) == bool(np.isfinite(rows).all())


def test_an_sgd_step_whose_square_sum_is_below_the_bound_but_whose_norm_is_not_is_checked() -> None:
    """Mutant: the sgd fast-path bound on ``lr * sum(g**2)`` instead of ``lr * sqrt(sum(g**2))``. With
    |g| < 1 the square is the smaller: lr = 4e32, g = -0.04 give lr * g^2 = 6.4e29 (below the 1e30 bound,
    one pass, no check) but a step of 1.6e31, which takes FLT_MAX past the half ulp (2**103 = 1.01e31) of
    the top binade to inf. The row must keep its value; a row with a harmless step is still updated."""
    rows = np.array([[FLT_MAX, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    g = np.array([[-0.04, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], np.float32)
    old = rows.copy()
    lr = 4e32
    assert np.float64(FLT_MAX) + lr * 0.04 > FLT_MAX + 2.0**103  # past the rounding to FLT_MAX: inf
    skipped = step_rows(SGD, rows, np.zeros((2, 0), np.float32), np.arange(2), g, lr, 0.0, 0.9, 0.999, 0.0, 0, 1)
    assert skipped == 1
    np.testing.assert_array_equal(rows[0], old[0])
    np.testing.assert_array_equal(rows[1], np.float32([1.0 - 4e32, 2.0, 3.0, 4.0]))


@pytest.mark.parametrize("parts", [2, 3])
def test_step_rows_counts_the_rows_skipped_in_every_part(parts: int) -> None:
    """Mutant: ``step_rows`` returning the first part's count only (``skipped[0]``). The overflow tests
    that run two threads skip rows through ``fused_bag_step``; ``step_rows`` (the path for QR tables)
    skipped rows only on one. Here the one row whose step overflows is the last, in the last part."""
    n = 6
    rows = np.ones((n, 4), np.float32)
    rows[-1, 0] = FLT_MAX
    g = np.full((n, 4), 1e-3, np.float32)
    g[-1, 0] = -1.0  # FLT_MAX + 1e38: inf
    old = rows.copy()
    skipped = step_rows(SGD, rows, np.zeros((n, 0), np.float32), np.arange(n), g, 1e38, 0.0, 0.9, 0.999, 0.0, 0,
                        parts)
    assert skipped == 1
    np.testing.assert_array_equal(rows[-1], old[-1])
    np.testing.assert_array_equal(rows[:-1], np.float32(1.0) - np.float32(1e38) * g[:-1])


@pytest.mark.parametrize("m", [0, 2**63, 2**64 + 1])
def test_affine_mod_refuses_a_modulus_outside_int64_with_a_value_error(m: int) -> None:
    """Mutant: ``affine_mod`` checking only ``m >= 1``. A modulus above 2**63 - 1 then reaches
    ``np.int64(m)`` and fails with numpy's OverflowError instead of the ValueError that names the modulus
    (m = 0 is refused by both)."""
    with pytest.raises(ValueError, match="modulus must be in"):
        affine_mod(3, np.arange(4, dtype=np.int64), 1, m)
    with pytest.raises(ValueError, match="modulus must be in"):
        affine_mod(0, np.arange(4, dtype=np.int64), 0, m)
