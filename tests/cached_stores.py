"""Stores whose tables sit behind DRAM caches of given policies and row counts (simulator-vs-store tests)."""

from __future__ import annotations

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig

DIM = 8
RB = 4 * DIM  # bytes per float32 row


def cached_store(path, names, levels, num=600):
    """Tables ``names`` of ``num`` rows, each with DRAM caches ``levels`` = [(policy, rows), ...] over mmap."""
    tabs = tuple(TableConfig(name=n, num_embeddings=num, dim=DIM,
                             tiers=tuple(TierConfig("dram", c * RB, p) for p, c in levels) + (TierConfig("mmap"),))
                 for n in names)
    return embstore.create(path, StoreConfig(tabs))
