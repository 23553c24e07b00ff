"""Concurrent reads and writes through a real uvicorn server, checked for linearizability per row.

One store with three tables: ``res`` (a direct-mapped DRAM tier holding every row: small lookups are
answered on the event loop, pooled bags straight from the slab), ``tier`` (a 6-row LRU DRAM cache over
an SSD home: reads miss and evict, lookups go through the micro-batcher) and ``hashed`` (mod-hashed
raw ids onto 24 rows of a 4-row cache over an SSD home: writes to one raw id change the rows read
through others). The server runs with the pooled-embedding cache on (a 2 KiB budget: entries are
evicted) and micro-batching on, or with both off; it flushes written rows every 50 ms and now and then
a client reloads the store (flush, close, reopen: the pooled cache starts empty).

Client threads (raw ``httpx`` and ``embstore.client.LookupClient``, JSON and binary) do random
operations stamped by a shared :class:`Clock` before the request is sent and after its answer is read:
row writes (1-4 distinct raw ids set to a value unique to that write, the whole row constant), raw
lookups, pooled lookups (sum and mean; a bag is one id repeated k times or 2-3 distinct ids; a few
"hot" bags are asked again and again so that the pooled cache answers them) and reloads.

Checks, per physical row (after the table's hash):

- every row a lookup returns is the row's initial value or a constant row of a write's value (no torn
  or foreign rows), and is *allowed*: a write W's value needs ``W.start < read.end`` and no write W2 to
  that row with ``W.end < W2.start`` and ``W2.end < read.start`` (W superseded before the read began:
  a stale read); the initial value needs no write to the row ended before the read began;
- every pooled bag equals sum or mean of an allowed combination of its distinct rows' values
  (multiplicities counted, float32 rounding allowed for the summation order);
- the reads whose value is identified (lookups, and bags with one matching combination) together with
  the writes form a linearizable register history: Gibbons and Korach's test for unique-valued
  registers (no two forward zones intersect, no backward zone lies inside a forward zone), which also
  catches a new-then-old inversion between two reads;
- at the end every row reads as a write no other write followed (or its initial value if never
  written), and the store, reopened after the server's shutdown flush, holds exactly those rows.

A failure prints the offending read and the row's writes near it (thread, stamps, values).
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import embstore
from embstore.client import LookupClient
from embstore.config import HashConfig, InitConfig, StoreConfig, TableConfig, TierConfig
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from test_server import post_bin, rows_of, same_bits
from test_wal_concurrency import Clock

TOKEN = "concurrency-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BINARY = "application/octet-stream"
DIM = 8
ROW_BYTES = 4 * DIM
INIT_SCALE = 1000.0  # initial rows far from each other and from the integer values writes use
RAW_IDS = {"res": 48, "tier": 64, "hashed": 160}  # raw ids the clients use per table
TABLE_NAMES = tuple(RAW_IDS)
CACHE_BYTES = 2048  # ~13 pooled entries per table: the hot bags and the random ones evict each other
HOT_BAGS = 4  # per table


def store_config() -> StoreConfig:
    init = InitConfig(scale=INIT_SCALE, seed=7)
    return StoreConfig((
        TableConfig("res", RAW_IDS["res"], DIM, init=init,
                    tiers=(TierConfig("dram", RAW_IDS["res"] * ROW_BYTES), TierConfig("mmap"))),
        TableConfig("tier", RAW_IDS["tier"], DIM, init=init,
                    tiers=(TierConfig("dram", 6 * ROW_BYTES, "lru"), TierConfig("ssd"))),
        TableConfig("hashed", 24, DIM, init=init, hash=HashConfig("mod"),
                    tiers=(TierConfig("dram", 4 * ROW_BYTES, "lru"), TierConfig("ssd"))),
    ))


@dataclass
class TableModel:
    """What the checker knows of a table: raw id -> physical row, and every physical row's initial value."""

    phys: np.ndarray
    init: np.ndarray


