"""The device tier on a GPU: tables held whole in HBM, against plain torch on the same GPU in the same run.

    python tools/bench/bench_gpu.py            # 8 tables x 1M rows x dim 64, batch 4096, pooling 20
    python tools/bench/bench_gpu.py --quick    # 8 tables x 100k rows
    python tools/bench/bench_gpu.py --allow-cpu --quick   # a dry run where torch sees no GPU

Each table's top tier is a ``device`` tier holding every row (over an mmap
home), so lookups gather and pool on the GPU and training steps the rows in
the tier's own slab. Baselines hold the same rows in torch-allocated GPU
tensors. The two sides take turns, every timed call ends with a
``torch.cuda.synchronize()``, best of ``--repeats`` each:

1. ``lookup_pooled`` with ids already on the GPU against ``F.embedding_bag``,
   uniform and Zipf(1.05) ids; ours is also timed with numpy ids, and with
   the on-device check and count (``embstore.table.COUNT_DEVICE_IDS_ON_DEVICE``,
   off by default until this figure says it pays).
2. ``lookup`` of raw rows against ``weight.index_select``.
3. A training step (forward, backward, optimizer), ids handed over as host
   tensors as a data loader gives them: ``TieredEmbeddingBagCollection``
   against ``nn.EmbeddingBag(sparse=True)`` with torch's SGD and sparse
   Adagrad (fbgemm-gpu is not installed on these GPU machines; torch has no
   row-wise Adagrad, so ours is reported beside torch's element-wise one).
4. Training with the device tier as a cache of ``--cache`` of the rows over a
   whole-table DRAM tier, against the tables held whole on the device.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.training import TieredEmbeddingBagCollection, state_dim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_shape_args, best_rates, positive_float, positive_int, zipf_ids  # noqa: E402


def synced(fn):
    """``fn`` followed by a wait for the GPU, so wall time covers the work it queued."""
    def run() -> None:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return run


def device_store(path: str, tables: int, rows: int, dim: int, optimizer: str | None, seed: int):
    """A store of ``tables`` tables each held whole in a device tier (room for rows + optimizer state), every row
    written: (store, the rows as numpy arrays)."""
    width = dim + (state_dim(optimizer, dim) if optimizer else 0)
    cfgs = tuple(TableConfig(f"t{i}", rows, dim, tiers=(TierConfig("device", rows * 4 * width), TierConfig("mmap")))
                 for i in range(tables))
    store = embstore.create(path, StoreConfig(cfgs))
    rng = np.random.default_rng(seed)
    weights = []
    for i in range(tables):
        w = rng.standard_normal((rows, dim), dtype=np.float32) * 0.1
        if optimizer:
            store.ensure_state_dim(f"t{i}", state_dim(optimizer, dim))
            store[f"t{i}"].write_with_state(np.arange(rows, dtype=np.int64), w,
                                            np.zeros((rows, state_dim(optimizer, dim)), np.float32))
        else:
            store[f"t{i}"].update(np.arange(rows, dtype=np.int64), w)
        weights.append(w)
    return store, weights


def bench_lookups(args, rows: int, dev: str, tmp: str) -> dict:
    T, B, L = args.tables, args.batch, args.pooling
    n = B * L
    rng = np.random.default_rng(0)
    store, weights = device_store(f"{tmp}/lookups", T, rows, args.dim, None, 1)
    tables = [store[f"t{i}"] for i in range(T)]
    tw = [torch.from_numpy(w).to(dev) for w in weights]  # torch's own allocation on the GPU
    offs = np.arange(0, n + 1, L, dtype=np.int64)
    toffs_dev = torch.from_numpy(offs[:-1]).to(dev)
    out: dict = {}
    for dist in ("uniform", "zipf"):
        ids = [rng.integers(0, rows, n) if dist == "uniform" else zipf_ids(rng, n, rows, 1.05) for _ in range(T)]
        dids = [torch.from_numpy(x).to(dev) for x in ids]
        toffs = torch.from_numpy(offs)
        for t, w, x in zip(tables, tw, dids):  # same numbers on both sides
            got = t.lookup_pooled(x, toffs)
            assert torch.allclose(got, F.embedding_bag(x, w, toffs_dev, mode="sum"), rtol=1e-5, atol=1e-5)
        def device_count() -> None:  # the on-device check and count (off by default; see embstore.table)
            embstore.table.COUNT_DEVICE_IDS_ON_DEVICE = True
            try:
                for t, x in zip(tables, dids):
                    t.lookup_pooled(x, toffs)
            finally:
                embstore.table.COUNT_DEVICE_IDS_ON_DEVICE = False

        fns = {
            "ours_pooled": synced(lambda: [t.lookup_pooled(x, toffs) for t, x in zip(tables, dids)]),
            "ours_pooled_device_count": synced(device_count),
            "ours_pooled_numpy_ids": synced(lambda: [t.lookup_pooled(x, offs) for t, x in zip(tables, ids)]),
            "torch_pooled": synced(lambda: [F.embedding_bag(x, w, toffs_dev, mode="sum") for w, x in zip(tw, dids)]),
            "ours_raw": synced(lambda: [t.lookup(x) for t, x in zip(tables, dids)]),
            "torch_raw": synced(lambda: [w.index_select(0, x) for w, x in zip(tw, dids)]),
        }
        rates = best_rates(fns, T * n, args.repeats)
        out[dist] = {k: v / 1e6 for k, v in rates.items()}
        out[dist]["pooled_ratio"] = rates["ours_pooled"] / rates["torch_pooled"]
        out[dist]["raw_ratio"] = rates["ours_raw"] / rates["torch_raw"]
        r = out[dist]
        print(f"  {dist:<8} pooled: ours {r['ours_pooled']:8.1f} M rows/s (numpy ids {r['ours_pooled_numpy_ids']:7.1f}, "
              f"counted on the device {r['ours_pooled_device_count']:7.1f})"
              f"  torch {r['torch_pooled']:8.1f}  ratio {r['pooled_ratio']:.2f}x")
        print(f"  {dist:<8} raw:    ours {r['ours_raw']:8.1f} M rows/s  torch {r['torch_raw']:8.1f}"
              f"  ratio {r['raw_ratio']:.2f}x")
    store.close()
    return out


class TorchBags:
    """The baseline: one ``nn.EmbeddingBag(sparse=True)`` per table on the GPU and a torch optimizer."""

    def __init__(self, weights: list[np.ndarray], optimizer: str, lr: float, dev: str) -> None:
        self.bags = []
        for w in weights:
            bag = torch.nn.EmbeddingBag(w.shape[0], w.shape[1], mode="sum", sparse=True, include_last_offset=True).to(dev)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(w))
            self.bags.append(bag)
        params = [b.weight for b in self.bags]
        self.opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.Adagrad(params, lr=lr)
        self.dev = dev

    def step(self, ids: list[torch.Tensor], offs: torch.Tensor, loss_w: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        o = offs.to(self.dev)
        out = torch.stack([bag(x.to(self.dev), o) for bag, x in zip(self.bags, ids)], dim=1)
        (out.square() * loss_w).sum().backward()
        self.opt.step()


def bench_training(args, rows: int, dev: str, tmp: str) -> dict:
    T, B, L, D = args.tables, args.batch, args.pooling, args.dim
    n = B * L
    rng = np.random.default_rng(2)
    steps = [[torch.from_numpy(rng.integers(0, rows, n)) for _ in range(T)] for _ in range(4)]
    offs = torch.arange(0, n + 1, L, dtype=torch.int64)
    loss_w = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32)).to(dev)
    out: dict = {}
    for optimizer, baseline in (("sgd", "sgd"), ("adagrad", "adagrad"), ("rowwise_adagrad", "adagrad")):
        store, weights = device_store(f"{tmp}/train_{optimizer}", T, rows, D, optimizer, 3)
        ebc = TieredEmbeddingBagCollection(store, [f"t{i}" for i in range(T)], optimizer=optimizer, lr=0.01)
        assert ebc.device.type == torch.device(dev).type
        ref = TorchBags(weights, baseline, 0.01, dev)
        del weights
        turn = {"ours": 0, "torch": 0}

        def ours() -> None:
            s = turn["ours"] = (turn["ours"] + 1) % len(steps)
            (ebc(steps[s], [offs] * T).square() * loss_w).sum().backward()

        def theirs() -> None:
            s = turn["torch"] = (turn["torch"] + 1) % len(steps)
            ref.step(steps[s], offs, loss_w)

        rates = best_rates({"ours": synced(ours), "torch": synced(theirs)}, 1, args.repeats)
        t_ours, t_torch = 1 / rates["ours"], 1 / rates["torch"]
        out[optimizer] = {"ours_ms": t_ours * 1e3, "torch_ms": t_torch * 1e3, "torch_optimizer": baseline,
                          "ratio": t_torch / t_ours, "ours_M_ids_s": T * n / t_ours / 1e6}
        print(f"  {optimizer:<16} ours {t_ours * 1e3:7.2f} ms/step ({T * n / t_ours / 1e6:6.1f} M ids/s)   "
              f"torch {baseline:<8} {t_torch * 1e3:7.2f} ms/step   ours/torch {t_torch / t_ours:.2f}x")
        ebc.release()
        store.close()
        del ref
    return out


def bench_tiered(args, rows: int, dev: str, tmp: str) -> dict:
    """Training with HBM as a cache: a device tier of ``--cache`` of each table's rows (lru+tinylfu) over a
    DRAM tier holding all of it (the home an mmap file), Zipf(1.05) ids, look-ahead 2; against the same
    tables held whole on the device. Rows reach the step through the hierarchy (a device hit is read back
    to the host and copied into the working set on the device), so this measures that path's cost."""
    T, B, L, D = args.tables, args.batch, args.pooling, args.dim
    n = B * L
    rng = np.random.default_rng(4)
    batches = [[torch.from_numpy(zipf_ids(rng, n, rows, 1.05)) for _ in range(T)] for _ in range(args.tiered_steps)]
    offs = torch.arange(0, n + 1, L, dtype=torch.int64)
    loss_w = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32)).to(dev)
    width = 4 * (D + state_dim("rowwise_adagrad", D))
    out: dict = {}
    for name, tiers in (("all on device", (TierConfig("device", rows * width), TierConfig("mmap"))),
                        ("device cache", (TierConfig("device", int(rows * args.cache) * width, "lru+tinylfu"),
                                          TierConfig("dram", rows * width), TierConfig("mmap")))):
        cfgs = tuple(TableConfig(f"t{i}", rows, D, tiers=tiers) for i in range(T))
        store = embstore.create(f"{tmp}/tiered_{len(out)}", StoreConfig(cfgs))
        ebc = TieredEmbeddingBagCollection(store, [f"t{i}" for i in range(T)], optimizer="rowwise_adagrad",
                                           lr=0.01, lookahead=2)
        warm = max(1, len(batches) // 4)
        for i, ids in enumerate(ebc.pipeline(batches, sparse=lambda b: (b, [offs] * T))):
            if i == warm:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            (ebc(ids, [offs] * T).square() * loss_w).sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        per_s = B * (len(batches) - warm) / (time.perf_counter() - t0)
        dev_stats = [store[f"t{i}"].stats()["device"] for i in range(T)]
        hits = sum(s["hits"] for s in dev_stats)
        looked = hits + sum(s["misses"] for s in dev_stats)
        out[name] = {"samples_s": per_s, "device_hit_ratio": hits / looked if looked else 0.0,
                     "demand_misses": ebc.counters["demand_misses"], "stall_s": ebc.counters["stall_s"]}
        print(f"  {name:<14} {per_s:10,.0f} samples/s  device hit ratio {out[name]['device_hit_ratio']:.3f}  "
              f"demand misses {ebc.counters['demand_misses']}  stalls {ebc.counters['stall_s']:.2f} s")
        ebc.release()
        store.close()
    out["ratio"] = out["device cache"]["samples_s"] / out["all on device"]["samples_s"]
    print(f"  device cache / all on device: {out['ratio']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, "call")
    ap.add_argument("--repeats", type=positive_int, default=10, help="timed runs of each side (default 10)")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU when torch sees no GPU (a dry run)")
    ap.add_argument("--skip-training", action="store_true", help="lookups only")
    ap.add_argument("--cache", type=positive_float, default=0.1,
                    help="device cache of the tiered run, as a share of each table's rows (default 0.1)")
    ap.add_argument("--tiered-steps", type=positive_int, default=12,
                    help="training steps of each tiered run, the first quarter untimed (default 12)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("bench_gpu: torch sees no GPU here (pass --allow-cpu for a dry run on the CPU)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device tier on {name} (torch {torch.__version__}): {args.tables} tables x {rows} rows x dim {args.dim}, "
          f"batch {args.batch}, pooling {args.pooling}")
    results: dict = {"device": name, "torch": torch.__version__, "rows": rows, "tables": args.tables}
    with tempfile.TemporaryDirectory() as tmp:
        print("lookups (M rows/s, 8 tables per call round):")
        results["lookups"] = bench_lookups(args, rows, dev, tmp)
        if not args.skip_training:
            print("training step (forward, backward, optimizer), device-resident tables:")
            results["training"] = bench_training(args, rows, dev, tmp)
            print(f"training with the device tier as a cache ({args.cache:.0%} of rows), Zipf(1.05), look-ahead 2:")
            results["tiered"] = bench_tiered(args, rows, dev, tmp)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
