"""DRAM-resident training step (forward, backward, exact row-wise Adagrad) vs fbgemm's CPU TBE.

    python tools/bench/bench_train_step.py            # 8 tables x 1M rows x dim 64, batch 4096, pooling 20
    python tools/bench/bench_train_step.py --quick    # 8 tables x 100k rows

Both sides train the same float32 rows on the same uniform ids with
EXACT_ROWWISE_ADAGRAD: ours is ``TieredEmbeddingBagCollection`` over a store
whose DRAM tier holds every row (+ its state column) above an mmap home;
fbgemm is ``SplitTableBatchedEmbeddingBagsCodegen`` (HOST, CPU), one TBE for
all tables. Both stay alive and take turns, one step each, ``--repeats`` timed
steps a side after warm-up (each step on the next of a few id batches).
Figure: looked-up ids per second of each side's fastest step, and the ratio
ours / fbgemm (goal >= 3x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.training import TieredEmbeddingBagCollection, state_dim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_shape_args, best_rates, positive_int  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, "step")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed steps of each side (default 5)")
    args = ap.parse_args(argv)
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    T, B, L, D = args.tables, args.batch, args.pooling, args.dim
    n = B * L
    rng = np.random.default_rng(0)
    steps = [[torch.from_numpy(rng.integers(0, rows, n)) for _ in range(T)] for _ in range(2 + args.repeats)]
    offs = torch.arange(0, n + 1, L, dtype=torch.int64)
    weights = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32))
    results: dict = {"rows": rows, "tables": T, "batch": B, "pooling": L, "ids_per_step": T * n,
                     "torch_threads": torch.get_num_threads()}

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

    with tempfile.TemporaryDirectory() as tmp:
        row_bytes = 4 * (D + state_dim("rowwise_adagrad", D))
        cfgs = tuple(TableConfig(f"t{i}", rows, D, tiers=(TierConfig("dram", rows * row_bytes), TierConfig("mmap")))
                     for i in range(T))
        store = embstore.create(f"{tmp}/store", StoreConfig(cfgs))
        ebc = TieredEmbeddingBagCollection(store, [f"t{i}" for i in range(T)], optimizer="rowwise_adagrad", lr=0.01)
        for i in range(T):  # make every row resident (as after a bulk import)
            store[f"t{i}"].write_with_state(np.arange(rows, dtype=np.int64),
                                            rng.standard_normal((rows, D), dtype=np.float32),
                                            np.zeros((rows, 1), np.float32))
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8,
            pooling_mode=PoolingMode.SUM, device=torch.device("cpu"))
        all_offs = torch.arange(0, T * n + 1, L, dtype=torch.int64)
        cat_ids = [torch.cat(s) for s in steps]
        turn = {"ours": 0, "fbgemm": 0}

        def ours() -> None:  # each call trains on the next batch of ``steps``
            s = turn["ours"] = (turn["ours"] + 1) % len(steps)
            out = ebc(steps[s], [offs] * T)
            (out.square() * weights).sum().backward()

        def fbgemm() -> None:
            s = turn["fbgemm"] = (turn["fbgemm"] + 1) % len(steps)
            out = tbe(cat_ids[s], all_offs).view(B, T, D)
            (out.square() * weights).sum().backward()

        ours()  # a second warm-up each: the first steps pay first touches of the state
        fbgemm()
        rates = best_rates({"ours": ours, "fbgemm": fbgemm}, 1, args.repeats)
        t_ours, t_fb = 1 / rates["ours"], 1 / rates["fbgemm"]
        ebc.release()
        store.close()

    results.update(ours_step_s=t_ours, fbgemm_step_s=t_fb, ours_ids_per_s=T * n / t_ours,
                   fbgemm_ids_per_s=T * n / t_fb, speedup_vs_fbgemm=t_fb / t_ours)
    print(f"train step, {T} tables x {rows} rows x dim {D}, batch {B}, pooling {L} (rowwise adagrad)")
    print(f"  ours   {t_ours * 1e3:8.1f} ms/step  {T * n / t_ours / 1e6:6.2f} M ids/s")
    print(f"  fbgemm {t_fb * 1e3:8.1f} ms/step  {T * n / t_fb / 1e6:6.2f} M ids/s")
    print(f"  ours / fbgemm: {t_fb / t_ours:.2f}x (goal >= 3x)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
