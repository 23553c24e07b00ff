"""Audit of the store config (TOML) and of `embstore tune`: properties over random traces, budgets and configs.

* every plan ``tune`` writes is a TOML ``embstore.create`` accepts, whose DRAM (cache rows, directories,
  look-ahead state, home indexes, RocksDB buffers, recomputed here from the TOML alone) stays within
  ``--dram`` (or, where even the homes' floors do not fit, caches nothing), and whose expected hit ratios
  are a replay of the trace through the written caches;
* a StoreConfig survives TOML and back unchanged; bad keys, types, sizes, tier orders and policies are
  ``ConfigError`` naming the key and the value; a damaged calibration file is a typed error naming it.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import embstore
from embstore import costmodel, traces
from embstore.cli import main
from embstore.config import (
    ConfigError,
    HashConfig,
    PolicySpec,
    StoreConfig,
    TableConfig,
    TierConfig,
    from_toml_file,
    parse_bytes,
)
from embstore.belady import dedup_batches
from embstore.errors import InvalidInputError
from embstore.lookahead import told_bytes
from embstore.rows import RowFormat
from embstore.simulator import replay_keys, table_keys
from embstore.tiers.cache import cache_metadata_bytes
from embstore.tiers.rocksdb import RocksDBTier
from embstore.tiers.ssd import SSDTier
from embstore.tiers.ssd_log import LogSSDTier
from embstore.tuning import POLICIES, pending_occurrences, tune

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------------------------------
# tune: random traces and budgets
# --------------------------------------------------------------------------------------------------------------

@st.composite
def small_traces(draw) -> traces.Trace:
    """A few tables of different sizes and skews (one maybe sparse: a rocksdb home), a few batches."""
    n_tables = draw(st.integers(1, 3))
    batches = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    specs = []
    for t in range(n_tables):
        rows = draw(st.sampled_from([1, 5, 40, 300, 2500]))
        alpha = draw(st.sampled_from([0.0, 0.7, 1.2, 2.5]))
        per_batch = draw(st.integers(0, 90))
        sparse = draw(st.integers(0, 9)) == 0
        p = 1.0 / np.arange(1, rows + 1) ** alpha
        specs.append((rows, p / p.sum(), per_batch, sparse, rng.permutation(rows)))
    ids, tab, off = [], [], [0]
    for _ in range(batches):
        bi, bt = [], []
        for t, (rows, p, per_batch, sparse, perm) in enumerate(specs):
            x = perm[rng.choice(rows, size=per_batch, p=p)].astype(np.int64)
            if sparse:
                x = x * (1 << 33) + 7
            bi.append(x)
            bt.append(np.full(per_batch, t, np.int32))
        bi, bt = np.concatenate(bi), np.concatenate(bt)
        order = rng.permutation(bi.size)  # tables interleaved within a batch
        ids.append(bi[order])
        tab.append(bt[order])
        off.append(off[-1] + bi.size)
    tr = traces.Trace(np.concatenate(ids), np.concatenate(tab), np.array(off), tuple(f"t{i}" for i in range(n_tables)))
    return tr


def _dram_from_toml(cfg: StoreConfig, tr: traces.Trace, announce: int | None,
                    device_in_host: bool = False) -> dict[str, int]:
    """The DRAM a store of ``cfg`` holds, by the parts README's tune section counts, from the config alone
    (``device_in_host``: the device tiers' rows too, tensors in host memory where torch sees no GPU)."""
    rows = meta = told = home = rocks = dev = 0
    for t in cfg.tables:
        rb = RowFormat(t.dim, t.dtype).row_bytes
        n = t.num_embeddings
        pending = None
        if announce is not None:
            _, o = dedup_batches(*table_keys(tr, tr.table_names.index(t.name)))
            pending = pending_occurrences(o, announce)
        for tier in t.tiers[:-1]:
            r = min(tier.capacity // rb, n)
            if tier.kind.value == "dram":
                rows += r * rb
            else:
                dev += r * rb
            meta += cache_metadata_bytes(r, n, str(tier.policy))
            if pending is not None and r < n:
                told += told_bytes(r, pending)
        h = t.tiers[-1]
        if h.kind.value == "rocksdb":
            rocks += RocksDBTier.dram_bytes(h.block_cache, h.write_buffer)
        else:
            assert h.kind.value == "ssd"
            home += (LogSSDTier if h.layout == "log" else SSDTier).index_bytes(n, rb)
    out = {"cache_rows": rows, "cache_directories": meta, "look_ahead": told, "home_indexes": home,
           "rocksdb_buffers": rocks}
    return {**out, "device_rows": dev} if device_in_host else out


def _store_dram(store) -> dict[str, int]:
    """What an opened store holds: cache slabs (dram), cache directories, ssd home indexes."""
    rows = meta = home = 0
    for table in store.tables.values():
        for tier in table.hierarchy.caches:
            rows += tier.slab.nbytes if tier.kind == "dram" else 0
            meta += tier.metadata_bytes
        h = table.hierarchy.home
        home += sum(getattr(h, a).nbytes for a in ("_bits", "_changed", "_slot_of", "_live", "_free")
                    if hasattr(h, a))
    return {"cache_rows": rows, "cache_directories": meta, "home_indexes": home}


def _replayed_hits(cfg: StoreConfig, tr: traces.Trace, announce: int | None) -> dict[str, tuple[int, int, int]]:
    """Per table: (deduplicated accesses, device hits, dram hits) of ``tr`` replayed through ``cfg``'s caches."""
    out = {}
    for t in cfg.tables:
        ids, off = table_keys(tr, tr.table_names.index(t.name))
        rb = RowFormat(t.dim, t.dtype).row_bytes
        caches = t.tiers[:-1]
        res = replay_keys(ids, off, [(str(c.policy), c.capacity // rb) for c in caches], belady=False,
                          announce=announce)
        dev = dram = 0
        for c, lv in zip(caches, res.levels):
            if c.kind.value == "device":
                dev += lv.hits
            else:
                assert c.kind.value == "dram"
                dram += lv.hits
        out[t.name] = (res.accesses, dev, dram)
    return out


@settings(max_examples=80, **SETTINGS)
@given(tr=small_traces(), budget=st.sampled_from(["zero", "tiny", "some", "floors+some", "generous"]),
       some=st.integers(1, 128 << 10), exact=st.booleans(),
       device=st.one_of(st.just(0), st.integers(1, 64 << 10), st.just(1 << 30)),
       dim=st.integers(1, 12), dtype=st.sampled_from(["float32", "float16", "int8"]),
       policies=st.lists(st.sampled_from(list(POLICIES) + ["lfu+tinylfu", "clock+tinylfu"]), min_size=1,
                         max_size=3, unique=True),
       announce=st.one_of(st.none(), st.none(), st.integers(0, 3)), read_only=st.booleans())
def test_every_tuned_plan_is_creatable_within_budget_and_hits_what_it_says(tr, budget, some, exact, device, dim,
                                                                           dtype, policies, announce, read_only):
    if len(tr) == 0:
        return  # refused by the CLI (tested elsewhere)
    row_bytes = RowFormat(dim, embstore.RowDType(dtype)).row_bytes
    floors = tune(tr, 0, row_bytes=row_bytes, dim=dim, dtype=dtype, policies=policies,
                  read_only=True).dram_breakdown()  # the homes' least: in_place indexes, rocksdb floors
    dram = {"zero": 0, "tiny": some % 97, "some": some, "generous": 1 << 30,
            "floors+some": floors["home_indexes"] + floors["rocksdb_buffers"] + some}[budget]
    if exact:  # a budget exactly what some plan holds: the plan for it must fit it too
        dram = tune(tr, dram, device, row_bytes=row_bytes, dim=dim, dtype=dtype, policies=policies,
                    announce=announce, read_only=read_only).used_bytes()[1]
    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(costmodel, "DEFAULT_PATH", Path(tmp) / "no-costmodel.json"):
        tmp = Path(tmp)
        traces.save(tr, tmp / "t.npz")
        out = tmp / "plan.toml"
        argv = ["tune", str(tmp / "t.npz"), "--dram", str(dram), "--device", str(device), "--dim", str(dim),
                "--dtype", dtype, "--policy", ",".join(policies), "--json", "--out", str(out)]
        argv += ["--announce", str(announce)] if announce is not None else []
        argv += ["--read-only"] if read_only else []
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0
        got = json.loads(buf.getvalue())
        text = out.read_text()
        assert text.startswith(f"# tuned for caches told each batch and the {announce} after it") == \
            (announce is not None)
        cfg = StoreConfig.from_toml(out)
        assert [t.name for t in cfg.tables] == list(tr.table_names)
        assert all(t.dim == dim and t.dtype.value == dtype for t in cfg.tables)
        assert StoreConfig.from_toml(cfg.to_toml()) == cfg

        # DRAM: recomputed from the TOML alone, as the JSON itemises it, within --dram
        parts = _dram_from_toml(cfg, tr, announce, device_in_host=device > 0 and not torch.cuda.is_available())
        assert parts == got["dram_breakdown"]
        used = sum(parts.values())
        assert used == got["dram_bytes_used"]
        if used > dram:  # only where even the homes' indexes and floors do not fit: then nothing is cached
            assert parts["cache_rows"] == parts["cache_directories"] == parts["look_ahead"] == 0, parts
            assert all(t.tiers[-1].layout == "in_place" for t in cfg.tables if t.tiers[-1].kind.value == "ssd")
        event(f"over budget: {used > dram}")
        event(f"homes: {sorted({t.tiers[-1].kind.value + '/' + t.tiers[-1].layout for t in cfg.tables})}")
        event(f"cache tiers: {sorted({c.kind.value for t in cfg.tables for c in t.tiers[:-1]})}")
        dev_used = sum(min(c.capacity // RowFormat(t.dim, t.dtype).row_bytes, t.num_embeddings)
                       * RowFormat(t.dim, t.dtype).row_bytes
                       for t in cfg.tables for c in t.tiers[:-1] if c.kind.value == "device")
        assert dev_used == got["device_bytes_used"] <= device

        # expected hit ratios: a replay of the trace through the written caches
        per_table = _replayed_hits(cfg, tr, announce)
        acc, dev_hits, dram_hits = (sum(x[i] for x in per_table.values()) for i in range(3))
        assert got["accesses"] == acc
        assert got["device_hit_ratio"] == (dev_hits / acc if acc else 0.0)
        assert got["dram_hit_ratio"] == (dram_hits / acc if acc else 0.0)
        assert got["cache_hit_ratio"] == ((dev_hits + dram_hits) / acc if acc else 0.0)
        if exact:  # and as printed: the same TOML, per-table and overall hit ratios of the replay
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main([a if a != str(out) else str(tmp / "text.toml") for a in argv if a != "--json"]) == 0
            assert (tmp / "text.toml").read_text() == text
            lines = buf.getvalue().splitlines()
            for name, (a, d, m) in per_table.items():
                row = next(ln.split() for ln in lines if ln.split()[:1] == [name])
                assert row[-1] == f"{100 * (d + m) / max(1, a):.2f}", row
            assert (f"device hits {100 * dev_hits / acc:.2f}%, DRAM hits {100 * dram_hits / acc:.2f}%, "
                    f"all caches {100 * (dev_hits + dram_hits) / acc:.2f}%") in buf.getvalue()

        # the TOML builds a store (a device tier lives in host memory on a CPU-only machine) holding what
        # the plan charged for
        with embstore.create(tmp / "s", cfg) as store:
            real = _store_dram(store)
            assert real["cache_rows"] == parts["cache_rows"]
            # a whole-table cache's distinct-count scratch comes with its first resident lookup
            assert real["cache_directories"] <= parts["cache_directories"]
            assert real["home_indexes"] == parts["home_indexes"]


# --------------------------------------------------------------------------------------------------------------
# config: round trip
# --------------------------------------------------------------------------------------------------------------

_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,20}", fullmatch=True)
_byte_sizes = st.one_of(st.integers(1, 1 << 40),
                        st.builds(lambda n, u: f"{n}{u}", st.integers(1, 4096),
                                  st.sampled_from(["", "B", "KiB", "MiB", "GiB", "kib", "KB", "mb"])))
_policies = st.builds(lambda k, f: k + ("+tinylfu" if f else ""), st.sampled_from(["lru", "lfu", "clock"]),
                      st.booleans())
# any text TOML can hold (no surrogates): quotes, backslashes and control characters included
_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@st.composite
def _tier_dicts(draw) -> list[dict]:
    tiers = []
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["device", "dram", "mmap"]))
        t = {"kind": kind, "capacity": draw(_byte_sizes)}
        if draw(st.booleans()):
            t["policy"] = draw(_policies)
        if kind == "device" and draw(st.booleans()):
            t["device"] = draw(st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:17"]))
        tiers.append(t)
    home = draw(st.sampled_from(["ssd", "rocksdb", "mmap"]))
    h: dict = {"kind": home}
    if home == "ssd":
        if draw(st.booleans()):
            h["queue_depth"] = draw(st.integers(1, 4096))
        if draw(st.booleans()):
            h["layout"] = draw(st.sampled_from(["in_place", "log"]))
    elif home == "rocksdb":
        for key in ("block_cache", "write_buffer"):
            if draw(st.booleans()):
                h[key] = draw(_byte_sizes)
        if draw(st.booleans()):
            h["compression"] = draw(st.sampled_from(["none", "lz4", "zstd", "snappy"]))
    return tiers + [h]


@st.composite
def _table_dicts(draw, name: str) -> dict:
    tiers = draw(_tier_dicts())
    top = 2**62 if tiers[-1]["kind"] == "rocksdb" else 2**40
    d = {"name": name, "num_embeddings": draw(st.integers(1, top)), "dim": draw(st.integers(1, 65536))}
    if draw(st.booleans()):
        d["dtype"] = draw(st.sampled_from(["float32", "float16", "int8"]))
    if draw(st.booleans()):
        init = {"kind": draw(st.sampled_from(["uniform", "normal", "zeros"]))}
        if draw(st.booleans()):
            init["scale"] = draw(st.one_of(st.integers(0, 10**6),
                                           st.floats(0, 1e300, allow_nan=False, allow_infinity=False)))
        if draw(st.booleans()):
            init["seed"] = draw(st.integers(0, 2**63 - 1))
        d["init"] = init
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["none", "mod", "qr", "learned"]))
        h = {"kind": kind}
        if kind == "mod" and draw(st.booleans()):
            h["seed"] = draw(st.integers(0, 2**63 - 1))
        if kind == "qr":
            h["collisions"] = draw(st.integers(1, 1000))
            h["combine"] = draw(st.sampled_from(["mult", "add", "concat"]))
        if kind == "learned":
            h["mapping"] = draw(_text)
        d["hash"] = h
    d["tiers"] = tiers
    return d


@st.composite
def store_dicts(draw) -> dict:
    names = draw(st.lists(_names, min_size=0, max_size=3, unique=True))
    return {"table": [draw(_table_dicts(n)) for n in names]}


@settings(max_examples=150, **SETTINGS)
@given(data=store_dicts())
def test_a_store_config_survives_toml_and_back(data, tmp_path_factory):
    cfg = StoreConfig.from_dict(data)
    text = cfg.to_toml()
    back = StoreConfig.from_toml(text)
    assert back == cfg
    assert back.to_toml() == text  # and writes the same TOML again
    assert StoreConfig.from_dict(cfg.to_dict()) == cfg
    p = tmp_path_factory.mktemp("rt") / "c.toml"
    p.write_text(text, encoding="utf-8")
    assert StoreConfig.from_toml(p) == cfg == from_toml_file(StoreConfig.from_dict, p)


def test_every_documented_key_is_accepted():
    text = """
[[table]]
name = "user_id"
num_embeddings = 50_000_000
dim = 64
dtype = "int8"
init = { kind = "normal", scale = 0.01, seed = 3 }
hash = { kind = "mod", seed = 5 }
tiers = [
  { kind = "device", capacity = "256MiB", policy = "lru", device = "cpu" },
  { kind = "dram",   capacity = "2GiB",   policy = "lfu+tinylfu" },
  { kind = "mmap",   capacity = 6400,     policy = "clock" },
  { kind = "ssd", queue_depth = 64, layout = "log" },
]

[[table]]
name = "item.id-2"
num_embeddings = 4_000_000_000_000
dim = 8
hash = { kind = "qr", collisions = 4, combine = "concat" }
tiers = [{ kind = "rocksdb", block_cache = "64KiB", write_buffer = "4MiB", compression = "zstd" }]

[[table]]
name = "_m"
num_embeddings = 10
dim = 1
dtype = "float16"
init = { kind = "zeros" }
hash = { kind = "learned", mapping = "map.npy" }
tiers = [{ kind = "dram", capacity = "64KiB" }, { kind = "mmap" }]
"""
    cfg = StoreConfig.from_toml(text)
    a, b, c = cfg.tables
    assert [t.capacity for t in a.tiers[:-1]] == [256 << 20, 2 << 30, 6400]
    assert str(a.tiers[1].policy) == "lfu+tinylfu" and a.tiers[0].device == "cpu"
    assert a.tiers[-1].layout == "log" and a.dtype.value == "int8" and a.hash.seed == 5
    assert b.tiers[-1].block_cache == 64 << 10 and b.tiers[-1].write_buffer == 4 << 20
    assert b.tiers[-1].compression == "zstd" and b.hash.combine == "concat"
    assert c.tiers[-1].kind.value == "mmap" and c.hash.mapping == "map.npy" and c.init.kind.value == "zeros"
    assert StoreConfig.from_toml(cfg.to_toml()) == cfg


# --------------------------------------------------------------------------------------------------------------
# config: what is refused, by key and value
# --------------------------------------------------------------------------------------------------------------

HEAD = '[[table]]\nname = "t"\nnum_embeddings = 100\ndim = 4\n'


def _tiers(*tiers: str) -> str:
    return HEAD + "tiers = [" + ", ".join(tiers) + "]\n"


BAD = [
    # (TOML, key named, text of the value the message must quote)
    (HEAD + "flavour = 1\n", "table.flavour", "flavour"),
    ("colour = 1\n" + HEAD, "store.colour", "colour"),
    (_tiers('{kind = "dram", capacity = "1KiB", size = 3}', '{kind = "ssd"}'), "tiers.size", "size"),
    (HEAD + 'init = {kind = "uniform", sale = 1.0}\n', "init.sale", "sale"),
    (HEAD.replace("100", '"100"'), "table.num_embeddings", "'100'"),
    (HEAD.replace("100", "100.0"), "table.num_embeddings", "100.0"),
    (HEAD.replace("100", "-100"), "table.num_embeddings", "-100"),
    (HEAD.replace("dim = 4", "dim = 4.5"), "table.dim", "4.5"),
    (HEAD.replace("dim = 4", 'dim = "4"'), "table.dim", "'4'"),
    (HEAD.replace("dim = 4", "dim = true"), "table.dim", "True"),
    (HEAD.replace('"t"', "7"), "table.name", "7"),
    (HEAD.replace('"t"', '"-t"'), "table.name", "'-t'"),
    (HEAD.replace('"t"', '"a b"'), "table.name", "'a b'"),
    (HEAD.replace('"t"', '"t\\n"'), "table.name", "'t\\n'"),  # a newline: a directory named so
    (HEAD.replace('"t"', '"' + "x" * 129 + '"'), "table.name", "x" * 129),
    (HEAD.replace('"t"', '"' + "x" * 128 + '\\n"'), "table.name", "x" * 128),
    (HEAD + HEAD, "table.name", "'t'"),
    (HEAD + 'dtype = "float64"\n', "table.dtype", "'float64'"),
    (_tiers('{kind = "dram", capacity = "2 GiBs"}', '{kind = "ssd"}'), "tiers.capacity", "'2 GiBs'"),
    (_tiers('{kind = "dram", capacity = "0"}', '{kind = "ssd"}'), "tiers.capacity", "'0'"),
    (_tiers('{kind = "dram", capacity = 0}', '{kind = "ssd"}'), "tiers.capacity", "0"),
    (_tiers('{kind = "dram", capacity = -4096}', '{kind = "ssd"}'), "tiers.capacity", "-4096"),
    (_tiers('{kind = "dram", capacity = "-4KiB"}', '{kind = "ssd"}'), "tiers.capacity", "'-4KiB'"),
    (_tiers('{kind = "dram", capacity = 1.5}', '{kind = "ssd"}'), "tiers.capacity", "1.5"),
    (_tiers('{kind = "dram", capacity = "1.5"}', '{kind = "ssd"}'), "tiers.capacity", "'1.5'"),
    (_tiers('{kind = "dram", capacity = "2 G"}', '{kind = "ssd"}'), "tiers.capacity", "'2 G'"),
    (_tiers('{kind = "dram", capacity = "1e6"}', '{kind = "ssd"}'), "tiers.capacity", "'1e6'"),
    (_tiers('{kind = "dram", capacity = true}', '{kind = "ssd"}'), "tiers.capacity", "True"),
    (_tiers('{kind = "dram", capacity = [1]}', '{kind = "ssd"}'), "tiers.capacity", "[1]"),
    (_tiers('{kind = "dram", capacity = "1KiB", policy = "lfu+tinylf"}', '{kind = "ssd"}'), "tiers.policy",
     "'lfu+tinylf'"),
    (_tiers('{kind = "dram", capacity = "1KiB", policy = "lur"}', '{kind = "ssd"}'), "tiers.policy", "'lur'"),
    (_tiers('{kind = "dram", capacity = "1KiB", policy = "lru+lfu"}', '{kind = "ssd"}'), "tiers.policy",
     "'lru+lfu'"),
    (_tiers('{kind = "dram", capacity = "1KiB", policy = 1}', '{kind = "ssd"}'), "tiers.policy", "1"),
    (_tiers('{kind = "dram", capacity = "1KiB"}', '{kind = "ssd", queue_depth = "64"}'), "tiers.queue_depth",
     "'64'"),
    (_tiers('{kind = "ssd", queue_depth = 64.0}'), "tiers.queue_depth", "64.0"),
    (_tiers('{kind = "ssd", queue_depth = 0}'), "tiers.queue_depth", "0"),
    (_tiers('{kind = "rocksdb", block_cache = "64 MiBs"}'), "tiers.block_cache", "'64 MiBs'"),
    (_tiers('{kind = "rocksdb", write_buffer = -1}'), "tiers.write_buffer", "-1"),
    (_tiers('{kind = "rocksdb", compression = "gzip"}'), "tiers.compression", "'gzip'"),
    (_tiers('{kind = "ssd", layout = "append"}'), "tiers.layout", "'append'"),
    (_tiers('{kind = "device", capacity = "1KiB", device = "gpu"}', '{kind = "ssd"}'), "tiers.device", "'gpu'"),
    (_tiers('{kind = "hdd"}'), "tiers.kind", "'hdd'"),
    # tier orders that make no sense
    (_tiers('{kind = "ssd"}', '{kind = "dram", capacity = "1KiB"}'), "table.tiers", "'dram'"),
    (_tiers('{kind = "ssd"}', '{kind = "ssd"}'), "tiers.kind", "'ssd'"),
    (_tiers('{kind = "rocksdb"}', '{kind = "ssd"}'), "tiers.kind", "'rocksdb'"),
    (_tiers('{kind = "dram", capacity = "1KiB"}'), "table.tiers", "'dram'"),
    (_tiers('{kind = "dram"}', '{kind = "ssd"}'), "tiers.capacity", "'dram'"),
    (_tiers('{kind = "ssd", capacity = "1KiB"}'), "tiers.capacity", "'ssd'"),
    (_tiers('{kind = "ssd", policy = "lru"}'), "tiers.policy", "'ssd'"),
    (_tiers(), "table.tiers", "at least one"),
    (HEAD + 'tiers = "ssd"\n', "table.tiers", "'ssd'"),
    (HEAD + "tiers = [1]\n", "tiers", "1"),
    (HEAD + 'hash = {kind = "qr", seed = 1}\n', "hash.seed", "'qr'"),
    (HEAD + 'hash = {kind = "learned"}\n', "hash.mapping", "mapping"),
    (HEAD + 'init = {scale = "0.1"}\n', "init.scale", "'0.1'"),
    (HEAD + "init = {scale = nan}\n", "init.scale", "nan"),
    ('[table]\nname = "t"\n', "table", "[[table]]"),
]


@pytest.mark.parametrize("text,key,value", BAD, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(BAD)])
def test_a_bad_config_is_a_config_error_naming_key_and_value(text, key, value, tmp_path):
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_toml(text)
    assert info.value.key == key
    assert value in str(info.value)
    p = tmp_path / "bad.toml"  # from a file: the same error, naming the file too
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_toml(p)
    assert info.value.key == key and value in str(info.value) and str(p) in str(info.value)