def make_store(path: Path) -> dict[str, TableModel]:
    """Create the store and read its hash mapping and initial rows directly (before a server opens it)."""
    with embstore.create(path, store_config()) as store:
        models = {}
        for name in TABLE_NAMES:
            table = store[name]
            phys = np.asarray(table.physical_rows(np.arange(RAW_IDS[name], dtype=np.int64)), np.int64)
            init = table.read_physical(np.arange(table.num_rows, dtype=np.int64))
            models[name] = TableModel(phys, init)
    assert len(np.unique(models["hashed"].phys)) > 1 and len(np.unique(models["hashed"].phys)) < RAW_IDS["hashed"]
    return models


# --- history ------------------------------------------------------------------------------------------
@dataclass
class Op:
    """One request as a client saw it: stamps taken before sending and after the answer was read."""

    thread: int
    kind: str  # "write" | "lookup" | "pooled" | "reload"
    table: str = ""
    start: int = 0
    end: int = 0
    ids: np.ndarray | None = None  # write / lookup: raw ids; pooled: the flat ids of every bag
    offsets: np.ndarray | None = None  # pooled
    mode: str = "sum"
    value: float = 0.0  # write
    result: np.ndarray | None = None
    how: str = ""  # wire format, for the report

    def describe(self) -> str:
        what = f"ids={self.ids.tolist() if self.ids is not None else None}"
        if self.kind == "pooled":
            what += f" offsets={self.offsets.tolist()} mode={self.mode}"
        if self.kind == "write":
            what += f" value={self.value:g}"
        return f"[{self.start},{self.end}] thread {self.thread} {self.kind} {self.table} {what} ({self.how})"


@dataclass
class Workload:
    """Knobs of one run."""

    threads: int = 5
    ops_per_thread: int = 120
    p_write: float = 0.25
    p_lookup: float = 0.3
    p_reload: float = 0.004
    seed: int = 0


