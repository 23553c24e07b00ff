"""`embstore replay` and `embstore tune`: what-if runs of a trace through cache tiers."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from embstore.atomic import atomic_file, atomic_write
from embstore.progress import progress_bar
from embstore.commands.argtypes import nonneg_byte_size, nonneg_int, positive_int, unwritable
from embstore import costmodel, strict_json, traces
from embstore.belady import dedup_batches
from embstore.config import MAX_DIM, PolicySpec, RowDType
from embstore.errors import ConfigError, InvalidInputError
from embstore.rows import RowFormat
from embstore.simulator import (miss_ratio_curve, pipeline_accesses, pipeline_mrc, replay_keys, replay_pipeline,
                                table_keys)
from embstore.tiers.rocksdb import MEMTABLES
from embstore.tuning import POLICIES, TuneResult, tune


def _policies(text: str) -> list[str]:
    out = []
    for p in text.split(","):
        try:
            out.append(str(PolicySpec.parse(p.strip())))
        except ConfigError as exc:  # the reason alone: the flag is named, not a config key
            raise argparse.ArgumentTypeError(exc.reason) from None
    return out


def _capacities(text: str) -> list[int | float]:
    out: list[int | float] = []
    for part in text.split(","):
        s = part.strip()
        try:
            v = int(s)
            if v < 0:
                raise ValueError
            out.append(v)
            continue
        except ValueError:
            pass
        try:
            f = float(s)
        except ValueError:
            f = -1.0
        if not 0.0 < f <= 1.0:
            raise argparse.ArgumentTypeError(f"capacity {s!r}: give a row count (integer >= 0) or a fraction "
                                             "of unique ids in (0, 1]")
        out.append(f)
    return out


def _dim(text: str) -> int:
    """``tune --dim``: a table's dimension, refused as the flag before the trace is read (it was a
    'config key table.dim' error once the whole tuning had run)."""
    value = positive_int(text)
    if value > MAX_DIM:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_DIM}], got {value}")
    return value


def _nonempty(trace: traces.Trace, path: str, verb: str) -> traces.Trace:
    """A trace with no accesses has no hits to count nor caches to size: refused, not answered with zeros
    (a replay of nothing, a store config from nothing)."""
    if len(trace) == 0:
        raise InvalidInputError(f"trace file {path!r} has no accesses; nothing to {verb}")
    return trace


def _check_output(path: str | None, flag: str, suffix: str | None = None) -> None:
    """Refuse an output path that cannot be written before the work, not after it (replay and tune
    take minutes on real traces)."""
    if path is None:
        return
    p = Path(path)
    if suffix is not None and p.suffix.lower() != suffix:
        raise InvalidInputError(f"{flag} writes a {suffix[1:].upper()}; give a file name ending in {suffix}, "
                                f"got {path!r}")
    if p.is_dir() or path.endswith("/"):
        raise InvalidInputError(f"{flag}: {path!r} is a directory; name the file to write")
    if not p.resolve().parent.is_dir():
        raise InvalidInputError(f"{flag}: directory {str(p.parent)!r} does not exist")
    if (why := unwritable(p)) is not None:
        raise InvalidInputError(f"{flag}: cannot write {path!r}: {why}")


PIPELINE_HELP = ("model a training pipeline, ebc.pipeline(..., lookahead=K): its working set holds the rows of "
                 "the K + 1 batches in its window, so the caches see only the rows entering it (the hit ratios "
                 "are of those reads) and the rows leaving it, written back through them (default: lookups, "
                 "which read every batch whole)")


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "replay", help="replay a trace through cache sizes and policies",
        description="Replay a trace through one DRAM cache (per policy and capacity) over a home tier, with the "
                    "store's own policy code, and print hit ratios with Belady's optimum beside them, bytes "
                    "fetched from the home and the modelled time per batch (cost model: the saved calibration "
                    "if any, else built-in figures). Accesses are deduplicated per batch, as the store "
                    "reads each row of a lookup call once. One cache over all tables unless --per-table (a "
                    "store has one per table, and counts the same hits as --per-table). Several cache levels: "
                    "embstore.simulator.replay_trace.",
        epilog="example: embstore replay t.npz --policy lru,lfu --capacity 1000,0.05 --plot mrc.png")
    r.add_argument("trace", help="trace file: .npz, Meta's .pt / .pt.gz, or .csv")
    r.add_argument("--policy", type=_policies, default=["lru", "lfu", "clock", "lru+tinylfu"],
                   help="comma-separated policies (default lru,lfu,clock,lru+tinylfu)")
    r.add_argument("--capacity", type=_capacities, default=[0.01, 0.05, 0.1],
                   help="comma-separated row counts or fractions of unique ids (default 0.01,0.05,0.1)")
    r.add_argument("--per-table", action="store_true", help="one cache per table (as the store has)")
    r.add_argument("--row-bytes", type=positive_int, default=256, help="bytes per row (default 256)")
    r.add_argument("--lookahead", type=nonneg_int, default=0,
                   help="batches known ahead for prefetch; reports demand misses left (default 0)")
    r.add_argument("--announce", type=nonneg_int, default=None, metavar="K",
                   help="tell the cache each batch and the K after it before the batch is read "
                        "(Table.announce, as a training pipeline with announce=K does): it then keeps the rows "
                        "needed soonest, as Belady's MIN does inside that window (default: nothing announced)")
    r.add_argument("--pipeline", type=nonneg_int, default=None, metavar="K", help=PIPELINE_HELP)
    r.add_argument("--home", choices=["ssd", "mmap", "rocksdb"], default="ssd",
                   help="home tier for the modelled time (default ssd)")
    r.add_argument("--batch-size", type=positive_int, default=None,
                   help="for Meta's torch format: samples per batch (default: the whole file is one batch)")
    r.add_argument("--json", action="store_true", help="one JSON record per line per policy and capacity")
    r.add_argument("--plot", metavar="F.png", help="draw miss-ratio curves of each policy and Belady")
    r.set_defaults(func=cmd_replay)

    t = sub.add_parser(
        "tune", help="recommend tiers and policies for a memory budget",
        description="Size each table's caches on its own miss-ratio curve (greedy: bytes go where they buy "
                    "the most hits per byte), pick the best policy per table, place the home (rocksdb for "
                    "sparse id spaces, else ssd) and write the result as a store TOML (to --out, else printed "
                    "after the summary).",
        epilog="example: embstore tune t.npz --dram 2GiB --device 256MiB --dim 64 --out store.toml")
    t.add_argument("trace", help="trace file: .npz, Meta's .pt / .pt.gz, or .csv")
    t.add_argument("--dram", type=nonneg_byte_size, required=True,
                   help="all the DRAM the store may hold (cache rows, their directories, home indexes), e.g. 2GiB")
    t.add_argument("--device", type=nonneg_byte_size, default=0,
                   help="device (accelerator) budget, e.g. 256MiB (default 0: no device tier); where torch sees "
                        "no GPU a device tier is host memory, so its rows count against --dram as well")
    t.add_argument("--row-bytes", type=positive_int, default=None,
                   help=f"bytes per float32 row, a multiple of 4 up to {4 * MAX_DIM} (instead of --dim; default: from "
                        "--dim and --dtype)")
    t.add_argument("--dim", type=_dim, default=None, help=f"embedding dimension, at most {MAX_DIM} (default 64)")
    t.add_argument("--dtype", choices=[d.value for d in RowDType], default="float32",
                   help="row format of the tables; with --dim it sets the bytes per row (default float32)")
    t.add_argument("--policy", type=_policies, default=list(POLICIES),
                   help=f"comma-separated candidate policies (default {','.join(POLICIES)})")
    t.add_argument("--batch-size", type=positive_int, default=None,
                   help="for Meta's torch format: samples per batch (default: the whole file is one batch)")
    t.add_argument("--read-only", action="store_true",
                   help="the store will only serve lookups: evictions write nothing back, so no ssd home needs "
                        "the log layout's slot map (4 bytes a row) and its DRAM goes to the caches")
    t.add_argument("--announce", type=nonneg_int, default=None, metavar="K",
                   help="size the caches for a training pipeline that tells them each batch and the K after it "
                        "(ebc.pipeline(..., announce=K)): curves of the told policies, which keep the rows "
                        "needed soonest (default: caches told nothing, as for serving)")
    t.add_argument("--pipeline", type=nonneg_int, default=None, metavar="K", help=PIPELINE_HELP)
    t.add_argument("--out", metavar="store.toml",
                   help="write the recommended config here (without it, the TOML is printed after the summary)")
    t.add_argument("--json", action="store_true", help="print one JSON object (and no TOML)")
    t.set_defaults(func=cmd_tune)


TOML_MARK = "# recommended store config"  # heads the TOML tune prints when not given --out
HOST_DEVICE_TOML_NOTE = ("# tuned where torch sees no GPU: the device tiers' rows were counted in the DRAM budget "
                         "(they are host memory here)")


def _rows(cap: int | float, unique: int) -> int:
    return int(cap) if isinstance(cap, int) else max(1, int(round(cap * unique)))


def _simulated_rows(rows: int, unique: int) -> int:
    """A cache with more slots than the trace has distinct rows behaves as one with exactly that many
    (it never evicts); simulating that size keeps a huge ``--capacity`` from allocating its slots."""
    return min(rows, max(unique, 1))


def cmd_replay(args: argparse.Namespace) -> int:
    _check_output(args.plot, "--plot", ".png")
    if args.pipeline is not None and args.lookahead:
        raise InvalidInputError("give --pipeline K (a training pipeline's own look-ahead) or --lookahead "
                                "(prefetch into the cache), not both")
    trace = _nonempty(traces.load(args.trace, batch_size=args.batch_size), args.trace, "replay")
    cost = costmodel.default_model()
    groups: list[tuple[str, np.ndarray, np.ndarray]] = []
    if args.per_table:
        for i, name in enumerate(trace.table_names):
            ids, off = table_keys(trace, i)
            if ids.size and ids.min() < 0:
                raise InvalidInputError(f"table {name!r} has negative ids; the store cannot look them up")
            groups.append((name, *dedup_batches(ids, off)))
    else:
        keys, _ = traces.dense_keys(trace)
        groups.append(("all", *dedup_batches(keys, trace.batch_offsets)))
    records, merged = [], []
    total = len(groups) * len(args.policy) * len(args.capacity)
    with progress_bar(total=total, desc="replay", unit="run", leave=False) as bar:
        for name, k, o in groups:
            uniq = int(np.unique(k).size)
            sizes = [_rows(cap, uniq) for cap in args.capacity]
            # fractions of a small table's distinct rows can round to one size: one record for it
            merged += [(name, cap, rows) for i, (cap, rows) in enumerate(zip(args.capacity, sizes))
                       if rows in sizes[:i]]
            for pol in args.policy:
                bar.update(len(sizes) - len(set(sizes)))
                for rows in dict.fromkeys(sizes):  # each size once, in the order asked
                    level = [(pol, _simulated_rows(rows, uniq))]
                    res = replay_keys(k, o, level, row_bytes=args.row_bytes, lookahead=args.lookahead, dedup=False,
                                      announce=args.announce) if args.pipeline is None else \
                        replay_pipeline(k, o, level, lookahead=args.pipeline, announce=args.announce,
                                        row_bytes=args.row_bytes)
                    lv = res.levels[0]
                    secs = cost.batch_seconds([("dram", lv.hits), (args.home, lv.misses)]) / max(1, res.batches)
                    # a table the trace never reads has no hit ratio: NaN here, null in --json
                    ratios = (lv.hit_ratio, lv.belady_hit_ratio) if res.accesses else (math.nan, math.nan)
                    rec = {"policy": pol, "capacity_rows": rows, "accesses": res.accesses, "hits": lv.hits,
                           "hit_ratio": ratios[0], "belady_hit_ratio": ratios[1]}
                    if args.per_table:
                        rec["table"] = name
                    if args.announce is not None:
                        rec["announce"] = args.announce
                    rec.update(bytes_read=lv.bytes_read, bytes_fetched=lv.bytes_in,
                               modelled_seconds_per_batch=secs, lookahead=res.lookahead,
                               demand_misses=res.demand_misses)
                    if args.pipeline is not None:
                        rec.update(pipeline=args.pipeline, home_writes=res.extra["home_writes"])
                    records.append(rec)
                    bar.update(1)
    if args.json:
        for rec in records:
            print(strict_json.dumps(rec))
    else:
        sys.stdout.write(_format_replay(records, args, cost))
        for name, cap, rows in merged:
            print(f"table {name}: capacity {cap} rounds to {rows:,} row{'s' * (rows != 1)} as an earlier one "
                  f"does; shown once")
    if args.plot:
        _plot(groups, args.policy, args.plot, args.capacity, args.announce, args.pipeline)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _pct(ratio: float, width: int) -> str:
    """A hit ratio as a percentage, '-' where it is undefined (no accesses)."""
    return f"{100 * ratio:{width}.2f}" if math.isfinite(ratio) else f"{'-':>{width}}"


def _format_replay(records: list[dict], args: argparse.Namespace, cost: costmodel.CostModel) -> str:
    src = "calibrated" if cost.measured else "built-in"
    lines = [f"trace {args.trace}: accesses are per-batch deduplicated; modelled time: {src} costs, "
             f"DRAM cache over {args.home}, {args.row_bytes} B rows"
             + (f"; each batch announced {args.announce} batches ahead" if args.announce is not None else "")
             + (f"; a training pipeline with lookahead={args.pipeline}: accesses are the rows entering its "
                "working set, and 'to home' the dirty rows the cache wrote back" if args.pipeline is not None
                else "")]
    head = f"{'table':<12} {'policy':<12} {'capacity':>10} {'hit %':>7} {'belady %':>9} {'of MIN':>7} " \
           f"{'fetched MiB':>12} {'ms/batch':>9}"
    if args.lookahead:
        head += f" {'demand miss':>12}"
    if args.pipeline is not None:
        head += f" {'to home':>10}"
    lines.append(head)
    for r in records:
        # no hit is possible (a capacity of 0, or no row used twice): the share of MIN is undefined
        # (a table with no accesses: every ratio is undefined)
        hit, best = r["hit_ratio"], r["belady_hit_ratio"]
        share = f"{100 * hit / best:6.1f}%" if best and math.isfinite(best) else f"{'-':>7}"
        line = (f"{r.get('table', 'all'):<12} {r['policy']:<12} {r['capacity_rows']:>10,} "
                f"{_pct(hit, 7)} {_pct(best, 9)} {share} "
                f"{r['bytes_fetched'] / 2**20:12.2f} {1e3 * r['modelled_seconds_per_batch']:9.3f}")
        if args.lookahead:
            line += f" {r['demand_misses']:>12,}"
        if args.pipeline is not None:
            line += f" {r['home_writes']:>10,}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _plot(groups, policies: list[str], path: str, marks: list[int | float] = (), announce: int | None = None,
          pipeline: int | None = None) -> None:
    """Miss ratio against capacity as a share of the distinct rows (log scale), one panel per group;
    Belady's MIN dashed, the capacities asked for as dotted verticals (policies told ``announce`` batches
    ahead when given; the reads of a training pipeline with ``lookahead=pipeline`` when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check_output(path, "--plot", ".png")
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    with progress_bar(total=len(groups) * (len(policies) + 1), desc="curves", unit="curve", leave=False) as bar:
        for ax, (name, k, o) in zip(axes[0], groups):
            if not k.size:  # a table the trace never reads: no curve to draw (a miss ratio of 1 would be made up)
                ax.text(0.5, 0.5, "no accesses", ha="center", va="center", transform=ax.transAxes)
                ax.set_title(f"miss-ratio curves: {name}")
                ax.set_xticks([]), ax.set_yticks([])
                bar.update(len(policies) + 1)
                continue
            uniq = int(np.unique(k).size)
            caps = np.unique(np.geomspace(max(1.0, uniq / 10_000), uniq, num=32).astype(np.int64))
            n = max(1, k.size if pipeline is None else sum(r.size for _, r, _ in pipeline_accesses(k, o, pipeline)))
            for i, pol in enumerate([*policies, "belady"]):
                ahead = None if pol == "belady" else announce
                hits = miss_ratio_curve(k, o, caps, pol, dedup=False, announce=ahead) if pipeline is None else \
                    pipeline_mrc(k, o, caps, pol, lookahead=pipeline, announce=ahead)
                style = dict(color="black", linestyle="--") if pol == "belady" else \
                    dict(linestyle=("-", "-.", ":")[i % 3], linewidth=1.6)
                label = pol if ahead is None else f"{pol}, announced {announce}"
                ax.plot(100 * caps / uniq, 1 - hits / n, label=label, **style)
                bar.update(1)
            for cap in marks:
                ax.axvline(100 * _rows(cap, uniq) / uniq, color="grey", linestyle=":", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel(f"cache capacity (% of the {uniq:,} distinct rows)")
            ax.set_ylabel("miss ratio")
            ax.set_title(f"miss-ratio curves: {name}" + ("" if pipeline is None else
                                                           f" (pipeline reads, lookahead={pipeline})"))
            ax.legend()
    fig.tight_layout()
    try:
        with atomic_file(path) as f:  # a full disk mid-write leaves no half-drawn PNG
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)


