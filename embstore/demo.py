"""`embstore demo`: the main job end to end on a synthetic click set, nothing external to start.

Four stages, each printed as it runs::

    1. trace  a short run of the click stream looked up through a probe store, recorded
              (embstore.recorder) -> trace.npz; `tune` picks each table's DRAM cache size and
              policy for a small DRAM budget -> tuned.toml
    2. train  a DLRM on the same stream (training.trainer.train) out of a store with the tuned
              caches over io_uring SSD homes; the largest table is several times the DRAM
              budget; look-ahead prefetch; held-out AUC / log loss / NE, curves.png, metrics.json
    3. serve  the lookup server (uvicorn on a free loopback port) on the trained store: rows and
              pooled bags through LookupClient must equal direct reads, and held-out samples are
              scored with the served model (predict), which must equal scoring it directly
    4. where  the store, trace, tuned TOML, curves and metrics

``run(out, quick=..., steps=...)`` returns a summary dict (the test checks it).
Full size (a 2M-row largest table, 1,200 steps of 1,024 samples) takes about 80 s on two
cores; ``--quick`` about ten seconds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embstore.atomic import atomic_write
from embstore import strict_json
from embstore.errors import InvalidInputError

__all__ = ["DemoSize", "FULL", "QUICK", "run"]


@dataclass(frozen=True)
class DemoSize:
    """Everything that scales: table rows, DRAM budget, batches."""

    user_rows: int  # the largest table (several times the DRAM budget)
    item_rows: int
    site_rows: int
    device_rows: int  # mod-hashed from a 10**9 raw id space
    dram_budget: int  # bytes for all tables' DRAM caches together
    batch_size: int
    steps: int
    trace_batches: int
    eval_batches: int
    served_samples: int  # held-out samples scored through the server


FULL = DemoSize(user_rows=2_000_000, item_rows=200_000, site_rows=2_000, device_rows=100_000,
                dram_budget=2 << 20, batch_size=1024, steps=1200, trace_batches=200, eval_batches=10,
                served_samples=4096)
QUICK = DemoSize(user_rows=20_000, item_rows=5_000, site_rows=200, device_rows=2_000,
                 dram_budget=256 << 10, batch_size=256, steps=60, trace_batches=10, eval_batches=4,
                 served_samples=512)

DIM = 16
NUM_DENSE = 13
SPARSE_OPTIMIZER = "rowwise_adagrad"
LOOKAHEAD = 2
SEED = 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tables(size: DemoSize) -> list[tuple[str, int, int, bool]]:
    """(name, rows, raw id space, hashed) of each table; the label depends on the first two."""
    return [("user", size.user_rows, size.user_rows, False),
            ("item", size.item_rows, size.item_rows, False),
            ("site", size.site_rows, size.site_rows, False),
            ("device", size.device_rows, 10**9, True)]


def _clicks(size: DemoSize, steps: int) -> Any:
    from embstore.training.data import SyntheticClicks

    return SyntheticClicks(tuple(space for _, _, space, _ in _tables(size)), size.batch_size, max(steps, 1),
                           NUM_DENSE, zipf_alpha=1.05, bag_min=1, bag_max=2, signal_tables=2, signal=2.0,
                           seed=SEED)


def _row_bytes() -> int:
    """Bytes of one training row: float32 embedding plus its optimizer state (what a cache slot holds)."""
    from embstore.rows import RowFormat
    from embstore.training.optim import state_dim

    return RowFormat(DIM, "float32", state_dim(SPARSE_OPTIMIZER, DIM)).row_bytes


# --------------------------------------------------------------------------- 1. trace and tune
def record_trace(size: DemoSize, steps: int, base: Path, say: Callable[..., None]) -> Path:
    """Look the first batches of the click stream up through a probe store and record what its tiers see."""
    import embstore
    from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
    from embstore.recorder import record

    probe_path = base / "probe_store"
    tables = tuple(TableConfig(name, rows, DIM, hash=HashConfig("mod") if hashed else HashConfig("none"),
                               tiers=(TierConfig("dram", 64 << 10, "lru"), TierConfig("mmap")))
                   for name, rows, _, hashed in _tables(size))
    clicks = _clicks(size, steps)
    trace_path = base / "trace.npz"
    with embstore.create(probe_path, StoreConfig(tables)) as probe, record(probe, trace_path) as rec:
        for i in range(min(size.trace_batches, clicks.num_batches)):
            batch = clicks.batch(i)
            for (name, *_), ids, offsets in zip(_tables(size), batch.ids, batch.offsets):
                probe[name].lookup_pooled(ids.numpy(), offsets.numpy())
        trace = rec.trace()
    shutil.rmtree(probe_path)
    say(f"   recorded {trace.ids.size:,} row reads in {trace.num_batches} lookup calls "
        f"({min(size.trace_batches, clicks.num_batches)} batches x {len(tables)} tables) -> {trace_path}")
    return trace_path


def tune_tiers(trace_path: Path, size: DemoSize, base: Path, say: Callable[..., None]) -> tuple[Any, Path]:
    """``tune`` the recorded trace for the DRAM budget; print and save the recommendation."""
    from embstore import traces
    from embstore.tuning import tune

    trace = traces.load(trace_path)
    res = tune(trace, size.dram_budget, 0, row_bytes=_row_bytes(), dim=DIM, pipeline=LOOKAHEAD)
    tuned_path = base / "tuned.toml"
    atomic_write(tuned_path, res.config().to_toml().encode())
    say(f"   {'table':<8} {'rows':>9} {'unique':>8} {'acc/byte':>9} {'dram rows':>10} {'policy':<12} "
        f"{'home':<5} {'hit %':>6}")
    rows = {name: n for name, n, _, _ in _tables(size)}
    for p in res.tables:
        hits = sum(lv.hits for lv in p.result.levels) if p.result else 0
        say(f"   {p.name:<8} {rows[p.name]:>9,} {p.unique_rows:>8,} {p.bandwidth_per_byte:9.3g} "
            f"{p.dram_rows:>10,} {p.dram_policy if p.dram_rows else '-':<12} {p.home:<5} "
            f"{100 * hits / max(1, p.accesses):6.1f}")
    tot = res.totals()
    parts = res.dram_breakdown()
    say(f"   DRAM used {_fmt_bytes(res.used_bytes()[1])} of {_fmt_bytes(size.dram_budget)} (cache rows "
        f"{_fmt_bytes(parts['cache_rows'])}, their directories {_fmt_bytes(parts['cache_directories'])}, home "
        f"indexes {_fmt_bytes(parts['home_indexes'])}); expected "
        f"{100 * tot['cache_hit_ratio']:.1f}% of the rows training's pipeline (look-ahead {LOOKAHEAD}) reads from "
        f"the store served from DRAM -> {tuned_path}")
    return res, tuned_path


# --------------------------------------------------------------------------- 2. train
def train_config(size: DemoSize, steps: int, plan: Any) -> Any:
    """The training run: the tuned DRAM caches over SSD homes, built in code."""
    from embstore.config import HashConfig, InitConfig, TableConfig, TierConfig
    from embstore.training.trainer import DataConfig, ModelConfig, ScheduleConfig, StoreSection, TrainConfig

    row_bytes = _row_bytes()
    plans = {p.name: p for p in plan.tables}
    tables = []
    for name, rows, _, hashed in _tables(size):
        p = plans[name]
        dram_rows = min(p.dram_rows, rows)
        tiers = ((TierConfig("dram", dram_rows * row_bytes, p.dram_policy),) if dram_rows else ()) + \
            (TierConfig("ssd"),)
        tables.append(TableConfig(name, rows, DIM, init=InitConfig("uniform", 0.05),
                                  hash=HashConfig("mod") if hashed else HashConfig("none"), tiers=tiers))
    data = DataConfig(kind="synthetic", batch_size=size.batch_size, train_batches=steps,
                      eval_batches=size.eval_batches, num_dense=NUM_DENSE, bag_min=1, bag_max=2,
                      id_space=tuple(space for _, _, space, _ in _tables(size)))
    model = ModelConfig(dense_arch=(32, DIM), over_arch=(64, 32, 1), sparse_optimizer=SPARSE_OPTIMIZER)
    schedule = ScheduleConfig(epochs=1, eval_every=max(1, steps // 4), lookahead=LOOKAHEAD, dense_lr=0.02,
                              sparse_lr=0.05, seed=SEED)
    return TrainConfig(data, model, StoreSection("", tuple(tables)), schedule)


def _metric(value: float) -> str:
    """A metric for a line of text: 'undefined' where it is NaN (an AUC over one-class labels)."""
    return "undefined (one-class labels)" if math.isnan(value) else f"{value:.4f}"


def held_whole(size: DemoSize, plan: Any) -> list[str]:
    """Tables the plan gives a DRAM tier of every row: training steps them in place, so their rows never
    pass through a cache (no tier counts their reads) and no hit ratio, expected or served, includes them."""
    rows = {name: n for name, n, _, _ in _tables(size)}
    return [p.name for p in plan.tables if p.dram_rows >= rows[p.name]]


def dram_hit_ratio(tier_stats: dict[str, dict], skip: Sequence[str] = ()) -> float | None:
    """DRAM hits over the rows read from each table's top tier, tables in ``skip`` left out: what tune's
    ``expected_dram_hit_ratio`` predicts. None where no table has a DRAM tier, or nothing was read."""
    tables = [st for name, st in tier_stats.items() if name not in skip and st]
    reads = sum(top["hits"] + top["misses"] for top in (next(iter(st.values())) for st in tables))  # fastest first
    if not reads or not any("dram" in st for st in tables):
        return None
    return sum(st["dram"]["hits"] for st in tables if "dram" in st) / reads


def expected_dram_hit_ratio(plan: Any, skip: Sequence[str] = ()) -> float | None:
    """The share of the recorded reads tune's plan serves from DRAM, tables in ``skip`` left out."""
    tables = [p for p in plan.tables if p.name not in skip]
    reads = sum(p.accesses for p in tables)
    return sum(sum(lv.hits for lv in p.result.levels) for p in tables if p.result) / reads if reads else None


