"""``LearnedHash.load`` refusing mapping files whose checksums hold but whose content is impossible
(session 10 mutation audit: accepting a row equal to the first reserved row, or an id table with no
empty slot, on which a lookup of an unseen id would probe forever, passed every existing test)."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.errors import CorruptStoreError
from embstore.hashing import LearnedHash
from embstore.hashing._format import write_arrays


def fitted() -> LearnedHash:
    rng = np.random.default_rng(0)
    return LearnedHash.fit(rng.zipf(1.3, size=5000).astype(np.int64), 64, seed=3)


def test_a_row_in_the_reserved_region_is_refused(tmp_path) -> None:
    h = fitted()
    rows = np.array(h._trows)
    rows[np.flatnonzero(rows != -1)[0]] = h.reserved_start  # the first reserved row: not the table's to give
    write_arrays(tmp_path / "m", h.meta, {"keys": np.array(h._tkeys), "rows": rows})
    with pytest.raises(CorruptStoreError, match="rows outside"):
        LearnedHash.load(tmp_path / "m")


def test_an_id_table_without_an_empty_slot_is_refused(tmp_path) -> None:
    """Lookups end at an empty slot; a table of exactly ``known_ids`` entries has none."""
    h = fitted()
    full = np.array(h._trows) != -1
    write_arrays(tmp_path / "m", h.meta, {"keys": np.array(h._tkeys)[full], "rows": np.array(h._trows)[full]})
    with pytest.raises(CorruptStoreError, match="one length > known_ids"):
        LearnedHash.load(tmp_path / "m")