def test_a_table_name_with_a_trailing_newline_is_refused_before_it_names_a_directory(tmp_path):
    """``$`` matches before a final newline: "t\\n" passed the name check and became the table directory
    ``tables/t\\n`` of a created store."""
    for name in ("t\n", "x" * 128 + "\n"):
        with pytest.raises(ConfigError, match="table.name"):
            TableConfig(name, 10, 4)
    with pytest.raises(ConfigError, match="table.name"):
        embstore.create(tmp_path / "s", StoreConfig.from_dict({"table": [{"name": "t\n", "num_embeddings": 10,
                                                                         "dim": 4}]}))
    assert not (tmp_path / "s" / "tables" / "t\n").exists()


@pytest.mark.parametrize("text,want", [("2GB", 2 * 10**9), ("2 GB", 2 * 10**9), ("2gib", 2 << 30),
                                       ("2GiB", 2 << 30), ("1.5GiB", 3 << 29), (" 64 KiB ", 64 << 10)])
def test_byte_sizes_in_the_units_they_name(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["2 GBs", "2 G B", "GiB", "", " ", "0", "0KiB", "0.0001KiB", "1.5", "2GiB2",
                                  "+2GiB", "2.GiB", ".5GiB", "0x10", "inf", "nan", "2\nGiB\nGiB"])