# --------------------------------------------------------------------------- 3. serve
def _direct_reads(store_path: Path, size: DemoSize, cfg: Any) -> dict[str, Any]:
    """Rows, pooled bags and scores read straight from the store (before the server opens it)."""
    import torch

    import embstore
    from embstore.training.registry import load_model, predict

    rng = np.random.default_rng(7)
    user_ids = np.concatenate([rng.integers(0, size.user_rows, 200), [0, size.user_rows - 1]]).astype(np.int64)
    bag_ids = rng.integers(0, size.item_rows, 40).astype(np.int64)
    bag_offsets = np.array([0, 5, 5, 17, 40], np.int64)  # bags of 5, 0, 12 and 23 ids
    device_ids = np.array([7, 123_456_789, 999_999_999], np.int64)  # raw ids of the hashed table
    samples = _holdout(size, cfg)
    with embstore.open(store_path) as store:
        rows = store["user"].lookup(user_ids)
        device_rows = store["device"].lookup(device_ids)
        pooled = store["item"].lookup_pooled(bag_ids, bag_offsets, mode="sum")
        model = load_model(store, "dlrm")
        k = min(256, len(samples["labels"]))
        scores = predict(model, torch.from_numpy(samples["dense"][:k]),
                         [torch.from_numpy(i) for i in samples["ids_head"]],
                         [torch.from_numpy(o) for o in samples["offsets_head"]]).numpy()
        model.sparse_arch.ebc.release()
    return {"user_ids": user_ids, "rows": rows, "device_ids": device_ids, "device_rows": device_rows,
            "bag_ids": bag_ids, "bag_offsets": bag_offsets, "pooled": pooled, "samples": samples,
            "direct_scores": scores}


