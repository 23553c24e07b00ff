"""Embedding-lookup traces: the in-memory form, the three file formats, statistics.

A trace is every lookup in order, cut into batches::

    ids           = [ 7, 3, 3, 9 | 7, 1 ]     int64, every access in order
    table         = [ 0, 0, 1, 1 | 0, 1 ]     int32, index into table_names
    batch_offsets = [ 0,          4,     6 ]  int64, batch b is ids[off[b]:off[b+1]]
    table_names   = ("user", "item")

A row is a ``(table, id)`` pair: id 3 of table 0 and id 3 of table 1 are
different rows. :func:`dense_keys` numbers the rows ``0..K-1`` for the
simulators (``embstore.belady``, ``embstore.stackdist``).

Formats read by :func:`load` (written: only npz, by :func:`save`):

* ``.npz`` with ``ids``, ``table``, ``batch_offsets`` and optional ``table_names``
  (SPEC section 6).
* Meta's ``dlrm_datasets`` release: ``indices, offsets, lengths = torch.load(f)``,
  optionally gzipped (inflated into the temporary folder, to at most
  :data:`GZIP_MAX_RATIO` times the gzipped size or :data:`GZIP_MIN_LIMIT`).
  ``lengths`` has shape ``(T, B)``; bag ``t * B + b`` (table t, sample b) is
  ``indices[offsets[t*B+b] : offsets[t*B+b+1]]`` (table-major, as fbgemm's TBE
  takes it). By default the whole file is one batch of B
  samples. With ``batch_size=S`` samples ``[kS, (k+1)S)`` form batch k (the
  last batch may be shorter). Inside a batch the order is **table-major**, as
  in the file: table 0's bags for the batch's samples in sample order, then
  table 1's, and so on.
* CSV with header ``table,id`` (optionally a third column ``batch``, batch
  numbers that never decrease). ``table`` is a table index or a table name
  (names get indices in order of first appearance). Numbers are ASCII decimal
  integers with an optional sign (no ``1_000``, no other scripts' digits); blank
  lines are skipped, and every error names its line. Without a ``batch`` column
  the file is one batch. CSV is meant for small hand-made traces.

Statistics (:func:`trace_stats`) follow the definitions used for the published
dlrm_datasets numbers: per batch, the unique ratio is unique rows / lookups,
and the reuse histogram gives, for k in 1, 8, 32, 64, 256, 1024, the share of
the batch's unique rows looked up more than k times in the batch and the share
of the batch's lookups that go to them; per-batch values are averaged over
batches weighted by lookups.
"""

from __future__ import annotations

import errno
import gzip
import math
import os
import re
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from embstore.arrays import Ids
from embstore.atomic import atomic_file
from embstore.belady import dedup_batches, densify
from embstore.errors import CorruptStoreError, EmbstoreError, InvalidInputError
from embstore.files import NPY_READ_ERRORS
from embstore.files import check_regular_file, zip_crc_failure
from embstore.stackdist import stack_distances

__all__ = [
    "REUSE_THRESHOLDS",
    "ReuseBucket",
    "ReuseDistance",
    "Trace",
    "TraceStats",
    "dense_keys",
    "load",
    "save",
    "trace_stats",
]

REUSE_THRESHOLDS: tuple[int, ...] = (1, 8, 32, 64, 256, 1024)
FORMATS = ("npz", "meta", "csv")
# Tables numbered ``table_0 ..`` when a trace names none. A bound, because the count comes from the
# file (the largest table index, or the shape of Meta's lengths): one stray index of 2**31 - 1 in a
# tiny file would otherwise build two billion names. Real workloads have hundreds of tables.
MAX_DEFAULT_TABLES = 1 << 20


def _int_array(x: Any, dtype: type, what: str) -> np.ndarray:
    """Cast an integer array to ``dtype`` if every value fits; refuse floats and objects."""
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype == dtype:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.array([]) is float64
            return np.zeros(0, dtype=dtype)
        raise InvalidInputError(f"{what} must be an integer array ({np.dtype(dtype).name}), got dtype {arr.dtype}")
    if arr.size:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise InvalidInputError(f"{what} holds values outside the {np.dtype(dtype).name} range "
                                    f"({int(lo)} .. {int(hi)})")
    return np.ascontiguousarray(arr, dtype=dtype)


