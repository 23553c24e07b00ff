"""Audit: served reads racing ``PUT /v1/tables/{name}/rows`` under a real uvicorn never see a torn table.

One writer thread PUTs every row of a table, alternating between two constant patterns A and B (every
element of A differs from B's); reader threads meanwhile call ``POST /v1/models/{name}/predict`` (one
single-table model per table, two threads so that one always waits) and ``/lookup`` and ``/pooled``. A
PUT is applied under the table's lock, and every read of one table takes that lock once, so:

- a lookup returns all rows equal to A's, or all equal to B's;
- each pooled bag is the sum of A rows or of B rows (the pooled cache may answer bags of one request
  from different sides of a write);
- a predict's scores are all those a numpy DLRM (read from the model's ``dense.pt``, not the served
  module) gives on all-A rows, or all those it gives on all-B rows. A read crossing a write scores some
  samples as A, some as B, and the bag it was in when they crossed as neither.

Tables: ``res`` (float32, a DRAM tier holding the whole table: the model pools straight out of the tier's
slab), ``dev`` (the same in a device tier, on the CPU here), ``f16`` and ``i8`` (row formats the model
reads through its own working set, copied under the table's lock). Before the fix the model pooled out
of ``res`` / ``dev`` without the table's lock: these tests failed 10 runs of 10 there.

A race is probabilistic; the window is widened three ways: each PUT writes 1024 rows of 2048 floats (an
8 MiB scatter), each predict pools 4096 rows (every row, 4 times), and the PUT writes the rows last id
first while the model pools them first id first, so a read overlapping a write in time crosses it. A run
stops at the first torn read. ``-m slow`` races each table for 30 s.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import embstore
from embstore.client import LookupClient
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from embstore.training.dlrm import DLRM
from embstore.training.ebc import TieredEmbeddingBagCollection
from embstore.training.registry import MODELS_DIR, ModelSpec, save_model

N = 1024  # rows per table, all written by every PUT
DIM = 2048
SAMPLES = 32  # bags: bag s holds rows [s * BAG, (s + 1) * BAG)
BAG = N // SAMPLES
REPEAT = 4  # a predict's bag holds its rows REPEAT times over: the model pools longer, the body stays small
NUM_DENSE = 4
SLAB = 2 * N * (DIM + 1) * 4  # a tier holding every row with its optimizer-state column
TABLES = {"res": ("float32", TierConfig("dram", SLAB)),
          "dev": ("float32", TierConfig("device", SLAB, device="cpu")),
          "f16": ("float16", TierConfig("dram", SLAB)),
          "i8": ("int8", TierConfig("dram", SLAB))}
SCALE = 1.0 + (np.arange(DIM) % 4) / 4  # exact in float16
PATTERN_A = (0.5 * SCALE).astype(np.float32)
PATTERN_B = (-0.25 * SCALE).astype(np.float32)
IDS = np.arange(N, dtype=np.int64)
OFFSETS = np.arange(0, N + 1, BAG, dtype=np.int64)
SCORE_TOL = 1e-5  # numpy vs torch rounding; one torn row moves a score by ~1e-3 (checked in `refs`)


def _make_store(path: Path) -> None:
    cfg = StoreConfig(tuple(TableConfig(name, N, DIM, dtype=dtype, tiers=(top, TierConfig("mmap")))
                            for name, (dtype, top) in TABLES.items()))
    with embstore.create(path, cfg) as store:
        for name in TABLES:
            spec = ModelSpec((name,), DIM, NUM_DENSE, (16, DIM), (8, 1))
            torch.manual_seed(len(name))
            model = DLRM(TieredEmbeddingBagCollection(store, [name]), 1, DIM, NUM_DENSE, spec.dense_arch,
                         spec.over_arch)
            with torch.no_grad():  # small bottom outputs: the dot with a bag (32 rows, 4 times) stays unsaturated
                model.dense_arch.model[-2].weight.mul_(8e-3)
                model.dense_arch.model[-2].bias.mul_(8e-3)
            save_model(store.path, f"m_{name}", spec, model)
            model.sparse_arch.ebc.release()


def _mlp(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]], last_relu: bool) -> np.ndarray:
    for i, (w, b) in enumerate(layers):
        x = x @ w.T.astype(np.float64) + b
        if last_relu or i < len(layers) - 1:
            x = np.maximum(x, 0)
    return x


def _layers(dense: dict[str, torch.Tensor], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
    idx = sorted({int(k.split(".")[2]) for k in dense if k.startswith(prefix)})
    return [(dense[f"{prefix}.{i}.weight"].double().numpy(), dense[f"{prefix}.{i}.bias"].double().numpy())
            for i in idx]


def numpy_scores(dense_pt: Path, x: np.ndarray, bags: np.ndarray) -> np.ndarray:
    """sigmoid(DLRM) with a dot interaction over one table, in float64 numpy: ``bags`` (samples, DIM) pooled."""
    dense = torch.load(dense_pt, weights_only=True)
    if json.loads((dense_pt.parent / "model.json").read_text()).get("dense_transform", "none") == "log1p":
        x = np.log1p(np.maximum(x.astype(np.float64), 0)).astype(np.float32)  # as predict feeds the model
    d = _mlp(x.astype(np.float64), _layers(dense, "dense_arch.model"), True)
    inter = np.concatenate([d, (d * bags).sum(axis=1, keepdims=True)], axis=1)
    return 1 / (1 + np.exp(-_mlp(inter, _layers(dense, "over_arch.model"), False)[:, 0]))


@functools.cache
def _put_body(pattern: int) -> bytes:
    """Every row set to A (0) or B (1), written last id first: reads sweep the other way, so one overlapping
    the write in time crosses it (in the same order a read started just after the write would trail it)."""
    rows = np.tile((PATTERN_A, PATTERN_B)[pattern], (N, 1)).astype(np.float64)
    return json.dumps({"ids": IDS[::-1].tolist(), "embeddings": rows.tolist()}).encode()


@dataclass
class Refs:
    """What a read may return: the stored rows of A and B (int8 rounds them), their bags and scores."""

    rows: tuple[np.ndarray, np.ndarray]
    bags: tuple[np.ndarray, np.ndarray]
    scores: tuple[np.ndarray, np.ndarray]
    bodies: tuple[bytes, bytes]
    predict: bytes


@dataclass
class Race:
    """Counts and the first torn reads seen."""

    puts: int = 0
    reads: dict[str, int] = field(default_factory=lambda: {"predict": 0, "lookup": 0, "pooled": 0})
    torn: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0  # when the writer stops


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server url, store path) of a store holding the four tables and a single-table model over each."""
    path = tmp_path_factory.mktemp("predict_race") / "store"
    _make_store(path)
    settings = ServerSettings(store=path, durable_writes=False, flush_interval=0)
    with ServerThread(create_app(settings)) as srv:
        yield srv.url, path


