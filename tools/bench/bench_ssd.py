"""SSDTier random single-row reads against fio 4 KiB random reads on the same slab file.

Run::

    python tools/bench/bench_ssd.py             # 4 GiB slab, 2 rounds of 5 s each side
    python tools/bench/bench_ssd.py --quick     # 1 GiB slab, 1 round of 3 s each side
    python tools/bench/bench_ssd.py --dir /mnt/nvme --size-gib 16 --queue-depth 128

Builds a fresh SSDTier of 256-byte rows filling ``--size-gib`` (every row
written, so no read hits a hole the file system answers without the device),
then runs, for ``--rounds`` rounds (alternating which side goes first):

- fio: ``--ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=QD
  --numjobs=1 --readonly`` over the slab file for ``--seconds``;
- the tier: ``get(ids)`` on batches of 4096 unique random row ids for
  ``--seconds`` (one 4 KiB page read per row; ids are drawn beforehand).

Both bypass the page cache (O_DIRECT), so the file only needs to be larger
than the device's own cache. ``ratio`` = tier rows/s over fio IOPS in the same
round (the goal is >= 0.8); ``read_amplification`` = device bytes read per
useful row byte (4096 / 256 = 16 for random single rows). fio is installed with
apt-get when missing. The slab goes in a temp directory under --dir (default
$TMPDIR or /tmp; a warning is printed when that is tmpfs, i.e. memory), removed
at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embstore.tiers.ssd import SLAB_FILE, SSDTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import positive_float, positive_int  # noqa: E402


def ensure_fio() -> str:
    """Path of fio, installing the Debian package when it is missing; RuntimeError saying why when that fails
    (no apt-get, not root, no network)."""
    fio = shutil.which("fio")
    if fio:
        return fio
    print("fio not found; installing it with apt-get", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    why = ""
    try:
        if subprocess.run(["apt-get", "install", "-y", "fio"], env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
            subprocess.run(["apt-get", "install", "-y", "fio"], env=env, capture_output=True, check=True)
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        why = f": `{' '.join(exc.cmd)}` failed" + (f" ({lines[-1]})" if lines else f" with status {exc.returncode}")
    except OSError as exc:
        why = f": {exc}"
    fio = shutil.which("fio")
    if not fio:
        raise RuntimeError(f"fio (the baseline) is not installed and apt-get could not install it{why}; "
                           "install fio and run again")
    return fio


def fs_type(path: Path) -> str:
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return lines[-1].split()[1] if out.returncode == 0 and len(lines) > 1 else "?"


def run_fio(fio: str, path: Path, qd: int, seconds: float) -> float:
    """fio's 4 KiB O_DIRECT random-read IOPS over ``path`` at depth ``qd``."""
    cmd = [fio, "--name=randread", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
           "--rw=randread", "--bs=4k", f"--iodepth={qd}", "--numjobs=1", "--readonly",
           "--time_based", f"--runtime={seconds}s", "--ramp_time=0", "--norandommap",
           "--randrepeat=0", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["jobs"][0]["read"]["iops"])


def fill(tier: SSDTier, rng: np.random.Generator) -> float:
    """Write every row (bulk puts of whole pages become 1 MiB O_DIRECT writes); returns seconds."""
    start = time.perf_counter()
    chunk = (16 << 20) // tier.row_bytes
    pattern = rng.integers(0, 256, size=(chunk, tier.row_bytes), dtype=np.uint8)
    for lo in range(0, tier.num_rows, chunk):
        ids = np.arange(lo, min(lo + chunk, tier.num_rows), dtype=np.int64)
        pattern[:, :8] = (np.arange(chunk, dtype=np.uint64) + np.uint64(lo)).view(np.uint8).reshape(-1, 8)
        tier.put(ids, pattern[:len(ids)])
    tier.flush()
    return time.perf_counter() - start


