"""Hash functions at equal memory: the same DLRM trained with a full table, mod, QR and learned hashing.

Run::

    python tools/eval_hashing.py                                  # synthetic planted groups (default)
    python tools/eval_hashing.py --quick                          # smaller synthetic run (seconds)
    python tools/eval_hashing.py --synthetic --fraction 0.1 --json out.json
    python tools/eval_hashing.py --criteo day_0.tsv --holdout-every 10 --max-train-batches 200

What it does. The data (synthetic: :class:`PlantedGroupClicks`; or Criteo-format
files) is materialised once: training batches and held-out batches. Every table's
raw ids are indexed by the sorted unique ids of both splits, so the *full* table
has one row per distinct id (``N`` rows) and QR sees dense indices as its paper
assumes. Every variant then trains the same DLRM (same seed, hence the same dense
initialisation; same batches in the same order; same steps; same optimizers) and is
evaluated on the held-out batches. The model: DLRM with dot interaction, bottom MLP
[32, dim], top MLP [32, 1], Adam on the MLPs, row-wise Adagrad on the rows, pooled
through :class:`TieredEmbeddingBagCollection` from a store whose tables hash ids
themselves (``HashConfig`` kinds none, mod, qr, learned). Rows per table:

    variant   rows per table                          memory per table
    full      N                                       N * row_bytes            (the reference, not budgeted)
    mod       R = ceil(fraction * N)                  R * row_bytes
    qr        R physical rows (quotient + remainder)  R * row_bytes
    learned   L = (R * row_bytes - mapping) // row_bytes    L * row_bytes + mapping_bytes <= R * row_bytes

``row_bytes = dim * 4`` (float32 values; the optimizer state, one float per row
for row-wise Adagrad, is not counted: counting it would only favour the learned
hash, which has the fewest rows). QR uses the smallest ``collisions`` ``m``
with ``m * (R - m) >= N`` (every id a distinct row pair) and ``combine="mult"``;
its rows start with a larger init scale so that the product of two rows has the
spread of one plain row. The learned hash (:class:`embstore.hashing.LearnedHash`)
is fit on the *training* split's accesses only (batches cut into contexts of
``--context-size`` accesses); held-out ids it never saw go to its reserved rows.

Reported per variant: held-out log loss, AUC and NE; rows and bytes; and two
collision figures over the training split's lookups (frequency weighted):
``shared_rows``, the share of lookups of which at least one row is *shared* (a row
is shared when >= 2 distinct seen ids map to it), and ``shared_vectors``, the
share of lookups whose whole row tuple is shared (differs from ``shared_rows``
only for QR, whose quotient rows are always shared but whose pairs are unique).

``main(argv) -> dict`` returns ``{"config": ..., "results": {variant: {...}}}``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import embstore
from embstore.atomic import atomic_write
from embstore.config import HashConfig, InitConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, InvalidInputError
from embstore.hashing import LearnedHash
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.data import ClickBatch, CriteoReader
from embstore.training.dlrm import DLRM, dense_optimizer
from embstore import strict_json
from embstore.training.metrics import EvalResult, evaluate
from embstore.training.optim import state_dim
from embstore.training.trainer import eval_line

VARIANTS = ("full", "mod", "qr", "learned")
VALUE_BYTES = 4  # float32 rows


# --------------------------------------------------------------------------- synthetic data
@dataclass(frozen=True)
class PlantedGroupClicks:
    """Clicks whose ids come in *groups that behave alike*.

    Per table, ``ids_per_table`` random int64 raw ids are split at random into
    ``groups`` equal groups. Each group has a hidden weight ~ N(0, 1); each id's
    weight is its group's plus ``within_noise`` * N(0, 1). Popularity is Zipf
    (``zipf_alpha``) over a random ranking of the ids, so every group holds hot
    and cold ids. A batch is made of sessions of ``session`` consecutive samples:
    per table a session picks one group (with probability its total popularity)
    and each sample draws an id of that group by popularity, or, with
    probability ``stray``, any id by popularity. So same-group ids co-occur
    within sessions, which is what a learned hash can pick up from the trace.
    The label is ``Bernoulli(sigmoid(bias + signal / sqrt(T) * sum_t w(id_t) +
    dense @ beta))``. Batch ``i`` of a split is a pure function of (seed, split, i).
    """

    num_tables: int = 3
    ids_per_table: int = 2000
    groups: int = 20
    session: int = 16
    batch_size: int = 256
    train_batches: int = 16
    eval_batches: int = 8
    zipf_alpha: float = 0.9
    signal: float = 3.0
    within_noise: float = 0.1
    stray: float = 0.05
    num_dense: int = 4
    bias: float = -0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("num_tables", "ids_per_table", "groups", "session", "batch_size", "train_batches",
                    "eval_batches", "num_dense"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"{key} must be a positive integer, got {v!r}")
        if self.groups > self.ids_per_table:
            raise InvalidInputError(f"groups ({self.groups}) must not exceed ids_per_table ({self.ids_per_table})")
        if not 0.0 <= self.stray <= 1.0:
            raise InvalidInputError(f"stray must be in [0, 1], got {self.stray}")
        if self.zipf_alpha < 0 or self.within_noise < 0:
            raise InvalidInputError("zipf_alpha and within_noise must be >= 0")

    def universe(self, table: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(raw ids, group of each, hidden weight of each, popularity of each) of one table."""
        rng = np.random.default_rng([self.seed, 7, table])
        n = self.ids_per_table
        raw = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
        raw = np.unique(raw)
        while raw.size < n:  # collisions in 2**63 values: practically never
            raw = np.unique(np.concatenate([raw, rng.integers(-(2**62), 2**62, n - raw.size, dtype=np.int64)]))
        raw = rng.permutation(raw)
        group = rng.permutation(np.arange(n) % self.groups)
        weight = rng.standard_normal(self.groups)[group] + self.within_noise * rng.standard_normal(n)
        pop = 1.0 / (rng.permutation(n) + 1.0) ** self.zipf_alpha
        return raw, group, weight, pop

    def _sampler(self, table: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Ids ordered by group with a cumulative popularity, and each group's [lo, hi) popularity span."""
        raw, group, weight, pop = self.universe(table)
        order = np.argsort(group, kind="stable")
        cum = np.cumsum(pop[order])
        ends = np.searchsorted(group[order], np.arange(self.groups), side="right")
        hi = cum[ends - 1]
        lo = np.concatenate([[0.0], hi[:-1]])
        return raw[order], weight[order], cum, lo, hi

    def batch(self, index: int, split: str = "train") -> ClickBatch:
        tag = {"train": 0, "holdout": 1}[split]
        rng = np.random.default_rng([self.seed, tag, int(index)])
        b, t_n = self.batch_size, self.num_tables
        dense = rng.standard_normal((b, self.num_dense)).astype(np.float32)
        beta = np.random.default_rng([self.seed, 99]).standard_normal(self.num_dense) / math.sqrt(self.num_dense)
        logit = self.bias + dense.astype(np.float64) @ beta
        n_sessions = -(-b // self.session)
        ids, offs = [], []
        for t in range(t_n):
            raw, weight, cum, lo, hi = self._samplers[t]
            total = cum[-1]
            seed_pos = np.minimum(np.searchsorted(cum, rng.random(n_sessions) * total, side="right"), cum.size - 1)
            g = np.searchsorted(hi, cum[seed_pos], side="left")  # group of each session's seed id
            g = np.repeat(g, self.session)[:b]
            u = lo[g] + rng.random(b) * (hi[g] - lo[g])
            stray = rng.random(b) < self.stray
            u[stray] = rng.random(int(stray.sum())) * total
            pos = np.minimum(np.searchsorted(cum, u, side="right"), cum.size - 1)
            logit = logit + self.signal / math.sqrt(t_n) * weight[pos]
            ids.append(torch.from_numpy(raw[pos].copy()))
            offs.append(torch.arange(b + 1, dtype=torch.int64))
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ClickBatch(torch.from_numpy(dense), torch.from_numpy(labels), ids, offs)

    @property
    def _samplers(self) -> list[tuple[np.ndarray, ...]]:
        cache = self.__dict__.get("_sampler_cache")
        if cache is None:
            cache = [self._sampler(t) for t in range(self.num_tables)]
            object.__setattr__(self, "_sampler_cache", cache)
        return cache

    def splits(self) -> tuple[list[ClickBatch], list[ClickBatch]]:
        """(training batches, held-out batches)."""
        return ([self.batch(i, "train") for i in range(self.train_batches)],
                [self.batch(i, "holdout") for i in range(self.eval_batches)])


# --------------------------------------------------------------------------- metrics and accounting
def collision_shares(ids: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """(shared_rows, shared_vectors) over the lookups ``ids`` (with repeats) mapped to ``rows``.

    ``rows`` is (n,) or (n, k) (k rows per id, as QR). A row is shared when >= 2
    distinct ids of ``ids`` map to it; ``shared_rows`` is the share of lookups
    with at least one shared row, ``shared_vectors`` the share whose whole row
    tuple is also some other id's tuple. Both weight an id by its lookups.
    """
    ids = np.asarray(ids, np.int64).ravel()
    rows = np.asarray(rows, np.int64)
    if rows.ndim not in (1, 2) or rows.shape[0] != ids.shape[0]:
        raise InvalidInputError(f"rows must be (n,) or (n, k) for n = {ids.shape[0]} ids, got shape {rows.shape}")
    if ids.size == 0:
        return 0.0, 0.0
    r = rows.reshape(ids.shape[0], -1)
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    urows = r[first]  # (u, k): each distinct id's rows
    k = urows.shape[1]
    pairs = np.unique(np.stack([np.repeat(np.arange(uniq.size), k), urows.ravel()], axis=1), axis=0)
    row_vals, ids_per_row = np.unique(pairs[:, 1], return_counts=True)
    shared_row = ids_per_row[np.searchsorted(row_vals, urows)] >= 2  # (u, k)
    _, tup_inv, tup_count = np.unique(urows, axis=0, return_inverse=True, return_counts=True)
    shared_vec = tup_count[tup_inv.ravel()] >= 2
    total = float(counts.sum())
    return float(counts[shared_row.any(axis=1)].sum() / total), float(counts[shared_vec].sum() / total)


def qr_collisions(rows: int, full_rows: int) -> int:
    """Smallest m with m * (rows - m) >= full_rows (each id its own pair), else the best m = rows // 2."""
    if rows < 2:
        raise ConfigError("fraction", f"QR needs at least 2 rows per table, got {rows}")
    for m in range(1, rows // 2 + 1):
        if m * (rows - m) >= full_rows:
            return m
    return rows // 2


def fit_learned_within(trace: np.ndarray, offsets: np.ndarray, budget_bytes: int, row_bytes: int,
                       fit: Callable[..., LearnedHash] = LearnedHash.fit, **kwargs: Any) -> LearnedHash:
    """A learned hash with as many rows as fit ``budget_bytes`` beside its own mapping."""
    rows = budget_bytes // row_bytes
    for _ in range(8):
        if rows < 2:
            break
        mapper = fit(trace, rows, batch_offsets=offsets, **kwargs)
        if rows * row_bytes + mapper.mapping_bytes <= budget_bytes:
            return mapper
        rows = (budget_bytes - mapper.mapping_bytes) // row_bytes
    raise ConfigError("fraction", f"a learned mapping of the {np.unique(trace).size} seen ids alone needs about "
                      f"{budget_bytes - rows * row_bytes} of the {budget_bytes} budget bytes; raise --fraction "
                      "or --dim, or --load-factor")


# --------------------------------------------------------------------------- data preparation
@dataclass
class Prepared:
    """Batches with raw ids replaced by indices into each table's sorted distinct ids."""

    train: list[ClickBatch]
    holdout: list[ClickBatch]
    full_rows: list[int]
    num_dense: int

    @property
    def num_tables(self) -> int:
        return len(self.full_rows)

    def trace(self, table: int) -> tuple[np.ndarray, np.ndarray]:
        """(training accesses of one table, batch offsets into them)."""
        parts = [b.ids[table].numpy() for b in self.train]
        offs = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
        return np.concatenate(parts), offs


def index_ids(train: list[ClickBatch], holdout: list[ClickBatch]) -> Prepared:
    """Index every table's raw ids by the sorted distinct ids of both splits (no label is looked at)."""
    if not train or not holdout:
        raise InvalidInputError(f"need training and held-out batches, got {len(train)} and {len(holdout)}")
    t_n = len(train[0].ids)
    vocab = [np.unique(np.concatenate([b.ids[t].numpy() for b in train + holdout])) for t in range(t_n)]

    def remap(b: ClickBatch) -> ClickBatch:
        ids = [torch.from_numpy(np.searchsorted(vocab[t], b.ids[t].numpy()).astype(np.int64)) for t in range(t_n)]
        return ClickBatch(b.dense, b.labels, ids, b.offsets)

    return Prepared([remap(b) for b in train], [remap(b) for b in holdout], [max(1, v.size) for v in vocab],
                    int(train[0].dense.shape[1]))


def criteo_splits(paths: Sequence[str], batch_size: int, holdout_every: int, max_train: int,
                  max_eval: int) -> tuple[list[ClickBatch], list[ClickBatch]]:
    common = dict(batch_size=batch_size, holdout_every=holdout_every)
    take = lambda it, n: [b for _, b in zip(range(n) if n else iter(int, 1), it)]  # noqa: E731
    return (take(CriteoReader(list(paths), split="train", **common), max_train),
            take(CriteoReader(list(paths), split="holdout", **common), max_eval))


# --------------------------------------------------------------------------- one variant
@dataclass(frozen=True)
class RunConfig:
    """Model and schedule shared by every variant."""

    dim: int = 64
    fraction: float = 0.1
    dense_arch: tuple[int, ...] = (32,)
    over_arch: tuple[int, ...] = (32, 1)
    dense_optimizer: str = "adam"
    dense_lr: float = 0.005
    sparse_optimizer: str = "rowwise_adagrad"
    sparse_lr: float = 0.1
    init_scale: float = 0.05
    epochs: int = 2
    seed: int = 0
    load_factor: float = 0.8
    context_size: int | None = None
    dedicated_fraction: float = 0.5
    variants: tuple[str, ...] = VARIANTS

    @property
    def row_bytes(self) -> int:
        return self.dim * VALUE_BYTES


def table_configs(variant: str, data: Prepared, cfg: RunConfig, workdir: Path,
                  say: Callable[[str], None]) -> tuple[list[TableConfig], list[dict[str, Any]]]:
    """The tables of one variant and its per-table accounting."""
    tiers = (TierConfig.from_dict({"kind": "mmap"}),)
    tables, info = [], []
    for t, n in enumerate(data.full_rows):
        budget_rows = max(2, math.ceil(cfg.fraction * n))
        budget = budget_rows * cfg.row_bytes
        init = InitConfig(scale=cfg.init_scale, seed=cfg.seed + t)
        mapping_bytes, extra = 0, {}
        if variant == "full":
            rows, h = n, HashConfig()
        elif variant == "mod":
            rows, h = budget_rows, HashConfig(kind="mod", seed=cfg.seed)
        elif variant == "qr":
            rows = budget_rows
            m = qr_collisions(rows, n)
            h = HashConfig(kind="qr", collisions=m, combine="mult")
            init = InitConfig(scale=math.sqrt(math.sqrt(3.0) * cfg.init_scale), seed=cfg.seed + t)
            extra = {"collisions": m}
        elif variant == "learned":
            trace, offs = data.trace(t)
            mapper = fit_learned_within(trace, offs, budget, cfg.row_bytes, seed=cfg.seed,
                                        context_size=cfg.context_size, load_factor=cfg.load_factor,
                                        dedicated_fraction=cfg.dedicated_fraction)
            path = workdir / f"learned_t{t}.hash"
            mapper.save(path)
            rows, mapping_bytes = mapper.num_rows, mapper.mapping_bytes
            h = HashConfig(kind="learned", mapping=str(path))
            extra = {"dedicated": mapper.dedicated, "cluster_rows": mapper.cluster_rows,
                     "reserved_rows": mapper.reserved_rows, "known_ids": mapper.known}
            say(f"  learned t{t}: {rows} rows ({mapper.dedicated} dedicated, {mapper.cluster_rows} clustered, "
                f"{mapper.reserved_rows} reserved) + mapping {mapping_bytes} B for {mapper.known} seen ids")
        else:
            raise ConfigError("variants", f"{variant!r} is not one of {', '.join(VARIANTS)}")
        tables.append(TableConfig(f"t{t}", rows, cfg.dim, init=init, hash=h, tiers=tiers))
        info.append({"rows": rows, "full_rows": n, "budget_bytes": budget, "mapping_bytes": mapping_bytes,
                     "memory_bytes": rows * cfg.row_bytes + mapping_bytes, **extra})
    return tables, info


def train_variant(variant: str, data: Prepared, cfg: RunConfig, workdir: Path,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Train one variant on the prepared batches; held-out metrics, accounting and collision shares."""
    t0 = time.perf_counter()
    vdir = workdir / variant
    vdir.mkdir(parents=True)
    tables, info = table_configs(variant, data, cfg, vdir, say)
    # Tables are made with their optimizer-state columns up front: ensure_state_dim re-lays out a fresh table by
    # deleting its directory, which holds the learned mapping's copy (see the report on issue 5).
    store = embstore.create(vdir / "store", StoreConfig(()))
    try:
        for t in tables:
            store.create_table(t, state_dim=state_dim(cfg.sparse_optimizer, cfg.dim))
        names = [t.name for t in tables]
        ebc = TieredEmbeddingBagCollection(store, names, optimizer=cfg.sparse_optimizer, lr=cfg.sparse_lr)
        torch.manual_seed(cfg.seed)
        model = DLRM(ebc, len(names), cfg.dim, data.num_dense, [*cfg.dense_arch, cfg.dim], list(cfg.over_arch))
        opt = dense_optimizer(cfg.dense_optimizer, model.dense_parameters(), cfg.dense_lr)
        losses = []
        for epoch in range(cfg.epochs):
            for b in data.train:
                loss = F.binary_cross_entropy_with_logits(model(b.dense, b.ids, b.offsets), b.labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            k = len(data.train)
            say(f"  {variant}: epoch {epoch + 1}/{cfg.epochs} train loss {np.mean(losses[-k:]):.4f}")
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(b.dense, b.ids, b.offsets) for b in data.holdout])
        labels = torch.cat([b.labels for b in data.holdout])
        ev = evaluate(labels.numpy(), logits.numpy())
        shares = []
        for t, table in enumerate(tables):
            trace, _ = data.trace(t)
            mapper = store[table.name].mapper
            shares.append(collision_shares(trace, trace if mapper is None else mapper(trace)))
        ebc.release()
    finally:
        store.close()
    weights = [data.trace(t)[0].size for t in range(data.num_tables)]
    wsum = float(sum(weights))
    return {
        "log_loss": ev.log_loss, "auc": ev.auc, "ne": ev.ne, "samples": ev.samples, "ctr": ev.ctr,
        "steps": len(losses), "final_train_loss": float(np.mean(losses[-len(data.train):])),
        "rows": sum(i["rows"] for i in info), "memory_bytes": sum(i["memory_bytes"] for i in info),
        "budget_bytes": sum(i["budget_bytes"] for i in info),
        "mapping_bytes": sum(i["mapping_bytes"] for i in info),
        "shared_rows": sum(w * s[0] for w, s in zip(weights, shares)) / wsum,
        "shared_vectors": sum(w * s[1] for w, s in zip(weights, shares)) / wsum,
        "tables": [dict(i, shared_rows=s[0], shared_vectors=s[1]) for i, s in zip(info, shares)],
        "seconds": time.perf_counter() - t0,
    }


def evaluate_hashing(data: Prepared, cfg: RunConfig, say: Callable[[str], None] = lambda _m: None,
                     workdir: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Every variant of ``cfg.variants`` on the same data; {variant: figures}."""
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise ConfigError("variants", f"{unknown[0]!r} is not one of {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="eval_hashing_", dir=workdir) as tmp:
        out = {}
        for v in cfg.variants:
            say(f"[{v}] training {cfg.epochs} x {len(data.train)} steps")
            out[v] = train_variant(v, data, cfg, Path(tmp), say)
            r = out[v]
            held_out = EvalResult(r["auc"], r["log_loss"], r["ne"], r["samples"], r["ctr"])
            say(f"[{v}] held-out {eval_line(held_out)}  ({r['seconds']:.1f}s)")  # AUC, NE undefined on one class
        return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The figures of every variant, one line each; AUC and NE read 'undefined' where they have no value
    (held-out labels of one class: they printed as 'nan'), and a last line says why."""
    def metric(x: float) -> str:
        return f"{x:>9.4f}" if math.isfinite(x) else f"{'undefined':>9}"

    head = (f"{'variant':<8} {'rows':>8} {'memory KiB':>11} {'/budget':>8} {'mapping KiB':>12} {'log loss':>9} "
            f"{'AUC':>9} {'NE':>9} {'shared rows':>12} {'shared vecs':>12}")
    lines = [head, "-" * len(head)]
    for v, r in results.items():
        lines.append(f"{v:<8} {r['rows']:>8} {r['memory_bytes'] / 1024:>11.1f} "
                     f"{r['memory_bytes'] / r['budget_bytes']:>8.3f} {r['mapping_bytes'] / 1024:>12.1f} "
                     f"{metric(r['log_loss'])} {metric(r['auc'])} {metric(r['ne'])} {r['shared_rows']:>12.3f} "
                     f"{r['shared_vectors']:>12.3f}")
    one_class = {r["ctr"] for r in results.values() if r["ctr"] in (0.0, 1.0)}  # every variant: one held-out set
    if one_class:
        lines.append(f"AUC and NE undefined: the held-out labels are all one class "
                     f"({'no clicks' if one_class == {0.0} else 'all clicks'})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option, and the module docstring's layout kept in the epilog."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/eval_hashing.py",
        description="Train the same DLRM with a full table and with mod, QR and learned hashing at equal memory "
                    "(rows x dim x 4 bytes + mapping bytes), and report held-out log loss, AUC and the share of "
                    "lookups landing on shared rows.",
        epilog=__doc__.split("What it does. ", 1)[1] if __doc__ else None,
        formatter_class=_HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--synthetic", action="store_true", help="synthetic clicks with planted id groups (default)")
    src.add_argument("--criteo", nargs="+", metavar="FILE", help="Criteo-format TSV files (optionally .gz)")
    p.add_argument("--fraction", type=float, default=0.1, help="row budget per table as a share of the full "
                   "table's rows (distinct ids)")
    p.add_argument("--dim", type=int, default=64, help="embedding dim")
    p.add_argument("--epochs", type=int, default=2, help="passes over the training batches")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the hashes")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dense-lr", type=float, default=0.005, help="Adam learning rate of the MLPs")
    p.add_argument("--sparse-lr", type=float, default=0.1, help="row-wise Adagrad learning rate of the rows")
    p.add_argument("--load-factor", type=float, default=0.8, help="fill of the learned hash's id table")
    p.add_argument("--context-size", type=int, default=None, help="accesses per co-occurrence context of the "
                   "learned fit (default: the synthetic session length; for Criteo 1024)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    syn = p.add_argument_group("synthetic data")
    syn.add_argument("--tables", type=int, default=4)
    syn.add_argument("--ids", type=int, default=5000, help="ids per table")
    syn.add_argument("--groups", type=int, default=25, help="planted groups per table")
    syn.add_argument("--train-batches", type=int, default=40)
    syn.add_argument("--eval-batches", type=int, default=20)
    syn.add_argument("--quick", action="store_true", help="small synthetic run (3 tables, 2000 ids, 16 batches)")
    cri = p.add_argument_group("criteo data")
    cri.add_argument("--holdout-every", type=int, default=10, help="line i is held out when i %% N == N - 1")
    cri.add_argument("--max-train-batches", type=int, default=0, help="0 = every training batch")
    cri.add_argument("--max-eval-batches", type=int, default=0, help="0 = every held-out batch")
    p.add_argument("--json", metavar="F", help="also write the figures as JSON to F")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    say = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not 0.0 < args.fraction <= 1.0:
        raise ConfigError("fraction", f"must be in (0, 1], got {args.fraction}")
    for key in ("dim", "epochs", "batch_size"):
        if getattr(args, key) < 1:
            raise ConfigError(key, f"must be >= 1, got {getattr(args, key)}")
    if args.criteo:
        say(f"reading {', '.join(args.criteo)}")
        train, hold = criteo_splits(args.criteo, args.batch_size, args.holdout_every, args.max_train_batches,
                                    args.max_eval_batches)
        source: dict[str, Any] = {"kind": "criteo", "paths": list(args.criteo), "holdout_every": args.holdout_every}
        context = args.context_size
    else:
        kw = dict(num_tables=3, ids_per_table=2000, groups=20, train_batches=16, eval_batches=8) if args.quick \
            else dict(num_tables=args.tables, ids_per_table=args.ids, groups=args.groups,
                      train_batches=args.train_batches, eval_batches=args.eval_batches)
        gen = PlantedGroupClicks(batch_size=args.batch_size, seed=args.seed, **kw)
        train, hold = gen.splits()
        source = {"kind": "synthetic", **asdict(gen)}
        context = args.context_size or gen.session
    data = index_ids(train, hold)
    cfg = RunConfig(dim=args.dim, fraction=args.fraction, dense_lr=args.dense_lr, sparse_lr=args.sparse_lr,
                    epochs=args.epochs, seed=args.seed, load_factor=args.load_factor, context_size=context,
                    variants=variants)
    say(f"{len(data.train)} training and {len(data.holdout)} held-out batches; full tables {data.full_rows} rows")
    results = evaluate_hashing(data, cfg, say)
    print(format_table(results))
    out = {"config": {"data": source, "run": asdict(cfg), "full_rows": data.full_rows}, "results": results}
    if args.json:
        # atomically: a full disk keeps the previous file; an undefined AUC or NE is null (strict JSON has no NaN)
        atomic_write(args.json, strict_json.dumps(out, indent=1).encode())
    return out


def _cli() -> None:
    """``main`` from the command line: bad input (a bad option value, a missing data file) is one usage error
    line, not a traceback."""
    try:
        main()
    except (ConfigError, InvalidInputError, FileNotFoundError) as exc:  # the input's fault, not the store's
        build_parser().error(str(exc))


if __name__ == "__main__":
    _cli()