def default_table_names(n: int) -> tuple[str, ...]:
    """``table_0 .. table_{n-1}``; more than :data:`MAX_DEFAULT_TABLES` is refused (give names)."""
    if n > MAX_DEFAULT_TABLES:
        raise InvalidInputError(f"{n:,} tables but no table_names; at most {MAX_DEFAULT_TABLES:,} tables are "
                                "named table_0, table_1, .. by default")
    return tuple(f"table_{i}" for i in range(n))


@dataclass(frozen=True, eq=False)
class Trace:
    """Every lookup of a workload, in order, with batch boundaries (see module doc).

    Integer arrays of other integer dtypes are cast when every value fits;
    ``table_names`` defaults to ``table_0 ..`` for as many tables as indices use.
    """

    ids: Ids
    table: npt.NDArray[np.int32]
    batch_offsets: npt.NDArray[np.int64]
    table_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        ids = _int_array(self.ids, np.int64, "ids")
        table = _int_array(self.table, np.int32, "table")
        off = _int_array(self.batch_offsets, np.int64, "batch_offsets")
        if table.size != ids.size:
            raise InvalidInputError(f"table has {table.size} entries but ids has {ids.size}; they must agree")
        if off.size < 1 or off[0] != 0:
            raise InvalidInputError("batch_offsets must start at 0")
        if off[-1] != ids.size:
            raise InvalidInputError(f"batch_offsets must end with len(ids) = {ids.size}, got {int(off[-1])}")
        if off.size > 1 and np.any(np.diff(off) < 0):
            i = int(np.argmax(np.diff(off) < 0))
            raise InvalidInputError(f"batch_offsets must be non-decreasing; entry {i} = {int(off[i])} > "
                                    f"entry {i + 1} = {int(off[i + 1])}")
        names = tuple(self.table_names)
        if any(not isinstance(n, str) or not n for n in names):
            raise InvalidInputError("table_names must be non-empty strings")
        if len(set(names)) != len(names):
            raise InvalidInputError(f"table_names must be unique, got {names}")
        if table.size:
            lo, hi = int(table.min()), int(table.max())
            if lo < 0:
                raise InvalidInputError(f"table indices must be >= 0, got {lo}")
            if not names:
                names = default_table_names(hi + 1)
            elif hi >= len(names):
                raise InvalidInputError(f"table index {hi} is out of range for {len(names)} table names")
        elif not names:
            names = default_table_names(1)
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "batch_offsets", off)
        object.__setattr__(self, "table_names", names)

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets.size - 1)

    @property
    def num_tables(self) -> int:
        return len(self.table_names)

    def __repr__(self) -> str:
        return (f"Trace({len(self)} accesses, {self.num_batches} batches, "
                f"{self.num_tables} tables)")


def dense_keys(trace: Trace) -> tuple[Ids, int]:
    """``(keys, K)``: each access's row ``(table, id)`` numbered ``0..K-1`` in order
    of first appearance; ``K`` is the number of distinct rows."""
    n = len(trace)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    ids, tab = trace.ids, trace.table
    shift = max(1, int(trace.num_tables - 1).bit_length())
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < (1 << (62 - shift)):
        return densify((tab.astype(np.int64) << np.int64(62 - shift)) | ids, compact=True)
    order = np.lexsort((ids, tab))
    new = np.empty(n, dtype=bool)
    new[0] = True
    new[1:] = (ids[order[1:]] != ids[order[:-1]]) | (tab[order[1:]] != tab[order[:-1]])
    keys = np.empty(n, dtype=np.int64)
    keys[order] = np.cumsum(new) - 1
    return densify(keys, compact=True)  # renumber by first appearance


# --------------------------------------------------------------------------- save / load