def test_byte_sizes_that_are_no_size_are_refused(text):
    with pytest.raises(ConfigError, match="tiers.capacity"):
        parse_bytes(text, "tiers.capacity")


def test_config_errors_are_never_raw_for_odd_toml_values():
    """Every TOML value type in every key: a ConfigError, never KeyError/TypeError/AttributeError."""
    values = ['"x"', "1", "-1", "1.5", "true", "[1]", "[]", "{a = 1}", "{}", "1979-05-27", "07:32:00", "nan", "inf"]
    for key in ["name", "num_embeddings", "dim", "dtype", "init", "hash", "tiers"]:
        lines = {"name": '"t"', "num_embeddings": "100", "dim": "4"}
        for v in values:
            lines[key] = v
            try:
                StoreConfig.from_toml("[[table]]\n" + "".join(f"{k} = {x}\n" for k, x in lines.items()))
            except ConfigError:
                pass
    for key in ["kind", "capacity", "policy", "queue_depth", "block_cache", "write_buffer", "compression", "layout",
                "device"]:
        for home in ("ssd", "rocksdb", "mmap"):
            for v in values:
                for tiers in ([f'{{kind = "dram", capacity = "1KiB", {key} = {v}}}', f'{{kind = "{home}"}}'],
                              [f'{{kind = "{home}", {key} = {v}}}'] if key != "kind" else []):
                    if not tiers:
                        continue
                    try:
                        StoreConfig.from_toml(_tiers(*tiers))
                    except ConfigError:
                        pass
    for section, keys in (("init", ["kind", "scale", "seed"]), ("hash", ["kind", "seed", "collisions", "combine",
                                                                        "mapping"])):
        for key in keys:
            for v in values:
                try:
                    StoreConfig.from_toml(HEAD + f"{section} = {{{key} = {v}}}\n")
                except ConfigError:
                    pass