def time_tier(tier: SSDTier, batches: list[np.ndarray], seconds: float) -> tuple[float, int, int]:
    """(elapsed, rows read, batches) of get() over ``batches`` (cycled) for about ``seconds``."""
    rows = 0
    done = 0
    start = time.perf_counter()
    while True:
        ids = batches[done % len(batches)]
        out, found = tier.get(ids)
        if not found.all():
            raise RuntimeError("bench rows missing from the tier")
        rows += len(ids)
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed, rows, done


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 GiB slab, one 3 s round")
    ap.add_argument("--size-gib", type=positive_float, default=None, help="slab size (default 4, quick 1)")
    ap.add_argument("--row-bytes", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=4096, help="random ids per get (duplicates dropped)")
    ap.add_argument("--queue-depth", type=positive_int, default=64, help="reads in flight, both sides (default 64)")
    ap.add_argument("--seconds", type=positive_float, default=None, help="per side per round (default 5, quick 3)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="fio/tier rounds (default 2, quick 1)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="parent of the temp directory; must be on the SSD (default: $TMPDIR or /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the slab directory")
    args = ap.parse_args(argv)
    size = int((args.size_gib or (1.0 if args.quick else 4.0)) * (1 << 30))
    seconds = args.seconds or (3.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 2)
    qd = args.queue_depth

    try:
        fio = ensure_fio()
    except RuntimeError as exc:
        raise SystemExit(f"bench_ssd: error: {exc}") from None
    workdir = Path(tempfile.mkdtemp(prefix="bench_ssd_", dir=args.dir))
    fstype = fs_type(workdir)
    if fstype in ("tmpfs", "ramfs"):
        print(f"warning: {workdir} is on {fstype} (memory), not an SSD; pass --dir", file=sys.stderr)
    rng = np.random.default_rng(0)
    try:
        num_rows = size // args.row_bytes
        tier = SSDTier(workdir / "ssd", num_rows, args.row_bytes, queue_depth=qd)
        fill_s = fill(tier, rng)
        slab = workdir / "ssd" / SLAB_FILE
        batches = [np.unique(rng.integers(0, num_rows, size=args.batch, dtype=np.int64)) for _ in range(256)]
        tier.get(batches[-1])  # warm up (numba kernels load from cache or compile)
        tier.counters.bytes_read = 0
        per_round = []
        tier_rows_total = tier_s_total = fio_iops_sum = 0.0
        for r in range(rounds):
            if r % 2 == 0:  # alternate which side goes first
                fio_iops = run_fio(fio, slab, qd, seconds)
                elapsed, rows, _ = time_tier(tier, batches, seconds)
            else:
                elapsed, rows, _ = time_tier(tier, batches, seconds)
                fio_iops = run_fio(fio, slab, qd, seconds)
            tier_iops = rows / elapsed
            per_round.append({"fio_iops": round(fio_iops), "tier_rows_per_s": round(tier_iops),
                              "ratio": round(tier_iops / fio_iops, 3)})
            tier_rows_total += rows
            tier_s_total += elapsed
            fio_iops_sum += fio_iops
        tier_iops = tier_rows_total / tier_s_total
        fio_iops = fio_iops_sum / rounds
        result = {
            "slab_gib": round(size / (1 << 30), 2),
            "fs": fstype,
            "engine": tier.io_engine,
            "queue_depth": qd,
            "row_bytes": args.row_bytes,
            "batch": args.batch,
            "fill_s": round(fill_s, 2),
            "fill_mib_per_s": round(size / (1 << 20) / fill_s, 1),
            "rounds": per_round,
            "fio_iops": round(fio_iops),
            "tier_rows_per_s": round(tier_iops),
            "ratio": round(tier_iops / fio_iops, 3),
            "read_amplification": round(tier.read_amplification, 2),
        }
        tier.close()
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"slab {result['slab_gib']} GiB on {fstype}, engine {result['engine']}, "
          f"queue depth {qd}, {args.row_bytes}-byte rows, batches of {args.batch}")
    print(f"fill: {result['fill_s']} s ({result['fill_mib_per_s']} MiB/s)")
    for i, pr in enumerate(per_round):
        print(f"round {i}: fio {pr['fio_iops']:>9,} IOPS   tier {pr['tier_rows_per_s']:>9,} rows/s   "
              f"ratio {pr['ratio']:.3f}")
    print(f"fio randread 4k qd{qd}: {result['fio_iops']:,} IOPS")
    print(f"SSDTier.get random rows: {result['tier_rows_per_s']:,} rows/s")
    print(f"ratio tier/fio: {result['ratio']:.3f} (goal >= 0.8)")
    print(f"read amplification: {result['read_amplification']:.2f} (bytes read / useful row bytes)")
    return result


if __name__ == "__main__":
    main()
