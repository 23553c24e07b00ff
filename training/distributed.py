"""Multi-process training: dense parameters data-parallel, embedding rows sharded by row id.

Design (the simplest one that is exactly equivalent to one process)::

    every rank                       rank r                                all ranks
    global batch ids ──hash──▶ physical rows ──keep row % W == r──▶ own EBC on rank r's store
                                                          │  partial pooled sums (B, T, D)
                                                          ▼
                                  all_reduce(sum) ──▶ full pooled (B, T, D) ──▶ rank r keeps rows [r*b, (r+1)*b)
                                  backward: all_gather of the (b, T, D) slice grads ──▶ (B, T, D) / W ──▶ own rows' update

- Row ``p`` (after the table's hash) lives on rank ``p % W``, in that rank's own
  store (``OUT/rank{r}/store``). Each rank's store keeps the full logical row
  range with the hash removed (the hash runs here, before sharding) so a row's
  initial value, a function of (table seed, row), is the same as in a
  one-process run; only owned rows are ever read or written, so caches hold
  only owned rows and the home (sparse slab file, RocksDB) only what was written.
- Every rank needs the global batch's ids. The trainer's readers are replicated
  (every rank reads the same global batch and keeps its slice of the dense part),
  so no id exchange is needed; :func:`gather_sparse` all-gathers ids for readers
  that shard the data instead.
- Dense parameters: identical initialisation (same seed, then a broadcast from
  rank 0) and one all-reduce (mean) of all their gradients, flattened into one
  buffer, per step: DDP without the bucketing.

Communication per step with B global samples, T tables, dim D, W ranks and P
dense parameters (bytes each rank sends, ring algorithms): pooled all-reduce
~ 2 * B*T*D*4, gradient all-gather ~ B*T*D*4, dense all-reduce ~ 2 * P*4.
A real all-to-all (each rank sends only its owned partial sums for the other
ranks' samples) cuts the pooled traffic to ~ B*T*D*4*(W-1)/W; the all-reduce
costs at most 2x that and keeps the code small. QR hashing (several physical
rows per id) is not supported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from embstore.arrays import check_id_range
from embstore.config import HashConfig, TableConfig
from embstore.errors import InvalidInputError
from embstore.hashing import build_hash
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.batch import normalize


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_from_env() -> DistContext:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR/PORT); gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size())


def hashless(cfg: TableConfig) -> TableConfig:
    """The table as a rank stores it: same rows and init, the hash applied by the sharder instead."""
    from dataclasses import replace
    return replace(cfg, hash=HashConfig())


class _AllReduceSlice(torch.autograd.Function):
    """Forward: sum the ranks' partial pooled bags, keep this rank's samples. Backward: gather the slices' grads."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, lo: int, hi: int, world: int) -> torch.Tensor:
        full = partial.detach().clone()
        dist.all_reduce(full)
        ctx.world = world
        return full[lo:hi].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        parts = [torch.empty_like(grad) for _ in range(ctx.world)]
        dist.all_gather(parts, grad.contiguous())
        # each rank's loss is its local mean; the job's loss is the mean of those
        return torch.cat(parts) / ctx.world, None, None, None


