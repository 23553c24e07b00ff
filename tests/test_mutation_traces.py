"""Trace parts that hand-made mutations of ``embstore/traces.py`` showed untested (session 10 mutation
audit): rows are (table, id) pairs also on the path for negative or huge ids, and CSV table names keep
their first-appearance numbering, and a table index past the names is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embstore.errors import InvalidInputError
from embstore.traces import Trace, dense_keys, load


def pair_numbers(ids: np.ndarray, table: np.ndarray) -> tuple[list[int], int]:
    """Each (table, id) pair numbered by first appearance: the reference of ``dense_keys``."""
    numbering: dict[tuple[int, int], int] = {}
    keys = [numbering.setdefault(pair, len(numbering)) for pair in zip(table.tolist(), ids.tolist())]
    return keys, len(numbering)


def test_dense_keys_tell_tables_apart_for_negative_and_huge_ids() -> None:
    """A negative id takes the sorting path, where table 0's largest id and table 1's smallest sort next
    to each other; here both are 7, and they are still two rows."""
    rng = np.random.default_rng(2)
    cases = [(np.array([-3, 7, 7, 9], np.int64), np.array([0, 0, 1, 1], np.int32)),
             (rng.choice(np.array([-5, 0, 7, 2**62, -(2**63)], np.int64), size=300),
              rng.integers(0, 3, size=300).astype(np.int32))]
    for ids, table in cases:
        keys, k = dense_keys(Trace(ids, table, np.array([0, len(ids)], np.int64)))
        assert (keys.tolist(), k) == pair_numbers(ids, table)


def test_csv_table_names_keep_the_order_they_first_appear_in(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    lines = [("zeta", 1), ("alpha", 2), ("zeta", 3), ("mid", 4), ("alpha", 5)]
    path.write_text("table,id\n" + "".join(f"{t},{i}\n" for t, i in lines))
    trace = load(path)
    assert trace.table_names == ("zeta", "alpha", "mid")
    assert [trace.table_names[t] for t in trace.table] == [t for t, _ in lines]
    assert trace.ids.tolist() == [i for _, i in lines]


def test_a_table_index_equal_to_the_number_of_names_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="out of range for 1 table names"):
        Trace(np.array([4], np.int64), np.array([1], np.int32), np.array([0, 1], np.int64), ("only",))
