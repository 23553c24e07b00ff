"""What a row costs on each tier of this machine, and the modelled time of a batch.

:func:`calibrate` runs for a few seconds through the real tier classes in a
temporary directory (so it measures what the store would do, io_uring and
O_DIRECT included): DRAM gather ns/row (:class:`DRAMTier`), SSD random-read
IOPS at queue depths 1, 8 and 64 (:class:`SSDTier`), mmap ns/row
(:class:`MmapTier`) and RocksDB get µs/row (:class:`RocksDBTier`). The figures
are saved as JSON (default ``~/.cache/embstore/costmodel.json``) and reused.

Model: time of a batch = sum over tiers of (rows served by that tier) x (that
tier's cost per row); the home serves the misses of the last cache. A device
tier is costed like DRAM when no accelerator figure was measured (it is a CPU
tensor then). The SSD cost per row is ``1 / IOPS`` at the tier's queue depth
(the nearest measured depth at or below it).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from embstore.atomic import atomic_write
from embstore.errors import InvalidInputError
from embstore.files import check_regular_file

__all__ = ["CostModel", "DEFAULT_PATH", "calibrate", "default_model", "load", "save"]

DEFAULT_PATH = Path(os.environ.get("EMBSTORE_COSTMODEL", Path.home() / ".cache" / "embstore" / "costmodel.json"))
QUEUE_DEPTHS = (1, 8, 64)


@dataclass(frozen=True)
class CostModel:
    """Per-row costs in nanoseconds (SSD as IOPS per queue depth)."""

    dram_ns_per_row: float = 50.0
    mmap_ns_per_row: float = 200.0
    ssd_iops: dict[int, float] = field(default_factory=lambda: {1: 10_000.0, 8: 60_000.0, 64: 200_000.0})
    rocksdb_us_per_row: float = 5.0
    row_bytes: int = 256
    measured: bool = False

    def ns_per_row(self, kind: str, queue_depth: int = 64) -> float:
        """Cost of serving one row from a tier of ``kind``."""
        if kind in ("dram", "device"):
            return self.dram_ns_per_row
        if kind == "mmap":
            return self.mmap_ns_per_row
        if kind == "ssd":
            depths = sorted(self.ssd_iops)
            d = max([q for q in depths if q <= queue_depth] or depths[:1])
            return 1e9 / self.ssd_iops[d]
        if kind == "rocksdb":
            return self.rocksdb_us_per_row * 1e3
        raise InvalidInputError(f"unknown tier kind {kind!r}; known: device, dram, mmap, ssd, rocksdb")

    def batch_seconds(self, rows_per_tier: Mapping[str, float] | list[tuple[str, float]],
                      queue_depth: int = 64) -> float:
        """Modelled time of serving ``rows`` from each tier (kind -> rows, or (kind, rows) pairs)."""
        items = rows_per_tier.items() if isinstance(rows_per_tier, Mapping) else rows_per_tier
        return sum(float(n) * self.ns_per_row(k, queue_depth) for k, n in items) * 1e-9

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ssd_iops"] = {str(k): v for k, v in self.ssd_iops.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "CostModel":
        """Read back ``to_dict``; every cost must be a finite positive number (a zero IOPS figure would
        divide by zero in every modelled time, a NaN make them all NaN)."""

        def cost(value: object, name: str) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            return float(value)

        try:
            iops = {int(k): cost(v, f"ssd_iops[{k}]") for k, v in d["ssd_iops"].items()}
            if not iops or min(iops) < 1:
                raise ValueError(f"ssd_iops needs queue depths >= 1, got {d['ssd_iops']!r}")
            row_bytes, measured = d.get("row_bytes", 256), d.get("measured", True)
            if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
                raise ValueError(f"row_bytes must be an integer >= 1, got {row_bytes!r}")
            if not isinstance(measured, bool):
                raise ValueError(f"measured must be true or false, got {measured!r}")
            return cls(cost(d["dram_ns_per_row"], "dram_ns_per_row"), cost(d["mmap_ns_per_row"], "mmap_ns_per_row"),
                       iops, cost(d["rocksdb_us_per_row"], "rocksdb_us_per_row"), row_bytes, measured)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidInputError(f"cost model JSON lacks or mangles a field: {exc!r}") from exc


def save(model: CostModel, path: str | os.PathLike | None = None) -> Path:
    p = Path(path) if path is not None else DEFAULT_PATH
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps(model.to_dict(), indent=2).encode())
    return p


def load(path: str | os.PathLike | None = None) -> CostModel:
    p = Path(path) if path is not None else DEFAULT_PATH
    check_regular_file(p, "cost model")  # a FIFO would block the read forever
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidInputError(f"cost model {str(p)!r} does not exist; run the calibration first") from None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, and UnicodeDecodeError
        # for non-UTF-8; RecursionError: arrays nested thousands deep
        raise InvalidInputError(f"cost model {str(p)!r} is not readable JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"cost model {str(p)!r} must hold a JSON object, got {type(data).__name__}")
    try:
        return CostModel.from_dict(data)
    except InvalidInputError as exc:  # name the file: the user has to find and fix or delete it
        raise InvalidInputError(f"{str(p)!r}: {exc}") from exc


def default_model(path: str | os.PathLike | None = None) -> CostModel:
    """The saved calibration when there is one, else the built-in round figures (``measured=False``); a
    damaged calibration is logged as a warning naming it (the figures would otherwise change silently)."""
    try:
        return load(path)
    except InvalidInputError as exc:
        p = Path(path) if path is not None else DEFAULT_PATH
        if p.exists():
            logging.getLogger("embstore.costmodel").warning("%s; using the built-in figures", exc)
        return CostModel()


def _timed(fn, reps: int) -> float:
    """Best-of-``reps`` wall time of ``fn()`` (best: least disturbed by a shared CPU)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(*, row_bytes: int = 256, rows: int = 1 << 16, batch: int = 4096, reps: int = 3,
              directory: str | os.PathLike | None = None, rocksdb: bool = True) -> CostModel:
    """Measure this machine's tiers (a few seconds with the defaults; see module doc)."""
    from embstore.tiers.cache import DRAMTier
    from embstore.tiers.mmap import MmapTier
    from embstore.tiers.ssd import SSDTier

    if row_bytes < 1 or rows < batch or batch < 1:
        raise InvalidInputError("calibrate needs row_bytes >= 1 and rows >= batch >= 1")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    all_ids = np.arange(rows, dtype=np.int64)
    sample = rng.choice(rows, size=batch, replace=False).astype(np.int64)
    with tempfile.TemporaryDirectory(dir=directory, prefix="embstore-calib-") as tmp:
        dram = DRAMTier(row_bytes, rows, "lru", rows)
        dram.put(all_ids, data)
        dram_ns = _timed(lambda: dram.get(sample), reps) / batch * 1e9
        dram.close()

        mm = MmapTier(Path(tmp) / "mmap", rows, row_bytes)
        mm.put(all_ids, data)
        mm.flush()
        mmap_ns = _timed(lambda: mm.get(sample), reps) / batch * 1e9
        mm.close()

        iops: dict[int, float] = {}
        ssd = SSDTier(Path(tmp) / "ssd", rows, row_bytes, queue_depth=64)
        ssd.put(all_ids, data)
        ssd.flush()
        ssd.close()
        for qd in QUEUE_DEPTHS:
            t = SSDTier(Path(tmp) / "ssd", rows, row_bytes, queue_depth=qd)
            n = min(batch, 256 * qd)  # enough requests to fill the queue many times over, yet short at depth 1
            ids = sample[:n]
            iops[qd] = n / _timed(lambda: t.get(ids), reps)
            t.close()

        rocks_us = CostModel().rocksdb_us_per_row
        if rocksdb:
            from embstore.tiers.rocksdb import RocksDBTier

            r = RocksDBTier(Path(tmp) / "rocks", row_bytes)
            r.put(all_ids, data)
            r.flush()
            rocks_us = _timed(lambda: r.get(sample), reps) / batch * 1e6
            r.close()
    return CostModel(dram_ns, mmap_ns, iops, rocks_us, row_bytes, True)
