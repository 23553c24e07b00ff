"""Audit of bulk import/export: chunks bounded in bytes (not only rows), what an import does to a trained
table's optimizer state, and whether an acknowledged import survives a SIGKILL right after it, for every
home, with and without a DRAM cache above it, and with older writes still in the store's write-ahead log.

References are numpy arrays; crashes are real child processes killed with SIGKILL over real files."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import embstore
from embstore import bulk
from embstore.bulk import export_rows, import_rows
from embstore.cli import main
from embstore.config import InitConfig, StoreConfig, TableConfig, TierConfig
from embstore.rows import RowFormat, initial_rows
from embstore.training import TieredEmbeddingBagCollection, state_dim
from crash_states import whole_lines
from homes import home_tier

HOMES = ("ssd", "ssd-log", "rocksdb", "mmap")
INIT = InitConfig("uniform", 0.5, 7)


def make_store(path: Path, num: int, dim: int, home: str = "ssd", cache_rows: int = 0,
               state: int = 0) -> None:
    """A store of one float32 table ``t``; ``cache_rows`` > 0 puts an LRU DRAM cache above the home."""
    row_bytes = 4 * (dim + state)
    tiers = (TierConfig("dram", cache_rows * row_bytes, "lru"),) if cache_rows else ()
    cfg = TableConfig(name="t", num_embeddings=num, dim=dim, init=INIT, tiers=(*tiers, home_tier(home)))
    embstore.create(path, StoreConfig((cfg,))).close()


def initial(ids: np.ndarray, dim: int) -> np.ndarray:
    return initial_rows(INIT, ids, dim)


# --- 1. chunks bounded in bytes -----------------------------------------------------------------------


class RecordingFormat(RowFormat):
    """The table's row format, recording the rows each validation call is given (a thin wrapper)."""

    def __init__(self, fmt: RowFormat, seen: list[int]) -> None:
        super().__init__(fmt.dim, fmt.dtype, fmt.state_dim)
        object.__setattr__(self, "_seen", seen)

    def check(self, rows: np.ndarray) -> None:
        self._seen.append(rows.nbytes)
        super().check(rows)


def record_chunks(table: embstore.Table) -> dict[str, list[int]]:
    """Float32 bytes per call of validation, write_physical and read_physical (wrapped on this table only)."""
    seen: dict[str, list[int]] = {"check": [], "write": [], "read": []}
    table.format = RecordingFormat(table.format, seen["check"])
    write, read = table.write_physical, table.read_physical

    def write_physical(rows, values):
        seen["write"].append(4 * table.format.dim * len(rows))
        assert np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))) if len(rows) else True
        return write(rows, values)

    def read_physical(rows):
        seen["read"].append(4 * table.format.dim * len(rows))
        return read(rows)

    table.write_physical, table.read_physical = write_physical, read_physical
    return seen


def allowed_bytes(dim: int, budget: int) -> int:
    """A chunk's size at most: the budget, or one row when a row alone is larger."""
    return max(budget, 4 * dim)


@settings(deadline=None, max_examples=15, suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 24), dim=st.integers(1, 40), rows_of_budget=st.integers(0, 9), start=st.integers(0, 6),
       slack=st.integers(0, 3))
def test_chunks_stay_within_a_byte_budget_and_rows_match(n, dim, rows_of_budget, start, slack):
    """With a small byte budget patched in, every validation, write and read chunk of an import and an
    export holds at most that many float32 bytes (or one row), the chunks add up to the rows, and the
    table holds exactly the numpy reference, including the rows at chunk boundaries."""
    budget = rows_of_budget * 4 * dim + slack  # not always a whole number of rows
    d = Path(tempfile.mkdtemp(prefix="bulk_dur_"))
    old = bulk.CHUNK_BYTES
    bulk.CHUNK_BYTES = budget
    try:
        num = start + n + 3
        make_store(d / "s", num, dim, "ssd", cache_rows=5)
        data = np.random.default_rng(n * 41 + dim).standard_normal((n, dim)).astype(np.float64)
        np.save(d / "in.npy", data)
        want = initial(np.arange(num), dim)
        want[start:start + n] = data.astype(np.float32)
        with embstore.open(d / "s") as s:
            seen = record_chunks(s["t"])
            progress: list[int] = []
            assert import_rows(s["t"], d / "in.npy", start=start, progress=progress.append) == n
            assert export_rows(s["t"], d / "out.npy", progress=progress.append) == num
            for what, sizes in seen.items():
                assert all(size <= allowed_bytes(dim, budget) for size in sizes), (what, sizes)
            assert sum(seen["write"]) == 4 * dim * n  # (the checks: validation's and write_physical's own)
            assert sum(seen["read"]) == 4 * dim * num
            assert sum(progress) == n + num
        np.testing.assert_array_equal(np.load(d / "out.npy"), want)
        with embstore.open(d / "s") as s:
            np.testing.assert_array_equal(s["t"].lookup(np.arange(num)), want)
    finally:
        bulk.CHUNK_BYTES = old
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("bad", [0, 3, 4, 9])
def test_a_bad_row_is_named_by_its_file_row_across_chunk_boundaries(tmp_path, bad, monkeypatch) -> None:
    """Validation in byte-bounded chunks of 3 rows still names the file's row of a NaN and writes nothing."""
    dim = 5
    monkeypatch.setattr(bulk, "CHUNK_BYTES", 3 * 4 * dim)
    make_store(tmp_path / "s", 20, dim)
    data = np.ones((10, dim), np.float32)
    data[bad, 2] = np.nan
    np.save(tmp_path / "in.npy", data)
    with embstore.open(tmp_path / "s") as s:
        with pytest.raises(embstore.InvalidRowsError, match=f"row {bad} holds NaN"):
            import_rows(s["t"], tmp_path / "in.npy")
        np.testing.assert_array_equal(s["t"].lookup(np.arange(20)), initial(np.arange(20), dim))


