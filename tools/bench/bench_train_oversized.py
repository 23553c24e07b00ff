"""Training tables 10x the DRAM budget (Zipf ids) against the same training all in DRAM.

    python tools/bench/bench_train_oversized.py            # 8 tables x 1M rows x dim 64, batch 4096, pooling 20
    python tools/bench/bench_train_oversized.py --quick    # 4 tables x 100k rows, batch 1024

Three runs on the same Zipf(1.05) batches, rowwise Adagrad:
- resident: a DRAM tier holding every row over an mmap home (the baseline);
- oversized, no look-ahead: a DRAM budget of 10% of the rows' bytes over an ssd home (by default the
  plan ``tune --pipeline`` favours: ``lru+tinylfu`` caches over log-layout homes, whose slot maps the budget
  pays; ``--policy lru --layout in_place`` was the default until session 23);
- oversized, look-ahead k: the same, through ``ebc.pipeline(batches, lookahead=k)``;
- with ``--announce A``, a fourth run: look-ahead k that also tells the caches
  each batch A batches beyond the window (``pipeline(..., announce=A)``), so the
  DRAM caches keep the rows needed soonest; compared by ssd page reads per step.
Figures: samples/s of each oversized run / the resident run (goal >= 0.7x for
look-ahead) and the forwards' demand misses (rows not in the working set when
the batch's forward started) with and without look-ahead.

It also prints the ceiling no cache policy can pass here: Belady's MIN over the reads and write-backs
the look-ahead pipeline makes (``embstore.simulator.pipeline_min_keys``) at the same cache size leaves a
number of home reads per timed step; at the run's own pages per home row read (at most one) and IOPS
that is the least I/O time a step could take, against the resident step.
"""

from __future__ import annotations

import os
import argparse
import sys
import tempfile
import time

import numpy as np
import torch

import embstore
from embstore.belady import belady_hits
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.simulator import pipeline_accesses, pipeline_min_keys
from embstore.training import TieredEmbeddingBagCollection, state_dim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import import_rows, nonneg_int, positive_int, zipf_ids  # noqa: E402


WARM_STEPS = 2  # untimed steps at the start of each run


def home_io(ebc: TieredEmbeddingBagCollection) -> np.ndarray:
    """(pages read, pages written, rows read) by the tables' ssd homes so far (4 KiB pages; zeros for other
    homes)."""
    total = np.zeros(3)
    for t in ebc.tables:
        st = t.stats().get("ssd")
        if st:
            total += (st["bytes_read"] / 4096, st["bytes_written"] / 4096, st["hits"])
    return total


def min_home_reads(batches, tables: int, lookahead: int, cache_rows: int, warm: int) -> dict:
    """The fewest rows any cache of ``cache_rows`` rows a table could leave to the homes under the look-ahead
    pipeline's reads and write-backs (``pipeline_min_keys``: write-backs fill a cache for free), over the
    whole run and over the timed steps (per step), beside the rows the pipeline reads from the store.

    The caches start empty, as the oversized runs' do (``run(..., reopen=True)``). MIN gets one row more than
    the cache: a cache that may decline to admit a row (TinyLFU) serves at most what MIN without bypass
    serves with one more row (that row holds the latest access). Every hit MIN finds over the whole run is
    credited to the timed steps too, so the per-step floor holds even where its hits fall in the untimed
    steps."""
    offs = np.cumsum([0] + [len(b[0][0]) for b in batches])
    timed = len(batches) - warm
    out = dict.fromkeys(("reads", "floor", "reads_per_step", "floor_per_step"), 0.0)
    for t in range(tables):
        keys = np.concatenate([b[0][t].numpy() for b in batches])
        steps = pipeline_accesses(keys, offs, lookahead)
        served = belady_hits(pipeline_min_keys(steps), cache_rows + 1)
        every = sum(r.size for _, r, _ in steps)
        late = sum(r.size for _, r, _ in steps[warm:])
        out["reads"] += every
        out["floor"] += max(0, every - served)
        out["reads_per_step"] += late / timed
        out["floor_per_step"] += max(0, late - served) / timed
    return out


def _hit_ratio(ebc: TieredEmbeddingBagCollection) -> float:
    """Hits / accesses of the tables' DRAM caches over the whole run."""
    hits = sum(t.stats()["dram"]["hits"] for t in ebc.tables)
    return hits / max(1, hits + sum(t.stats()["dram"]["misses"] for t in ebc.tables))