def _holdout(size: DemoSize, cfg: Any) -> dict[str, Any]:
    """Held-out samples (never trained on), as per-table bag lists for the server and flat arrays."""
    from embstore.client import bags
    from embstore.training.trainer import Batches

    need, dense, labels = size.served_samples, [], []
    sparse: dict[str, list[list[int]]] = {name: [] for name, *_ in _tables(size)}
    head_ids, head_offsets = None, None
    for batch in Batches(cfg, 1).holdout():
        if head_ids is None:  # the first batch's first 256 samples, for the direct-vs-served check
            k = min(256, batch.size)
            head_offsets = [o[:k + 1].numpy() for o in batch.offsets]
            head_ids = [i[:int(o[-1])].numpy() for i, o in zip(batch.ids, head_offsets)]
        # a client sends raw features (predict applies the model's log1p, as training's reader did):
        # the synthetic source's features are log1p of raw values, so expm1 gives them back
        dense.append(np.expm1(batch.dense.numpy().astype(np.float64)))
        labels.append(batch.labels.numpy())
        for (name, *_), ids, offsets in zip(_tables(size), batch.ids, batch.offsets):
            sparse[name].extend(bags(ids.numpy(), offsets.numpy()))
        if sum(len(x) for x in labels) >= need:
            break
    n = min(need, sum(len(x) for x in labels))
    return {"dense": np.concatenate(dense)[:n], "labels": np.concatenate(labels)[:n],
            "sparse": {t: b[:n] for t, b in sparse.items()}, "ids_head": head_ids, "offsets_head": head_offsets}


