"""Trained models kept inside their store, so a server can score with them.

::

    STORE/models/NAME/model.json   shape: tables, dims, MLP widths, interaction, optimizer
    STORE/models/NAME/dense.pt     the dense parameters (bottom MLP, interaction, top MLP)

The embedding rows are the store's own tables; a loaded model reads them
through a :class:`TieredEmbeddingBagCollection` in eval mode (no updates).
Both files are written to temporary names and moved into place, and
``model.json`` is what makes a model exist: a save removes it first and writes
it last, so a crash part-way leaves no model rather than one file of each save.
The trainer retires its model the same way before it moves the rows and saves
it again only after they are flushed (``training/trainer.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from embstore.atomic import atomic_file, atomic_write, fsync_dir
from embstore.errors import CorruptStoreError, InvalidInputError, TableExistsError
from embstore.files import not_a_regular_file, zip_crc_failure
from embstore.store import Store
from embstore.training.dlrm import DLRM
from embstore.training.ebc import TieredEmbeddingBagCollection
from embstore.training.optim import OPTIMIZERS

MODELS_DIR = "models"


@dataclass(frozen=True)
class ModelSpec:
    """What it takes to rebuild a DLRM over a store's tables."""

    tables: tuple[str, ...]
    embedding_dim: int
    dense_in_features: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    interaction: str = "dot"
    dcn_layers: int = 3
    dcn_low_rank: int = 0
    sparse_optimizer: str = "rowwise_adagrad"
    # What predict does to the dense features a client sends before the model sees them. "log1p" is
    # log(1 + max(x, 0)): what training/data.py feeds the model (Criteo's integers are read that way, and
    # the synthetic source draws its features as log1p of raw values), so a model the trainer saved takes
    # the raw features. "none": as sent; a model.json written before this field reads as "none", as it
    # was served then.
    dense_transform: str = "log1p"


DENSE_TRANSFORMS = ("none", "log1p")


def transform_dense(kind: str, dense: torch.Tensor) -> torch.Tensor:
    """float32 features as a model of ``dense_transform`` ``kind`` saw them in training; log1p in float64
    and then rounded, exactly as training/data.py computes it, so a raw integer scores as in training."""
    if kind == "none":
        return dense.to(torch.float32)
    if kind != "log1p":
        raise InvalidInputError(f"dense_transform must be one of {', '.join(DENSE_TRANSFORMS)}, got {kind!r}")
    raw = dense.detach().cpu().numpy().astype(np.float64)
    return torch.from_numpy(np.log1p(np.maximum(raw, 0.0)).astype(np.float32)).to(dense.device)


def save_model(store_path: str | os.PathLike, name: str, spec: ModelSpec, model: DLRM) -> Path:
    """Write ``model``'s dense parameters and shape under ``STORE/models/NAME``.

    ``model.json`` goes first (durably) and comes back last: with the two files replaced one by one, a
    crash between them left a ``dense.pt`` of this save beside the ``model.json`` of the last one, which
    loads silently when the shapes agree (tables listed in another order)."""
    folder = Path(store_path) / MODELS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    _unpublish(folder)
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}
    with atomic_file(folder / "dense.pt") as f:
        torch.save(dense, f)
    atomic_write(folder / "model.json", json.dumps(asdict(spec), indent=1).encode())
    return folder


def _unpublish(folder: Path) -> None:
    """Remove ``folder``'s ``model.json`` durably: from then on there is no model there to load."""
    spec_file = folder / "model.json"
    if spec_file.exists() or spec_file.is_symlink():
        spec_file.unlink()
        fsync_dir(folder)


def retire_model(store_path: str | os.PathLike, name: str) -> None:
    """Withdraw model ``name`` before its rows change (training goes on): its dense layers would not fit
    them. ``model.json`` goes first, so a crash mid-way leaves no model, never a stale one; the folder
    stays, empty, so that :func:`load_model` can say the model is being written, not merely absent."""
    folder = Path(store_path) / MODELS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    _unpublish(folder)
    (folder / "dense.pt").unlink(missing_ok=True)


def list_models(store_path: str | os.PathLike) -> list[str]:
    root = Path(store_path) / MODELS_DIR
    return sorted(p.name for p in root.iterdir() if (p / "model.json").exists()) if root.is_dir() else []