def run(path: str, tiers: tuple[TierConfig, ...], T: int, rows: int, D: int, batches, weights, k: int | None,
        imported: bool = True, announce: int = 0, reopen: bool = False) -> dict:
    """One training run; with ``reopen`` the store is closed and opened again after the import, so its
    caches start empty (as a training job's would after ``embstore import``), as Belady's MIN does."""
    names = [f"t{i}" for i in range(T)]
    store = embstore.create(path, StoreConfig(tuple(TableConfig(n, rows, D, tiers=tiers) for n in names)))
    ebc = TieredEmbeddingBagCollection(store, names, optimizer="rowwise_adagrad", lr=0.01)
    if imported:  # every row written (as after `embstore import`): misses now read real rows from the home
        import_rows(ebc.tables)
        store.flush()
        if reopen:
            ebc.release()
            store.close()
            store = embstore.open(path)
            ebc = TieredEmbeddingBagCollection(store, names, optimizer="rowwise_adagrad", lr=0.01)
    offs = batches[0][1]
    warm = WARM_STEPS
    t0, misses0 = 0.0, 0
    start_io = home_io(ebc)
    it = batches if k is None else ebc.pipeline(batches, lookahead=k, sparse=lambda b: b, announce=announce)
    io0 = np.zeros(3)
    for i, (ids, o) in enumerate(it):
        if i == warm:
            t0 = time.perf_counter()
            misses0 = ebc.counters["demand_misses"]
            io0 = home_io(ebc)
        out = ebc(ids, o)
        (out.square() * weights).sum().backward()
    ebc._drain()  # the timed steps' prefetches and write-backs are part of their cost
    dt = time.perf_counter() - t0
    reads, writes, _ = (home_io(ebc) - io0) / (len(batches) - warm)
    run_pages, _, run_rows = home_io(ebc) - start_io
    res = {"samples_per_s": (len(batches) - warm) * (len(offs[0]) - 1) / dt,
           "demand_misses": ebc.counters["demand_misses"] - misses0, "late_rows": ebc.counters["late_rows"],
           "stall_s": ebc.counters["stall_s"], "ssd_page_reads_per_step": reads, "ssd_page_writes_per_step": writes,
           "ssd_rows_read_in_run": run_rows, "ssd_pages_read_in_run": run_pages,
           "step_s": dt / (len(batches) - warm),
           "dram_hit_ratio": _hit_ratio(ebc)}
    ebc.release()
    store.close()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 tables x 100k rows, batch 1024, 8 steps")
    ap.add_argument("--steps", type=positive_int, default=None,
                    help=f"steps per run, the first {WARM_STEPS} untimed (default 12, quick 8)")
    ap.add_argument("--lookahead", type=nonneg_int, default=3, help="batches the look-ahead run prefetches")
    ap.add_argument("--announce", type=nonneg_int, default=0, metavar="A",
                    help="also run look-ahead k telling the caches batches A beyond it (default 0: no such run)")
    ap.add_argument("--policy", default="lru+tinylfu", help="the DRAM caches' policy (default lru+tinylfu)")
    ap.add_argument("--layout", choices=["in_place", "log"], default="log",
                    help="the ssd homes' layout (default log, as tune plans for caches holding part of a table); "
                         "log pays its slot maps (4 bytes a row) out of the 10%% DRAM budget, so its caches hold "
                         "fewer rows")
    ap.add_argument("--cold", action="store_true",
                    help="start from fresh tables (rows at their initial values, nothing on disk yet) instead of "
                         "tables whose every row was imported")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps <= WARM_STEPS:
        ap.error(f"--steps must be more than the {WARM_STEPS} untimed ones, got {args.steps}")
    T, rows, B = (4, 100_000, 1024) if args.quick else (8, 1_000_000, 4096)
    D, L = 64, 20
    steps = args.steps or (8 if args.quick else 12)
    rng = np.random.default_rng(0)
    n = B * L
    offs = torch.arange(0, n + 1, L, dtype=torch.int64)
    batches = [([torch.from_numpy(zipf_ids(rng, n, rows, 1.05)) for _ in range(T)], [offs] * T) for _ in range(steps)]
    weights = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32))
    row_bytes = 4 * (D + state_dim("rowwise_adagrad", D))
    full = (TierConfig("dram", rows * row_bytes), TierConfig("mmap"))
    budget = rows // 10 * row_bytes
    cache_rows = (budget - (4 * rows if args.layout == "log" else 0)) // row_bytes
    small = (TierConfig("dram", cache_rows * row_bytes, policy=args.policy), TierConfig("ssd", layout=args.layout))
    out: dict = {"tables": T, "rows": rows, "batch": B, "steps": steps, "lookahead": args.lookahead,
                 "policy": args.policy, "layout": args.layout, "cache_rows": cache_rows,
                 "start": "cold" if args.cold else "imported"}
    with tempfile.TemporaryDirectory() as tmp:
        out["resident"] = run(f"{tmp}/r", full, T, rows, D, batches, weights, None, not args.cold)
        out["oversized_k0"] = run(f"{tmp}/o0", small, T, rows, D, batches, weights, None, not args.cold,
                                  reopen=True)
        out["oversized_k"] = run(f"{tmp}/ok", small, T, rows, D, batches, weights, args.lookahead, not args.cold,
                                 reopen=True)
        if args.announce:
            out["oversized_told"] = run(f"{tmp}/ot", small, T, rows, D, batches, weights, args.lookahead,
                                        not args.cold, args.announce, reopen=True)
    base = out["resident"]["samples_per_s"]
    out["ratio_k0"] = out["oversized_k0"]["samples_per_s"] / base
    out["ratio_k"] = out["oversized_k"]["samples_per_s"] / base
    print(f"oversized training: {T} tables x {rows} rows (DRAM budget 10%: {cache_rows} cache rows, {args.policy}, "
          f"ssd homes {args.layout}), batch {B}, Zipf 1.05, {steps} steps, {out['start']} tables")
    print(f"  resident          {base:10.0f} samples/s")
    print(f"  10x, no lookahead {out['oversized_k0']['samples_per_s']:10.0f} samples/s  {out['ratio_k0']:.2f}x  "
          f"demand misses {out['oversized_k0']['demand_misses']}")
    print(f"  10x, lookahead {args.lookahead}  {out['oversized_k']['samples_per_s']:10.0f} samples/s  "
          f"{out['ratio_k']:.2f}x  demand misses {out['oversized_k']['demand_misses']} (goal >= 0.7x, 0 misses)")
    ok = out["oversized_k"]
    ios = ok["ssd_page_reads_per_step"] + ok["ssd_page_writes_per_step"]
    print(f"  ssd home per step (look-ahead run): {ok['ssd_page_reads_per_step']:.0f} page reads + "
          f"{ok['ssd_page_writes_per_step']:.0f} page writes in {1e3 * ok['step_s']:.0f} ms = "
          f"{ios / ok['step_s'] / 1e3:.1f} k IOPS; the resident step takes {1e3 * out['resident']['step_s']:.0f} ms")
    floor = min_home_reads(batches, T, args.lookahead, cache_rows, WARM_STEPS)
    # rows sharing a page cost one read; a layout's own extra reads (the log's cleaner) are no floor
    pages_per_row = min(1.0, ok["ssd_pages_read_in_run"] / max(1.0, ok["ssd_rows_read_in_run"]))
    least_io_s = floor["floor_per_step"] * pages_per_row / max(1.0, ios / ok["step_s"])
    out["ceiling"] = {**floor, "pages_per_home_row": pages_per_row, "min_io_s_per_step": least_io_s,
                      "ratio": out["resident"]["step_s"] / max(out["resident"]["step_s"], least_io_s)}
    print(f"  ceiling (Belady's MIN, {cache_rows} cache rows, look-ahead {args.lookahead}): of the "
          f"{floor['reads_per_step']:.0f} rows the pipeline reads a step, at least {floor['floor_per_step']:.0f} "
          f"come from the homes (whole run: at least {floor['floor']:.0f}; this run {ok['ssd_rows_read_in_run']:.0f} "
          f"rows in {ok['ssd_pages_read_in_run']:.0f} pages); at this run's {pages_per_row:.2f} pages a row and "
          f"IOPS that is >= {1e3 * least_io_s:.0f} ms of I/O a step: <= {out['ceiling']['ratio']:.2f}x even with "
          "the I/O hidden behind compute")
    if args.announce:
        told = out["oversized_told"]
        out["ratio_told"] = told["samples_per_s"] / base
        print(f"  10x, lookahead {args.lookahead}, announce {args.announce}  {told['samples_per_s']:10.0f} samples/s  "
              f"{out['ratio_told']:.2f}x; DRAM hit ratio {100 * told['dram_hit_ratio']:.1f}% (told nothing: "
              f"{100 * ok['dram_hit_ratio']:.1f}%); ssd page reads per step {told['ssd_page_reads_per_step']:.0f} "
              f"({told['ssd_page_reads_per_step'] / max(1.0, ok['ssd_page_reads_per_step']):.2f}x)")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
