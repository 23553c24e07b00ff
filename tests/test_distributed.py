"""Two gloo processes (rows sharded by id, dense data-parallel) train to the same losses as one process."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embstore.training.distributed import DistContext, ShardedEmbeddingBags, hashless
from embstore.training.trainer import TrainConfig, train

from test_trainer import config_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        res = train(TrainConfig.from_toml(cfg_path), out, ctx=DistContext(rank, world), progress=False)
        np.save(Path(out) / f"losses{rank}.npy", np.array(res.losses))
        # each rank reports its own shard's tier statistics, one entry per table
        tables = TrainConfig.from_toml(cfg_path).store.tables
        reads = [sum(s["hits"] + s["misses"] for s in res.tier_stats[t.name].values()) for t in tables]
        np.save(Path(out) / f"reads{rank}.npy", np.array(reads))
        np.save(Path(out) / f"auc{rank}.npy", np.array([e.auc for _, e in res.evals]))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_one_process(tmp_path):
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(config_text(batches=12, eval_every=6, ckpt_every=6))
    torch.set_num_threads(1)
    one = train(TrainConfig.from_toml(cfg_path), tmp_path / "one", progress=False)
    out = tmp_path / "two"
    mp.spawn(_worker, args=(2, _free_port(), str(cfg_path), str(out)), nprocs=2, join=True)
    for r in range(2):
        np.testing.assert_allclose(np.load(out / f"losses{r}.npy"), one.losses, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.load(out / f"auc{r}.npy"), [e.auc for _, e in one.evals], atol=1e-3)
        assert (out / f"rank{r}" / "store").is_dir()
        reads = np.load(out / f"reads{r}.npy")
        assert len(reads) == len(TrainConfig.from_toml(cfg_path).store.tables) and (reads > 0).all()
        assert (out / "checkpoints" / "step_12" / f"rank{r}.pt").exists()


def _shard_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each rank's shard holds exactly the rows p with p % world == rank; the summed shards give every bag."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import embstore
        from embstore.config import StoreConfig, TableConfig
        cfg = TableConfig.from_dict({"name": "t", "num_embeddings": 7, "dim": 2, "hash": {"kind": "mod", "seed": 5},
                                     "tiers": [{"kind": "mmap"}]})
        store = embstore.create(Path(out) / f"s{rank}", StoreConfig((hashless(cfg),)))
        sh = ShardedEmbeddingBags(store, [cfg], DistContext(rank, world))
        raw, offsets = np.array([3, 10, 4, 8, 5, 99]), np.array([0, 2, 2, 5, 6])
        ids, offs = sh.shard([torch.from_numpy(raw)], [torch.from_numpy(offsets)])
        rows = sh.mappers[0](raw)
        bag = np.repeat(np.arange(4), np.diff(offsets))
        keep = rows % world == rank
        assert ids[0].tolist() == rows[keep].tolist()
        assert offs[0].tolist() == [0, *np.cumsum(np.bincount(bag[keep], minlength=4)).tolist()]
        with torch.no_grad():
            pooled = sh([torch.from_numpy(raw)], [torch.from_numpy(offsets)])
        ref = embstore.create(Path(out) / f"ref{rank}", StoreConfig((cfg,)))["t"].lookup_pooled(raw, offsets)
        np.testing.assert_allclose(pooled[:, 0].numpy(), ref[2 * rank:2 * rank + 2], rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_shard_keeps_owned_rows_and_pools_every_bag(tmp_path):
    mp.spawn(_shard_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)


def _bad_ids_and_learned_worker(rank: int, world: int, port: int, out: str) -> None:
    """A bad id in the global batch raises the same typed error on every rank (it used to raise only on the
    rank owning its row, leaving the others in the all-reduce); a relative learned mapping is found where
    the one-process store finds it (the working directory), not in the hashless rank store."""
    import datetime
    import os

    import pytest

    import embstore
    from embstore.config import StoreConfig, TableConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        os.chdir(out)  # where m.ehash lies
        plain = TableConfig.from_dict({"name": "p", "num_embeddings": 7, "dim": 2, "tiers": [{"kind": "mmap"}]})
        learned = TableConfig.from_dict({"name": "l", "num_embeddings": 16, "dim": 2, "tiers": [{"kind": "mmap"}],
                                         "hash": {"kind": "learned", "mapping": "m.ehash"}})
        cfgs = (plain, learned)
        store = embstore.create(Path(out) / f"s{rank}", StoreConfig(tuple(hashless(c) for c in cfgs)))
        sh = ShardedEmbeddingBags(store, list(cfgs), DistContext(rank, world))
        ids_l = torch.tensor([3, 10**9, 4, 8, 5, 99])
        offsets = torch.tensor([0, 2, 2, 5, 6])
        for bad in (7, -1):  # row 7 % 2 == 1 and -1 % 2 == 1: only rank 1 owned it
            with pytest.raises(embstore.IdOutOfRangeError, match=f"id {bad} outside"):
                sh([torch.tensor([1, 2, bad, 3, 0, 6]), ids_l], [offsets, offsets])
        raw_p = np.array([1, 2, 6, 3, 0, 6])
        with torch.no_grad():
            pooled = sh([torch.from_numpy(raw_p), ids_l], [offsets, offsets])
        ref = embstore.create(Path(out) / f"ref{rank}", StoreConfig(cfgs))
        o = offsets.numpy()
        np.testing.assert_allclose(pooled[:, 0].numpy(), ref["p"].lookup_pooled(raw_p, o)[2 * rank:2 * rank + 2])
        np.testing.assert_allclose(pooled[:, 1].numpy(),
                                   ref["l"].lookup_pooled(ids_l.numpy(), o)[2 * rank:2 * rank + 2], rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_bad_ids_raise_on_every_rank_and_learned_mappings_resolve(tmp_path):
    from embstore.hashing import LearnedHash

    LearnedHash.fit(np.random.default_rng(0).zipf(1.3, 3000).astype(np.int64), 16).save(tmp_path / "m.ehash")
    mp.spawn(_bad_ids_and_learned_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
