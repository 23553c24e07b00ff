"""A table's home holds its rows: a store whose home folder is gone or emptied is refused at open, not
reopened with a new, empty home in which every row silently reads as its initial value."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig

HOMES = {"ssd": TierConfig("ssd"), "ssd_log": TierConfig("ssd", layout="log"), "mmap": TierConfig("mmap"),
         "rocksdb": TierConfig("rocksdb")}


def snapshot(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(params=sorted(HOMES))
def store_path(request, tmp_path):
    cfg = StoreConfig((TableConfig("t", 1000, 4, tiers=(TierConfig("dram", 64 * 16, "lru"), HOMES[request.param])),
                       TableConfig("u", 100, 4, tiers=(HOMES[request.param],))))
    with embstore.create(tmp_path / "s", cfg) as s:
        s["t"].update(np.arange(10), np.ones((10, 4), np.float32))
    return tmp_path / "s"


@pytest.mark.parametrize("damage", ["home deleted", "home emptied", "table folder deleted"])
def test_a_missing_home_is_refused_and_nothing_is_made_in_its_place(store_path, damage) -> None:
    home = store_path / "tables" / "t" / "home"
    if damage == "home deleted":
        shutil.rmtree(home)
    elif damage == "home emptied":
        for child in home.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    else:
        shutil.rmtree(home.parent)
    before = snapshot(store_path)
    with pytest.raises(embstore.CorruptStoreError, match="home of table 't'.*missing or empty"):
        embstore.open(store_path)
    assert snapshot(store_path) == before
    with pytest.raises(embstore.CorruptStoreError):  # and again: the refused open made no new home
        embstore.open(store_path)


def test_an_intact_store_reopens_with_its_rows(store_path) -> None:
    with embstore.open(store_path) as s:
        np.testing.assert_array_equal(s["t"].lookup(np.arange(10)), np.ones((10, 4), np.float32))


def test_tables_made_later_get_their_homes(store_path) -> None:
    """create_table, a table added to config.toml by hand, and a re-layout for optimizer state all make
    a home where none was: those are not refused."""
    with embstore.open(store_path) as s:
        s.create_table(TableConfig("v", 50, 4, tiers=(TierConfig("mmap"),)))
        s.ensure_state_dim("u", 1)
    text = (store_path / "config.toml").read_text()
    (store_path / "config.toml").write_text(text + '\n[[table]]\nname = "w"\nnum_embeddings = 20\ndim = 4\n'
                                            'tiers = [{ kind = "mmap" }]\n')
    with embstore.open(store_path) as s:
        assert sorted(s) == ["t", "u", "v", "w"]
        assert s["u"].format.state_dim == 1
    with embstore.open(store_path) as s:
        np.testing.assert_array_equal(s["t"].lookup(np.arange(10)), np.ones((10, 4), np.float32))
