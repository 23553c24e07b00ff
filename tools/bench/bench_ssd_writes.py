"""SSD home write-back: random small-row writes, ``log`` layout against ``in_place`` in the same run.

Run::

    python tools/bench/bench_ssd_writes.py            # 4M rows of 68 bytes (272 MB), 2 rounds
    python tools/bench/bench_ssd_writes.py --quick    # 1M rows, 1 round

What a partly cached training table does to its home: every evicted row is
written back, one small row at a time, to random places. Both tiers hold the
same table with every row written first (as after ``embstore import``); then
batches of ``--batch`` distinct random ids are written (``put``) for
``--seconds``. The log tier first writes until its cleaner has run
``--cycles`` times over (its spare blocks used up several times), so the
timed part is its steady state, cleaning included. Prints rows/s of each
layout, their ratio (log / in_place), the device I/O per written row, and the
cleaner's share of the log's block writes. The two layouts alternate rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embstore.tiers.ssd import PAGE, SSDTier
from embstore.tiers.ssd_log import LogSSDTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_float, positive_int  # noqa: E402

WARM_PASSES = 20  # the warm-up gives up waiting for the cleaner after this many times the table's rows


def filled(cls: type[SSDTier], path: Path, rows: int, row_bytes: int) -> SSDTier:
    tier = cls(path, rows, row_bytes)
    chunk = (16 << 20) // row_bytes
    pattern = np.random.default_rng(0).integers(0, 256, (chunk, row_bytes), dtype=np.uint8)
    for lo in range(0, rows, chunk):
        ids = np.arange(lo, min(rows, lo + chunk), dtype=np.int64)
        tier.put(ids, pattern[:len(ids)])
    tier.flush()
    return tier


def write_for(tier: SSDTier, rng: np.random.Generator, batch: int, rows: np.ndarray, seconds: float) -> dict:
    """Random-batch puts for ``seconds``: rows/s and device I/O (4 KiB blocks) per written row."""
    c0 = (tier.counters.bytes_read, tier.counters.bytes_written)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        ids = np.unique(rng.integers(0, tier.num_rows, batch))
        tier.put(ids, rows[:len(ids)])
        n += len(ids)
    elapsed = time.perf_counter() - start
    reads = (tier.counters.bytes_read - c0[0]) / PAGE
    writes = (tier.counters.bytes_written - c0[1]) / PAGE
    return {"rows_per_s": n / elapsed, "blocks_read_per_row": reads / n, "blocks_written_per_row": writes / n}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1M rows, 1 round, 3 s per side")
    p.add_argument("--rows", type=positive_int, default=None, help="rows in the table (default 4M; quick 1M)")
    p.add_argument("--row-bytes", type=positive_int, default=68,
                   help="bytes per row (default 68: dim 16 + Adagrad state)")
    p.add_argument("--batch", type=positive_int, default=1000, help="rows per put (default 1000)")
    p.add_argument("--seconds", type=positive_float, default=None,
                   help="timed seconds per side and round (default 5; quick 3)")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 2; quick 1)")
    p.add_argument("--cycles", type=float, default=2.0,
                   help="before timing, write this many times the log's spare blocks (its cleaner then runs; "
                        f"a table whose puts empty whole blocks may never need it: then {WARM_PASSES} times its "
                        "rows at most)")
    p.add_argument("--dir", default=None, help="where the slabs go (default: a temp dir; needs O_DIRECT)")
    args = p.parse_args(argv)
    rows = args.rows or (1 << 20 if args.quick else 4 << 20)
    seconds = args.seconds or (3.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 2)
    rng = np.random.default_rng(1)
    payload = rng.integers(0, 256, (args.batch, args.row_bytes), dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        log = filled(LogSSDTier, root / "log", rows, args.row_bytes)
        inplace = filled(SSDTier, root / "in_place", rows, args.row_bytes)
        assert isinstance(log, LogSSDTier)
        warm = int(args.cycles * log.spare_blocks * log.rows_per_block)
        written = 0
        # until the cleaner has run; a put that rewrites every row of its blocks leaves none to clean
        while written < warm or (log.cleaned_blocks == 0 and written < warm + WARM_PASSES * rows):
            ids = np.unique(rng.integers(0, rows, args.batch))
            log.put(ids, payload[:len(ids)])
            written += len(ids)
        log_cleaned = log.cleaned_blocks
        runs: dict[str, list[dict]] = {"log": [], "in_place": []}
        for r in range(rounds):
            order = (("log", log), ("in_place", inplace)) if r % 2 == 0 else (("in_place", inplace), ("log", log))
            for name, tier in order:
                moved0, written0 = log.moved_rows, log.counters.bytes_written
                out = write_for(tier, rng, args.batch, payload, seconds)
                if name == "log":
                    out["cleaner_share_of_writes"] = ((log.moved_rows - moved0) / log.rows_per_block * PAGE
                                                      / max(1, log.counters.bytes_written - written0))
                runs[name].append(out)
        for tier in (log, inplace):
            tier.close()
        shutil.rmtree(root, ignore_errors=True)
    best = {k: max(v, key=lambda x: x["rows_per_s"]) for k, v in runs.items()}
    result = {
        "rows": rows, "row_bytes": args.row_bytes, "batch": args.batch, "rounds": rounds,
        "warmup_rows_written_to_log": written, "log_cleaned_blocks_in_warmup": int(log_cleaned),
        "log": {k: round(v, 3) for k, v in best["log"].items()},
        "in_place": {k: round(v, 3) for k, v in best["in_place"].items()},
        "round_ratios": [round(a["rows_per_s"] / b["rows_per_s"], 2) for a, b in zip(runs["log"], runs["in_place"])],
        "ratio_log_over_in_place": round(best["log"]["rows_per_s"] / best["in_place"]["rows_per_s"], 2),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
