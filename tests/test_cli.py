"""The command line: create, import, export, stats, demo, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.cli import main

CONFIG = """
[[table]]
name = "emb"
num_embeddings = 300
dim = 8
tiers = [{ kind = "dram", capacity = "1KiB", policy = "lru" }, { kind = "ssd" }]
"""


@pytest.fixture()
def store_path(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    return tmp_path / "s"


def test_import_export_round_trip(store_path, tmp_path) -> None:
    rows = np.random.default_rng(0).standard_normal((200, 8)).astype(np.float32)
    np.save(tmp_path / "in.npy", rows)
    assert main(["import", str(store_path), "emb", str(tmp_path / "in.npy"), "--start", "50"]) == 0
    assert main(["export", str(store_path), "emb", str(tmp_path / "out.npy")]) == 0
    out = np.load(tmp_path / "out.npy")
    assert out.shape == (300, 8)
    np.testing.assert_array_equal(out[50:250], rows)
    with embstore.open(store_path) as s:  # untouched rows keep their initial values
        np.testing.assert_array_equal(out[:50], s["emb"].lookup(np.arange(50, dtype=np.int64)))


def test_import_rejects_bad_files_and_changes_nothing(store_path, tmp_path, capsys) -> None:
    bad = np.ones((10, 8), np.float32)
    bad[7, 3] = np.inf
    np.save(tmp_path / "bad.npy", bad)
    np.save(tmp_path / "wrongdim.npy", np.ones((4, 5), np.float32))
    np.save(tmp_path / "ints.npy", np.ones((4, 8), np.int32))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with embstore.open(store_path) as s:
        before = s["emb"].lookup(np.arange(300, dtype=np.int64))
    for name, needle in [("bad.npy", "row 7"), ("wrongdim.npy", "shape (n, 8)"), ("ints.npy", "floating"),
                         ("junk.npy", "not a readable")]:
        assert main(["import", str(store_path), "emb", str(tmp_path / name)]) == 2
        assert needle in capsys.readouterr().err
    assert main(["import", str(store_path), "emb", str(tmp_path / "bad.npy"), "--start", "295"]) == 2
    assert main(["import", str(store_path), "nope", str(tmp_path / "bad.npy")]) == 2
    assert "known tables: emb" in capsys.readouterr().err
    with embstore.open(store_path) as s:
        np.testing.assert_array_equal(s["emb"].lookup(np.arange(300, dtype=np.int64)), before)


def test_create_errors(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("dim = 8", "dim = 8\nflavour = 'x'"))
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 2
    assert "table.flavour" in capsys.readouterr().err
    cfg.write_text(CONFIG)
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 2
    assert "already holds a store" in capsys.readouterr().err
    assert main(["create", str(tmp_path / "t"), "--config", str(tmp_path / "missing.toml")]) == 2


def test_stats_json(store_path, capsys) -> None:
    assert main(["stats", str(store_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["emb"]["dim"] == 8 and set(out["emb"]["tiers"]) == {"dram", "ssd"}


def test_help_of_every_verb() -> None:
    top = subprocess.run([sys.executable, "-m", "embstore.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0
    for verb in ("create", "import", "export", "stats", "demo"):
        assert verb in top.stdout
        r = subprocess.run([sys.executable, "-m", "embstore.cli", verb, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage: embstore " + verb in r.stdout
