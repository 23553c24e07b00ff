"""Bulk load and dump of a table's physical rows in chunks, with progress.

``import_rows`` checks the whole file (shape, dtype, finiteness) before it
writes a single row, so a bad file leaves the table unchanged. Rows land
through the hierarchy and the store is flushed at the end (``Table.flush_durable``:
its write-ahead log too, whose older writes a crash would otherwise replay over
the imported rows). Imported rows get fresh optimizer state (zeros, as a
never-trained row has); the table's other rows keep theirs. Chunks are bounded
in rows and in bytes, so the widest table (65,536 values a row) still moves in
chunks of about ``CHUNK_BYTES``.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from embstore.atomic import atomic_file
from embstore.errors import InvalidInputError, InvalidRowsError
from embstore.files import NPY_READ_ERRORS, check_regular_file
from embstore.table import Table

CHUNK_ROWS = 1 << 16  # rows per chunk at most (a narrow table's chunk)
CHUNK_BYTES = 64 << 20  # float32 bytes per chunk at most: 65,536 rows of the widest table would be 16 GiB
MAX_EXPORT_ROWS = 1 << 31

Progress = Callable[[int], None]


_NPY_MAGIC = b"\x93NUMPY"


def open_npy(path: str | os.PathLike) -> np.ndarray:
    """A read-only memory map of a .npy file: a header declaring more rows than the file holds is an
    error here, not an allocation of that size. Damaged files raise :class:`InvalidInputError`."""
    check_regular_file(path, ".npy file")  # a FIFO would block open() forever; a directory is said as such
    with open(path, "rb") as f:  # numpy takes any other bytes for a pickle and says so, misleadingly
        head = f.read(len(_NPY_MAGIC))
    if head != _NPY_MAGIC and not head.startswith(b"PK"):  # PK: a zip (.npz), refused below with its own words
        what = "an empty file" if not head else "no .npy header (numpy.save writes one)"
        raise InvalidInputError(f"{path}: not a readable .npy array ({what})")
    try:
        with np.errstate(over="ignore"):  # numpy.memmap multiplies a huge header shape in C longs: warns
            data = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise
    except (*NPY_READ_ERRORS, OverflowError) as exc:  # EOFError: an empty file; TokenError, SyntaxError: a
        # damaged header; OverflowError: a header dimension past a C long (2**64 rows)
        raise InvalidInputError(f"{path}: not a readable .npy array ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, np.ndarray):  # np.load opens any zip (.npz, torch.save) as an NpzFile
        data.close()
        raise InvalidInputError(f"{path}: not a readable .npy array (a zip archive such as .npz; "
                                "save one array with numpy.save)")
    return data


def npy_rows(path: str | os.PathLike) -> int | None:
    """Rows of a .npy file, from its header (the total of an import's progress); None when the file
    cannot be read as one: :func:`import_rows` then names the problem."""
    try:
        data = open_npy(path)
    except (InvalidInputError, OSError):
        return None
    return data.shape[0] if data.ndim else None


def import_rows(table: Table, path: str | os.PathLike, start: int = 0, progress: Progress | None = None) -> int:
    """Write rows ``start ..`` of ``table`` from a (n, physical dim) float .npy file; returns n."""
    data = open_npy(path)
    dim = table.format.dim
    if data.ndim != 2 or data.shape[1] != dim:
        raise InvalidRowsError(f"{path}: expected shape (n, {dim}) for table {table.name!r}, got {data.shape}")
    if data.dtype.kind != "f":
        raise InvalidRowsError(f"{path}: expected floating-point rows, got {data.dtype}")
    n = data.shape[0]
    if start < 0 or start + n > table.num_rows:
        raise InvalidInputError(f"{path}: rows {start}..{start + n - 1} do not fit table {table.name!r} "
                                f"of {table.num_rows} rows")
    step = chunk_rows(table)
    for lo in range(0, n, step):  # validate everything before the first write
        with np.errstate(over="ignore"):  # a float64 beyond float32's range turns inf, refused just below
            chunk = np.asarray(data[lo:lo + step], dtype=np.float32)
        if not np.isfinite(chunk).all():
            bad = lo + int(np.argwhere(~np.isfinite(chunk))[0][0])
            raise InvalidRowsError(f"{path}: row {bad} holds NaN or inf (or overflows float32); nothing imported")
        try:  # the row format's own limits (float16's range), which write_physical would hit mid-import
            table.format.check(chunk)
        except InvalidRowsError as exc:
            bad = lo + _first_refused_row(table, chunk)
            reason = str(exc).split("; row ")[0]  # its row number counts from the chunk, not the file
            raise InvalidRowsError(f"{path}: row {bad}: {reason}; nothing imported") from None
    for lo in range(0, n, step):
        chunk = np.ascontiguousarray(data[lo:lo + step], dtype=np.float32)
        table.write_physical(np.arange(start + lo, start + lo + len(chunk), dtype=np.int64), chunk)
        if progress:
            progress(len(chunk))
    table.flush_durable()
    return n


def chunk_rows(table: Table) -> int:
    """Rows per chunk of an import or export: at most ``CHUNK_ROWS`` and ``CHUNK_BYTES`` of float32 rows
    (with their optimizer state, which a write encodes beside them), and at least one."""
    row_bytes = 4 * (table.format.dim + table.format.state_dim)
    return max(1, min(CHUNK_ROWS, CHUNK_BYTES // row_bytes))


def _first_refused_row(table: Table, chunk: np.ndarray) -> int:
    """Index of the first row of ``chunk`` that ``table.format.check`` refuses (bisection over prefixes)."""
    lo, hi = 0, len(chunk) - 1  # the whole chunk, chunk[:hi + 1], is refused
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            table.format.check(chunk[:mid + 1])
            lo = mid + 1
        except InvalidRowsError:
            hi = mid
    return lo


def export_rows(table: Table, path: str | os.PathLike, rows: int | None = None,
                progress: Progress | None = None) -> int:
    """Dump physical rows ``0 .. rows-1`` (default all) as float32 (n, physical dim) .npy; returns n."""
    n = table.num_rows if rows is None else rows
    if not 0 <= n <= table.num_rows:
        raise InvalidInputError(f"rows must be in [0, {table.num_rows}], got {n}")
    if n > MAX_EXPORT_ROWS:
        raise InvalidInputError(f"table {table.name!r} has {n} rows; export at most {MAX_EXPORT_ROWS} (use --rows)")
    # streamed into a temp file that replaces ``path`` at the end: a full disk is an OSError here (a
    # memory-mapped output would die of SIGBUS), and a failed export leaves no half-written file
    with atomic_file(path) as f:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
                  "shape": (n, table.format.dim)}
        np.lib.format.write_array_header_1_0(f, header)
        step = chunk_rows(table)
        for lo in range(0, n, step):
            ids = np.arange(lo, min(n, lo + step), dtype=np.int64)
            f.write(np.ascontiguousarray(table.read_physical(ids), "<f4").tobytes())
            if progress:
                progress(len(ids))
    return n
