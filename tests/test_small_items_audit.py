"""Audit of four small items: what a learned-hash file records, `tune --device` where torch sees no GPU,
which reads the trace recorder sees, and the dense features predict takes.

1. A learned-hash mapping records the table it was fitted on and the ids' range; a store refuses it on
   another of its tables (ConfigError naming both) and still takes files written before those fields.
2. Where torch sees no GPU a ``device`` tier is a tensor in host memory: ``embstore tune`` counts its rows
   in ``--dram`` too (checked against what a store built from the plan really holds), and says so.
3. The recorder: every read that reaches the tiers on behalf of a user or a training batch is one trace
   batch of its distinct physical rows, once; bulk export (``read_physical``) and training's fetches
   (``read_with_state``, recorded when the batch enters the window) are not; a call of no ids records nothing.
4. Predict takes raw Criteo dense features: a model the trainer saved applies ``log(1 + max(x, 0))`` as
   training/data.py does, so a sample scored over HTTP from its raw line equals the training-time forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import embstore
from embstore import bulk, tracegen, traces
from embstore.cli import main
from embstore.client import LookupClient, bags
from embstore.config import HashConfig, StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, CorruptStoreError
from embstore.hashing import LearnedHash
from embstore.hashing._format import read_arrays, write_arrays
from embstore.recorder import record
from embstore.rows import RowFormat
from embstore.server import ServerSettings, create_app
from embstore.server.testing import ServerThread
from embstore.training.data import parse_lines
from embstore.training.registry import load_model, predict
from embstore.tuning import tune

DIM = 4


# ------------------------------------------------------------------------------ 1. learned-hash file records
def _two_table_trace(path: Path) -> traces.Trace:
    """Tables 'user' (ids 0..399) and 'item' (ids 10**6..10**6 + 299), Zipf-ish, four batches."""
    rng = np.random.default_rng(7)
    ids, tab, off = [], [], [0]
    for _ in range(4):
        u = np.minimum(rng.zipf(1.4, 300), 400) - 1
        i = 10**6 + np.minimum(rng.zipf(1.4, 200), 300) - 1
        ids += [u, i]
        tab += [np.zeros(300, np.int32), np.ones(200, np.int32)]
        off.append(off[-1] + 500)
    tr = traces.Trace(np.concatenate(ids).astype(np.int64), np.concatenate(tab), np.array(off), ("user", "item"))
    traces.save(tr, path)
    return tr


def _fit(tmp_path: Path, table: str, buckets: int = 64, name: str | None = None) -> Path:
    out = tmp_path / (name or f"{table}.ehash")
    assert main(["hash", "fit", str(tmp_path / "t.npz"), "--buckets", str(buckets), "--out", str(out),
                 "--table", table, "--quiet"]) == 0
    return out


def _learned(name: str, mapping: Path, rows: int = 64) -> TableConfig:
    return TableConfig(name, rows, DIM, hash={"kind": "learned", "mapping": str(mapping)}, tiers=(TierConfig("mmap"),))


@pytest.fixture()
def fitted(tmp_path):
    """(trace, user mapping, item mapping) fitted by `embstore hash fit` on the two-table trace."""
    tr = _two_table_trace(tmp_path / "t.npz")
    return tr, _fit(tmp_path, "user"), _fit(tmp_path, "item")


def test_hash_fit_records_the_table_and_the_id_range_it_was_fitted_on(tmp_path, fitted):
    tr, user, item = fitted
    for path, t in ((user, 0), (item, 1)):
        m = LearnedHash.load(path)
        ids = tr.ids[tr.table == t]
        assert m.table == tr.table_names[t] and m.id_range == (int(ids.min()), int(ids.max()))
        assert m.num_rows == 64
    np.save(tmp_path / "ids.npy", tr.ids[tr.table == 0])  # bare ids name no table
    assert main(["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "64", "--out", str(tmp_path / "n.ehash"),
                 "--quiet"]) == 0
    assert LearnedHash.load(tmp_path / "n.ehash").table is None


def test_a_mapping_fitted_on_another_table_of_the_store_is_refused_naming_both(tmp_path, fitted):
    _, user, item = fitted
    swapped = StoreConfig((_learned("user", item), _learned("item", user)))
    with pytest.raises(ConfigError) as e:
        embstore.create(tmp_path / "s", swapped)
    assert e.value.key == "hash.mapping" and "fitted for table 'item'" in str(e.value)
    assert "attached to table 'user'" in str(e.value) and "hash.ehash" in str(e.value)  # the store's copy
    assert not (tmp_path / "s").exists()
    with embstore.create(tmp_path / "ok", StoreConfig((_learned("user", user),))) as store:  # matching: fine
        assert store["user"].mapper.table == "user"
        with pytest.raises(ConfigError, match="fitted for table 'user' but is attached to table 'item'"):
            store.create_table(_learned("item", user))  # adding a table: checked as well
        assert list(store.tables) == ["user"]
        store.create_table(_learned("item", item))
    # a store's copy replaced by the other table's mapping is refused at open
    inside = tmp_path / "ok" / "tables" / "item" / "hash.ehash"
    good = inside.read_bytes()
    shutil.copyfile(user, inside)
    with pytest.raises(ConfigError, match="fitted for table 'user' but is attached to table 'item'"):
        embstore.open(tmp_path / "ok")
    inside.write_bytes(good)
    embstore.open(tmp_path / "ok").close()


def test_a_mapping_of_a_trace_whose_names_the_store_does_not_use_is_taken_as_configured(tmp_path, fitted):
    """A generated trace names its tables table_0..: no table of the store can be matched by name."""
    traces.save(tracegen.generate(zipf_alpha=1.0, batches=3, batch_size=100, tables=2, ids=500, seed=1),
                tmp_path / "t.npz")
    m = _fit(tmp_path, "table_1", name="g.ehash")
    assert LearnedHash.load(m).table == "table_1"
    embstore.create(tmp_path / "s", StoreConfig((_learned("user", m), _learned("item", m)))).close()


def test_a_mapping_of_another_bucket_count_is_refused_whatever_the_table(tmp_path, fitted):
    _, user, _ = fitted
    with pytest.raises(ConfigError, match="maps onto 64 rows but the table has num_embeddings = 65"):
        embstore.create(tmp_path / "s", StoreConfig((_learned("user", user, rows=65),)))


def _rewrite_meta(path: Path, edit) -> None:
    """Rewrite a mapping file with its header's meta edited (a valid file otherwise: CRCs recomputed)."""
    meta, arrays = read_arrays(path)
    edit(meta)
    write_arrays(path, meta, {k: np.array(v) for k, v in arrays.items()})