class Values:
    """Write values unique across the run: integers, exact in float32 and never an initial row."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return float(next(self._next))


def hot_bags(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    """A few bags per table that the clients ask for again and again (pooled-cache hits; as lookups too, so
    that an answer kept from an earlier read would show)."""
    out: dict[str, list[np.ndarray]] = {}
    for name in TABLE_NAMES:
        out[name] = [random_bag(rng, name) for _ in range(HOT_BAGS)]
    return out


def random_bag(rng: np.random.Generator, name: str) -> np.ndarray:
    """One id repeated 1-4 times, or 2-3 distinct ids."""
    n = RAW_IDS[name]
    if rng.random() < 0.5:
        return np.full(int(rng.integers(1, 5)), rng.integers(0, n), np.int64)
    return rng.choice(n, size=int(rng.integers(2, 4)), replace=False).astype(np.int64)


class Client:
    """One thread's connection: raw httpx (JSON or binary per request) or ``LookupClient``."""

    def __init__(self, url: str, kind: str) -> None:
        self.kind = kind
        self.http = httpx.Client(base_url=url, timeout=60)
        self.lc = LookupClient(url, token=TOKEN, binary=kind == "lc-binary") if kind.startswith("lc") else None

    def close(self) -> None:
        self.http.close()
        if self.lc is not None:
            self.lc.close()

    def write(self, name: str, ids: np.ndarray, value: float) -> str:
        rows = np.full((len(ids), DIM), value, np.float32)
        if self.lc is not None:
            self.lc.update(name, ids, rows)
            return self.kind
        resp = self.http.put(f"/v1/tables/{name}/rows", headers=AUTH,
                             json={"ids": ids.tolist(), "embeddings": rows.tolist()})
        assert resp.status_code == 204, resp.text
        return "json"

    def lookup(self, name: str, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        if self.lc is not None:
            return self.lc.lookup(name, ids), self.kind
        ask_bin, answer_bin = bool(rng.integers(2)), bool(rng.integers(2))
        accept = BINARY if answer_bin else "application/json"
        if ask_bin:
            resp = post_bin(self.http, f"/v1/tables/{name}/lookup", ids, accept=accept)
        else:
            resp = self.http.post(f"/v1/tables/{name}/lookup", json={"ids": ids.tolist()}, headers={"Accept": accept})
        return rows_of(resp), f"{'bin' if ask_bin else 'json'}->{'bin' if answer_bin else 'json'}"

    def pooled(self, name: str, ids: np.ndarray, offsets: np.ndarray, mode: str,
               rng: np.random.Generator) -> tuple[np.ndarray, str]:
        if self.lc is not None:
            return self.lc.lookup_pooled(name, ids, offsets, mode=mode), self.kind
        if rng.integers(2):
            resp = post_bin(self.http, f"/v1/tables/{name}/pooled", np.concatenate([offsets, ids]),
                            num_bags=len(offsets) - 1, mode=mode)
            return rows_of(resp), "bin"
        resp = self.http.post(f"/v1/tables/{name}/pooled",
                              json={"ids": ids.tolist(), "offsets": offsets.tolist(), "mode": mode})
        return rows_of(resp), "json"

    def reload(self) -> None:
        resp = self.http.post("/v1/admin/reload", headers=AUTH)
        assert resp.status_code == 200, resp.text


CLIENT_KINDS = ("http", "lc-binary", "lc-json", "http", "http", "http", "http", "http")


def run_client(k: int, url: str, work: Workload, clock: Clock, values: Values, hot: dict[str, list[np.ndarray]],
               log: list[Op], failures: list[str], go: threading.Barrier) -> None:
    """Thread ``k``: ``work.ops_per_thread`` random operations, each appended to ``log`` once answered."""
    rng = np.random.default_rng([work.seed, k])
    client = Client(url, CLIENT_KINDS[k % len(CLIENT_KINDS)])
    try:
        go.wait()
        for i in range(work.ops_per_thread):
            name = TABLE_NAMES[int(rng.integers(len(TABLE_NAMES)))]
            roll = rng.random()
            if roll < work.p_reload and i < work.ops_per_thread // 2:  # none late: the run's stats survive
                op = Op(k, "reload", start=clock())
                client.reload()
            elif roll < work.p_reload + work.p_write:
                ids = rng.choice(RAW_IDS[name], size=int(rng.integers(1, 5)), replace=False).astype(np.int64)
                op = Op(k, "write", name, ids=ids, value=values())
                op.start = clock()
                op.how = client.write(name, ids, op.value)
            elif roll < work.p_reload + work.p_write + work.p_lookup:  # half of them a hot id list, asked again
                ids = (hot[name][int(rng.integers(HOT_BAGS))] if rng.random() < 0.5
                       else rng.integers(0, RAW_IDS[name], int(rng.integers(1, 9))).astype(np.int64))
                op = Op(k, "lookup", name, ids=ids)
                op.start = clock()
                op.result, op.how = client.lookup(name, ids, rng)
            else:
                bags = [hot[name][int(rng.integers(HOT_BAGS))] if rng.random() < 0.5 else random_bag(rng, name)
                        for _ in range(int(rng.integers(1, 4)))]
                offsets = np.cumsum([0] + [len(b) for b in bags]).astype(np.int64)
                op = Op(k, "pooled", name, ids=np.concatenate(bags), offsets=offsets,
                        mode="sum" if rng.integers(2) else "mean")
                op.start = clock()
                op.result, op.how = client.pooled(name, op.ids, offsets, op.mode, rng)
            op.end = clock()
            log.append(op)
    except BaseException as exc:  # reported by the test, with the thread that saw it
        failures.append(f"thread {k}: {type(exc).__name__}: {exc}")
        go.abort()
    finally:
        client.close()


# --- the checker --------------------------------------------------------------------------------------
INIT = -1  # the value id of a row's initial value


@dataclass
class Write:
    start: int
    end: int
    value: float
    op: Op


@dataclass
class Read:
    start: int
    end: int
    value: int | float  # INIT or a write's value
    op: Op


@dataclass
class RowHistory:
    writes: list[Write] = field(default_factory=list)
    by_value: dict[float, Write] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)  # reads whose value is known