def test_config_files_that_are_no_toml_are_config_errors_naming_the_file(tmp_path):
    good = StoreConfig.from_toml(_tiers('{kind = "dram", capacity = "1KiB"}', '{kind = "ssd"}')).to_toml()
    cases = {"truncated": good[: len(good) // 2 + 3].encode(), "binary": b"\x00\xff\xfe[[table]]\n",
             "empty-ish": b"[[table]\n", "bom": b"\xef\xbb\xbf" + good.encode()}
    for label, raw in cases.items():
        p = tmp_path / f"{label}.toml"
        p.write_bytes(raw)
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_toml(p)
        assert str(p) in str(info.value), label


# --------------------------------------------------------------------------------------------------------------
# calibration file
# --------------------------------------------------------------------------------------------------------------

def _damaged_costmodels() -> dict[str, bytes]:
    good = json.dumps(costmodel.CostModel(measured=True).to_dict(), indent=2)
    other_version = costmodel.CostModel().to_dict()
    other_version["ssd_iops"] = [[1, 10000.0], [8, 60000.0]]  # a list of pairs, not an object
    renamed = costmodel.CostModel().to_dict()
    renamed["dram_ns"] = renamed.pop("dram_ns_per_row")
    return {
        "truncated": good[: len(good) // 2].encode(),
        "cut-at-brace": good[:-1].encode(),
        "empty": b"",
        "garbage": b"\x00\x01\x02\x03" * 8,
        "list": b"[1, 2, 3]",
        "other-version-iops": json.dumps(other_version).encode(),
        "renamed-field": json.dumps(renamed).encode(),
        "iops-key-not-depth": json.dumps({**costmodel.CostModel().to_dict(), "ssd_iops": {"deep": 5.0}}).encode(),
        "null-costs": json.dumps({**costmodel.CostModel().to_dict(), "mmap_ns_per_row": None}).encode(),
        "string-costs": json.dumps({**costmodel.CostModel().to_dict(), "rocksdb_us_per_row": "5"}).encode(),
        "row-bytes-float": json.dumps({**costmodel.CostModel().to_dict(), "row_bytes": 256.0}).encode(),
        "huge-number": b'{"dram_ns_per_row": 1e999}',
    }


@pytest.mark.parametrize("label", sorted(_damaged_costmodels()))
def test_a_damaged_calibration_is_a_typed_error_naming_the_file_and_tune_falls_back(label, tmp_path, caplog):
    p = tmp_path / "costmodel.json"
    p.write_bytes(_damaged_costmodels()[label])
    with pytest.raises(InvalidInputError) as info:
        costmodel.load(p)
    assert str(p) in str(info.value)
    with caplog.at_level("WARNING", logger="embstore.costmodel"):
        assert costmodel.default_model(p) == costmodel.CostModel()
    assert str(p) in caplog.text
    tr = traces.Trace(np.array([1, 2, 1, 3], np.int64), np.zeros(4, np.int32), np.array([0, 2, 4]), ("a",))
    traces.save(tr, tmp_path / "t.npz")
    buf = io.StringIO()
    with mock.patch.object(costmodel, "DEFAULT_PATH", p), contextlib.redirect_stdout(buf):
        assert main(["tune", str(tmp_path / "t.npz"), "--dram", "1MiB", "--dim", "4"]) == 0
    assert "built-in costs" in buf.getvalue()


def test_a_saved_calibration_is_what_tune_models_with(tmp_path):
    model = costmodel.CostModel(dram_ns_per_row=7.0, mmap_ns_per_row=70.0, ssd_iops={1: 100.0, 8: 800.0},
                                rocksdb_us_per_row=9.0, row_bytes=16, measured=True)
    p = costmodel.save(model, tmp_path / "sub" / "c.json")
    assert costmodel.load(p) == model
    tr = traces.Trace(np.array([1, 2, 1, 3], np.int64), np.zeros(4, np.int32), np.array([0, 2, 4]), ("a",))
    traces.save(tr, tmp_path / "t.npz")
    buf = io.StringIO()
    with mock.patch.object(costmodel, "DEFAULT_PATH", p), contextlib.redirect_stdout(buf):
        assert main(["tune", str(tmp_path / "t.npz"), "--dram", "0", "--dim", "4", "--json"]) == 0
    got = json.loads(buf.getvalue())
    # nothing cached: each of the 4 accesses is a home read at queue depth 64 (measured up to 8), 2 batches
    assert got["seconds_per_batch"] == pytest.approx(4 * 1e9 / 800.0 * 1e-9 / 2)
    assert got["all_dram_seconds_per_batch"] == pytest.approx(4 * 7.0 * 1e-9 / 2)


def test_log_slot_maps_are_taken_only_where_they_fit_beside_the_rocksdb_floors():
    """A sparse table (rocksdb home, 8 MiB of floors) beside a dense one: the dense home's log slot map (80
    KiB) fit in a quarter of the budget, so it was taken, and with the floors it overran a budget that
    in_place homes and some cache fit (the CLI then warned that no cache fits)."""
    rng = np.random.default_rng(0)
    n, nb = 1000, 5
    dense = np.minimum(rng.zipf(1.3, (nb, n)), 20_000) - 1
    dense[0, 0] = 19_999
    sparse = np.minimum(rng.zipf(1.3, (nb, n)), 300) * (1 << 33) + 1
    tr = traces.Trace(np.concatenate([dense, sparse], axis=1).ravel(), np.tile(np.repeat(np.int32([0, 1]), n), nb),
                      np.arange(nb + 1) * 2 * n, ("dense", "sparse"))
    floors = tune(tr, 0, row_bytes=4, dim=1).dram_breakdown()["rocksdb_buffers"]
    for dram in (floors + (16 << 10), floors + (64 << 10)):
        res = tune(tr, dram, row_bytes=4, dim=1)
        assert res.used_bytes()[1] <= dram, (dram, res.dram_breakdown())
        assert res.totals()["cache_hit_ratio"] > 0.3
    big = tune(tr, floors + (1 << 20), row_bytes=4, dim=1)  # room for both: the dense home still gets its log
    assert big.tables[0].layout == "log" and big.used_bytes()[1] <= floors + (1 << 20)