def test_a_file_written_before_the_fields_loads_and_attaches_to_any_table(tmp_path, fitted):
    _, user, _ = fitted
    old = tmp_path / "old.ehash"
    shutil.copyfile(user, old)
    _rewrite_meta(old, lambda m: (m.pop("table"), m.pop("id_range")))
    h = LearnedHash.load(old)
    assert h.table is None and h.id_range is None
    probe = np.arange(-5, 500, dtype=np.int64)
    np.testing.assert_array_equal(h(probe), LearnedHash.load(user)(probe))  # the same mapping
    embstore.create(tmp_path / "s", StoreConfig((_learned("user", old), _learned("item", old)))).close()


@pytest.mark.parametrize("field, value", [("table", 5), ("table", ""), ("id_range", [3]), ("id_range", [9, 2]),
                                          ("id_range", [0.5, 2]), ("id_range", "0..9")])
def test_damaged_fitted_for_fields_are_corrupt_store_errors(tmp_path, fitted, field, value):
    _, user, _ = fitted
    _rewrite_meta(user, lambda m: m.__setitem__(field, value))
    with pytest.raises(CorruptStoreError, match=f"header field '{field}'"):
        LearnedHash.load(user)


def test_the_python_fit_refuses_a_table_that_is_no_name():
    with pytest.raises(ConfigError) as e:
        LearnedHash.fit(np.arange(10, dtype=np.int64), 8, table="")
    assert e.value.key == "table"


# ------------------------------------------------------------------------------ 2. tune --device, no GPU
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the device tier is host memory only without a GPU")


@pytest.fixture(scope="module")
def tune_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("tune") / "t.npz"
    traces.save(tracegen.generate(zipf_alpha=1.0, batches=10, batch_size=300, tables=3, ids=5000, seed=2), p)
    return p


def _host_bytes(store) -> int:
    """What an open store holds in host memory for its caches and homes: dram and (CPU) device slabs,
    every cache directory, the ssd homes' indexes."""
    total = 0
    for table in store.tables.values():
        for tier in table.hierarchy.caches:
            if tier.kind == "dram":
                total += tier.slab.nbytes
            elif tier.kind == "device":
                assert tier.slab.device.type == "cpu"
                total += tier.slab.numel() * tier.slab.element_size()
            total += tier.metadata_bytes
        h = table.hierarchy.home
        total += sum(getattr(h, a).nbytes for a in ("_bits", "_changed", "_slot_of", "_live", "_free")
                     if hasattr(h, a))
    return total