_MAX_WIDTH = (1 << 31) - 1  # a layer width, dim or count past this is damage (and past int64 a torch error)


def _spec_from_json(raw: object) -> ModelSpec:
    """``model.json``'s contents as a :class:`ModelSpec`, every field's type and bounds checked first: the
    widths size the layers built from them. Raises ``ValueError`` saying what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"holds a JSON {type(raw).__name__}, not an object")
    fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in raw]
    unknown = sorted(set(raw) - set(fields))
    if missing or unknown:
        raise ValueError(f"lacks {missing} or has unknown keys {unknown}" if missing and unknown else
                         f"lacks the key(s) {missing}" if missing else f"has unknown key(s) {unknown}")

    def count(key: str, value: object, lo: int) -> int:
        if type(value) is not int or not lo <= value <= _MAX_WIDTH:
            raise ValueError(f"{key} must be an integer from {lo} to {_MAX_WIDTH}, got {value!r:.60}")
        return value

    def widths(key: str) -> tuple[int, ...]:
        value = raw[key]
        if not isinstance(value, list) or not value or len(value) > 1000:
            raise ValueError(f"{key} must be a non-empty list of layer widths, got {value!r:.60}")
        return tuple(count(key, w, 1) for w in value)

    tables = raw["tables"]
    if (not isinstance(tables, list) or not tables or not all(isinstance(t, str) and t for t in tables)
            or len(set(tables)) != len(tables)):
        raise ValueError(f"tables must be a non-empty list of distinct table names, got {tables!r:.60}")
    spec = ModelSpec(tuple(tables), count("embedding_dim", raw["embedding_dim"], 1),
                     count("dense_in_features", raw["dense_in_features"], 1), widths("dense_arch"),
                     widths("over_arch"), raw.get("interaction", "dot"),
                     count("dcn_layers", raw.get("dcn_layers", 3), 1),
                     count("dcn_low_rank", raw.get("dcn_low_rank", 0), 0),
                     raw.get("sparse_optimizer", "rowwise_adagrad"), raw.get("dense_transform", "none"))
    if spec.interaction not in ("dot", "dcn"):
        raise ValueError(f"interaction must be 'dot' or 'dcn', got {spec.interaction!r:.60}")
    if spec.dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"dense_transform must be one of {', '.join(DENSE_TRANSFORMS)}, "
                         f"got {spec.dense_transform!r:.60}")
    if spec.sparse_optimizer not in OPTIMIZERS:
        raise ValueError(f"sparse_optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.sparse_optimizer!r:.60}")
    return spec


def _shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    """The dense parameters' shapes ``spec`` implies, from a model built on the meta device (shapes only,
    no memory): a damaged width such as 10**12 costs nothing here. Raises ``ValueError`` when ``spec``
    describes no DLRM (e.g. ``dense_arch`` not ending in the embedding dim)."""
    try:
        with torch.device("meta"):
            skeleton = DLRM(nn.Module(), len(spec.tables), spec.embedding_dim, spec.dense_in_features,
                            spec.dense_arch, spec.over_arch, spec.interaction, spec.dcn_layers, spec.dcn_low_rank)
    except (InvalidInputError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"describes no DLRM: {exc}") from exc
    return {k: v.shape for k, v in skeleton.state_dict().items() if not k.startswith("sparse_arch.")}


def _check_dense(want: dict[str, torch.Size], dense: object) -> str | None:
    """Why the contents of ``dense.pt`` are not parameters of the shapes ``want``, or None. Once they
    agree, the real model built from the widths is no larger than ``dense.pt`` itself."""
    if not isinstance(dense, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in dense.items()):
        return f"holds a {type(dense).__name__}, not a dict of named tensors"
    if set(dense) != set(want):
        return (f"does not fit model.json: missing {sorted(set(want) - set(dense))[:3]}, "
                f"unexpected {sorted(set(dense) - set(want))[:3]}")
    for key, t in dense.items():
        if t.layout != torch.strided or not t.is_floating_point():
            return f"holds {key!r} as a {t.dtype} ({t.layout}) tensor, not a dense floating-point one"
        if t.shape != want[key]:
            return f"holds {key!r} of shape {tuple(t.shape)}, but model.json's widths need {tuple(want[key])}"
        if not bool(torch.isfinite(t).all()):  # a NaN weight would make every prediction NaN, silently
            return f"holds NaN or inf in {key!r}"
    return None


def load_model(store: Store, name: str) -> DLRM:
    """Rebuild model ``name`` over ``store``'s tables, in eval mode.

    Both files are checked before anything is built or the store touched: a damaged, truncated or
    mismatched ``model.json`` / ``dense.pt`` is a :class:`CorruptStoreError` naming the file.
    """
    folder = store.path / MODELS_DIR / name
    spec_file, dense_file = folder / "model.json", folder / "dense.pt"
    if not spec_file.exists():
        interrupted = (" (its folder lacks model.json, which a save writes last: the save, or the training "
                       "run that retrains it, was interrupted; resume the run to write it)") if folder.is_dir() else ""
        raise InvalidInputError(f"no model {name!r} in {store.path}{interrupted}; "
                                f"known: {', '.join(list_models(store.path))}")

    def bad(path: Path, why: str) -> CorruptStoreError:
        return CorruptStoreError(f"model {name!r}: {str(path)!r}: {why}")

    for path in (spec_file, dense_file):
        kind = not_a_regular_file(path)  # a FIFO would block the read forever
        if kind is not None:
            raise bad(path, f"{kind}, not a regular file")
    try:
        raw = json.loads(spec_file.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON syntax, UTF-8
        raise bad(spec_file, f"cannot be read: {type(exc).__name__}: {exc}") from exc
    try:
        spec = _spec_from_json(raw)
        want = _shapes(spec)
    except ValueError as exc:
        raise bad(spec_file, str(exc)) from exc
    try:
        crc = zip_crc_failure(dense_file)  # torch.load does not check: a flipped bit would be another weight
        dense = None if crc else torch.load(dense_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types on damaged bytes (RuntimeError, UnpicklingError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # its advice runs to many lines
        raise bad(dense_file, f"cannot be read: {type(exc).__name__}: {first}") from exc
    if crc is not None:
        raise bad(dense_file, f"cannot be read: {crc}")
    why = _check_dense(want, dense)
    if why is not None:
        raise bad(dense_file, why)
    for table in spec.tables:  # checked here: building the EBC may re-lay-out an empty table first
        if table not in store.tables:
            raise bad(spec_file, f"names table {table!r}, which the store lacks (it has: "
                                 f"{', '.join(sorted(store.tables)) or 'none'})")
        if store.tables[table].dim != spec.embedding_dim:
            raise bad(spec_file, f"says embedding_dim {spec.embedding_dim}, but table {table!r} has dim "
                                 f"{store.tables[table].dim}")
    try:  # a table holding rows laid out for another optimizer's state
        ebc = TieredEmbeddingBagCollection(store, list(spec.tables), optimizer=spec.sparse_optimizer)
    except (InvalidInputError, TableExistsError) as exc:
        raise bad(spec_file, f"does not fit the store: {exc}") from exc
    model = DLRM(ebc, len(spec.tables), spec.embedding_dim, spec.dense_in_features, spec.dense_arch,
                 spec.over_arch, spec.interaction, spec.dcn_layers, spec.dcn_low_rank)
    model.load_state_dict(dense, strict=False)  # checked above; not strict: the rows live in the store
    model.spec = spec  # type: ignore[attr-defined]
    # the dense layers run where the bags come out (a device tier's accelerator), as the trainer's build_model
    return model.to(ebc.device).eval()


@torch.no_grad()
def predict(model: DLRM, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
    """Click probabilities, shape (batch,), on the CPU (``dense`` may be on any device)."""
    spec: ModelSpec = model.spec  # type: ignore[attr-defined]
    if dense.ndim != 2 or dense.shape[1] != spec.dense_in_features:
        raise InvalidInputError(f"dense must have shape (batch, {spec.dense_in_features}), got {tuple(dense.shape)}")
    if not torch.isfinite(dense).all():
        raise InvalidInputError("dense features must be finite")
    device = model.sparse_arch.ebc.device  # where load_model put the dense layers
    x = transform_dense(spec.dense_transform, dense)  # the features as training fed them
    return torch.sigmoid(model(x.to(device, torch.float32), ids, offsets)).cpu()
