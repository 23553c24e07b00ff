"""`embstore demo`: the store end to end on embedded defaults, nothing external to start.

Creates a store from an embedded TOML (a small device cache and a DRAM cache
over an io_uring SSD home, plus a RocksDB-homed sparse table), bulk-imports
rows, looks them up raw and pooled, updates some, reopens and checks that
every write survived, and prints per-tier statistics.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import embstore
from embstore.bulk import import_rows
from embstore.commands.store_cmds import format_tier_stats

DEMO_CONFIG = """
[[table]]
name = "item_id"
num_embeddings = {rows}
dim = 32
dtype = "float32"
init = {{ kind = "uniform", scale = 0.01, seed = 0 }}
tiers = [
  {{ kind = "device", capacity = "{device}", policy = "lru" }},
  {{ kind = "dram",   capacity = "{dram}",   policy = "lru+tinylfu" }},
  {{ kind = "ssd" }},
]

[[table]]
name = "user_id"
num_embeddings = 1_000_000_000
dim = 16
dtype = "float16"
hash = {{ kind = "none" }}
tiers = [
  {{ kind = "dram", capacity = "1MiB", policy = "lfu" }},
  {{ kind = "rocksdb" }},
]
"""


def zipf(rng: np.random.Generator, n: int, universe: int, alpha: float = 1.05) -> np.ndarray:
    ranks = np.arange(1, universe + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -alpha)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), universe - 1).astype(np.int64)


def run(out_dir: str | Path | None = None, rows: int = 200_000, batches: int = 50, batch_size: int = 2048,
        quiet: bool = False) -> dict:
    """Run the demo; returns what it measured (used by the tests)."""
    say = (lambda *a: None) if quiet else print
    base = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="embstore-demo-"))
    store_path = base / "store"
    cfg_path = base / "demo.toml"
    base.mkdir(parents=True, exist_ok=True)
    row_bytes = 32 * 4
    cfg_path.write_text(DEMO_CONFIG.format(rows=rows, device=f"{rows // 100 * row_bytes}",
                                           dram=f"{rows // 10 * row_bytes}"))
    say(f"1. creating a store at {store_path} from {cfg_path}")
    store = embstore.create(store_path, cfg_path)
    rng = np.random.default_rng(0)
    items = store["item_id"]
    say(f"   {items!r}\n   {store['user_id']!r}")

    say(f"2. bulk-importing {rows:,} rows into item_id")
    weights = rng.standard_normal((rows, 32), dtype=np.float32)
    np.save(base / "item_rows.npy", weights)
    with tqdm(total=rows, unit="row", unit_scale=True, disable=quiet) as bar:
        import_rows(items, base / "item_rows.npy", progress=bar.update)

    say(f"3. looking up {batches} Zipf(1.05) batches of {batch_size} bags x 8 ids (pooled) and raw rows")
    offsets = np.arange(0, batch_size * 8 + 1, 8, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in tqdm(range(batches), unit="batch", disable=quiet):
        ids = zipf(rng, batch_size * 8, rows)
        pooled = items.lookup_pooled(ids, offsets)
        np.testing.assert_allclose(pooled[0], weights[ids[:8]].sum(0), rtol=1e-4, atol=1e-5)
    elapsed = time.perf_counter() - t0
    raw = items.lookup(np.array([0, 1, rows - 1], np.int64))
    assert np.array_equal(raw, weights[[0, 1, rows - 1]])
    say(f"   {batches * batch_size * 8 / elapsed / 1e6:.2f} M ids/s pooled")

    say("4. updating sparse user rows (ids up to 1e9, RocksDB home, float16) and reopening")
    users = np.array([7, 123_456_789, 999_999_999], np.int64)
    new = rng.standard_normal((3, 16)).astype(np.float32)
    store["user_id"].update(users, new)
    stats_before = {name: t.stats() for name, t in store.tables.items()}
    store.close()
    with embstore.open(store_path) as store:
        back = store["user_id"].lookup(users)
        assert np.allclose(back, new.astype(np.float16).astype(np.float32))
        assert np.array_equal(store["item_id"].lookup(np.array([5], np.int64))[0], weights[5])
    say("   every write read back after reopening")

    say("5. per-tier statistics (before reopening)")
    for name, st in stats_before.items():
        say(f"   {name}")
        say(format_tier_stats(st))
    say(f"\nstore: {store_path}\nconfig: {cfg_path}")
    return {"store": str(store_path), "stats": stats_before, "ids_per_s": batches * batch_size * 8 / elapsed}