def _span(sizes: list[int]) -> str:
    """``4.0 MiB`` or ``1.0-4.4 MiB``: the range of per-home sizes, short enough for one line."""
    lo, hi = min(sizes) / (1 << 20), max(sizes) / (1 << 20)
    return f"{lo:.1f} MiB" if lo == hi else f"{lo:.1f}-{hi:.1f} MiB"


def _announce_note(k: int) -> str:
    """The TOML comment that says the sizes assume told caches (the store config itself has no such field)."""
    return (f"# tuned for caches told each batch and the {k} after it: train with "
            f"ebc.pipeline(..., announce={k})")


def _device_in_host(device_bytes: int) -> bool:
    """Whether a device tier planned here would be a tensor in host memory: a device budget on a machine
    where torch sees no GPU (a device tier's ``device = "auto"`` then takes the CPU)."""
    if not device_bytes:
        return False
    import torch

    return not torch.cuda.is_available()


def _host_device_note(res: TuneResult) -> str:
    """The summary line saying that the device budget came out of host memory, and why."""
    return (f"note         torch sees no GPU here, so a device tier is a tensor in host memory: its rows "
            f"({res.dram_breakdown()['device_rows']:,} B) are counted in --dram as well as --device; "
            "tune on the GPU machine to give them a budget of their own")


