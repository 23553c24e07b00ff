"""A collection's ``flush()`` makes trained rows final even over older writes in the store's write-ahead log.

``update_logged`` + ``sync_log`` (how the server acknowledges a PUT) leaves a row's write in the log until the
store flushes. If training then wrote that row and ``TieredEmbeddingBagCollection.flush()`` flushed only the
tables, a crash left the older logged write in the log and the reopen replayed it over the trained row.
A real child process is SIGKILLed right after ``flush()`` returns; the parent reopens the real files."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.config import InitConfig, StoreConfig, TableConfig, TierConfig
from homes import home_tier

NUM, DIM = 64, 8

CHILD = """
import os, signal, sys
import numpy as np, torch
import embstore
from embstore.training import TieredEmbeddingBagCollection
s = embstore.open(sys.argv[1])
s.update_logged("t", np.array([3, 9], np.int64), np.full((2, 8), 7.0, np.float32))
s.sync_log()  # acknowledged, as a PUT is
ebc = TieredEmbeddingBagCollection(s, ["t"], optimizer="sgd", lr=0.5)
out = ebc([torch.tensor([3, 5], dtype=torch.int64)], [torch.tensor([0, 2], dtype=torch.int64)])
out.sum().backward()
ebc.flush()
np.save(sys.argv[2], s["t"].lookup(np.arange(64, dtype=np.int64)))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("cache_rows", [0, 6], ids=["home-only", "dram-cache"])
@pytest.mark.parametrize("home", ["ssd", "rocksdb"])
def test_trained_rows_flushed_by_the_collection_survive_a_crash_over_older_logged_writes(
        tmp_path: Path, home: str, cache_rows: int) -> None:
    tiers = (TierConfig("dram", cache_rows * 4 * (DIM + 1), "lru"),) if cache_rows else ()
    cfg = TableConfig(name="t", num_embeddings=NUM, dim=DIM, init=InitConfig("uniform", 0.5, 7),
                      tiers=(*tiers, home_tier(home)))
    embstore.create(tmp_path / "s", StoreConfig((cfg,))).close()
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "s"), str(tmp_path / "seen.npy")],
                           capture_output=True, text=True, timeout=180)
    assert child.returncode == -signal.SIGKILL, child.stderr
    seen = np.load(tmp_path / "seen.npy")
    assert np.array_equal(seen[3], np.full(DIM, 7.0 - 0.5, np.float32))  # the logged row, then one sgd step
    assert np.array_equal(seen[9], np.full(DIM, 7.0, np.float32))  # logged, not trained
    with embstore.open(tmp_path / "s") as s:
        np.testing.assert_array_equal(s["t"].lookup(np.arange(NUM, dtype=np.int64)), seen)