def serve_and_check(store_path: Path, size: DemoSize, cfg: Any, say: Callable[..., None]) -> dict[str, Any]:
    """Serve the trained store; lookups and scores through the client must equal the direct reads."""
    from embstore.client import LookupClient
    from embstore.server import ServerSettings, create_app
    from embstore.server.testing import ServerThread
    from embstore.training.metrics import auc

    direct = _direct_reads(store_path, size, cfg)
    samples = direct["samples"]
    with ServerThread(create_app(ServerSettings(store=store_path))) as srv, LookupClient(srv.url) as client:
        say(f"   server up at {srv.url}; tables {[t['name'] for t in client.tables()]}, "
            f"models {[m['name'] for m in client.models()]}")
        rows = client.lookup("user", direct["user_ids"])
        device_rows = client.lookup("device", direct["device_ids"])
        pooled = client.lookup_pooled("item", direct["bag_ids"], direct["bag_offsets"], mode="sum")
        rows_equal = bool(np.array_equal(rows, direct["rows"]) and np.array_equal(device_rows, direct["device_rows"]))
        pooled_equal = bool(np.allclose(pooled, direct["pooled"], rtol=1e-6, atol=1e-7))
        say(f"   {len(rows)} user rows + {len(device_rows)} hashed device rows: "
            f"{'equal to' if rows_equal else 'DIFFERENT FROM'} direct reads (bit for bit)")
        say(f"   {len(pooled)} pooled item bags (sizes {np.diff(direct['bag_offsets']).tolist()}): "
            f"{'equal to' if pooled_equal else 'DIFFERENT FROM'} direct pooled reads")
        t0 = time.perf_counter()
        chunk = 1024
        scores = np.concatenate([
            client.predict("dlrm", samples["dense"][lo:lo + chunk],
                           {t: b[lo:lo + chunk] for t, b in samples["sparse"].items()})
            for lo in range(0, len(samples["labels"]), chunk)])
        predict_s = time.perf_counter() - t0
    k = len(direct["direct_scores"])
    scores_equal = bool(np.allclose(scores[:k], direct["direct_scores"], rtol=0, atol=1e-6))
    served_auc = float(auc(samples["labels"], scores))
    say(f"   scored {len(scores):,} held-out samples with the served model in {predict_s:.2f} s; first five: "
        + ", ".join(f"{s:.3f} (clicked {int(y)})" for s, y in zip(scores[:5], samples["labels"][:5])))
    say(f"   served AUC {_metric(served_auc)}; the first {k} scores {'equal' if scores_equal else 'DIFFER FROM'} "
        "the model scored directly from the store")
    return {"rows_equal": rows_equal, "pooled_equal": pooled_equal, "scores_equal": scores_equal,
            "served_auc": served_auc, "served_samples": int(len(scores)), "first_scores": scores[:5].tolist()}


