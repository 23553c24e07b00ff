"""The cache directory's kernels run without numba's reference counting (``_nrt=False``).

With it, every array an inlined helper takes was incref'd and decref'd again
through out-of-line atomic calls, ~20 per LFU hit: the simulator and the
store's directory ran 2-4.5x slower (BENCHMARKS.md, simulator, session 17).
Nothing times that here; this holds the flag on every kernel of those modules
so a new kernel, or an edit, cannot silently bring the refcounts back.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

from embstore import belady, lookahead, policies
from embstore.training import _index


def _kernels(module: types.ModuleType) -> list[tuple[str, CPUDispatcher]]:
    """The module's own jitted functions that are compiled on their own (not inlined into a caller)."""
    return [(name, obj) for name, obj in vars(module).items()
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__
            and obj.targetoptions.get("inline", "never") != "always"]


@pytest.mark.parametrize("module", [policies, lookahead, _index], ids=lambda m: m.__name__)
def test_every_kernel_runs_without_reference_counts(module: types.ModuleType) -> None:
    kernels = _kernels(module)
    assert kernels, "no kernels found: the scan is broken"
    counted = [name for name, k in kernels if k.targetoptions.get("_nrt") is not False]
    assert not counted, f"{module.__name__}: compiled with reference counting: {counted}"


def test_belady_min_kernel_runs_without_reference_counts() -> None:
    assert belady._min_kernel.targetoptions.get("_nrt") is False


def test_numba_refuses_an_allocation_without_reference_counts() -> None:
    """An allocation inside an ``_nrt=False`` kernel does not compile: the flag is only usable because
    the kernels take every array from outside. This proves numba enforces that (so a later edit that
    allocates fails at once rather than leaking or crashing)."""
    import numba
    from numba.core.errors import NumbaError

    @numba.njit(_nrt=False)
    def allocates(n):
        return np.zeros(n).sum()

    @numba.njit(_nrt=False)
    def copies_a_row(a):  # what lookahead's map did before session 17 (a row view assigned)
        a[0, :] = a[1, :]

    with pytest.raises(NumbaError):
        allocates(3)
    with pytest.raises(NumbaError, match="NRT required"):
        copies_a_row(np.zeros((2, 3)))