def test_widest_table_imports_and_exports_in_chunks_of_at_most_the_default_budget(tmp_path) -> None:
    """A table of the widest dim (65,536 float32 values, 256 KiB a row): with the default budget no chunk
    passed to write_physical, read_physical or the validation holds more than 64 MiB (a row count of
    65,536 made one chunk 16 GiB), and the rows round-trip exactly."""
    from embstore.config import MAX_DIM

    n = 260  # 65 MiB: more than one chunk of the budget
    make_store(tmp_path / "s", n + 2, MAX_DIM, "ssd")
    data = np.random.default_rng(1).standard_normal((n, MAX_DIM)).astype(np.float32)
    np.save(tmp_path / "in.npy", data)
    with embstore.open(tmp_path / "s") as s:
        seen = record_chunks(s["t"])
        assert import_rows(s["t"], tmp_path / "in.npy", start=1) == n
        assert export_rows(s["t"], tmp_path / "out.npy") == n + 2
        for what, sizes in seen.items():
            assert sizes and max(sizes) <= 64 << 20, (what, sizes)
    out = np.load(tmp_path / "out.npy", mmap_mode="r")
    np.testing.assert_array_equal(out[1:n + 1], data)
    np.testing.assert_array_equal(out[[0, n + 1]], initial(np.array([0, n + 1]), MAX_DIM))


# --- 2. optimizer state of a trained table --------------------------------------------------------------

TRAIN_ROWS, TRAIN_DIM = 40, 4


def trained_store(path: Path, optimizer: str, cache_rows: int) -> None:
    """Table ``t`` trained a few steps with ``optimizer`` on every row (so every row has non-zero state)."""
    make_store(path, TRAIN_ROWS, TRAIN_DIM, "ssd", cache_rows, state_dim(optimizer, TRAIN_DIM))
    with embstore.open(path) as s:
        ebc = TieredEmbeddingBagCollection(s, ["t"], optimizer=optimizer, lr=0.05)
        rng = np.random.default_rng(0)
        for _ in range(3):
            ids = torch.from_numpy(rng.permutation(TRAIN_ROWS).astype(np.int64))
            offs = torch.arange(0, TRAIN_ROWS + 1, 4, dtype=torch.int64)
            (ebc([ids], [offs]) ** 2).sum().backward()
        ebc.flush()
        ebc.release()


