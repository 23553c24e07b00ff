"""Software prefetch for numba kernels: ask for memory several iterations before it is used.

Random rows of a slab far larger than the caches are the cost of every pooled
lookup and training step: one DRAM miss per row, which a loop doing real work
per row does not overlap by itself. The kernels ask for a row's first cache
line several iterations ahead (as fbgemm's JIT kernels do; the core's
adjacent-line prefetcher brings the rest), which took the row update of a
training step from 12 ms to 5 ms per table-batch here. numba has no prefetch
of its own, so these are LLVM's ``llvm.prefetch`` intrinsic.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba import njit
from numba.extending import intrinsic

# The intrinsic's name carries its pointer type: opaque "p0" from LLVM 15 on, "p0i8" before.
_INTRINSIC = "llvm.prefetch.p0" if llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"

PREFETCH_DISTANCE = 8  # rows ahead: 2-8 measured alike, 16 slower (bags of 20 rows, 2 threads)


def _prefetch_codegen(rw: int):  # type: ignore[no-untyped-def]
    """Code for ``llvm.prefetch`` of ``&arr[idx...]``: rw=1 the line will be written, 0 only read;
    locality 3: keep it in every cache level."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
        ptr = cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                        cgutils.unpack_tuple(builder, ary.strides), aryty.layout, idx)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            _INTRINSIC)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, rw), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return codegen


_codegen = _prefetch_codegen(rw=1)
_read_codegen = _prefetch_codegen(rw=0)


@intrinsic
def prefetch_cell(typingctx, arr, row, col):  # type: ignore[no-untyped-def]
    """Prefetch ``arr[row, col]`` of a 2-D array."""
    return types.void(arr, row, col), _codegen


@intrinsic
def prefetch_at(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """Prefetch ``arr[i]`` of a 1-D array (no bounds check: any index is harmless, it is only a hint)."""
    return types.void(arr, i), _codegen


@intrinsic
def prefetch_read(typingctx, arr, row, col):  # type: ignore[no-untyped-def]
    """Prefetch ``arr[row, col]`` of a 2-D array for reading (pooling only reads its rows)."""
    return types.void(arr, row, col), _read_codegen


@njit(cache=True, inline="always")
def prefetch_row_lines(arr, row):  # type: ignore[no-untyped-def]
    """Prefetch, for writing, every cache line ``arr[row]`` of a 2-D float32 array touches: a cell every
    16 values (64 bytes) and the last one, which covers the final line at any starting offset. A kernel
    that rewrites whole random rows far beyond the last-level cache needs them all in flight: the
    adjacent-line prefetcher alone left most of them to demand misses on session 19's machine."""
    width = arr.shape[1]
    for c in range(0, width, 16):
        prefetch_cell(arr, row, c)
    if width > 1 and (width - 1) % 16 != 0:
        prefetch_cell(arr, row, width - 1)