@needs_no_gpu
@pytest.mark.parametrize("dram, device", [(64 << 10, 8 << 10), (64 << 10, 1 << 30), (256 << 10, 32 << 10)])
def test_tune_without_a_gpu_keeps_the_device_tiers_rows_within_dram(tune_trace, tmp_path, capsys, dram, device):
    """A store built from the plan here holds its device tiers in host memory: all of it within --dram."""
    out = tmp_path / "plan.toml"
    assert main(["tune", str(tune_trace), "--dram", str(dram), "--device", str(device), "--dim", "16",
                 "--json", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    cfg = StoreConfig.from_toml(out)
    with embstore.create(tmp_path / "s", cfg) as store:
        assert _host_bytes(store) <= dram  # was 72,065 B of a 64 KiB budget (--device 8KiB on top of it)
    row_bytes = RowFormat(16, embstore.RowDType.FLOAT32).row_bytes
    dev_rows = sum(c.capacity // row_bytes for t in cfg.tables for c in t.tiers if c.kind.value == "device")
    assert 0 < dev_rows * row_bytes == got["device_bytes_used"] <= device
    assert got["device_in_host"] is True
    parts = got["dram_breakdown"]
    assert got["device_bytes_used"] == parts["device_rows"]
    assert got["dram_bytes_used"] == sum(parts.values()) <= dram
    assert out.read_text().startswith("# tuned where torch sees no GPU")


@needs_no_gpu
def test_tune_without_a_gpu_says_where_the_device_budget_went(tune_trace, capsys):
    assert main(["tune", str(tune_trace), "--dram", "64KiB", "--device", "8KiB", "--dim", "16"]) == 0
    text = capsys.readouterr().out
    assert "note         torch sees no GPU here, so a device tier is a tensor in host memory" in text
    assert "counted in --dram as well as --device" in text and "device rows in host memory" in text
    assert main(["tune", str(tune_trace), "--dram", "64KiB", "--dim", "16"]) == 0  # no device budget: no note
    assert "no GPU" not in capsys.readouterr().out


def test_tune_api_device_in_host_charges_the_device_rows_to_dram(tune_trace):
    """The planning function itself is machine-independent: ``device_in_host`` says where the tier lives."""
    tr = traces.load(tune_trace)
    gpu = tune(tr, 64 << 10, 8 << 10, row_bytes=64)
    host = tune(tr, 64 << 10, 8 << 10, row_bytes=64, device_in_host=True)
    assert "device_rows" not in gpu.dram_breakdown() and not gpu.device_in_host
    for res in (gpu, host):
        dev, used = res.used_bytes()
        assert dev == sum(p.device_rows for p in res.tables) * 64 <= 8 << 10 and used <= 64 << 10
    assert host.dram_breakdown()["device_rows"] == host.used_bytes()[0] > 0
    # the host plan's DRAM caches got what the device rows took out of the budget
    assert host.dram_breakdown()["cache_rows"] < gpu.dram_breakdown()["cache_rows"]


# ------------------------------------------------------------------------------ 3. the trace recorder
def _rec_store(path: Path):
    return embstore.create(path, StoreConfig((
        TableConfig("lru", 60, DIM, tiers=(TierConfig("dram", 8 * 16, "lru"), TierConfig("mmap"))),
        TableConfig("full", 60, DIM, tiers=(TierConfig("dram", 60 * 16), TierConfig("mmap"))),
        TableConfig("dev", 60, DIM, tiers=(TierConfig("device", 60 * 16), TierConfig("mmap"))),
        TableConfig("qr", 40, DIM, hash=HashConfig("qr", collisions=4), tiers=(TierConfig("mmap"),)),
        TableConfig("mod", 60, DIM, hash=HashConfig("mod"), tiers=(TierConfig("mmap"),)))))


def _batches(tr: traces.Trace) -> list[tuple[str, list[int]]]:
    return [(tr.table_names[int(tr.table[lo])] if hi > lo else "", tr.ids[lo:hi].tolist())
            for lo, hi in zip(tr.batch_offsets[:-1], tr.batch_offsets[1:])]


def _distinct(rows: np.ndarray) -> list[int]:
    return list(dict.fromkeys(np.asarray(rows).reshape(-1).tolist()))


def test_every_lookup_path_records_its_distinct_physical_rows_once(tmp_path):
    """lookup and lookup_pooled of DRAM (partial and whole), whole-table device (host here), QR- and
    mod-hashed tables: one batch each, the call's distinct physical rows in first-seen order."""
    ids = np.array([5, 3, 5, 7, 3, 1], np.int64)
    offs = np.array([0, 2, 2, 6], np.int64)
    with _rec_store(tmp_path / "s") as store, record(store, tmp_path / "t.npz"):
        want = []
        for name in store.tables:
            t = store[name]
            t.lookup(ids)
            t.lookup_pooled(ids, offs)
            t.lookup_pooled(torch.from_numpy(ids), torch.from_numpy(offs), mode="mean")
            want += [(name, _distinct(t.physical_rows(ids)))] * 3
    assert _batches(traces.load(tmp_path / "t.npz")) == want


def test_a_call_of_no_ids_records_no_batch(tmp_path):
    """lookup() of no ids recorded nothing, but a pooled call of only empty bags recorded an empty batch."""
    none = np.zeros(0, np.int64)
    with _rec_store(tmp_path / "s") as store, record(store, tmp_path / "t.npz"):
        for name in store.tables:
            store[name].lookup(none)
            store[name].lookup_pooled(none, np.zeros(3, np.int64))
        store["lru"].lookup(np.array([2], np.int64))
    assert _batches(traces.load(tmp_path / "t.npz")) == [("lru", [2])]


def test_bulk_export_and_physical_reads_are_not_traffic(tmp_path):
    """read_physical (export) and read_with_state (training's fetch, recorded when its batch entered the
    look-ahead window) record nothing: a scan of every row is not the workload a tuning trace measures."""
    with _rec_store(tmp_path / "s") as store, record(store, tmp_path / "t.npz"):
        bulk.export_rows(store["lru"], tmp_path / "lru.npy")
        store["full"].read_physical(np.arange(60))
        store["mod"].read_with_state(np.arange(10))
        store["dev"].lookup(np.array([4, 4], np.int64))
    assert _batches(traces.load(tmp_path / "t.npz")) == [("dev", [4])]


def test_server_lookups_record_what_reaches_the_tiers(tmp_path):
    """Over real HTTP: a lookup and a pooled request each record their distinct physical rows once."""
    store = _rec_store(tmp_path / "s")
    mod_rows = _distinct(store["mod"].physical_rows(np.array([10**12, 3, 3], np.int64)))
    qr_rows = _distinct(store["qr"].physical_rows(np.array([7, 33], np.int64)))
    settings = ServerSettings(store=tmp_path / "s", batching=False, pooled_cache_bytes=0)
    with record(store, tmp_path / "t.npz"):  # the server closes the store it serves when it stops
        srv = ServerThread(create_app(settings, opener=lambda _p: store)).start()
        try:
            with LookupClient(srv.url) as client:
                client.lookup("lru", np.array([9, 8, 9], np.int64))
                client.lookup_pooled("mod", np.array([10**12, 3, 3], np.int64), np.array([0, 1, 3], np.int64))
                client.lookup("qr", np.array([7, 33], np.int64))
        finally:
            srv.stop()
    assert _batches(traces.load(tmp_path / "t.npz")) == [("lru", [9, 8]), ("mod", mod_rows), ("qr", qr_rows)]


# ------------------------------------------------------------------------------ 4. predict's dense features
TABLES = ("a", "b", "c")


def _criteo_line(i: int, rng: np.random.Generator) -> str:
    raw = rng.integers(-3, 200_000, 13)  # Criteo's counts, with a few negatives and empties
    dense = ["" if j == i % 13 else str(v) for j, v in enumerate(raw.tolist())]
    cats = [format(int(rng.integers(0, 900)), "x"), format(int(rng.integers(0, 400)), "x"), format(i * 11, "x")]
    return "\t".join([str(i % 2), *dense, *cats]) + "\n"


@pytest.fixture(scope="module")
def criteo_model(tmp_path_factory):
    """(store path, held-out raw lines) of a small DLRM trained by `embstore train` on Criteo-format lines."""
    from test_trainer import config_text

    from embstore.training.trainer import TrainConfig, train

    tmp = tmp_path_factory.mktemp("criteo")
    rng = np.random.default_rng(4)
    lines = [_criteo_line(i, rng) for i in range(48)]
    (tmp / "day.tsv").write_text("".join(lines[:40]))
    (tmp / "eval.tsv").write_text("".join(lines[40:]))
    text = config_text(batches=4).replace('kind = "synthetic"', f'kind = "criteo"\ntrain_paths = ["{tmp / "day.tsv"}"]\n'
                                          f'eval_paths = ["{tmp / "eval.tsv"}"]').replace("batch_size = 256",
                                                                                          "batch_size = 8")
    (tmp / "cfg.toml").write_text(text)
    train(TrainConfig.from_toml(tmp / "cfg.toml"), tmp / "run", progress=False)
    return tmp / "run" / "store", lines[40:]


def _raw_request(lines: list[str]) -> tuple[np.ndarray, dict[str, list[list[int]]], torch.Tensor]:
    """(raw dense as a client has them, bags per table, the training-time forward's dense features)."""
    dense = np.array([[int(v) if v else 0 for v in ln.rstrip("\n").split("\t")[1:14]] for ln in lines], np.float64)
    parsed, bad, _ = parse_lines(lines, 13, len(TABLES))
    assert bad == 0
    batch = parsed.to_batch()
    sparse = {t: bags(i.numpy(), o.numpy()) for t, i, o in zip(TABLES, batch.ids, batch.offsets)}
    return dense, sparse, batch


def test_predict_of_raw_features_equals_the_training_time_forward(criteo_model, tmp_path):
    path, lines = criteo_model
    dense, sparse, batch = _raw_request(lines)
    shutil.copytree(path, tmp_path / "ref")
    with embstore.open(tmp_path / "ref") as ref:
        model = load_model(ref, "dlrm")
        try:
            with torch.no_grad():  # what training computes on these lines: the reader's features, the model
                want = torch.sigmoid(model(batch.dense, batch.ids, batch.offsets)).numpy()
            got_direct = predict(model, torch.from_numpy(dense), batch.ids, batch.offsets).numpy()
        finally:
            model.sparse_arch.ebc.release()
    np.testing.assert_array_equal(got_direct, want)
    srv = ServerThread(create_app(ServerSettings(store=path))).start()
    try:
        with LookupClient(srv.url) as client:
            got = client.predict("dlrm", dense, sparse)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            raw = http.post("/v1/models/dlrm/predict", json={"dense": dense.tolist(), "sparse": sparse})
    finally:
        srv.stop()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array(raw.json()["scores"]), want, rtol=0, atol=1e-6)
    assert not np.allclose(want, torch.sigmoid(torch.zeros(1)).numpy())  # a model that tells the samples apart
    assert json.loads((path / "models" / "dlrm" / "model.json").read_text())["dense_transform"] == "log1p"


def test_a_model_json_without_the_field_is_served_as_before(criteo_model, tmp_path):
    """model.json files written before dense_transform existed: features as sent (their clients'
    contract); an unknown transform is a damaged model."""
    path, lines = criteo_model
    dense, _, batch = _raw_request(lines)
    shutil.copytree(path, tmp_path / "s")
    spec_file = tmp_path / "s" / "models" / "dlrm" / "model.json"
    spec = json.loads(spec_file.read_text())
    del spec["dense_transform"]
    spec_file.write_text(json.dumps(spec))
    with embstore.open(tmp_path / "s") as store:
        model = load_model(store, "dlrm")
        try:
            assert model.spec.dense_transform == "none"
            with torch.no_grad():
                want = torch.sigmoid(model(batch.dense, batch.ids, batch.offsets)).numpy()
            np.testing.assert_array_equal(predict(model, batch.dense, batch.ids, batch.offsets).numpy(), want)
        finally:
            model.sparse_arch.ebc.release()
        spec_file.write_text(json.dumps({**spec, "dense_transform": "log2"}))
        with pytest.raises(CorruptStoreError, match="dense_transform must be one of none, log1p"):
            load_model(store, "dlrm")


def test_sharded_training_refuses_a_mapping_fitted_on_another_table(tmp_path, fitted):
    """A sharded run builds each table's hash itself (its rank stores are hashless): the same check applies."""
    from embstore.training.distributed import DistContext, ShardedEmbeddingBags

    _, user, item = fitted
    hashless = StoreConfig((TableConfig("user", 64, DIM, tiers=(TierConfig("mmap"),)),
                            TableConfig("item", 64, DIM, tiers=(TierConfig("mmap"),))))
    with embstore.create(tmp_path / "rank0", hashless) as store:
        with pytest.raises(ConfigError, match="fitted for table 'item' but is attached to table 'user'"):
            ShardedEmbeddingBags(store, [_learned("user", item), _learned("item", user)], DistContext(0, 1))
        ShardedEmbeddingBags(store, [_learned("user", user), _learned("item", item)], DistContext(0, 1))