def rows_and_state(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with embstore.open(path) as s:
        return s["t"].read_with_state(np.arange(TRAIN_ROWS, dtype=np.int64))


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("cache_rows", [0, 8, TRAIN_ROWS], ids=["no-cache", "small-cache", "whole-cache"])
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_import_gives_imported_rows_fresh_state_and_keeps_the_others(tmp_path, optimizer, cache_rows, via) -> None:
    """Rows imported into a trained table get fresh optimizer state (zeros: what a never-trained row has,
    as their old moments belong to values that are gone); every other row keeps its values and state."""
    trained_store(tmp_path / "s", optimizer, cache_rows)
    rows0, state0 = rows_and_state(tmp_path / "s")
    assert (np.abs(state0).sum(axis=1) > 0).all()  # every row was trained
    lo, hi = 9, 23
    new = np.random.default_rng(5).uniform(-1, 1, (hi - lo, TRAIN_DIM)).astype(np.float32)
    np.save(tmp_path / "in.npy", new)
    if via == "cli":
        assert main(["import", str(tmp_path / "s"), "t", str(tmp_path / "in.npy"), "--start", str(lo)]) == 0
    else:
        with embstore.open(tmp_path / "s") as s:
            import_rows(s["t"], tmp_path / "in.npy", start=lo)
    want_rows, want_state = rows0.copy(), state0.copy()
    want_rows[lo:hi], want_state[lo:hi] = new, 0.0
    rows1, state1 = rows_and_state(tmp_path / "s")
    np.testing.assert_array_equal(rows1, want_rows)
    np.testing.assert_array_equal(state1, want_state)


def test_training_continues_from_fresh_state_on_imported_rows(tmp_path) -> None:
    """After an import, one more adagrad step moves an imported row as a first step from zero state
    would (numpy reference), and an untouched row as a step from its kept state would."""
    optimizer, lr, eps = "rowwise_adagrad", 0.05, 1e-8
    trained_store(tmp_path / "s", optimizer, 8)
    rows0, state0 = rows_and_state(tmp_path / "s")
    new = np.full((1, TRAIN_DIM), 0.25, np.float32)
    np.save(tmp_path / "in.npy", new)
    with embstore.open(tmp_path / "s") as s:
        import_rows(s["t"], tmp_path / "in.npy", start=3)
        ebc = TieredEmbeddingBagCollection(s, ["t"], optimizer=optimizer, lr=lr, eps=eps)
        ids = torch.tensor([3, 30], dtype=torch.int64)
        (ebc([ids], [torch.tensor([0, 1, 2])]) ** 2).sum().backward()  # grad of a bag b: 2 * row
        ebc.flush()
        ebc.release()
        got = s["t"].read_with_state(np.array([3, 30], np.int64))[0]
    for i, (row, start_state) in enumerate(((new[0], 0.0), (rows0[30], state0[30, 0]))):
        g = 2 * row
        acc = np.float32(start_state) + np.float32(np.mean(g * g))
        np.testing.assert_allclose(got[i], row - g * np.float32(lr / (np.sqrt(acc) + eps)), rtol=1e-6)


# --- 3. an acknowledged import survives SIGKILL ----------------------------------------------------------

NUM, DIM = 64, 8
LO, HI = 10, 30  # the imported rows
LOGGED = np.array([5, 12, 20, 40], np.int64)  # logged (update_logged + sync_log) before the import

CHILD = """
import os, signal, sys
import numpy as np
import embstore
from embstore.bulk import import_rows
store_dir, npy, logged = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
s = embstore.open(store_dir)
if logged:
    ids = np.array([5, 12, 20, 40], np.int64)
    s.update_logged("t", ids, np.full((4, 8), 7.0, np.float32))
    s.sync_log()
import_rows(s["t"], npy, start=10)
print("imported", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def imported_data() -> np.ndarray:
    return np.random.default_rng(3).uniform(-1, 1, (HI - LO, DIM)).astype(np.float32)


def expected_after_import(logged: bool) -> np.ndarray:
    want = initial(np.arange(NUM), DIM)
    if logged:
        want[LOGGED] = 7.0
    want[LO:HI] = imported_data()  # the import came after the logged writes: it wins on 12 and 20
    return want


def run_child(store_dir: Path, npy: Path, logged: bool) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(store_dir), str(npy), "1" if logged else "0"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert whole_lines(child.stdout) == ["imported\n"]


@pytest.mark.parametrize("logged", [False, True], ids=["no-log", "older-logged-writes"])
@pytest.mark.parametrize("cache_rows", [0, 6], ids=["home-only", "dram-cache"])
@pytest.mark.parametrize("home", HOMES)
def test_import_rows_survives_sigkill_right_after_it_returns(tmp_path, home, cache_rows, logged) -> None:
    """A child imports rows (after acknowledged logged writes to some of the same rows, or not) and is
    SIGKILLed as soon as import_rows returns: the reopened store holds every imported row, and the logged
    writes to rows the import did not cover. A table flush alone left the older logged writes in the log,
    and the reopen replayed them over the imported rows."""
    make_store(tmp_path / "s", NUM, DIM, home, cache_rows)
    np.save(tmp_path / "in.npy", imported_data())
    run_child(tmp_path / "s", tmp_path / "in.npy", logged)
    with embstore.open(tmp_path / "s") as s:
        np.testing.assert_array_equal(s["t"].lookup(np.arange(NUM)), expected_after_import(logged))


CRASHED_SERVER = """
import os, signal, sys
import numpy as np
import embstore
s = embstore.open(sys.argv[1])
s.update_logged("t", np.array([5, 12, 20, 40], np.int64), np.full((4, 8), 7.0, np.float32))
s.sync_log()
print("logged", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("cache_rows", [0, 6], ids=["home-only", "dram-cache"])
@pytest.mark.parametrize("home", HOMES)
def test_cli_import_after_a_crash_with_a_log_is_durable_once_it_exits(tmp_path, home, cache_rows) -> None:
    """A process dies with acknowledged logged writes in the log; then `embstore import` (a real process)
    exits 0: the store holds the imported rows over the logged ones, and the logged rows outside the
    import, however many times it is reopened."""
    make_store(tmp_path / "s", NUM, DIM, home, cache_rows)
    np.save(tmp_path / "in.npy", imported_data())
    crashed = subprocess.run([sys.executable, "-c", CRASHED_SERVER, str(tmp_path / "s")], capture_output=True,
                             text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL and crashed.stdout == "logged\n", crashed.stderr
    cli = subprocess.run([sys.executable, "-m", "embstore.cli", "import", str(tmp_path / "s"), "t",
                          str(tmp_path / "in.npy"), "--start", str(LO)], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert f"imported {HI - LO} rows" in cli.stdout
    for _ in range(2):
        with embstore.open(tmp_path / "s") as s:
            np.testing.assert_array_equal(s["t"].lookup(np.arange(NUM)), expected_after_import(True))
