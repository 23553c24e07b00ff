"""Crash consistency: a child streams updates and flushes and is SIGKILLed at a random point.

After reopening, every row acknowledged by a completed flush() holds exactly
its value, and every other row holds either its initial value or exactly a
value that was written (no torn rows). 3 trials per home in the default run,
20 in the slow suite. The logged variant writes through the write-ahead log
(``update_logged``) and acknowledges after each ``sync_log()``, with flushes
(which seal and drop log segments) in between: the reopened store replays
the log.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.rows import initial_rows
from crash_states import whole_lines
from homes import home_tier

ROWS, DIM, PER_STEP = 20_000, 16, 40

CHILD = r"""
import sys, numpy as np, embstore
store = embstore.open(sys.argv[1])
t = store["t"]
step = 0
while True:
    ids = np.arange(step * {per}, (step + 1) * {per}, dtype=np.int64) % {rows}
    t.update(ids, np.full((len(ids), {dim}), step + 1, np.float32) + ids[:, None] / 1e6)
    if step % 5 == 4:
        store.flush()
        print(step, flush=True)
    step += 1
"""


LOGGED_CHILD = r"""
import sys, numpy as np, embstore
store = embstore.open(sys.argv[1])
step = 0
while True:
    ids = np.arange(step * {per}, (step + 1) * {per}, dtype=np.int64) % {rows}
    store.update_logged("t", ids, np.full((len(ids), {dim}), step + 1, np.float32) + ids[:, None] / 1e6)
    store.sync_log()
    print(step, flush=True)
    if step % 7 == 6:
        store.flush()
    step += 1
"""


def expected_row(step: int, i: int) -> np.ndarray:
    return np.full(DIM, step + 1, np.float32) + np.float32(i / 1e6)


def run_trial(tmp: Path, home: str, rng: random.Random, logged: bool = False) -> None:
    cfg = TableConfig("t", ROWS, DIM, tiers=(TierConfig("dram", 300 * DIM * 4, "lru"), home_tier(home)))
    embstore.create(tmp / "s", StoreConfig((cfg,))).close()
    code = (LOGGED_CHILD if logged else CHILD).format(per=PER_STEP, rows=ROWS, dim=DIM)
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp / "s")], stdout=subprocess.PIPE, text=True)
    acks: list[int] = []
    want = rng.randint(1, 60 if logged else 12)
    deadline = time.monotonic() + 60
    while len(acks) < want and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line:
            break
        acks.append(int(line))
    time.sleep(rng.random() * 0.05)  # land the kill anywhere, mid-write or mid-flush
    os.kill(child.pid, signal.SIGKILL)
    rest, _ = child.communicate()
    acks += [int(line) for line in whole_lines(rest)]
    assert acks, "the child never completed a flush"
    last_ack = acks[-1]
    with embstore.open(tmp / "s") as store:
        got = store["t"].lookup(np.arange(ROWS, dtype=np.int64))
    init = initial_rows(cfg.init, np.arange(ROWS, dtype=np.int64), DIM)
    durable_until = (last_ack + 1) * PER_STEP  # rows [0, durable_until) were acknowledged
    assert durable_until <= ROWS
    for i in range(ROWS):
        if i < durable_until:
            np.testing.assert_array_equal(got[i], expected_row(i // PER_STEP, i), err_msg=f"row {i} lost")
        elif not np.array_equal(got[i], init[i]):  # written after the last ack: whole or absent
            np.testing.assert_array_equal(got[i], expected_row(i // PER_STEP, i), err_msg=f"row {i} torn")


@pytest.mark.parametrize("home", ["ssd", "ssd-log", "rocksdb", "mmap"])
def test_crash_keeps_flushed_rows(home: str, tmp_path) -> None:
    rng = random.Random(home)
    for trial in range(3):
        run_trial(tmp_path / f"{trial}", home, rng)


@pytest.mark.slow
@pytest.mark.parametrize("home", ["ssd", "ssd-log", "rocksdb", "mmap"])
def test_crash_keeps_flushed_rows_20_trials(home: str, tmp_path) -> None:
    rng = random.Random(home + "slow")
    for trial in range(20):
        run_trial(tmp_path / f"{trial}", home, rng)


@pytest.mark.parametrize("home", ["ssd", "ssd-log"])
def test_crash_keeps_logged_rows(home: str, tmp_path) -> None:
    rng = random.Random(home + "logged")
    for trial in range(3):
        run_trial(tmp_path / f"{trial}", home, rng, logged=True)


@pytest.mark.slow
@pytest.mark.parametrize("home", ["ssd", "ssd-log", "rocksdb", "mmap"])
def test_crash_keeps_logged_rows_20_trials(home: str, tmp_path) -> None:
    rng = random.Random(home + "logged-slow")
    for trial in range(20):
        run_trial(tmp_path / f"{trial}", home, rng, logged=True)
