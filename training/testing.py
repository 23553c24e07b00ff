"""Reference models for the training tests and benchmarks: plain torch (and fbgemm) doing the same steps.

Each reference holds dense ``nn.EmbeddingBag(sparse=True)`` tables and the
matching torch optimizer (``SGD``, ``Adagrad``, ``SparseAdam``), fbgemm's CPU
TBE for ``EXACT_ROWWISE_ADAGRAD``, and a hand-written per-row-step Adam (the
module's default), all fed the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

import embstore
from embstore.rows import initial_rows

Batch = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


def make_store(path: str | Path, tables: Sequence[tuple[str, int, int]], tiers: str,
               extra: str = "") -> embstore.Store:
    """A store of float32 tables ``(name, num_embeddings, dim)`` sharing the TOML ``tiers`` list."""
    text = "".join(f'[[table]]\nname = "{n}"\nnum_embeddings = {rows}\ndim = {dim}\n'
                   f'init = {{ kind = "uniform", scale = 0.1, seed = {i} }}\n{extra}tiers = {tiers}\n'
                   for i, (n, rows, dim) in enumerate(tables))
    return embstore.create(path, embstore.StoreConfig.from_toml(text))


def initial_weights(store: embstore.Store, name: str) -> np.ndarray:
    """The physical rows a fresh table starts with (without touching its tiers)."""
    t = store[name]
    return initial_rows(t.config.init, np.arange(t.num_rows, dtype=np.int64), t.format.dim)


def random_batches(seed: int, count: int, num_rows: Sequence[int], batch: int, max_len: int, dim: int,
                   zipf: float | None = None) -> list[Batch]:
    """Batches of bags (empty bags and repeated ids included) plus loss weights (batch, tables, dim)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids, offs = [], []
        for n in num_rows:
            lens = rng.integers(0, max_len + 1, batch)
            total = int(lens.sum())
            if zipf:
                x = (rng.zipf(zipf, total) - 1) % n
                x = (x * 2654435761) % n  # spread the hot ids over the table
            else:
                x = rng.integers(0, n, total)
            ids.append(torch.from_numpy(x.astype(np.int64)))
            offs.append(torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)))
        w = torch.from_numpy(rng.standard_normal((batch, len(num_rows), dim)).astype(np.float32))
        out.append((ids, offs, w))
    return out


def loss_of(pooled: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (pooled.square() * weights).sum()


class TorchReference:
    """The same training with dense torch tables and torch's (or fbgemm's) optimizer."""

    def __init__(self, weights: Sequence[np.ndarray], optimizer: str, lr: float, eps: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), pooling: str = "sum", adam_step: str = "row") -> None:
        self.kind = optimizer
        self.lr, self.betas, self.pooling = lr, betas, pooling
        self.tbe: list[Any] = []
        self.bags = [nn.EmbeddingBag(w.shape[0], w.shape[1], mode=pooling, sparse=True, include_last_offset=True)
                     for w in weights]
        for bag, w in zip(self.bags, weights):
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(w))
        params = [b.weight for b in self.bags]
        self.opt: Any = None
        self.state: list[dict[str, torch.Tensor]] = []
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=lr)
        elif optimizer == "adagrad":
            self.opt = torch.optim.Adagrad(params, lr=lr, eps=1e-10 if eps is None else eps)
        elif optimizer == "adam" and adam_step == "global":
            self.opt = torch.optim.SparseAdam(params, lr=lr, betas=betas, eps=1e-8 if eps is None else eps)
        elif optimizer == "adam":
            self.eps = 1e-8 if eps is None else eps
            self.state = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p),
                           "t": torch.zeros(p.shape[0], dtype=torch.float64)} for p in params]
        elif optimizer == "rowwise_adagrad" and _has_fbgemm():
            self.tbe = [_fbgemm_tbe(w, lr, 1e-8 if eps is None else eps, pooling) for w in weights]
        elif optimizer == "rowwise_adagrad":  # where fbgemm is not installed (an accelerator machine's torch)
            self.eps = 1e-8 if eps is None else eps
            self.state = [{"g2": torch.zeros(p.shape[0], dtype=torch.float32)} for p in params]
        else:
            raise ValueError(optimizer)

    def step(self, ids: list[torch.Tensor], offs: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
        if self.tbe:
            out = torch.stack([tbe(i, o) for tbe, i, o in zip(self.tbe, ids, offs)], dim=1)
            loss_of(out, weights).backward()  # fbgemm updates its rows in backward
            return out.detach()
        if self.opt is not None:
            self.opt.zero_grad()
        out = torch.stack([bag(i, o) for bag, i, o in zip(self.bags, ids, offs)], dim=1)
        loss_of(out, weights).backward()
        if self.opt is not None:
            self.opt.step()
        elif self.kind == "rowwise_adagrad":
            self._rowwise_adagrad()
        else:
            self._row_adam()
        return out.detach()

    @torch.no_grad()
    def pooled(self, ids: list[torch.Tensor], offs: list[torch.Tensor]) -> torch.Tensor:
        """The bags of the current weights, without a step (an eval forward)."""
        if self.tbe:
            return torch.stack([tbe(i, o) for tbe, i, o in zip(self.tbe, ids, offs)], dim=1)
        return torch.stack([bag(i, o) for bag, i, o in zip(self.bags, ids, offs)], dim=1)

    def _rowwise_adagrad(self) -> None:
        """fbgemm's EXACT_ROWWISE_ADAGRAD: one accumulator per row, of the mean squared gradient."""
        with torch.no_grad():
            for bag, st in zip(self.bags, self.state):
                g = bag.weight.grad.coalesce()
                rows, gv = g.indices()[0], g.values()
                st["g2"][rows] += gv.square().mean(dim=1)
                bag.weight[rows] -= self.lr * gv / (st["g2"][rows].sqrt() + self.eps)[:, None]
                bag.weight.grad = None

    def _row_adam(self) -> None:
        b1, b2 = self.betas
        with torch.no_grad():
            for bag, st in zip(self.bags, self.state):
                g = bag.weight.grad.coalesce()
                rows, gv = g.indices()[0], g.values()
                st["t"][rows] += 1
                m = st["m"][rows] * b1 + (1 - b1) * gv
                v = st["v"][rows] * b2 + (1 - b2) * gv * gv
                st["m"][rows], st["v"][rows] = m, v
                t = st["t"][rows]
                step = (self.lr * torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)).float()[:, None]
                bag.weight[rows] -= step * m / (v.sqrt() + self.eps)
                bag.weight.grad = None

    def weights(self) -> list[np.ndarray]:
        if self.tbe:
            return [t.split_embedding_weights()[0].detach().numpy().copy() for t in self.tbe]
        return [b.weight.detach().numpy().copy() for b in self.bags]


def _has_fbgemm() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception:  # ImportError, or a build that does not load against this torch
        return False
    return True


def _fbgemm_tbe(w: np.ndarray, lr: float, eps: float, pooling: str) -> Any:
    """fbgemm's CPU TBE holding ``w`` with EXACT_ROWWISE_ADAGRAD."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN, device=torch.device("cpu"))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(w))
    return tbe


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the relative error of a whole table."""
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


__all__ = ["Batch", "TorchReference", "initial_weights", "loss_of", "make_store", "random_batches", "rel_err"]
