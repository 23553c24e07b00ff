"""Trained models kept inside their store, so a server can score with them.

::

    STORE/models/NAME/model.json   shape: tables, dims, MLP widths, interaction, optimizer
    STORE/models/NAME/dense.pt     the dense parameters (bottom MLP, interaction, top MLP)

The embedding rows are the store's own tables; a loaded model reads them
through a :class:`TieredEmbeddingBagCollection` in eval mode (no updates).
Both files are written to temporary names and moved into place.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from embstore.errors import CorruptStoreError, InvalidInputError
from embstore.atomic import atomic_file, atomic_write
from embstore.store import Store
from embstore.training.dlrm import DLRM
from embstore.training.ebc import TieredEmbeddingBagCollection

MODELS_DIR = "models"
# what reading a damaged model.json / dense.pt raises (garbage or empty dense.pt: pickle / EOF errors)
_UNREADABLE = (OSError, ValueError, TypeError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError)


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


def save_model(store_path: str | os.PathLike, name: str, spec: ModelSpec, model: DLRM) -> Path:
    """Write ``model``'s dense parameters and shape under ``STORE/models/NAME``."""
    folder = Path(store_path) / MODELS_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}
    with atomic_file(folder / "dense.pt") as f:
        torch.save(dense, f)
    atomic_write(folder / "model.json", json.dumps(asdict(spec), indent=1).encode())
    return folder


def list_models(store_path: str | os.PathLike) -> list[str]:
    root = Path(store_path) / MODELS_DIR
    return sorted(p.name for p in root.iterdir() if (p / "model.json").exists()) if root.is_dir() else []


def load_model(store: Store, name: str) -> DLRM:
    """Rebuild model ``name`` over ``store``'s tables, in eval mode."""
    folder = store.path / MODELS_DIR / name
    if not (folder / "model.json").exists():
        raise InvalidInputError(f"no model {name!r} in {store.path}; known: {', '.join(list_models(store.path))}")
    try:
        raw: dict[str, Any] = json.loads((folder / "model.json").read_text())
        spec = ModelSpec(**{**raw, "tables": tuple(raw["tables"]), "dense_arch": tuple(raw["dense_arch"]),
                            "over_arch": tuple(raw["over_arch"])})
        dense = torch.load(folder / "dense.pt", weights_only=True)
    except _UNREADABLE as exc:
        raise CorruptStoreError(f"model {name!r} in {folder} cannot be read: {exc}") from exc
    if isinstance(dense, dict):  # a NaN weight would make every prediction NaN, silently
        bad = [k for k, v in dense.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
               and not bool(torch.isfinite(v).all())]
        if bad:
            raise CorruptStoreError(f"model {name!r} in {folder}: dense.pt holds NaN or inf in {bad[0]!r}")
    ebc = TieredEmbeddingBagCollection(store, list(spec.tables), optimizer=spec.sparse_optimizer)
    model = DLRM(ebc, len(spec.tables), spec.embedding_dim, spec.dense_in_features, spec.dense_arch,
                 spec.over_arch, spec.interaction, spec.dcn_layers, spec.dcn_low_rank)
    try:  # not a state dict, or a tensor of another shape
        missing, unexpected = model.load_state_dict(dense, strict=False)
    except (TypeError, RuntimeError) as exc:
        raise CorruptStoreError(f"model {name!r} in {folder}: dense.pt does not fit its shape: {exc}") from exc
    missing = [k for k in missing if not k.startswith("sparse_arch.")]
    if missing or unexpected:
        raise CorruptStoreError(f"model {name!r} in {folder}: parameters do not match its shape "
                                f"(missing {missing[:3]}, unexpected {list(unexpected)[:3]})")
    model.spec = spec  # type: ignore[attr-defined]
    return model.eval()


@torch.no_grad()
def predict(model: DLRM, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
    """Click probabilities, shape (batch,)."""
    spec: ModelSpec = model.spec  # type: ignore[attr-defined]
    if dense.ndim != 2 or dense.shape[1] != spec.dense_in_features:
        raise InvalidInputError(f"dense must have shape (batch, {spec.dense_in_features}), got {tuple(dense.shape)}")
    if not torch.isfinite(dense).all():
        raise InvalidInputError("dense features must be finite")
    return torch.sigmoid(model(dense.to(torch.float32), ids, offsets))
