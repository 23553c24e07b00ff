"""Training a table held whole in memory, while the same process reads or writes it.

The collection's working set for such a table is the table's own tier: the fused step writes the rows in
place. It took only the collection's lock, so a ``Table.lookup`` on another thread could read a row half
stepped, and a ``Table.update`` racing a step could leave a row half one and half the other (and a flush on
another thread write such a row home). The step now holds the table's lock too, as the forward already did.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.training import TieredEmbeddingBagCollection

ROWS, DIM = 8, 8192


def _store(path):
    """One table held whole in a DRAM tier over an mmap home."""
    cfg = TableConfig("t", ROWS, DIM, tiers=(TierConfig("dram", ROWS * DIM * 4 * 4), TierConfig("mmap")))
    return embstore.create(path, StoreConfig((cfg,)))


def _uniform(rows: np.ndarray) -> bool:
    """Every row has one value in all its elements (each step and each PUT below keeps rows so)."""
    return bool((rows == rows[:, :1]).all())


def _train(ebc: TieredEmbeddingBagCollection, steps: int, stop: threading.Event) -> None:
    """sgd, lr 1, loss = sum of every bag: each step lowers every element of every row by exactly 1."""
    ids = torch.arange(ROWS)
    offsets = torch.arange(ROWS + 1)
    try:
        for _ in range(steps):
            ebc([ids], [offsets]).sum().backward()
    finally:
        stop.set()


def test_a_lookup_never_reads_a_row_half_stepped(tmp_path) -> None:
    with _store(tmp_path / "s") as store:
        table = store["t"]
        table.update(np.arange(ROWS), np.zeros((ROWS, DIM), np.float32))
        ebc = TieredEmbeddingBagCollection(store, ["t"], optimizer="sgd", lr=1.0)
        stop, torn, reads = threading.Event(), [], [0]

        def read() -> None:
            while not stop.is_set():
                rows = table.lookup(np.arange(ROWS))
                reads[0] += 1
                if not _uniform(rows):
                    torn.append(rows)
        reader = threading.Thread(target=read)
        reader.start()
        _train(ebc, 400, stop)
        reader.join()
        ebc.release()
        assert reads[0] > 0 and not torn, f"{len(torn)} of {reads[0]} lookups read half-stepped rows"
        np.testing.assert_array_equal(table.lookup(np.arange(ROWS)), np.full((ROWS, DIM), -400, np.float32))