# --------------------------------------------------------------------------- the whole job
@contextlib.contextmanager
def _quiet_logs(names: tuple[str, ...] = ("httpx", "embstore.store")) -> Iterator[None]:
    """Keep per-request and per-table INFO lines out of the demo's own progress output."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run(out_dir: str | Path | None = None, *, quick: bool = False, steps: int | None = None,
        quiet: bool = False) -> dict[str, Any]:
    """Run the demo (see the module doc); returns a summary of what it did and where the files are."""
    with _quiet_logs():
        return _run(out_dir, quick, steps, quiet)


def _run(out_dir: str | Path | None, quick: bool, steps: int | None, quiet: bool) -> dict[str, Any]:
    from embstore.training.trainer import eval_line, train

    say: Callable[..., None] = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    size = QUICK if quick else FULL
    steps = size.steps if steps is None else steps
    if steps < 1:
        raise InvalidInputError(f"steps must be >= 1, got {steps}")
    base = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="embstore-demo-"))
    if base.exists() and not base.is_dir():  # mkdir's own error was a bare '[Errno 17] File exists'
        raise InvalidInputError(f"{base} is a file; give a new folder for the demo's output")
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / "train"
    if run_dir.exists() or (base / "probe_store").exists():
        raise InvalidInputError(f"{base} already holds a demo run; give a new --out")
    timings: dict[str, float] = {}
    row_bytes = _row_bytes()
    largest = size.user_rows * row_bytes
    say(f"embstore demo{' (quick)' if quick else ''}: synthetic clicks, 4 tables of dim {DIM}, "
        f"{steps} steps of {size.batch_size} samples, DRAM budget {_fmt_bytes(size.dram_budget)} "
        f"(largest table 'user': {size.user_rows:,} rows = {_fmt_bytes(largest)}, "
        f"{largest / size.dram_budget:.1f}x the budget); output in {base}")

    t0 = time.perf_counter()
    say(f"\n1. recording a short run ({size.trace_batches} batches) and tuning tiers for "
        f"{_fmt_bytes(size.dram_budget)} of DRAM")
    trace_path = record_trace(size, steps, base, say)
    plan, tuned_path = tune_tiers(trace_path, size, base, say)
    timings["trace_and_tune_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    cfg = train_config(size, steps, plan)
    say(f"\n2. training a DLRM ({cfg.model.interaction} interaction, {SPARSE_OPTIMIZER} rows, look-ahead "
        f"{LOOKAHEAD}) out of the tuned store: DRAM caches over io_uring SSD homes")
    for t in cfg.store.tables:
        tiers = " -> ".join(f"{tc.kind.value}" + (f" {_fmt_bytes(tc.capacity)} {tc.policy}" if tc.capacity else "")
                            for tc in t.tiers)
        say(f"   {t.name:<8} {t.num_embeddings:>9,} rows  {tiers}")
    result = train(cfg, run_dir, progress=not quiet)
    timings["train_s"] = time.perf_counter() - t0
    last = result.evals[-1][1]
    store_path = run_dir / "store"
    say(f"   trained {result.step} steps at {result.samples_per_s:,.0f} samples/s: held-out {eval_line(last)} "
        f"({last.samples:,} samples, CTR {last.ctr:.3f})")
    whole = held_whole(size, plan)
    served_dram, expected_dram = dram_hit_ratio(result.tier_stats, whole), expected_dram_hit_ratio(plan, whole)
    if served_dram is not None and expected_dram is not None:
        part = f" of the tables cached in part ({', '.join(whole)} held whole in DRAM, trained in place)" \
            if whole else ""
        say(f"   the DRAM caches served {100 * served_dram:.1f}% of the rows the run read from the store{part} "
            f"(tune expected {100 * expected_dram:.1f}% of them over the {size.trace_batches} batches recorded, "
            "whose caches start empty)")
    say(f"   curves: {run_dir / 'curves.png'}")

    t0 = time.perf_counter()
    say("\n3. serving the trained store over HTTP and checking the answers")
    served = serve_and_check(store_path, size, cfg, say)
    timings["serve_s"] = time.perf_counter() - t0

    files = {"out": base, "store": store_path, "trace": trace_path, "tuned_toml": tuned_path,
             "curves": run_dir / "curves.png", "metrics": run_dir / "metrics.json",
             "model": store_path / "models" / "dlrm", "summary": base / "summary.json"}
    summary: dict[str, Any] = {
        "quick": quick, "steps": result.step, "size": asdict(size),
        "train": {"auc": last.auc, "log_loss": last.log_loss, "ne": last.ne, "samples": last.samples,
                  "samples_per_s": result.samples_per_s, "dram_hit_ratio": served_dram},
        "expected_dram_hit_ratio": expected_dram, "held_whole_in_dram": whole,
        "tuned": {p.name: {"dram_rows": p.dram_rows, "policy": p.dram_policy, "home": p.home,
                           "unique_rows": p.unique_rows} for p in plan.tables},
        "served": served, "timings": timings, **{k: str(v) for k, v in files.items()}}
    # an AUC or NE undefined on one-class labels is null: strict JSON has no NaN
    atomic_write(files["summary"], strict_json.dumps(summary, indent=1).encode())
    ok = served["rows_equal"] and served["pooled_equal"] and served["scores_equal"]
    say(f"\n4. done in {sum(timings.values()):.0f} s (trace+tune {timings['trace_and_tune_s']:.0f} s, "
        f"train {timings['train_s']:.0f} s, serve {timings['serve_s']:.0f} s); "
        f"{'every served answer matched the store' if ok else 'SOME SERVED ANSWERS DID NOT MATCH'}")
    width = max(len(k) for k in files)
    for key in ("store", "model", "trace", "tuned_toml", "curves", "metrics", "summary"):
        say(f"   {key:<{width}}  {files[key]}")
    say(f"   try: embstore stats {store_path}   |   embstore replay {trace_path} --policy lru,lru+tinylfu "
        f"--capacity 0.01,0.1   |   embstore serve {store_path}")
    return summary
