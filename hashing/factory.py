"""``build_hash``: the mapper a table's ``[hash]`` config asks for."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from embstore.config import HashConfig, HashKind
from embstore.errors import ConfigError
from embstore.hashing.base import Mapper
from embstore.hashing.learned import LearnedHash
from embstore.hashing.mod import ModHash
from embstore.hashing.qr import QRHash


def build_hash(cfg: HashConfig, num_embeddings: int, base_dir: Path | None = None, *, table: str | None = None,
               store_tables: Collection[str] = ()) -> Mapper | None:
    """None for kind 'none'; otherwise a mapper onto ``num_embeddings`` physical rows.
    A learned mapping's relative path is taken from ``base_dir`` (the store directory). ``table`` and
    ``store_tables``: the table the mapping is for and every table of its store (see
    :func:`check_fitted_table`)."""
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
        check_fitted_table(mapper, path, table, store_tables)
        return mapper
    raise ConfigError("hash.kind", f"unknown kind {cfg.kind!r}")  # pragma: no cover - HashConfig validates


def check_fitted_table(mapper: LearnedHash, path: Path, table: str | None, store_tables: Collection[str]) -> None:
    """ConfigError when ``mapper`` was fitted on another table of the same store: its hot ids and clusters
    are that table's, so ids of ``table`` would collide at random while the rows look fine. A mapping
    fitted on a trace whose table names the store does not use (``table_0`` of a generated trace, say)
    cannot be matched to a table by name and is taken as the config says; so is one that names no table
    (written before the name was recorded, or fitted from bare ids)."""
    fitted = mapper.table
    if table is None or fitted is None or fitted == table or fitted not in store_tables:
        return
    raise ConfigError("hash.mapping", f"{str(path)!r} was fitted for table {fitted!r} but is attached to table "
                      f"{table!r}; point {table!r} at a mapping fitted on its own ids "
                      f"(embstore hash fit TRACE --table {table} ...)")