def _refs(http: httpx.Client, client: LookupClient, path: Path, table: str) -> Refs:
    """Write A, read it back, then B: the rows as stored, and their bags and scores by numpy."""
    rng = np.random.default_rng(7)
    x = rng.uniform(0, 3, (SAMPLES, NUM_DENSE)).astype(np.float32)
    bodies = (_put_body(0), _put_body(1))
    sparse = {table: [IDS[o:o + BAG].tolist() * REPEAT for o in OFFSETS[:-1]]}
    dense_pt = path / MODELS_DIR / f"m_{table}" / "dense.pt"
    rows, bags, scores = [], [], []
    for body, want in zip(bodies, (PATTERN_A, PATTERN_B)):
        assert http.put(f"/v1/tables/{table}/rows", content=body,
                        headers={"Content-Type": "application/json"}).status_code == 204
        got = client.lookup(table, IDS)
        assert (got == got[0]).all()  # constant rows: int8 rounds each the same way
        np.testing.assert_allclose(got[0], want, rtol=0.02)
        rows.append(got[0])
        bag = got[0].astype(np.float64) * BAG
        bags.append(np.tile(bag, (SAMPLES, 1)))
        scores.append(numpy_scores(dense_pt, x, bags[-1] * REPEAT))
        np.testing.assert_allclose(client.lookup_pooled(table, IDS, OFFSETS), bags[-1], rtol=1e-6)
        np.testing.assert_allclose(client.predict(f"m_{table}", x, sparse), scores[-1], rtol=0, atol=SCORE_TOL)
    # one row of B in a bag of A must be told apart from both: a torn read is caught by the score alone
    one_torn = numpy_scores(dense_pt, x, bags[0] * REPEAT + (rows[1] - rows[0]).astype(np.float64))
    assert np.abs(one_torn - scores[0]).min() > 20 * SCORE_TOL
    assert np.abs(scores[1] - scores[0]).min() > 20 * SCORE_TOL
    assert ((scores[0] > 0.01) & (scores[0] < 0.99)).all()  # off saturation
    predict = json.dumps({"dense": x.astype(np.float64).tolist(), "sparse": sparse}).encode()
    return Refs(tuple(rows), tuple(bags), tuple(scores), bodies, predict)


