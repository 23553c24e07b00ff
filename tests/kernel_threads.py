"""Force the numba kernels onto their parallel or their single-thread path.

Test inputs are far below ``PARALLEL_MIN_ITEMS``, so without this every test
would only ever run the kernels on one thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from embstore import kernels


@contextlib.contextmanager
def kernel_path(parallel: bool) -> Iterator[None]:
    old = kernels.PARALLEL_MIN_ITEMS
    kernels.PARALLEL_MIN_ITEMS = 1 if parallel else 1 << 62
    try:
        yield
    finally:
        kernels.PARALLEL_MIN_ITEMS = old