class Checker:
    """Per physical row: the writes, the reads, and the allowed values of a read in real time."""

    def __init__(self, models: dict[str, TableModel], log: list[Op]) -> None:
        self.models = models
        self.rows: dict[tuple[str, int], RowHistory] = defaultdict(RowHistory)
        self.violations: list[str] = []
        self.checked_rows = 0
        self.checked_bags = 0
        self.ambiguous_bags = 0
        for op in log:
            if op.kind == "write":
                for row in np.unique(models[op.table].phys[op.ids]).tolist():
                    hist = self.rows[(op.table, row)]
                    w = Write(op.start, op.end, op.value, op)
                    hist.writes.append(w)
                    hist.by_value[op.value] = w

    def vector(self, table: str, row: int, value: float) -> np.ndarray:
        return self.models[table].init[row] if value == INIT else np.full(DIM, value, np.float32)

    def allowed(self, table: str, row: int, start: int, end: int) -> list[float]:
        """Values a read of ``row`` over [start, end] may return (INIT included when it may)."""
        writes = self.rows[(table, row)].writes
        ended = [w for w in writes if w.end < start]
        latest_start_of_ended = max((w.start for w in ended), default=-1)
        out: list[float] = [] if ended else [INIT]
        # W is superseded before the read began iff some W2 began after W ended and ended before the read
        out += [w.value for w in writes if w.start < end and not latest_start_of_ended > w.end]
        return out

    def explain(self, table: str, row: int, op: Op, got: np.ndarray) -> str:
        writes = sorted(self.rows[(table, row)].writes, key=lambda w: w.start)
        near = [w for w in writes if w.start < op.end][-6:]
        lines = [f"table {table!r} physical row {row}: {op.describe()} returned {np.asarray(got).tolist()}",
                 f"  allowed: {self.allowed(table, row, op.start, op.end)}; the row's writes up to the read's end:"]
        lines += [f"    {w.op.describe()}" for w in near]
        return "\n".join(lines)

    def identify(self, table: str, row: int, got: np.ndarray) -> float | None:
        """INIT or the write value ``got`` is, bit for bit; None for anything else (torn, foreign)."""
        if same_bits(got, self.models[table].init[row]):
            return INIT
        if (got == got[0]).all() and float(got[0]) in self.rows[(table, row)].by_value:
            return float(got[0])
        return None

    def check_lookup(self, op: Op) -> None:
        phys = self.models[op.table].phys[op.ids]
        assert op.result is not None and op.result.shape == (len(op.ids), DIM), op.describe()
        for row, got in zip(phys.tolist(), op.result):
            self.checked_rows += 1
            value = self.identify(op.table, row, got)
            if value is None:
                self.violations.append("torn or foreign row:\n" + self.explain(op.table, row, op, got))
                continue
            if value not in self.allowed(op.table, row, op.start, op.end):
                self.violations.append("stale or future read:\n" + self.explain(op.table, row, op, got))
            self.rows[(op.table, row)].reads.append(Read(op.start, op.end, value, op))

    def check_pooled(self, op: Op) -> None:
        assert op.result is not None and op.offsets is not None
        assert op.result.shape == (len(op.offsets) - 1, DIM), op.describe()
        phys_all = self.models[op.table].phys[op.ids]
        for b in range(len(op.offsets) - 1):
            self.checked_bags += 1
            got = op.result[b]
            rows, mult = np.unique(phys_all[op.offsets[b]:op.offsets[b + 1]], return_counts=True)
            choices = [self.allowed(op.table, int(r), op.start, op.end) for r in rows.tolist()]
            matches = [combo for combo in itertools.product(*choices)
                       if self._pools_to(op, rows, mult, combo, got)]
            if not matches:
                every = [[INIT] + list(self.rows[(op.table, int(r))].by_value) for r in rows.tolist()]
                stale = [c for c in itertools.product(*every) if self._pools_to(op, rows, mult, c, got)]
                self.violations.append(
                    f"pooled bag {b} ({op.mode} of physical rows {rows.tolist()} x {mult.tolist()}) matches no "
                    f"allowed combination {choices}; it matches {stale or 'no combination of any values'}:\n"
                    + "\n".join(self.explain(op.table, int(r), op, got) for r in rows.tolist()))
                continue
            if len(matches) > 1:
                self.ambiguous_bags += 1
                continue
            for r, value in zip(rows.tolist(), matches[0]):
                self.rows[(op.table, r)].reads.append(Read(op.start, op.end, value, op))

    def _pools_to(self, op: Op, rows: np.ndarray, mult: np.ndarray, combo: tuple[float, ...],
                  got: np.ndarray) -> bool:
        vecs = np.stack([self.vector(op.table, int(r), v) for r, v in zip(rows.tolist(), combo)]).astype(np.float64)
        weighted = vecs * mult[:, None]
        want = weighted.sum(axis=0)
        if op.mode == "mean":
            want /= mult.sum()
        tol = 1e-6 * np.abs(weighted).sum(axis=0) + 1e-6  # float32 sums in any order, and the mean's division
        return bool((np.abs(got.astype(np.float64) - want) <= tol).all())

    def check_linearizable(self) -> None:
        """Gibbons-Korach zones per row over the writes and the identified reads (INIT: a write at time 0)."""
        for (table, row), hist in self.rows.items():
            clusters: dict[float, list[tuple[int, int]]] = {INIT: [(0, 0)]}
            for w in hist.writes:
                clusters[w.value] = [(w.start, w.end)]
            for r in hist.reads:
                clusters[r.value].append((r.start, r.end))
            forward, backward = [], []
            for value, ops in clusters.items():
                lo, hi = min(e for _, e in ops), max(s for s, _ in ops)
                (forward if lo < hi else backward).append((lo, hi, value))
            forward.sort()
            for (a_lo, a_hi, a), (b_lo, b_hi, b) in zip(forward, forward[1:]):
                if b_lo < a_hi:
                    self.violations.append(self._zone_report(
                        table, row, hist, f"forward zones of values {a} [{a_lo},{a_hi}] and {b} [{b_lo},{b_hi}] "
                                          "intersect", a_lo, max(a_hi, b_hi)))
            for lo, hi, value in backward:  # the zone is [hi, lo]: max start, then min end
                for f_lo, f_hi, f in forward:
                    if f_lo <= hi and lo <= f_hi:
                        self.violations.append(self._zone_report(
                            table, row, hist, f"backward zone of value {value} [{hi},{lo}] lies inside the forward "
                                              f"zone of value {f} [{f_lo},{f_hi}] (new-old inversion)", f_lo, f_hi))

    def _zone_report(self, table: str, row: int, hist: RowHistory, what: str, lo: int, hi: int) -> str:
        """The row's operations that overlap the stamps [lo, hi] of the zones in conflict."""
        ops = sorted({id(o): o for o in [w.op for w in hist.writes] + [r.op for r in hist.reads]
                      if o.end >= lo and o.start <= hi}.values(), key=lambda o: o.start)
        lines = [f"not linearizable: table {table!r} physical row {row}: {what}; its operations in [{lo},{hi}]:"]
        lines += [f"    {o.describe()}" + ("" if o.kind == "write" else
                                          f" -> {[r.value for r in hist.reads if r.op is o]}") for o in ops]
        return "\n".join(lines)

    def allowed_at_end(self, table: str, row: int) -> list[float]:
        """Writes no other write to the row followed (INIT when never written)."""
        writes = self.rows[(table, row)].writes if (table, row) in self.rows else []
        if not writes:
            return [INIT]
        latest_start = max(w.start for w in writes)
        return [w.value for w in writes if not latest_start > w.end]