class ShardedEmbeddingBags(nn.Module):
    """Row-sharded tiered embedding bags: ``forward(global ids, offsets)`` -> this rank's (b, T, D) slice."""

    def __init__(self, store: Any, table_configs: Sequence[TableConfig], ctx: DistContext, optimizer: str = "sgd",
                 lr: float = 0.01, lookahead: int = 0, **kwargs: Any) -> None:
        super().__init__()
        self.ctx = ctx
        self.table_names = [c.name for c in table_configs]
        self.mappers = []
        for c in table_configs:
            # a rank's store is hashless and holds no mapping: a relative learned mapping is taken from the
            # working directory, as embstore.create adopts it for the one-process run
            m = build_hash(c.hash, c.num_embeddings, table=c.name,
                           store_tables={t.name for t in table_configs})  # a map fitted on another table is refused
            if m is not None and m.rows_per_id != 1:
                raise InvalidInputError(f"table {c.name!r}: sharded training supports one row per id "
                                        f"(hash kind none, mod or learned), not {c.hash.kind.value!r}")
            self.mappers.append(m)
        self.num_rows = [c.num_embeddings for c in table_configs]
        if kwargs.get("pooling", "sum") != "sum":
            raise InvalidInputError("sharded training pools with 'sum' (partial sums add up across ranks)")
        self.inner = TieredEmbeddingBagCollection(store, self.table_names, optimizer=optimizer, lr=lr,
                                                  lookahead=lookahead, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where this rank's bags come out (``TieredEmbeddingBagCollection.device``)."""
        return self.inner.device

    @property
    def tables(self) -> list:
        """This rank's shard of each table (its store's ``Table``s), e.g. for its tier statistics."""
        return self.inner.tables

    def shard(self, ids: Any, offsets: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's part of a global batch: owned physical rows, bags kept (possibly empty)."""
        id_list, off_list = normalize(self.table_names, ids, offsets)
        w, r = self.ctx.world, self.ctx.rank
        out_ids, out_offs = [], []
        for t, (x, o) in enumerate(zip(id_list, off_list)):
            if self.mappers[t] is None:  # checked on the global batch, so every rank raises, not just the owner
                check_id_range(x, self.num_rows[t], f"table {self.table_names[t]!r}",
                               "; give the table a hash (hash = { kind = 'mod' }) to accept any id")
            rows = self.mappers[t](x) if self.mappers[t] is not None else x
            keep = rows % w == r
            bag = np.repeat(np.arange(len(o) - 1), np.diff(o))
            counts = np.bincount(bag[keep], minlength=len(o) - 1)
            offs = np.zeros(len(o), dtype=np.int64)
            np.cumsum(counts, out=offs[1:])
            out_ids.append(torch.from_numpy(np.ascontiguousarray(rows[keep], dtype=np.int64)))
            out_offs.append(torch.from_numpy(offs))
        return out_ids, out_offs

    def forward(self, ids: Any, offsets: Any = None) -> torch.Tensor:
        local_ids, local_offs = self.shard(ids, offsets)
        partial = self.inner(local_ids, local_offs)
        b = partial.shape[0]
        if b % self.ctx.world:
            raise InvalidInputError(f"global batch {b} must split evenly over {self.ctx.world} ranks")
        per = b // self.ctx.world
        return _AllReduceSlice.apply(partial, self.ctx.rank * per, (self.ctx.rank + 1) * per, self.ctx.world)

    def prefetch(self, ids: Any, offsets: Any = None) -> None:
        self.inner.prefetch(*self.shard(ids, offsets))

    def pipeline(self, batches: Iterable[Any], lookahead: int | None = None,
                 sparse: Callable[[Any], Any] | None = None, announce: int = 0) -> Iterator[Any]:
        get = sparse or (lambda b: b)

        def local(b: Any) -> Any:
            s = get(b)
            return self.shard(s) if not isinstance(s, tuple) else self.shard(*s)
        return self.inner.pipeline(batches, lookahead, sparse=local, announce=announce)

    def flush(self) -> None:
        self.inner.flush()

    def release(self) -> None:
        self.inner.release()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()


def average_gradients(params: Sequence[torch.Tensor], extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """All-reduce (mean) every parameter's gradient in one flat buffer; ``extra`` (e.g. the loss) rides along."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    parts = [g.reshape(-1) for g in grads] + ([extra.detach().reshape(-1).float()] if extra is not None else [])
    flat = torch.cat(parts)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[i:i + n].view_as(p).clone()
        i += n
    return flat[i:] if extra is not None else None


def broadcast_parameters(module: nn.Module) -> None:
    """Rank 0's dense weights everywhere (they already agree when seeded alike; this makes it certain)."""
    for p in module.parameters():
        dist.broadcast(p.data, 0)


def gather_sparse(ids: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                                          list[torch.Tensor]]:
    """All-gather per-table jagged ids of every rank's local batch into the global batch (rank order)."""
    world = dist.get_world_size()
    out_ids, out_offs = [], []
    for x, o in zip(ids, offsets):
        sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(x), len(o) - 1], dtype=torch.int64))
        n_max = max(int(s[0]) for s in sizes)
        b_max = max(int(s[1]) for s in sizes)
        xs = [torch.zeros(n_max, dtype=torch.int64) for _ in range(world)]
        lens = [torch.zeros(b_max, dtype=torch.int64) for _ in range(world)]
        pad_x = torch.zeros(n_max, dtype=torch.int64)
        pad_x[:len(x)] = x
        pad_l = torch.zeros(b_max, dtype=torch.int64)
        pad_l[:len(o) - 1] = o[1:] - o[:-1]
        dist.all_gather(xs, pad_x)
        dist.all_gather(lens, pad_l)
        all_ids = torch.cat([xs[r][:int(sizes[r][0])] for r in range(world)])
        all_lens = torch.cat([lens[r][:int(sizes[r][1])] for r in range(world)])
        out_ids.append(all_ids)
        out_offs.append(torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(all_lens, 0)]))
    return out_ids, out_offs


__all__ = ["DistContext", "ShardedEmbeddingBags", "average_gradients", "broadcast_parameters", "gather_sparse",
           "hashless", "init_from_env"]
