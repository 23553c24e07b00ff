"""``build_hash``: the mapper a table's ``[hash]`` config asks for."""

from __future__ import annotations

from pathlib import Path

from embstore.config import HashConfig, HashKind
from embstore.errors import ConfigError
from embstore.hashing.base import Mapper
from embstore.hashing.learned import LearnedHash
from embstore.hashing.mod import ModHash
from embstore.hashing.qr import QRHash


def build_hash(cfg: HashConfig, num_embeddings: int, base_dir: Path | None = None) -> Mapper | None:
    """None for kind 'none'; otherwise a mapper onto ``num_embeddings`` physical rows.
    A learned mapping's relative path is taken from ``base_dir`` (the store directory)."""
    if cfg.kind is HashKind.NONE:
        return None
    if cfg.kind is HashKind.MOD:
        return ModHash(num_embeddings, cfg.seed)
    if cfg.kind is HashKind.QR:
        if cfg.collisions >= num_embeddings:
            raise ConfigError("hash.collisions", f"must be below num_embeddings = {num_embeddings} (the remainder "
                              f"rows share the table with at least one quotient row), got {cfg.collisions}")
        return QRHash(num_embeddings, cfg.collisions, cfg.combine)
    if cfg.kind is HashKind.LEARNED:
        path = Path(cfg.mapping or "")
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        try:
            mapper = LearnedHash.load(path)
        except ConfigError as exc:
            raise ConfigError("hash.mapping", str(exc).split(": ", 1)[-1]) from None
        if mapper.num_rows != num_embeddings:
            raise ConfigError("hash.mapping", f"{str(path)!r} maps onto {mapper.num_rows} rows but the table has "
                              f"num_embeddings = {num_embeddings}; refit with --buckets {num_embeddings}")
        return mapper
    raise ConfigError("hash.kind", f"unknown kind {cfg.kind!r}")  # pragma: no cover - HashConfig validates