# --- the test -----------------------------------------------------------------------------------------
def run_stress(tmp_path: Path, work: Workload, **server_kw: Any) -> dict[str, Any]:
    """Serve a fresh store, run ``work`` against it, check the history; returns counters for the report."""
    models = make_store(tmp_path / "s")
    settings = ServerSettings(store=tmp_path / "s", token=TOKEN, flush_interval=0.05, **server_kw)
    app = create_app(settings)
    clock, values = Clock(), Values()
    hot = hot_bags(np.random.default_rng([work.seed, 999]))
    log: list[Op] = []
    failures: list[str] = []
    final: dict[str, np.ndarray] = {}
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            if settings.pooled_cache_bytes:  # the same bag twice in a row: the second is a pooled-cache hit
                bag = {"ids": hot["tier"][0].tolist(), "offsets": [0, len(hot["tier"][0])], "mode": "sum"}
                assert same_bits(rows_of(http.post("/v1/tables/tier/pooled", json=bag)),
                                 rows_of(http.post("/v1/tables/tier/pooled", json=bag)))
                assert http.get("/v1/tables/tier").json()["pooled_cache"]["hits"] >= 1
            go = threading.Barrier(work.threads)
            threads = [threading.Thread(target=run_client, args=(k, srv.url, work, clock, values, hot, log,
                                                                 failures, go)) for k in range(work.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not failures, failures
            details = {name: http.get(f"/v1/tables/{name}").json() for name in TABLE_NAMES}
            start = clock()
            for name in TABLE_NAMES:
                final[name] = rows_of(post_bin(http, f"/v1/tables/{name}/lookup",
                                               np.arange(RAW_IDS[name], dtype=np.int64)))
            end = clock()
    checker = Checker(models, log)
    for op in sorted(log, key=lambda o: o.start):
        if op.kind == "lookup":
            checker.check_lookup(op)
        elif op.kind == "pooled":
            checker.check_pooled(op)
    checker.check_linearizable()
    for name in TABLE_NAMES:
        for raw, (row, got) in enumerate(zip(models[name].phys.tolist(), final[name])):
            value = checker.identify(name, row, got)
            if value not in checker.allowed_at_end(name, row):
                fake = Op(-1, "lookup", name, start, end, ids=np.array([raw]), how="final read")
                checker.violations.append("final read:\n" + checker.explain(name, row, fake, got))
    assert not checker.violations, f"{len(checker.violations)} violations:\n" + "\n\n".join(checker.violations[:5])
    with embstore.open(tmp_path / "s") as store:  # the shutdown flush kept exactly what the server served last
        for name in TABLE_NAMES:
            assert same_bits(store[name].lookup(np.arange(RAW_IDS[name], dtype=np.int64)), final[name]), name
    kinds = defaultdict(int)
    for op in log:
        kinds[op.kind] += 1
    assert sum(kinds.values()) == work.threads * work.ops_per_thread
    for name, d in details.items():
        assert d["pooled_cache"]["bytes"] <= settings.pooled_cache_bytes, (name, d["pooled_cache"])
    return {"ops": dict(kinds), "rows_checked": checker.checked_rows, "bags_checked": checker.checked_bags,
            "ambiguous_bags": checker.ambiguous_bags,
            "pooled_cache": {n: d["pooled_cache"] for n, d in details.items()},
            "batching": {n: d["batching"] for n, d in details.items()}}


VARIANTS = {  # a 2 ms batch wait makes concurrent lookups of a table share reads; 0 only coalesces under load
    "cache+batching": dict(pooled_cache_bytes=CACHE_BYTES, batching=True, batch_wait=0.002),
    "plain": dict(pooled_cache_bytes=0, batching=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_concurrent_reads_and_writes_are_linearizable(tmp_path, variant):
    report = run_stress(tmp_path, Workload(seed=1), **VARIANTS[variant])
    print(variant, report)


SLOW_VARIANTS = {
    **VARIANTS,
    "cache+batching-no-wait": dict(pooled_cache_bytes=CACHE_BYTES, batching=True, batch_wait=0.0),
    "cache+batching-not-durable": dict(pooled_cache_bytes=CACHE_BYTES, batching=True, durable_writes=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("variant", list(SLOW_VARIANTS))
def test_concurrent_reads_and_writes_are_linearizable_long(tmp_path, variant, seed):
    report = run_stress(tmp_path, Workload(threads=8, ops_per_thread=400, seed=100 + seed), **SLOW_VARIANTS[variant])
    print(variant, seed, report)


# --- the checker on hand-made histories -----------------------------------------------------------------
def tiny_models() -> dict[str, TableModel]:
    """Table ``tier`` of 4 rows, raw id == row, initial rows 0.5 + row + column / 8 (never constant)."""
    init = (0.5 + np.arange(4)[:, None] + np.arange(DIM)[None, :] / 8).astype(np.float32)
    return {"tier": TableModel(np.arange(4, dtype=np.int64), init)}


def write_op(start: int, end: int, ids: list[int], value: float) -> Op:
    return Op(0, "write", "tier", start, end, ids=np.array(ids, np.int64), value=value)


def read_op(start: int, end: int, ids: list[int], rows: list[np.ndarray]) -> Op:
    return Op(1, "lookup", "tier", start, end, ids=np.array(ids, np.int64), result=np.stack(rows))


def pooled_op(start: int, end: int, bags: list[list[int]], mode: str, rows: list[np.ndarray]) -> Op:
    offsets = np.cumsum([0] + [len(b) for b in bags]).astype(np.int64)
    return Op(1, "pooled", "tier", start, end, ids=np.array(sum(bags, []), np.int64), offsets=offsets, mode=mode,
              result=np.stack(rows).astype(np.float32))


def verdicts(log: list[Op]) -> list[str]:
    checker = Checker(tiny_models(), log)
    for op in sorted(log, key=lambda o: o.start):
        if op.kind == "lookup":
            checker.check_lookup(op)
        elif op.kind == "pooled":
            checker.check_pooled(op)
    checker.check_linearizable()
    return checker.violations


def const(v: float) -> np.ndarray:
    return np.full(DIM, v, np.float32)


def test_the_checker_accepts_linearizable_histories_and_names_each_kind_of_violation():
    """The stress test above passes only if the checker can fail: each history here has one known flaw."""
    init = tiny_models()["tier"].init
    ok = [write_op(1, 4, [0, 1], 7.0), read_op(2, 3, [0], [init[0]]), read_op(5, 6, [0, 1], [const(7), const(7)]),
          write_op(7, 12, [0], 8.0), read_op(8, 9, [0], [const(8)]), read_op(10, 11, [0], [const(8)]),
          pooled_op(13, 14, [[0, 0, 0], [1, 2]], "sum", [const(24), const(7) + init[2]]),
          pooled_op(15, 16, [[1, 2, 2]], "mean", [(const(7) + 2 * init[2]) / 3])]
    assert verdicts(ok) == []
    seven, eight = write_op(1, 2, [0], 7.0), write_op(3, 4, [0], 8.0)
    torn = np.r_[const(7)[:4], init[0][4:]]
    assert any("torn" in v for v in verdicts([seven, read_op(3, 4, [0], [torn])]))
    assert any("stale" in v for v in verdicts([seven, eight, read_op(5, 6, [0], [const(7)])]))
    assert any("stale" in v for v in verdicts([seven, read_op(3, 4, [0], [init[0]])]))
    assert any("future" in v for v in verdicts([read_op(0, 1, [0], [const(7)]), seven]))
    stale_bag = verdicts([seven, eight, pooled_op(5, 6, [[0, 1]], "sum", [const(7) + init[1]])])
    assert any("matches [(7.0, -1)]" in v for v in stale_bag), stale_bag
    # new-then-old: each read alone is allowed while the write runs, but not the two in this order
    inversion = verdicts([write_op(1, 10, [0], 7.0), read_op(2, 3, [0], [const(7)]),
                          pooled_op(4, 5, [[0]], "sum", [init[0]])])
    assert len(inversion) == 1 and "new-old inversion" in inversion[0], inversion
    two_orders = verdicts([write_op(1, 10, [0], 7.0), write_op(2, 11, [0], 8.0), read_op(12, 13, [0], [const(7)]),
                           read_op(14, 15, [0], [const(8)]), read_op(16, 17, [0], [const(7)])])
    assert any("not linearizable" in v for v in two_orders), two_orders


# --- two interleavings forced through the real server -----------------------------------------------
def pooled_row(http: httpx.Client, ids: list[int]) -> np.ndarray:
    return rows_of(http.post("/v1/tables/tier/pooled", json={"ids": ids, "offsets": [0, len(ids)], "mode": "sum"}))[0]


def test_a_bag_pooled_before_a_write_landed_is_not_cached_past_it(tmp_path):
    """A pooled read computes the bag from the old row, a write of that row completes, then the read stores
    its bag: the next ask must see the write (the entry carries the epoch read before the pooling)."""
    models = make_store(tmp_path / "s")
    pooled, release = threading.Event(), threading.Event()

    def opener(path: Path) -> embstore.Store:
        store = embstore.open(path)
        real = store["tier"].lookup_pooled

        def held_pool(ids: Any, offsets: Any, mode: str = "sum") -> Any:
            out = real(ids, offsets, mode)
            if list(ids) == [5]:  # the one read this test holds between its pooling and its cache entry
                pooled.set()
                release.wait(30)
            return out
        store["tier"].lookup_pooled = held_pool
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, pooled_cache_bytes=CACHE_BYTES), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        early: list[np.ndarray] = []
        reader = threading.Thread(target=lambda: early.append(pooled_row(http, [5])))
        reader.start()
        assert pooled.wait(30)
        assert http.put("/v1/tables/tier/rows", headers=AUTH,
                        json={"ids": [5], "embeddings": [[9.0] * DIM]}).status_code == 204
        release.set()
        reader.join()
        assert same_bits(early[0], models["tier"].init[5])  # concurrent with the write: the old row is allowed
        assert same_bits(pooled_row(http, [5]), const(9))
        assert same_bits(pooled_row(http, [5]), const(9))


def test_a_pooled_hit_never_answers_older_than_a_lookup_that_finished_before_it(tmp_path):
    """A write's worker thread is held twice: before the table's update (a pooled read then may cache
    the old row, as one invalidating only before the write would let it) and right after it, before
    the cache hears of it. A lookup of the row then reads the new value and finishes; a pooled request
    for the same row, sent after it, must not answer the old value (new, then old: not linearizable)."""
    make_store(tmp_path / "s")
    entered, go_on, applied, release = (threading.Event() for _ in range(4))

    def opener(path: Path) -> embstore.Store:
        store = embstore.open(path)
        real = store.update_logged

        def held_write(name: str, ids: Any, rows: Any) -> None:
            entered.set()
            go_on.wait(30)
            real(name, ids, rows)
            applied.set()
            release.wait(30)
        store.update_logged = held_write
        return store

    app = create_app(ServerSettings(store=tmp_path / "s", token=TOKEN, pooled_cache_bytes=CACHE_BYTES), opener=opener)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        old = pooled_row(http, [5])
        assert same_bits(pooled_row(http, [5]), old)
        assert http.get("/v1/tables/tier").json()["pooled_cache"]["hits"] == 1  # the bag is cached
        put: list[int] = []
        writer = threading.Thread(target=lambda: put.append(http.put(
            "/v1/tables/tier/rows", headers=AUTH, json={"ids": [5], "embeddings": [[9.0] * DIM]}).status_code))
        writer.start()
        try:
            assert entered.wait(30)
            assert same_bits(pooled_row(http, [5]), old)  # the write is under way: the old row is allowed
            go_on.set()
            assert applied.wait(30)
            assert same_bits(rows_of(post_bin(http, "/v1/tables/tier/lookup", np.array([5])))[0], const(9))
            after = pooled_row(http, [5])  # sent after the lookup above answered the new row
        finally:
            go_on.set()
            release.set()
            writer.join()
        assert put == [204]
        assert same_bits(after, const(9)), f"the pooled cache answered the old row {after} after a lookup saw 9.0"