def _which(value: np.ndarray, refs: tuple[np.ndarray, np.ndarray], rtol: float, atol: float) -> int | None:
    """0 or 1: the reference ``value`` equals, or None."""
    for i, ref in enumerate(refs):
        if np.allclose(value, ref, rtol=rtol, atol=atol):
            return i
    return None


def _writer(url: str, table: str, refs: Refs, race: Race) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while not race.stop.is_set() and time.monotonic() < race.deadline:
            r = http.put(f"/v1/tables/{table}/rows", content=refs.bodies[race.puts % 2],
                         headers={"Content-Type": "application/json"})
            assert r.status_code == 204, r.text
            race.puts += 1


def _predicts(url: str, table: str, refs: Refs, race: Race) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while not race.stop.is_set():
            r = http.post(f"/v1/models/m_{table}/predict", content=refs.predict,
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            scores = np.array(r.json()["scores"])
            race.reads["predict"] += 1
            if _which(scores, refs.scores, 0, SCORE_TOL) is None:  # one table: read whole, before or after a PUT
                near_a = np.abs(scores - refs.scores[0]) <= SCORE_TOL
                near_b = np.abs(scores - refs.scores[1]) <= SCORE_TOL
                race.torn.append(f"predict: {int(near_a.sum())} samples scored as all-A, {int(near_b.sum())} as "
                                 f"all-B, {int((~near_a & ~near_b).sum())} as neither, of {SAMPLES}")


def _lookups(url: str, table: str, refs: Refs, race: Race) -> None:
    with LookupClient(url) as client:
        while not race.stop.is_set():
            rows = client.lookup(table, IDS)
            race.reads["lookup"] += 1
            is_a, is_b = (rows == refs.rows[0]).all(axis=1), (rows == refs.rows[1]).all(axis=1)
            if not (is_a.all() or is_b.all()):
                race.torn.append(f"lookup: {int(is_a.sum())} rows A, {int(is_b.sum())} rows B, "
                                 f"{int((~is_a & ~is_b).sum())} neither, of {N}")
            pooled = client.lookup_pooled(table, IDS, OFFSETS)
            race.reads["pooled"] += 1
            for b, bag in enumerate(pooled):
                if _which(bag, (refs.bags[0][b], refs.bags[1][b]), 1e-5, 1e-5) is None:
                    race.torn.append(f"pooled: bag {b} is neither the sum of A rows nor of B rows: {bag[:4]}...")
                    break


def _guard(fn, url: str, table: str, refs: Refs, race: Race) -> None:
    """``fn`` in a thread: its failure is kept for the test; the writer's end ends the race."""
    try:
        fn(url, table, refs, race)
    except BaseException as exc:
        race.errors.append(exc)
    finally:
        if fn is _writer:
            race.stop.set()


def race_reads_against_puts(url: str, path: Path, table: str, seconds: float) -> Race:
    """PUT A / B alternately for ``seconds`` (or until a torn read) while two threads read; the counts."""
    with httpx.Client(base_url=url, timeout=60) as http, LookupClient(url) as client:
        refs = _refs(http, client, path, table)
    race = Race(deadline=time.monotonic() + seconds)
    threads = [threading.Thread(target=_guard, args=(f, url, table, refs, race))
               for f in (_writer, _predicts, _predicts, _lookups)]  # two: the model always has one queued
    for t in threads:
        t.start()
    while not race.stop.wait(0.05):
        if race.torn or race.errors:
            race.stop.set()
    for t in threads:
        t.join(120)
    if race.errors:
        raise race.errors[0]
    with LookupClient(url) as client:  # and once the writes are over, the last one's rows
        np.testing.assert_array_equal(client.lookup(table, IDS), np.tile(refs.rows[(race.puts - 1) % 2], (N, 1)))
    return race


@pytest.mark.parametrize("table,seconds", [("res", 4.5), ("dev", 2.5), ("f16", 0.75), ("i8", 0.75)])
def test_reads_racing_puts_see_whole_tables(served, table, seconds):
    url, path = served
    race = race_reads_against_puts(url, path, table, seconds)
    torn = len(race.torn)
    assert torn == 0, f"{table}: torn reads after {race.puts} PUTs, {race.reads}: {race.torn[:3]}"
    assert race.puts >= 1 and min(race.reads.values()) >= 1, (race.puts, race.reads)


@pytest.mark.slow
@pytest.mark.parametrize("table", list(TABLES))
def test_reads_racing_puts_see_whole_tables_long(served, table):
    url, path = served
    race = race_reads_against_puts(url, path, table, 30.0)
    torn = len(race.torn)
    assert torn == 0, f"{table}: torn reads after {race.puts} PUTs, {race.reads}: {race.torn[:3]}"
