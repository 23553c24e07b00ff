"""`embstore train CONFIG.toml`: a DLRM trained out of a tiered store, with evals, curves and checkpoints.

One TOML holds everything (see ``examples/train_synthetic.toml``)::

    [data]      kind = "synthetic" | "criteo", batch_size, synthetic knobs or criteo paths
    [model]     dense_arch = [64, 16], over_arch = [64, 32, 1], interaction, optimizers
    [store]     path (default OUT/store), defaults = { dim, dtype, tiers, ... }, [[store.table]] entries
    [schedule]  epochs | steps, eval_every, checkpoint_every, lookahead, announce, dense_lr, sparse_lr, seed

Training is segmented at evaluation and checkpoint steps: each segment runs
through the EBC's look-ahead pipeline, which drains at the segment's end, so an
evaluation or a checkpoint never races a prefetch and sees every row written back.

A checkpoint (``OUT/checkpoints/step_N``) holds the dense ``state_dict`` (with
the EBC's extra state), the dense optimizer, the step, the loss history and a
copy of the store taken after ``flush()``, every file of it fsynced before the
``latest`` marker names the checkpoint; ``--resume`` restores all of it and
re-creates the data iterator at the next batch, so a resumed run equals the
uninterrupted one step for step. ``checkpoint_store = "in_place"`` skips the
copy (for stores too big to copy): then resume is exact only when the run
stopped right at its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

import embstore
from embstore.atomic import atomic_file, atomic_write, copy_tree_durably
from embstore.progress import progress_bar
from embstore.table import MAX_ANNOUNCED
from embstore.config import HashKind, StoreConfig, TableConfig, from_toml_file
from embstore.errors import ConfigError, CorruptStoreError, EmbstoreError
from embstore.files import not_a_regular_file, zip_crc_failure
from embstore.modmath import INT64_MAX
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.data import ClickBatch, CriteoReader, SyntheticClicks
from embstore.training.distributed import (DistContext, ShardedEmbeddingBags, average_gradients,
                                           broadcast_parameters, hashless)
from embstore.training.registry import _MAX_WIDTH as MAX_WIDTH, ModelSpec, retire_model, save_model
from embstore.training.dlrm import DENSE_OPTIMIZERS, DLRM, dense_optimizer
from embstore import strict_json
from embstore.training.metrics import EvalResult, evaluate
from embstore.training.optim import _FLOAT32_MAX, OPTIMIZERS

log = logging.getLogger("embstore.training.trainer")


# --------------------------------------------------------------------------- config
def _from_dict(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build a frozen config dataclass, rejecting unknown keys and wrong types with the key's name."""
    if not isinstance(data, Mapping):
        raise ConfigError(where, f"expected a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        key = f"{where}.{name}"
        if isinstance(default, tuple):
            if not isinstance(value, list):
                raise ConfigError(key, f"expected a list, got {value!r}")
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(key, f"expected true or false, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(key, f"expected an integer, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(key, f"expected a finite number, got {value!r}")  # TOML has nan and inf
            value = float(value)
        elif isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def _positive(where: str, **values: int) -> None:
    for k, v in values.items():
        if v < 1:
            raise ConfigError(f"{where}.{k}", f"must be >= 1, got {v}")


# Sizes (batch, features, ids per bag, layer widths) are capped at the registry's MAX_WIDTH, 2**31 - 1: numpy
# and torch take them as array dimensions (2**63 was a ValueError traceback) and the registry refuses a
# model.json width past it (a trained model must stay loadable). Whether a size below it fits this machine
# is check_memory's question.
MAX_LAYERS = 1000  # layers in an MLP or DCN: the registry refuses a longer list; 10**9 DCN layers built for hours


def _at_most(where: str, limit: int, **values: int) -> None:
    for k, v in values.items():
        if v > limit:
            raise ConfigError(f"{where}.{k}", f"must be at most {limit:,}, got {v}")


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from. Synthetic knobs are ignored for criteo and vice versa."""

    kind: str = "synthetic"
    batch_size: int = 512
    # synthetic
    train_batches: int = 200  # batches per epoch
    eval_batches: int = 20
    num_dense: int = 13
    zipf_alpha: float = 1.05
    bag_min: int = 1
    bag_max: int = 1
    signal_tables: int = 2
    signal: float = 2.0
    shuffle_labels: bool = False
    id_space: tuple[int, ...] = ()  # raw ids per table; default: each table's num_embeddings
    # criteo
    train_paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    holdout_every: int = 0  # with no eval_paths: line i is held out when i % N == N - 1
    multi_hot_delimiter: str = ""  # "" = one id per field
    missing: str = "reserved"  # "reserved" | "skip"
    eval_max_batches: int = 0  # 0 = the whole held-out set

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "criteo"):
            raise ConfigError("data.kind", f"{self.kind!r} is not one of 'synthetic', 'criteo'")
        _positive("data", batch_size=self.batch_size, train_batches=self.train_batches,
                  eval_batches=self.eval_batches, num_dense=self.num_dense)
        for key in ("bag_min", "signal_tables", "holdout_every", "eval_max_batches"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}", f"must be >= 0, got {getattr(self, key)}")
        _at_most("data", MAX_WIDTH, batch_size=self.batch_size, num_dense=self.num_dense, bag_min=self.bag_min,
                 bag_max=self.bag_max)
        if self.zipf_alpha < 0:
            raise ConfigError("data.zipf_alpha", f"must be >= 0, got {self.zipf_alpha}")
        if self.kind == "synthetic":  # checked here, not by SyntheticClicks later, so the error names the key
            if self.bag_max < 1:
                raise ConfigError("data.bag_max", f"must be >= 1 (ids per bag), got {self.bag_max}")
            if self.bag_min > self.bag_max:
                raise ConfigError("data.bag_min", f"must be <= bag_max ({self.bag_max}), got {self.bag_min}")
        if any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= INT64_MAX for n in self.id_space):
            raise ConfigError("data.id_space", f"must list integers from 1 to 2**63 - 1 (ids are int64), "
                                               f"got {list(self.id_space)}")
        for key in ("train_paths", "eval_paths"):
            if not all(isinstance(x, str) for x in getattr(self, key)):
                raise ConfigError(f"data.{key}", f"must be a list of file paths, got {list(getattr(self, key))}")
        if self.kind == "criteo":
            if not self.train_paths:
                raise ConfigError("data.train_paths", "criteo data needs train_paths = ['day_0.tsv', ...]")
            if not self.eval_paths and self.holdout_every < 2:
                raise ConfigError("data.holdout_every", "give eval_paths or holdout_every >= 2 for a held-out split")
        if self.missing not in ("reserved", "skip"):
            raise ConfigError("data.missing", f"{self.missing!r} is not one of 'reserved', 'skip'")


@dataclass(frozen=True)
class ModelConfig:
    """DLRM shape and optimizers; MLP widths are lists of ints."""

    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (64, 32, 1)
    interaction: str = "dot"  # "dot" | "dcn"
    dcn_layers: int = 3
    dcn_low_rank: int = 0  # 0 = full-rank cross layers
    dense_optimizer: str = "adagrad"
    sparse_optimizer: str = "rowwise_adagrad"

    def __post_init__(self) -> None:
        if self.interaction not in ("dot", "dcn"):
            raise ConfigError("model.interaction", f"{self.interaction!r} is not one of 'dot', 'dcn'")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ConfigError("model.dense_optimizer", f"{self.dense_optimizer!r} is not one of {DENSE_OPTIMIZERS}")
        if self.sparse_optimizer not in OPTIMIZERS:
            raise ConfigError("model.sparse_optimizer", f"{self.sparse_optimizer!r} is not one of {OPTIMIZERS}")
        for key in ("dense_arch", "over_arch"):
            v = getattr(self, key)
            if not v or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in v):
                raise ConfigError(f"model.{key}", f"must be a non-empty list of positive ints, got {list(v)}")
            if len(v) > MAX_LAYERS or max(v) > MAX_WIDTH:
                raise ConfigError(f"model.{key}", f"must list at most {MAX_LAYERS} widths of at most "
                                                  f"{MAX_WIDTH:,}, got {len(v)} up to {max(v)}")
        if self.over_arch[-1] != 1:
            raise ConfigError("model.over_arch", f"must end in 1 (one logit), got {list(self.over_arch)}")
        _positive("model", dcn_layers=self.dcn_layers)
        if self.dcn_low_rank < 0:
            raise ConfigError("model.dcn_low_rank", f"must be >= 0 (0 = full rank), got {self.dcn_low_rank}")
        _at_most("model", MAX_LAYERS, dcn_layers=self.dcn_layers)
        _at_most("model", MAX_WIDTH, dcn_low_rank=self.dcn_low_rank)


@dataclass(frozen=True)
class StoreSection:
    """The tables: ``[[store.table]]`` entries, each merged over ``defaults``."""

    path: str = ""  # "" = OUT/store
    tables: tuple[TableConfig, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StoreSection":
        unknown = sorted(set(data) - {"path", "defaults", "table"})
        if unknown:
            raise ConfigError(f"store.{unknown[0]}", "unknown key; allowed: defaults, path, table")
        defaults = data.get("defaults", {})
        if not isinstance(defaults, Mapping):
            raise ConfigError("store.defaults", f"expected a table, got {defaults!r}")
        entries = data.get("table", [])
        if not isinstance(entries, list) or not entries:
            raise ConfigError("store.table", "give one [[store.table]] section per embedding table")
        tables = tuple(TableConfig.from_dict({**defaults, **t}) for t in entries)
        StoreConfig(tables)  # duplicate names
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ConfigError("store.table.dim", f"every table needs the same dim, got {sorted(dims)}")
        return cls(str(data.get("path", "")), tables)


@dataclass(frozen=True)
class ScheduleConfig:
    """How long, how often to evaluate and checkpoint, learning rates, look-ahead, seed."""

    epochs: int = 1
    steps: int = 0  # > 0: stop after this many steps
    eval_every: int = 0  # 0: only at the end
    checkpoint_every: int = 0  # 0: only at the end
    checkpoint_store: str = "copy"  # "copy" | "in_place"
    lookahead: int = 2
    announce: int = 0  # batches beyond the look-ahead told to the tables' caches (Table.announce)
    dense_lr: float = 0.01
    sparse_lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("schedule", epochs=self.epochs)
        for key in ("steps", "eval_every", "checkpoint_every", "lookahead", "announce", "seed"):
            if getattr(self, key) < 0:
                raise ConfigError(f"schedule.{key}", f"must be >= 0, got {getattr(self, key)}")
        if self.announce and self.lookahead + 1 + self.announce > MAX_ANNOUNCED:  # what pipeline() refuses
            raise ConfigError("schedule.announce", f"lookahead + announce + 1 must be at most {MAX_ANNOUNCED} "
                              f"(the batches a table keeps announced), got {self.lookahead + 1 + self.announce}")
        if self.seed >= 1 << 64:  # torch.manual_seed's limit (TOML integers are not bounded by the parser)
            raise ConfigError("schedule.seed", f"must be below 2**64, got {self.seed}")
        if self.checkpoint_store not in ("copy", "in_place"):
            raise ConfigError("schedule.checkpoint_store", f"{self.checkpoint_store!r} is not 'copy' or 'in_place'")
        for key in ("dense_lr", "sparse_lr"):  # float32 weights: a step past its range makes them inf
            if not 0 < getattr(self, key) <= _FLOAT32_MAX:
                raise ConfigError(f"schedule.{key}", f"must be a positive number up to {_FLOAT32_MAX:.6g} "
                                                     f"(float32), got {getattr(self, key)}")


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    store: StoreSection = field(default_factory=StoreSection)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def __post_init__(self) -> None:
        """Checks across sections, made before a store is created (a failure later would leave one behind)."""
        tables = self.store.tables
        if not tables:
            return
        dim = tables[0].dim
        if self.model.dense_arch[-1] != dim:
            raise ConfigError("model.dense_arch",
                              f"must end in the embedding dim {dim}, got {list(self.model.dense_arch)}")
        space = self.data.id_space
        if self.data.kind == "synthetic" and space:
            if len(space) != len(tables):
                raise ConfigError("data.id_space", f"one entry per table ({len(tables)}), got {len(space)}")
            for t, n in zip(tables, space):
                if t.hash.kind is HashKind.NONE and n > t.num_embeddings:
                    raise ConfigError("data.id_space", f"{n} raw ids for table {t.name!r}, which has no hash and "
                                                       f"{t.num_embeddings} rows; give it a hash or a smaller id_space")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        unknown = sorted(set(data) - {"data", "model", "store", "schedule"})
        if unknown:
            raise ConfigError(unknown[0], "unknown section; allowed: [data], [model], [store], [schedule]")
        if "store" not in data:
            raise ConfigError("store", "missing; give [store] with [[store.table]] entries")
        return cls(_from_dict(DataConfig, data.get("data", {}), "data"),
                   _from_dict(ModelConfig, data.get("model", {}), "model"),
                   StoreSection.from_dict(data["store"]),
                   _from_dict(ScheduleConfig, data.get("schedule", {}), "schedule"))

    @classmethod
    def from_toml(cls, path: str | Path) -> "TrainConfig":
        return from_toml_file(cls.from_dict, path)


# --------------------------------------------------------------------------- result
@dataclass
class TrainResult:
    """What a run did: per-step global losses, evaluations, throughput."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, EvalResult]] = field(default_factory=list)
    samples_per_s: float = 0.0
    stopped_early: bool = False
    malformed_lines: int = 0
    resumed_from: int | None = None  # the checkpoint's step, when the run resumed
    tier_stats: dict[str, dict] = field(default_factory=dict)  # per table, at the end: Table.stats()


# --------------------------------------------------------------------------- data
class Batches:
    """The configured data as resumable iterators of global batches."""

    def __init__(self, cfg: TrainConfig, world: int) -> None:
        self.cfg = cfg.data
        d = cfg.data
        if d.batch_size % world:
            raise ConfigError("data.batch_size", f"{d.batch_size} must split evenly over {world} ranks")
        self.synthetic: SyntheticClicks | None = None
        self.reader: CriteoReader | None = None
        if d.kind == "synthetic":
            space = d.id_space or tuple(t.num_embeddings for t in cfg.store.tables)
            if len(space) != len(cfg.store.tables):
                raise ConfigError("data.id_space", f"one entry per table ({len(cfg.store.tables)}), got {len(space)}")
            self.synthetic = SyntheticClicks(space, d.batch_size, d.train_batches, d.num_dense, d.zipf_alpha,
                                             d.bag_min, d.bag_max, min(d.signal_tables, len(space)), d.signal,
                                             shuffle_labels=d.shuffle_labels, seed=cfg.schedule.seed)
            self.num_dense = d.num_dense
        else:
            common = dict(num_sparse=len(cfg.store.tables), multi_hot_delimiter=d.multi_hot_delimiter or None,
                          missing=d.missing, drop_last=world > 1)
            split = "all" if d.eval_paths else "train"
            self.reader = CriteoReader(list(d.train_paths), d.batch_size, split=split,
                                       holdout_every=d.holdout_every, **common)
            self.eval_reader = CriteoReader(list(d.eval_paths or d.train_paths), d.batch_size,
                                            split="all" if d.eval_paths else "holdout",
                                            holdout_every=d.holdout_every, **common)
            self.num_dense = 13

    def per_epoch(self) -> int | None:
        return self.cfg.train_batches if self.synthetic else None

    def train(self, start: int, epochs: int) -> Iterator[ClickBatch]:
        """Global batches from global index ``start`` on, over ``epochs`` passes."""
        index = 0
        for _ in range(epochs):
            if self.synthetic is not None:
                n = self.synthetic.num_batches
                if start >= index + n:
                    index += n
                    continue
                yield from self.synthetic.iter_batches(max(start - index, 0))
                index += n
            else:
                assert self.reader is not None
                yield from self.reader.iter_batches(max(start - index, 0))
                index += self.reader.stats.batches

    def holdout(self) -> Iterator[ClickBatch]:
        if self.synthetic is not None:
            yield from self.synthetic.iter_batches(0, "holdout", self.cfg.eval_batches)
            return
        for i, b in enumerate(self.eval_reader):
            if self.cfg.eval_max_batches and i >= self.cfg.eval_max_batches:
                break
            yield b


# --------------------------------------------------------------------------- pieces
SERVED_MODEL = "dlrm"  # STORE/models/dlrm: what `embstore serve` scores with after a run
def build_store(cfg: TrainConfig, out: Path, ctx: DistContext, resume: bool) -> tuple[embstore.Store, Path]:
    """Create (or, resuming, restore from the last checkpoint) this rank's store."""
    base = Path(cfg.store.path) if cfg.store.path else out / "store"
    path = out / f"rank{ctx.rank}" / "store" if ctx.enabled else base
    tables = tuple(hashless(t) for t in cfg.store.tables) if ctx.enabled else cfg.store.tables
    ckpt = latest_checkpoint(out) if resume else None
    if ckpt is not None and (ckpt / _store_name(ctx)).exists():
        # the live store is set aside, not deleted, until the restored copy opens and the checkpoint's state
        # fits the model (train() then drops it, or puts it back: a refused resume leaves it as it was)
        src, aside = ckpt / _store_name(ctx), _aside(path)
        if path.exists():
            if aside.exists():  # a resume died restoring: `aside` is the live store, `path` a partial copy
                shutil.rmtree(path)
            else:
                os.replace(path, aside)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            copy_tree_durably(src, path)
            return embstore.open(path), path
        except BaseException as exc:
            _put_back(path)
            if isinstance(exc, EmbstoreError):  # the copy's files are the checkpoint's: name those
                raise CorruptStoreError(f"checkpoint {str(src)!r} holds a store that cannot be opened: "
                                        f"{str(exc).replace(str(path), str(src))}") from exc
            raise
    if resume and ckpt is not None:  # checkpoint_store = "in_place": the store is the checkpoint
        return embstore.open(path), path
    if resume:
        raise ConfigError("resume", f"no checkpoint under {str(out / 'checkpoints')!r} to resume from")
    if path.exists():
        raise ConfigError("store.path", f"{str(path)!r} already exists; pass --resume to continue or a new --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    return embstore.create(path, StoreConfig(tables)), path


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.before_resume")


def _put_back(path: Path) -> None:
    """Undo a restore from a checkpoint's store copy: the live store set aside goes back (none: none)."""
    shutil.rmtree(path, ignore_errors=True)
    if _aside(path).exists():
        os.replace(_aside(path), path)


def _drop_aside(path: Path) -> None:
    """The restore stands: delete the live store set aside (renamed first, so a crash mid-delete leaves no
    half-deleted store under the name a later resume would put back)."""
    aside, trash = _aside(path), path.with_name(f".{path.name}.discarded")
    if aside.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(aside, trash)
        shutil.rmtree(trash)


def build_model(cfg: TrainConfig, store: embstore.Store, num_dense: int, ctx: DistContext) -> DLRM:
    torch.manual_seed(cfg.schedule.seed)
    names = [t.name for t in cfg.store.tables]
    dim = cfg.store.tables[0].dim
    kw = dict(optimizer=cfg.model.sparse_optimizer, lr=cfg.schedule.sparse_lr, lookahead=cfg.schedule.lookahead)
    ebc = (ShardedEmbeddingBags(store, cfg.store.tables, ctx, **kw) if ctx.enabled
           else TieredEmbeddingBagCollection(store, names, **kw))
    m = cfg.model
    model = DLRM(ebc, len(names), dim, num_dense, list(m.dense_arch), list(m.over_arch), m.interaction,
                 m.dcn_layers, m.dcn_low_rank)
    return model.to(ebc.device)  # the dense layers run where the bags come out (a GPU with a device tier)


def model_spec(cfg: TrainConfig, num_dense: int) -> ModelSpec:
    """The shape a server needs to rebuild the trained model over the store (``training/registry.py``)."""
    m = cfg.model
    return ModelSpec(tuple(t.name for t in cfg.store.tables), cfg.store.tables[0].dim, num_dense,
                     tuple(m.dense_arch), tuple(m.over_arch), m.interaction, m.dcn_layers, m.dcn_low_rank,
                     m.sparse_optimizer)


def local_part(batch: ClickBatch, ctx: DistContext,
               device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dense features and labels of a global batch, on the model's ``device``."""
    per = batch.size // ctx.world
    lo = ctx.rank * per
    return batch.dense[lo:lo + per].to(device), batch.labels[lo:lo + per].to(device)


_NO_HELD_OUT = ("the held-out split has no samples to evaluate on (check eval_paths, holdout_every and "
                "eval_max_batches against the data)")


def check_data(data: Batches) -> None:
    """Refuse Criteo files without one usable sample in either split before a store is made (an empty or
    all-malformed train file "trained 0 steps" and exited 0). Reads until the first batch of each: one chunk."""
    if data.reader is None:
        return  # synthetic: train_batches and eval_batches are >= 1
    if next(iter(data.holdout()), None) is None:
        raise ConfigError("data", _NO_HELD_OUT)
    if next(data.reader.iter_batches(), None) is None:
        st = data.reader.stats
        raise ConfigError("data.train_paths", f"the training split has no samples ({st.lines} lines, "
                                              f"{st.malformed} malformed, {st.blank} blank)")


def physical_memory() -> int | None:
    """This machine's RAM in bytes, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _mlp_parameters(width_in: int, widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip((width_in, *widths[:-1]), widths))  # Linear(a, b): weight and bias


def dense_parameter_counts(cfg: TrainConfig, num_dense: int) -> dict[str, int]:
    """Parameters of the bottom MLP, the interaction and the top MLP as training/dlrm.py lays them out,
    counted in Python ints from the widths: torch's own size arithmetic overflows (2**31 x 2**31 weights)."""
    m, tables = cfg.model, len(cfg.store.tables)
    dim = cfg.store.tables[0].dim
    if m.interaction == "dcn":
        n = (tables + 1) * dim  # x0 = concat(dense, one bag per table); low rank: V (n x r), U (r x n) + bias
        inter = m.dcn_layers * (2 * n * m.dcn_low_rank + n if m.dcn_low_rank else n * n + n)
        width = n
    else:
        inter, width = 0, dim + (tables + 1) * tables // 2  # the dense vector and the pairwise dot products
    return {"dense_arch": _mlp_parameters(num_dense, m.dense_arch), "interaction": inter,
            "over_arch": _mlp_parameters(width, m.over_arch)}


def check_memory(cfg: TrainConfig, num_dense: int, ram: int | None = None) -> None:
    """Refuse, before a store is made, a config whose dense layers, one batch or the held-out pass cannot fit
    in memory (a batch_size of 10**12 created the store, then died of a MemoryError). Every estimate is a
    lower bound (what must be held at once, not what the run peaks at), so a refused config could not run
    here; one that passes may still run short. The key named is the largest factor of the product."""
    ram = physical_memory() if ram is None else ram
    if ram is None:
        return
    d, m, tables = cfg.data, cfg.model, cfg.store.tables
    groups = dense_parameter_counts(cfg, num_dense)
    copies = {"sgd": 2, "adagrad": 3, "adam": 4}.get(m.dense_optimizer, 2)  # weights, gradients, optimizer state
    params = sum(groups.values())
    if params * 4 * copies > ram:
        biggest = max(groups, key=groups.__getitem__)
        key = {"dense_arch": "data.num_dense" if num_dense > max(m.dense_arch) else "model.dense_arch",
               "over_arch": "model.over_arch", "interaction": "model.dcn_low_rank" if m.dcn_low_rank
               else "model.interaction"}[biggest]
        raise ConfigError(key, f"the dense layers hold {params:,} parameters ({biggest}: {groups[biggest]:,}), "
                               f"{_gib(params * 4 * copies)} with gradients and {m.dense_optimizer} state, more "
                               f"than this machine's {_gib(ram)} of memory")
    bag = 1 if d.kind == "criteo" else (d.bag_min + d.bag_max) / 2
    ids = len(tables) * max(bag, 1)
    widths = sum(m.dense_arch) + sum(m.over_arch) + len(tables) * tables[0].dim
    # features (drawn or parsed in float64, fed in float32), int64 ids and offsets, pooled rows and activations
    # with their gradients: ~380 bytes for the example config, where a run peaks at ~700 a sample
    per_sample = 12 * num_dense + 8 * (ids + len(tables)) + 8 * widths
    if d.batch_size * per_sample > ram:
        factors = {"data.batch_size": d.batch_size, "data.num_dense": num_dense, "data.bag_max": ids}
        raise ConfigError(max(factors, key=factors.__getitem__),
                          f"a batch of {d.batch_size:,} samples ({num_dense} dense features, about {ids:,.0f} ids "
                          f"over {len(tables)} tables, layers {widths:,} wide) needs at least "
                          f"{_gib(d.batch_size * per_sample)}, more than this machine's {_gib(ram)} of memory")
    held_out = d.eval_batches if d.kind == "synthetic" else d.eval_max_batches  # criteo: bounded by its files
    if held_out * d.batch_size * 16 > ram:  # a logit and a label per sample, in float64 for the metrics
        factors = {"data.eval_batches" if d.kind == "synthetic" else "data.eval_max_batches": held_out,
                   "data.batch_size": d.batch_size}
        raise ConfigError(max(factors, key=factors.__getitem__),
                          f"{held_out:,} held-out batches of {d.batch_size:,} samples keep "
                          f"{_gib(held_out * d.batch_size * 16)} of scores for the metrics, more than this "
                          f"machine's {_gib(ram)} of memory")


@torch.no_grad()
def run_eval(model: DLRM, batches: Iterator[ClickBatch], ctx: DistContext) -> EvalResult:
    """Metrics over the held-out split (every rank's slice gathered when distributed)."""
    model.eval()
    logits, labels = [], []
    for b in batches:
        dense, y = local_part(b, ctx, model.sparse_arch.ebc.device)
        logits.append(model(dense, b.ids, b.offsets))
        labels.append(y)
    model.train()
    if not logits:
        raise ConfigError("data", _NO_HELD_OUT)
    z, y = torch.cat(logits), torch.cat(labels)
    if ctx.enabled:
        import torch.distributed as dist
        zs = [torch.empty_like(z) for _ in range(ctx.world)]
        ys = [torch.empty_like(y) for _ in range(ctx.world)]
        dist.all_gather(zs, z)
        dist.all_gather(ys, y)
        z, y = torch.cat(zs), torch.cat(ys)
    return evaluate(y.cpu().numpy(), z.cpu().numpy())


def plot_curves(result: TrainResult, path: Path, smooth: int = 20) -> None:
    """Training loss (moving average) and held-out AUC against the step, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    losses = np.asarray(result.losses)
    if len(losses):
        k = max(1, min(smooth, len(losses) // 5 or 1))
        ma = np.convolve(losses, np.ones(k) / k, mode="valid")
        a.plot(np.arange(len(losses)) + 1, losses, alpha=0.3, label="loss")
        a.plot(np.arange(len(ma)) + k, ma, label=f"mean of {k}")
        a.legend()
    a.set(xlabel="step", ylabel="training log loss", title="training loss")
    if result.evals:
        steps = [s for s, _ in result.evals]
        b.plot(steps, [e.auc for _, e in result.evals], marker="o", label="AUC")
        b.plot(steps, [e.ne for _, e in result.evals], marker="s", label="NE")
        b.legend()
    b.set(xlabel="step", title="held-out AUC and normalised entropy")
    fig.tight_layout()
    try:
        with atomic_file(path) as f:  # a full disk mid-write keeps the previous plot, not half a PNG
            fig.savefig(f, format="png", dpi=90)
    finally:
        plt.close(fig)


def _store_name(ctx: DistContext) -> str:
    return f"store_rank{ctx.rank}" if ctx.enabled else "store"


_CHECKPOINT_NAME = re.compile(r"step_[0-9]+")


def latest_checkpoint(out: Path) -> Path | None:
    """The folder ``checkpoints/latest`` names, None when there is no marker; a marker that names no
    checkpoint folder (damaged, or edited by hand) is a :class:`CorruptStoreError` naming it."""
    marker = out / "checkpoints" / "latest"
    if not marker.exists():
        return None
    kind = not_a_regular_file(marker)  # a FIFO would block the read forever
    if kind is not None:
        raise CorruptStoreError(f"checkpoint marker {str(marker)!r} is {kind}, not a regular file")
    try:
        name = marker.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        name = ""
    ckpt = out / "checkpoints" / name
    if not _CHECKPOINT_NAME.fullmatch(name) or not ckpt.is_dir():
        raise CorruptStoreError(f"checkpoint marker {str(marker)!r} names no checkpoint folder (it should hold "
                                f"a name like step_100; folders there: {', '.join(_checkpoints(out)) or 'none'})")
    return ckpt


def _checkpoints(out: Path) -> list[str]:
    """Checkpoint folders under ``out``, oldest first."""
    root = out / "checkpoints"
    names = [p.name for p in root.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name)] if root.is_dir() else []
    return sorted(names, key=lambda n: int(n[5:]))


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state, loaded with ``weights_only=True``: it holds tensors and plain Python values
    only, so loading a checkpoint file cannot run code. A damaged, truncated or foreign file is a
    :class:`CorruptStoreError` naming it. There is no silent fall-back to an earlier checkpoint (the
    ``latest`` marker only ever names a complete one, so a damaged one is damage worth seeing); the
    message lists the earlier ones, which ``latest`` can be pointed at by hand."""
    out = path.parent.parent.parent

    def bad(why: str) -> CorruptStoreError:
        earlier = [n for n in _checkpoints(out) if n != path.parent.name]
        hint = (f"; earlier checkpoints: {', '.join(earlier)} (write one's name into "
                f"{str(out / 'checkpoints' / 'latest')!r} to resume from it)") if earlier else ""
        return CorruptStoreError(f"checkpoint {str(path)!r} {why}{hint}")

    kind = not_a_regular_file(path)  # a FIFO would block torch.load forever
    if kind is not None:
        raise bad(f"is {kind}, not a regular file")
    if not path.is_file():
        raise bad("is missing")
    try:
        crc = zip_crc_failure(path)  # torch.load does not check: a flipped bit would be a different weight
        with warnings.catch_warnings():  # torch warns of pickle protocols it was not written with: noise
            warnings.simplefilter("ignore", UserWarning)
            state = None if crc else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types on damaged bytes (RuntimeError, UnpicklingError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # its advice runs to many lines
        raise bad(f"cannot be read: {type(exc).__name__}: {first}") from exc
    if crc is not None:
        raise bad(f"cannot be read: {crc}")
    if not isinstance(state, dict):
        raise bad(f"holds a {type(state).__name__}, not a checkpoint")
    kinds = {"step": int, "model": dict, "optimizer": dict, "losses": list, "evals": list}
    for key, kind in kinds.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise bad(f"lacks {key!r} (a {kind.__name__}), or holds something else there")
    step, losses = state["step"], state["losses"]
    if step < 0 or len(losses) != step or not all(type(x) is float for x in losses):
        raise bad(f"holds step {step} with {len(losses)} losses; it needs one float per step")
    fields = {f.name for f in dataclasses.fields(EvalResult)}
    for ev in state["evals"]:
        if (not isinstance(ev, (list, tuple)) or len(ev) != 2 or type(ev[0]) is not int or not isinstance(ev[1], dict)
                or set(ev[1]) != fields or not all(type(v) in (int, float) for v in ev[1].values())):
            raise bad(f"holds an evaluation that is not (step, {{{', '.join(sorted(fields))}}}): {ev!r:.80}")
    return state


def _restore(ckpt: Path, state: dict[str, Any], model: DLRM, opt: torch.optim.Optimizer) -> None:
    """Load a checkpoint's state into the model and optimizer: one that does not fit them (another config's
    checkpoint, a damaged tensor shape) is a :class:`CorruptStoreError` naming the file, not a traceback."""
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, EmbstoreError) as exc:
        raise CorruptStoreError(f"checkpoint {str(ckpt)!r} does not fit this config's model: "
                                f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc  # one line


def save_checkpoint(out: Path, step: int, model: DLRM, opt: torch.optim.Optimizer, result: TrainResult,
                    store: embstore.Store, cfg: TrainConfig, ctx: DistContext) -> Path:
    """Flush rows, copy the store (unless in_place), write this rank's state; rank 0 moves the ``latest`` marker."""
    ckpt = out / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    model.sparse_arch.ebc.flush()
    store.flush()
    if cfg.schedule.checkpoint_store == "copy":
        dst = ckpt / _store_name(ctx)
        if dst.exists():
            shutil.rmtree(dst)
        copy_tree_durably(store.path, dst)
    # plain Python values and tensors only: read_checkpoint loads with weights_only=True
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "losses": [float(x) for x in result.losses],
             "evals": [(int(s), {k: (int(v) if k == "samples" else float(v)) for k, v in dataclasses.asdict(e).items()})
                       for s, e in result.evals]}
    with atomic_file(ckpt / f"rank{ctx.rank}.pt") as f:
        torch.save(state, f)
    if ctx.enabled:
        import torch.distributed as dist
        dist.barrier()
    if ctx.is_main:
        atomic_write(out / "checkpoints" / "latest", ckpt.name.encode())
    return ckpt


_MOVED_PAST = "moved_past"


def _mark_moved_past(out: Path, step: int) -> None:
    """Note that training goes on past checkpoint ``step_N`` while the store is that checkpoint
    (``in_place``): a resume from it then cannot be exact, and says so."""
    atomic_write(out / "checkpoints" / _MOVED_PAST, f"step_{step}".encode())


def _moved_past(out: Path) -> str | None:
    """The checkpoint the run last went on training past (``in_place``), None when there is no note."""
    try:
        return (out / "checkpoints" / _MOVED_PAST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _boundaries(step: int, total: int, cfg: ScheduleConfig) -> int:
    """The next step at which training pauses for an eval or a checkpoint."""
    nxt = total
    for every in (cfg.eval_every, cfg.checkpoint_every):
        if every:
            nxt = min(nxt, (step // every + 1) * every)
    return nxt


# --------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, out: str | Path, resume: bool = False, ctx: DistContext = DistContext(),
          progress: bool = True, stop_at: int | None = None) -> TrainResult:
    """Train as configured, writing the store, checkpoints and curves under ``out``.

    ``stop_at`` ends the run after that step (and its eval and checkpoint, if
    due) without the final ones, as if killed there; the resume test uses it.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sched = cfg.schedule
    data = Batches(cfg, ctx.world)
    ckpt = latest_checkpoint(out) if resume else None
    state = read_checkpoint(ckpt / f"rank{ctx.rank}.pt") if ckpt is not None else None  # before the store moves
    if ckpt is None:
        check_data(data)
    check_memory(cfg, data.num_dense)
    store, store_path = build_store(cfg, out, ctx, resume)
    restored = ckpt is not None and (ckpt / _store_name(ctx)).exists()  # the store is the checkpoint's copy
    model: DLRM | None = None
    try:
        model = build_model(cfg, store, data.num_dense, ctx)
        dense_params = model.dense_parameters()
        opt = dense_optimizer(cfg.model.dense_optimizer, dense_params, sched.dense_lr)
        if ckpt is not None and state is not None:
            _restore(ckpt / f"rank{ctx.rank}.pt", state, model, opt)
    except BaseException:  # another config's checkpoint: the live store goes back as it was
        if model is not None:
            model.sparse_arch.ebc.release()
        store.close()
        if restored:
            _put_back(store_path)
        raise
    if restored:
        _drop_aside(store_path)
    result = TrainResult()

    if ckpt is not None and state is not None:
        result.step, result.losses = state["step"], list(state["losses"])
        result.evals = [(s, EvalResult(**e)) for s, e in state["evals"]]
        result.resumed_from = result.step
        if ctx.is_main:
            log.info("resumed from %s at step %d", ckpt, result.step)
            if not (ckpt / _store_name(ctx)).exists() and _moved_past(out) == ckpt.name:
                log.warning("resuming from %s with checkpoint_store = \"in_place\": the run went on training "
                            "after that checkpoint, so the store holds rows from later steps under step %d's "
                            "dense state; this run goes on from them and is not exact (checkpoint_store = "
                            "\"copy\" resumes bit for bit)", ckpt.name, result.step)
    elif ctx.enabled:
        broadcast_parameters(model)

    per_epoch = data.per_epoch()
    total = per_epoch * sched.epochs if per_epoch else (sched.steps or 10**12)
    if sched.steps:
        total = min(total, sched.steps)
    ebc = model.sparse_arch.ebc
    if result.step < total and not ctx.enabled:  # the rows are about to move: a model saved beside them
        retire_model(store_path, SERVED_MODEL)     # would no longer fit them (a sharded run saves none)
    stream = data.train(result.step, sched.epochs)
    bar = _progress(progress and ctx.is_main and result.step < total, total, result.step)
    t0, samples = time.perf_counter(), 0
    exhausted = False
    last_checkpoint = result.resumed_from
    try:
        while result.step < total and not exhausted:
            if last_checkpoint == result.step and sched.checkpoint_store == "in_place" and ctx.is_main:
                _mark_moved_past(out, last_checkpoint)  # the store is about to move on from its checkpoint
            end = _boundaries(result.step, total, sched)
            if stop_at is not None:
                end = min(end, stop_at)
            segment = _take(stream, end - result.step)
            n_before = result.step
            for batch in ebc.pipeline(segment, sparse=ClickBatch.sparse, announce=sched.announce):
                dense, labels = local_part(batch, ctx, ebc.device)
                logits = model(dense, batch.ids, batch.offsets)
                loss = F.binary_cross_entropy_with_logits(logits, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if ctx.enabled:
                    loss = average_gradients(dense_params, loss)
                opt.step()
                result.step += 1
                result.losses.append(float(loss.detach()))
                samples += batch.size
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.losses[-1]:.4f}",
                                    samples_s=f"{samples / (time.perf_counter() - t0):,.0f}")
            if result.step - n_before < end - n_before:
                exhausted = True  # a criteo pass ended before `total`
            done = result.step >= total or exhausted
            if (sched.eval_every and result.step % sched.eval_every == 0) or done:
                ev = run_eval(model, data.holdout(), ctx)
                result.evals.append((result.step, ev))
                if ctx.is_main:
                    _print(bar, f"step {result.step}: {eval_line(ev)}  ({ev.samples} held-out samples, "
                                f"CTR {ev.ctr:.3f})")
                    plot_curves(result, out / "curves.png")
            if (sched.checkpoint_every and result.step % sched.checkpoint_every == 0) or done:
                save_checkpoint(out, result.step, model, opt, result, store, cfg, ctx)
                last_checkpoint = result.step
            if stop_at is not None and result.step >= stop_at and not done:
                result.stopped_early = True  # as if killed here
                break
        if not result.stopped_early and not ctx.enabled:  # a sharded model has no single store to serve
            ebc.flush()  # the rows first (the final checkpoint flushed them already: this costs nothing then)
            store.flush()
            save_model(store_path, SERVED_MODEL, model_spec(cfg, data.num_dense), model)
        result.tier_stats = {t.name: t.stats() for t in ebc.tables}  # training's and evaluation's reads
    finally:
        if bar is not None:
            bar.close()
        ebc.release()
        store.close()
    elapsed = time.perf_counter() - t0
    result.samples_per_s = samples / elapsed if elapsed > 0 else 0.0
    if data.reader is not None:
        result.malformed_lines = data.reader.stats.malformed
    if ctx.is_main:
        metrics = {"step": result.step, "samples_per_s": result.samples_per_s,
                   "malformed_lines": result.malformed_lines,
                   "evals": [dict(step=s, **dataclasses.asdict(e)) for s, e in result.evals]}
        text = strict_json.dumps(metrics, indent=1)  # NaN is no JSON: strict parsers refuse it
        atomic_write(out / "metrics.json", text.encode())  # a full disk keeps the old one
    return result


def eval_line(ev: EvalResult) -> str:
    """AUC, log loss and NE for a progress line; one held-out class leaves AUC and NE undefined, and says so
    (NE's baseline, the entropy of the click rate, is 0 there: it printed 408323.6862)."""
    if ev.ctr in (0.0, 1.0):
        return (f"log loss {ev.log_loss:.4f}  AUC and NE undefined: held-out labels are all one class "
                f"({'no clicks' if ev.ctr == 0.0 else 'all clicks'})")
    return f"AUC {ev.auc:.4f}  log loss {ev.log_loss:.4f}  NE {ev.ne:.4f}"


def _take(it: Iterator[ClickBatch], n: int) -> Iterator[ClickBatch]:
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def _progress(on: bool, total: int, initial: int) -> Any:
    if not on:
        return None
    return progress_bar(total=total if total < 10**12 else None, initial=initial, desc="train", unit="step")


def _print(bar: Any, text: str) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m embstore.training CONFIG.toml [--resume] [--out DIR]`` (also under torchrun)."""
    import argparse

    from embstore.commands.train_cmds import add_arguments
    from embstore.training.distributed import init_from_env
    p = argparse.ArgumentParser(prog="python -m embstore.training", description="Train a DLRM from one TOML config.")
    add_arguments(p)
    args = p.parse_args(argv)
    return run_from_args(args, init_from_env())


def run_from_args(args: Any, ctx: DistContext = DistContext()) -> int:
    cfg = TrainConfig.from_toml(args.config)
    result = train(cfg, args.out, resume=args.resume, ctx=ctx, progress=args.progress)
    if ctx.is_main:
        last = result.evals[-1][1] if result.evals else None
        tail = f"  {eval_line(last)}" if last else ""
        if result.resumed_from is not None and result.step == result.resumed_from:
            print(f"nothing to train: the run in {args.out} already did its {result.step} steps{tail}")
        else:
            print(f"trained {result.step} steps, {result.samples_per_s:,.0f} samples/s{tail}; "
                  f"curves in {Path(args.out) / 'curves.png'}")
    return 0


__all__ = ["Batches", "DataConfig", "ModelConfig", "ScheduleConfig", "StoreSection", "TrainConfig", "TrainResult",
           "build_model", "build_store", "latest_checkpoint", "main", "plot_curves", "run_eval",
           "run_from_args", "save_checkpoint", "train"]