def cmd_tune(args: argparse.Namespace) -> int:
    _check_output(args.out, "--out")
    if args.row_bytes is not None and args.dim is not None:  # the flags are checked before the trace is read
        raise InvalidInputError("give --row-bytes or --dim (with --dtype), not both")
    if args.row_bytes is not None:
        if args.dtype != "float32" or args.row_bytes % 4 or args.row_bytes > 4 * MAX_DIM:
            raise InvalidInputError(f"--row-bytes means float32 rows of row_bytes/4 values: give a multiple of 4 "
                                    f"up to {4 * MAX_DIM} (or use --dim with --dtype), got {args.row_bytes}")
        dim = args.row_bytes // 4
    else:
        dim = args.dim or 64
    row_bytes = RowFormat(dim, RowDType(args.dtype)).row_bytes
    trace = _nonempty(traces.load(args.trace, batch_size=args.batch_size), args.trace, "tune")
    cost = costmodel.default_model()
    runs = [args.announce] if args.announce is None else [args.announce, None]  # told: and the plan told nothing
    in_host = _device_in_host(args.device)
    with progress_bar(total=len(runs) * trace.num_tables, desc="tune", unit="table", leave=False) as bar:
        res, *plain = [tune(trace, args.dram, args.device, row_bytes=row_bytes, dim=dim, dtype=args.dtype,
                            policies=args.policy, cost=cost, progress=bar.update, read_only=args.read_only,
                            announce=k, device_in_host=in_host, pipeline=args.pipeline) for k in runs]
    untold = plain[0].totals()["cache_hit_ratio"] if plain else None
    cfg = res.config()
    toml = (_announce_note(args.announce) + "\n" if args.announce is not None else "") + \
        (f"# tuned for a training pipeline: train with ebc.pipeline(..., lookahead={args.pipeline})\n"
         if args.pipeline is not None else "") + \
        (HOST_DEVICE_TOML_NOTE + "\n" if in_host else "") + cfg.to_toml()
    if args.out:
        atomic_write(args.out, toml.encode())
    tot = res.totals()
    dev_used, dram_used = res.used_bytes()
    parts = res.dram_breakdown()
    if args.json:
        print(json.dumps({"trace": args.trace, "out": args.out, "row_bytes": row_bytes, "announce": res.announce,
                          "pipeline": res.pipeline,
                          "device_in_host": res.device_in_host,
                          "told_nothing_cache_hit_ratio": untold,
                          "device_bytes_used": dev_used, "dram_bytes_used": dram_used, "dram_breakdown": parts,
                          **tot,
                          "tables": [{"name": p.name, "accesses": p.accesses, "unique_rows": p.unique_rows,
                                      "bandwidth_per_byte": p.bandwidth_per_byte, "home": p.home,
                                      "device_rows": p.device_rows, "device_policy": p.device_policy,
                                      "dram_rows": p.dram_rows, "dram_policy": p.dram_policy,
                                      "layout": p.layout if p.home == "ssd" else None,
                                      "block_cache": p.block_cache if p.home == "rocksdb" else None,
                                      "write_buffer": p.write_buffer if p.home == "rocksdb" else None}
                                     for p in res.tables]}))
        return 0
    lines = [f"{'table':<14} {'acc/byte':>9} {'device rows':>12} {'policy':<12} {'dram rows':>10} {'policy':<12} "
             f"{'home':<12} {'hit %':>6}"]
    for p in res.tables:
        hits = sum(lv.hits for lv in p.result.levels) if p.result else 0
        lines.append(f"{p.name:<14} {p.bandwidth_per_byte:9.3g} {p.device_rows:>12,} "
                     f"{p.device_policy if p.device_rows else '-':<12} {p.dram_rows:>10,} "
                     f"{p.dram_policy if p.dram_rows else '-':<12} "
                     f"{p.home + ('/' + p.layout if p.home == 'ssd' else ''):<12} "
                     f"{100 * hits / max(1, p.accesses):6.2f}")
    rocks = [p for p in res.tables if p.home == "rocksdb"]
    of_what = "deduplicated accesses" if res.pipeline is None else \
        f"the rows a training pipeline with lookahead={res.pipeline} reads from the store"
    lines += [
        f"budget used  device {dev_used:,} of {args.device:,} B, DRAM {dram_used:,} of {args.dram:,} B "
        f"(cache rows {parts['cache_rows']:,}, cache directories {parts['cache_directories']:,}, "
        + (f"look-ahead state {parts['look_ahead']:,}, " if res.announce is not None else "") +
        f"home indexes {parts['home_indexes']:,}"
        + (f", rocksdb block caches + memtables {parts['rocksdb_buffers']:,}" if rocks else "")
        + (f", device rows in host memory {parts['device_rows']:,}" if res.device_in_host else "") + ")",
    ]
    if res.device_in_host:
        lines.append(_host_device_note(res))
    if rocks:
        lines.append(f"rocksdb      {len(rocks)} home(s): block cache {_span([p.block_cache for p in rocks])}, "
                     f"memtables {_span([p.write_buffer for p in rocks])} x {MEMTABLES} each (RocksDB's defaults: 64 MiB, "
                     f"64 MiB x {MEMTABLES})")
    lines += [
        f"expected     device hits {100 * tot['device_hit_ratio']:.2f}%, DRAM hits {100 * tot['dram_hit_ratio']:.2f}%,"
        f" all caches {100 * tot['cache_hit_ratio']:.2f}% of {of_what}"
        + (f", caches told {res.announce} batches ahead" if res.announce is not None else ""),
        *([f"told nothing {100 * untold:.2f}% of {of_what} from all caches under the same budget "
           "(which needs no look-ahead state)"]
          if plain else []),
        f"modelled     {1e3 * tot['seconds_per_batch']:.3f} ms/batch vs all-DRAM "
        f"{1e3 * tot['all_dram_seconds_per_batch']:.3f} ms/batch "
        f"({'calibrated' if cost.measured else 'built-in'} costs)",
    ]
    if dram_used > args.dram:
        what = "the homes' indexes" + (", RocksDB's smallest block caches and memtables" if rocks else "")
        lines.append(f"warning      {what} and the device caches' directories alone need "
                     f"{dram_used - parts['cache_rows']:,} B of DRAM, more than --dram {args.dram:,}: "
                     f"no DRAM cache fits; raise the budget")
    if args.out:
        lines.append(f"wrote {args.out}")
    else:  # the recommendation is the point of the run: never lose it
        lines += ["", f"{TOML_MARK} (--out FILE writes it to a file)", toml.rstrip("\n")]
    print("\n".join(lines))
    return 0