def save(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write the npz form (uncompressed: fast for 100M-access traces), atomically."""
    with atomic_file(path) as f:
        np.savez(f, ids=trace.ids, table=trace.table, batch_offsets=trace.batch_offsets,
                 table_names=np.array(trace.table_names, dtype=np.str_))


def load(path: str | os.PathLike[str], *, batch_size: int | None = None, format: str | None = None) -> Trace:
    """Read a trace in any supported format (see module doc).

    ``format`` is ``"npz"``, ``"meta"`` or ``"csv"``; by default it is guessed
    from the suffix, then from the file's first bytes. ``batch_size`` (samples
    per batch) applies to the Meta format only. Unreadable files raise
    :class:`CorruptStoreError`, readable ones with wrong contents
    :class:`InvalidInputError`; both name the file.
    """
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"trace file {str(p)!r} does not exist")
    check_regular_file(p, "trace file")  # a FIFO would block open() forever, /dev/zero never end
    fmt = format or _guess_format(p)
    if fmt not in FORMATS:
        raise InvalidInputError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if batch_size is not None:
        if fmt != "meta":
            raise InvalidInputError(f"batch_size applies to Meta's torch format only; {str(p)!r} is {fmt}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidInputError(f"batch_size must be a positive number of samples, got {batch_size!r}")
    try:
        if fmt == "npz":
            return _load_npz(p)
        if fmt == "meta":
            return _load_meta(p, batch_size)
        return _load_csv(p)
    except CorruptStoreError:
        raise
    except InvalidInputError as exc:
        if str(p) in str(exc):
            raise
        raise type(exc)(f"trace file {str(p)!r}: {exc}") from exc


def _guess_format(p: Path) -> str:
    name = p.name.lower()
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith((".pt", ".pt.gz", ".pth", ".gz")):
        return "meta"
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CorruptStoreError(f"trace file {str(p)!r} cannot be read: {exc}") from exc
    if head[:2] == b"\x1f\x8b":
        return "meta"
    if head == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(p) as z:
                return "npz" if any(n.endswith(".npy") for n in z.namelist()) else "meta"
        except zipfile.BadZipFile as exc:
            raise CorruptStoreError(f"trace file {str(p)!r} is not a valid zip archive: {exc}") from exc
    return "csv"


def _load_npz(p: Path) -> Trace:
    if p.is_file() and not zipfile.is_zipfile(p):  # np.load would take it for a pickle and say so
        raise CorruptStoreError(f"trace file {str(p)!r} is not an npz archive (a zip of .npy arrays, as "
                                "embstore.traces.save or numpy.savez write)")
    try:
        _check_npz_sizes(p)
        with np.load(p, allow_pickle=False) as z:
            missing = [k for k in ("ids", "table", "batch_offsets") if k not in z.files]
            if missing:
                raise CorruptStoreError(f"trace file {str(p)!r} lacks the array(s) {', '.join(missing)} "
                                        f"(has: {', '.join(z.files) or 'nothing'})")
            ids, table, off = z["ids"], z["table"], z["batch_offsets"]
            names: tuple[str, ...] = ()
            if "table_names" in z.files:
                raw = z["table_names"]
                if raw.dtype.kind != "U" or raw.ndim != 1:
                    raise InvalidInputError(f"trace file {str(p)!r}: table_names must be a 1-D string array, "
                                            f"got {raw.dtype} {raw.shape}")
                names = tuple(str(s) for s in raw)
    except NPY_READ_ERRORS as exc:
        if isinstance(exc, EmbstoreError):
            raise
        raise CorruptStoreError(f"trace file {str(p)!r} is not a readable npz trace: {exc}") from exc
    for what, arr in (("ids", ids), ("table", table), ("batch_offsets", off)):
        if arr.dtype.kind not in "iu":
            raise InvalidInputError(f"trace file {str(p)!r}: {what} must be integers, got dtype {arr.dtype}")
    return Trace(ids, table, off, names)


# Deflate inflates at most ~1032:1; a member claiming more is damaged (or a bomb), not data.
_MAX_DEFLATE_RATIO = 1100


def _check_npz_sizes(p: Path) -> None:
    """Refuse, before numpy allocates them, arrays whose declared size the archive cannot hold: numpy
    allocates the whole ``shape`` of a zip member's header first, so a damaged header declaring 10**12
    ids would ask for terabytes (a MemoryError, not a corrupt-file error)."""
    size = p.stat().st_size
    with open(p, "rb") as f:  # the end record's entry count: a damaged length field in the central
        f.seek(max(0, size - (1 << 16) - 22))  # directory swallows the entries after it (table_names
        tail = f.read()  # vanished, and the trace silently got default names)
    end = tail.rfind(b"PK\x05\x06")
    entries = struct.unpack_from("<H", tail, end + 10)[0] if 0 <= end <= len(tail) - 22 else 0xFFFF
    with zipfile.ZipFile(p) as z:
        if entries != 0xFFFF and entries != len(z.infolist()):  # 0xFFFF: a zip64 count, kept elsewhere
            raise CorruptStoreError(f"trace file {str(p)!r}: its zip directory lists {len(z.infolist())} of "
                                    f"{entries} entries")
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                z.open(info).close()  # checks the name against the entry's own header: a damaged
                continue  # "table_names.npy" in the directory would otherwise just go missing
            limit = info.compress_size * (1 if info.compress_type == zipfile.ZIP_STORED else _MAX_DEFLATE_RATIO)
            if info.compress_size > size or info.file_size > limit:
                raise CorruptStoreError(f"trace file {str(p)!r}: member {info.filename!r} claims {info.file_size} "
                                        f"bytes, more than its {info.compress_size} stored bytes can hold")
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0(f))
                header = f.tell()
            declared = math.prod(shape) * dtype.itemsize  # Python ints: no wrap-around
            if declared > info.file_size - header:
                raise CorruptStoreError(f"trace file {str(p)!r}: array {info.filename[:-4]!r} declares shape "
                                        f"{shape} ({declared} bytes) but holds {info.file_size - header} bytes")


# A gzipped Meta trace is inflated to a temporary file (torch.load needs random access). Real traces shrink
# 3-60 times in gzip (60: indices all zero); deflate reaches ~1030, which is what a gzip bomb uses to fill
# the temporary folder from a small file. Inflating stops past this ratio (or the floor, for small files).
GZIP_MAX_RATIO = 200
GZIP_MIN_LIMIT = 256 << 20
_INFLATE_CHUNK = 1 << 24


def _inflate(p: Path, out: Any) -> None:
    """Inflate the gzip file ``p`` into the open binary file ``out``, refusing a likely gzip bomb (see
    :data:`GZIP_MAX_RATIO`) before writing past the limit; a full temporary folder is an ``OSError``
    that says so (not a corrupt trace)."""
    limit = max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * p.stat().st_size)
    written = 0
    try:
        with gzip.open(p, "rb") as inp:
            while chunk := inp.read(_INFLATE_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise CorruptStoreError(
                        f"trace file {str(p)!r} inflates to more than {limit:,} bytes ({GZIP_MAX_RATIO} times its "
                        f"gzipped size, or at least {GZIP_MIN_LIMIT >> 20} MiB): refused as a likely gzip bomb; if "
                        "it is a real trace, gunzip it yourself and load the .pt")
                out.write(chunk)
        out.flush()
    except OSError as exc:  # a damaged gzip stream (BadGzipFile, EOFError) is left to the caller
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(exc.errno, f"{exc.strerror}: inflating {str(p)!r} into {tempfile.gettempdir()!r} "
                                 "(set TMPDIR to a folder with more room, or gunzip it there first)") from exc


def _torch_load(p: Path) -> Any:
    import torch

    with open(p, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    tmp_name = None
    try:
        src = p
        if gz:  # torch.load needs random access; inflate to a temporary file first
            fd, tmp_name = tempfile.mkstemp(suffix=".pt")
            with os.fdopen(fd, "wb") as out:
                _inflate(p, out)
            src = Path(tmp_name)
        crc = zip_crc_failure(src)  # torch.load does not check: a flipped bit would be a different trace
        if crc is not None:
            raise CorruptStoreError(f"trace file {str(p)!r} is not a readable torch file{' (gzipped)' if gz else ''}: "
                                    f"{crc}")
        with warnings.catch_warnings():  # torch warns of pickle protocols it was not written with: noise
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(src, map_location="cpu", weights_only=True)
    except CorruptStoreError:
        raise  # a gzip bomb (said by _inflate), a failed CRC
    except Exception as exc:  # torch.load raises many types (RuntimeError, UnpicklingError, ...) on bad files
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # no room to inflate into (said by _inflate): the machine's fault, not the trace's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # its advice runs to many lines
        raise CorruptStoreError(f"trace file {str(p)!r} is not a readable torch file"
                                f"{' (gzipped)' if gz else ''}: {type(exc).__name__}: {first}") from exc
    finally:
        if tmp_name is not None:
            os.unlink(tmp_name)


def _load_meta(p: Path, batch_size: int | None) -> Trace:
    import torch

    obj = _torch_load(p)
    if not isinstance(obj, (tuple, list)) or len(obj) != 3 or not all(isinstance(t, torch.Tensor) for t in obj):
        what = f"{type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list)) else type(obj).__name__
        raise CorruptStoreError(f"trace file {str(p)!r} should hold (indices, offsets, lengths) tensors, got a {what}")
    for what, t in zip(("indices", "offsets", "lengths"), obj):
        if t.layout != torch.strided or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InvalidInputError(f"trace file {str(p)!r}: {what} must be a dense integer tensor, got "
                                    f"{t.dtype} ({t.layout})")
    try:  # a quantized or other exotic integer tensor has no numpy form
        indices, offsets, lengths = (t.detach().cpu().numpy() for t in obj)
    except (TypeError, RuntimeError) as exc:
        raise InvalidInputError(f"trace file {str(p)!r}: tensors must be plain integer tensors: {exc}") from exc
    for what, arr in (("indices", indices), ("offsets", offsets), ("lengths", lengths)):
        if arr.dtype.kind not in "iu":
            raise InvalidInputError(f"trace file {str(p)!r}: {what} must be an integer tensor, got {arr.dtype}")
    if lengths.ndim != 2:
        raise InvalidInputError(f"trace file {str(p)!r}: lengths must have shape (tables, batch), got {lengths.shape}")
    if indices.ndim != 1 or offsets.ndim != 1:
        raise InvalidInputError(f"trace file {str(p)!r}: indices and offsets must be 1-D, "
                                f"got {indices.shape} and {offsets.shape}")
    T, B = (int(x) for x in lengths.shape)
    indices = _int_array(indices, np.int64, "indices")  # uint64 ids past int64: refused, not wrapped negative
    offsets = offsets.astype(np.int64, copy=False)
    lens = lengths.reshape(-1).astype(np.int64)
    if offsets.size == T * B and (offsets.size == 0 or offsets[0] == 0):  # no trailing end offset
        offsets = np.append(offsets, indices.size)
    if offsets.size != T * B + 1:
        raise InvalidInputError(f"trace file {str(p)!r}: offsets has {offsets.size} entries; lengths of shape "
                                f"({T}, {B}) needs {T * B + 1}")
    if offsets[0] != 0 or offsets[-1] != indices.size:
        raise InvalidInputError(f"trace file {str(p)!r}: offsets must run from 0 to len(indices) = {indices.size}, "
                                f"got {int(offsets[0])} .. {int(offsets[-1])}")
    if not np.array_equal(np.diff(offsets), lens):
        raise InvalidInputError(f"trace file {str(p)!r}: lengths disagree with the differences of offsets")
    if np.any(lens < 0):
        raise InvalidInputError(f"trace file {str(p)!r}: negative bag lengths")
    names = default_table_names(max(T, 1))
    per_table = lens.reshape(T, B).sum(axis=1)
    S = B if batch_size is None else min(int(batch_size), max(B, 1))
    if S >= B:  # one batch: the file's own (table-major) order
        table = np.repeat(np.arange(T, dtype=np.int32), per_table)
        return Trace(indices, table, np.array([0, indices.size], dtype=np.int64), names)
    # bag order: batch-major, then table, then sample
    full = B // S
    grid = np.arange(T * B, dtype=np.int64).reshape(T, B)
    parts = [grid[:, : full * S].reshape(T, full, S).transpose(1, 0, 2).reshape(-1)]
    if full * S < B:
        parts.append(grid[:, full * S:].reshape(-1))
    bags = np.concatenate(parts)
    blen = lens[bags]
    cum = np.zeros(bags.size + 1, dtype=np.int64)
    np.cumsum(blen, out=cum[1:])
    pos = np.repeat(offsets[:-1][bags] - cum[:-1], blen) + np.arange(cum[-1], dtype=np.int64)
    table = np.repeat((bags // B).astype(np.int32), blen)
    bounds = [k * T * S for k in range(full + 1)]
    if full * S < B:
        bounds.append(T * B)
    return Trace(indices[pos], table, cum[np.array(bounds, dtype=np.int64)], names)


# A CSV number: ASCII digits with an optional sign. int() also takes '1_000', and digits of other scripts
# ('\u0661\u0662' is 12): a trace is a file another program wrote, where such a cell is damage, not a number.
_CSV_INT = re.compile(r"[+-]?[0-9]+")


def _csv_int(cell: str) -> int | None:
    """A CSV cell's integer (ASCII digits, optionally signed, leading zeros allowed), or None. The
    significant digits are counted first: int() refuses strings of over 4300 digits with a ValueError
    of its own, and a cell of 25 characters may still hold a small id ("0000...07")."""
    if not _CSV_INT.fullmatch(cell):
        return None
    digits = cell.lstrip("+-").lstrip("0") or "0"
    return int(digits) * (-1 if cell[0] == "-" else 1) if len(digits) <= 20 else None


def _load_csv(p: Path) -> Trace:
    """Read a CSV trace line by line (blank lines skipped); every error names the line it is about."""

    def bad(line: int, why: str) -> InvalidInputError:
        return InvalidInputError(f"trace file {str(p)!r}: line {line}: {why}")

    try:
        with open(p, encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark is not a column name
            header = [h.strip().lower() for h in f.readline().strip().split(",")]
            if header not in (["table", "id"], ["table", "id", "batch"]):
                raise InvalidInputError(f"trace file {str(p)!r}: expected the CSV header 'table,id' "
                                        f"(or 'table,id,batch'), got {','.join(header)!r}")
            rows: list[list[str]] = []
            lines: list[int] = []  # each row's line number in the file
            for n, text in enumerate(f, start=2):
                if not text.strip():
                    continue
                row = [c.strip() for c in text.split(",")]
                if len(row) != len(header):
                    raise bad(n, f"malformed CSV: rows have {len(row)} columns, header has {len(header)}")
                rows.append(row)
                lines.append(n)
    except UnicodeDecodeError as exc:
        raise CorruptStoreError(f"trace file {str(p)!r} is not a UTF-8 CSV file: {exc}") from exc
    except OSError as exc:
        raise CorruptStoreError(f"trace file {str(p)!r} cannot be read: {exc}") from exc

    def ints(col: int, what: str, dtype: type) -> np.ndarray:
        info = np.iinfo(dtype)
        out = np.empty(len(rows), dtype=dtype)
        for i, (row, n) in enumerate(zip(rows, lines)):
            cell = row[col]
            value = _csv_int(cell)
            if value is None or not info.min <= value <= info.max:
                shown = repr(cell) if len(cell) <= 40 else f"{cell[:40]!r}.. ({len(cell)} characters)"
                raise bad(n, f"{what} {shown} is not an integer in the {info.dtype.name} range "
                             "(ASCII digits, optionally signed)")
            out[i] = value
        return out

    ids = ints(1, "id", np.int64)
    names: tuple[str, ...] = ()
    if all(_CSV_INT.fullmatch(row[0]) for row in rows):  # table indices
        table = ints(0, "table", np.int32)
        if table.size:
            lo, hi = int(table.argmin()), int(table.argmax())
            if table[lo] < 0:
                raise bad(lines[lo], f"table indices must be >= 0, got {int(table[lo])}")
            try:
                names = default_table_names(int(table[hi]) + 1)
            except InvalidInputError as exc:
                raise bad(lines[hi], str(exc)) from None
    else:  # table names, numbered in order of first appearance
        index: dict[str, int] = {}
        for row, n in zip(rows, lines):
            if not row[0]:
                raise bad(n, "the table cell is empty (give a table name or index)")
            index.setdefault(row[0], len(index))
        table = np.array([index[row[0]] for row in rows], dtype=np.int32)
        names = tuple(index)
    if len(header) == 3:
        b = ints(2, "batch", np.int64)
        if b.size and np.any(np.diff(b) < 0):
            at = int(np.argmax(np.diff(b) < 0)) + 1
            raise bad(lines[at], "batch numbers must not decrease")
        starts = np.flatnonzero(np.diff(b)) + 1
        off = np.concatenate([[0], starts, [ids.size]]).astype(np.int64)
    else:
        off = np.array([0, ids.size], dtype=np.int64)
    return Trace(ids, table, off, names)


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ReuseBucket:
    """Rows looked up more than ``threshold`` times in a batch."""

    threshold: int
    rows_pct: float  # % of the batch's unique rows
    lookups_pct: float  # % of the batch's lookups that go to them


@dataclass(frozen=True)
class ReuseDistance:
    """Distinct other rows between successive accesses of a row, measured on the
    per-batch deduplicated sequence (the accesses a cache of the store sees).
    ``d < C`` means an LRU cache of C rows would hit. A trace with no re-access has no distances: the
    percentiles are NaN and ``max`` is None (``trace stats`` prints "undefined", its JSON null)."""

    reaccess_pct: float  # % of (deduplicated) accesses that revisit a row seen before; NaN: no accesses
    p50: float
    p90: float
    p99: float
    max: int | None


@dataclass(frozen=True)
class TraceStats:
    accesses: int
    batches: int
    tables: int
    unique_rows: int  # distinct (table, id) pairs in the whole trace
    unique_ratio: float  # per batch: unique rows / lookups, lookup-weighted mean over batches; NaN: no accesses
    dedup_factor: float  # 1 / unique_ratio: lookups per distinct row in a batch; NaN: no accesses
    reuse: tuple[ReuseBucket, ...]
    reuse_distance: ReuseDistance | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@njit(cache=True)
def _batch_reuse(keys, offsets, num_keys, thresholds, uniq, rows_above, lookups_above):  # pragma: no cover
    """Per batch: count each dense key, then bucket the counts (O(n), no sorting)."""
    cnt = np.zeros(num_keys, dtype=np.int64)
    longest = 0
    for b in range(offsets.shape[0] - 1):
        longest = max(longest, offsets[b + 1] - offsets[b])
    touched = np.empty(longest, dtype=np.int64)
    for b in range(offsets.shape[0] - 1):
        m = 0
        for i in range(offsets[b], offsets[b + 1]):
            k = keys[i]
            if cnt[k] == 0:
                touched[m] = k
                m += 1
            cnt[k] += 1
        uniq[b] = m
        for j in range(m):
            run = cnt[touched[j]]
            cnt[touched[j]] = 0
            for t in range(thresholds.shape[0]):
                if run > thresholds[t]:
                    rows_above[b, t] += 1
                    lookups_above[b, t] += run


def batch_reuse(keys: Ids, batch_offsets: npt.NDArray[np.int64],
                thresholds: tuple[int, ...] = REUSE_THRESHOLDS) -> tuple[float, tuple[ReuseBucket, ...]]:
    """``(unique_ratio, buckets)`` of a key sequence, each lookup-weighted over batches; all NaN (undefined)
    when there is no lookup."""
    keys, num = densify(keys)
    nb = batch_offsets.size - 1
    th = np.asarray(thresholds, dtype=np.int64)
    uniq = np.zeros(nb, dtype=np.int64)
    rows_above = np.zeros((nb, th.size), dtype=np.int64)
    lookups_above = np.zeros((nb, th.size), dtype=np.int64)
    if keys.size:
        _batch_reuse(keys, batch_offsets, num, th, uniq, rows_above, lookups_above)
    n_b = np.diff(batch_offsets).astype(np.float64)
    total = n_b.sum()
    if total == 0:
        return math.nan, tuple(ReuseBucket(int(k), math.nan, math.nan) for k in thresholds)
    ok = uniq > 0
    w = n_b[ok] / total
    ratio = float(uniq.sum() / total)  # == sum_b w_b * U_b / N_b
    rows_pct = 100.0 * (w[:, None] * rows_above[ok] / uniq[ok, None]).sum(axis=0)
    lookups_pct = 100.0 * lookups_above.sum(axis=0) / total
    return ratio, tuple(ReuseBucket(int(k), float(r), float(q)) for k, r, q in zip(thresholds, rows_pct, lookups_pct))


def trace_stats(trace: Trace, *, reuse_distances: bool = True,
                progress: Callable[[int], object] | None = None) -> TraceStats:
    """Summary statistics of a trace (vectorised/numba; fine for 100M accesses).

    ``reuse_distances=False`` skips the O(n log n) reuse-distance pass.
    ``progress(n)`` is called as chunks of that pass complete.
    """
    keys, num = dense_keys(trace)
    ratio, buckets = batch_reuse(keys, trace.batch_offsets)
    rd = None
    if reuse_distances:
        dk, _ = dedup_batches(keys, trace.batch_offsets)
        d = stack_distances(dk, progress=progress)
        re = d[d >= 0]
        if re.size:
            q = np.percentile(re, [50, 90, 99])
            rd = ReuseDistance(100.0 * re.size / d.size, float(q[0]), float(q[1]), float(q[2]), int(re.max()))
        else:  # nothing revisited: no distance to take percentiles of
            rd = ReuseDistance(0.0 if d.size else math.nan, math.nan, math.nan, math.nan, None)
    return TraceStats(
        accesses=len(trace),
        batches=trace.num_batches,
        tables=trace.num_tables,
        unique_rows=num if len(trace) else 0,
        unique_ratio=ratio,
        dedup_factor=1.0 / ratio if ratio > 0 else math.nan,  # ratio > 0 wherever it is defined
        reuse=buckets,
        reuse_distance=rd,
    )
