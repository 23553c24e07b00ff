"""Behaviours a mutation audit of the training driver and of tier tuning found unpinned (session 11).

Cost model per tier, tuning's device/DRAM sizing and layouts, the trace generator's shuffling, replay's
modelled time, and the trainer's schedule, resume and config checks: each test names what it pins.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from embstore import costmodel, tracegen, traces
from embstore.belady import dedup_batches
from embstore.cli import main
from embstore.errors import InvalidInputError
from embstore.simulator import miss_ratio_curve, table_keys
from embstore.tuning import home_index_bytes, tune


# --------------------------------------------------------------------------- cost model
COSTS = costmodel.CostModel(dram_ns_per_row=7.0, mmap_ns_per_row=300.0, ssd_iops={1: 1000.0, 8: 4000.0, 64: 16000.0},
                            rocksdb_us_per_row=3.0)


@pytest.mark.parametrize("kind, depth, ns", [
    ("dram", 64, 7.0), ("device", 64, 7.0), ("mmap", 64, 300.0), ("rocksdb", 64, 3000.0),
    ("ssd", 1, 1e6), ("ssd", 7, 1e6), ("ssd", 8, 2.5e5), ("ssd", 63, 2.5e5), ("ssd", 64, 62500.0),
    ("ssd", 1000, 62500.0), ("ssd", 0, 1e6),
])
def test_cost_per_row_of_each_tier(kind, depth, ns):
    """Each tier is costed by its own figure (rocksdb in µs), ssd by the deepest measured queue depth at or
    below the tier's own, the shallowest when none is."""
    assert COSTS.ns_per_row(kind, depth) == pytest.approx(ns)
    assert COSTS.batch_seconds({kind: 10}, depth) == pytest.approx(10 * ns * 1e-9)


def test_cost_of_an_unknown_tier_kind_is_an_error():
    """A typo in a tier kind is refused, not costed as some other tier."""
    with pytest.raises(InvalidInputError, match="unknown tier kind 'nvme'"):
        COSTS.ns_per_row("nvme")


def test_a_saved_calibration_without_the_measured_flag_counts_as_measured():
    """Files written before the flag existed hold measured figures."""
    d = COSTS.to_dict()
    del d["measured"]
    assert costmodel.CostModel.from_dict(d).measured is True
    assert costmodel.CostModel.from_dict(COSTS.to_dict()) == COSTS


# --------------------------------------------------------------------------- tuning
def _every_id_trace(rows: int = 200, batches: int = 12, per_batch: int = 150, tables: int = 2) -> traces.Trace:
    """Zipf lookups over ``rows`` ids per table, with every id in [0, rows) looked up at least once."""
    rng = np.random.default_rng(1)
    ids, tab = [], []
    for b in range(batches):
        for t in range(tables):
            x = np.minimum(rng.zipf(1.3, per_batch) - 1, rows - 1)
            if b == 0:
                x = np.concatenate([np.arange(rows), x])
            ids.append(x)
            tab.append(np.full(len(x), t, np.int32))
    sizes = [sum(len(ids[b * tables + t]) for t in range(tables)) for b in range(batches)]
    return traces.Trace(np.concatenate(ids).astype(np.int64), np.concatenate(tab),
                        np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def test_a_dram_cache_no_larger_than_the_device_cache_is_dropped():
    """The tiers are inclusive: a DRAM cache the size of the device cache above it adds no hit, only bytes."""
    res = tune(_every_id_trace(), 1 << 20, 1 << 20, row_bytes=16)
    assert all(p.device_rows == p.unique_rows for p in res.tables)  # the device holds every row
    assert all(p.dram_rows == 0 for p in res.tables)
    assert all(t.tiers[0].kind.value == "device" and len(t.tiers) == 2 for t in res.config().tables)


def test_whole_table_caches_keep_the_in_place_layout_and_partial_ones_take_the_log():
    """Evictions (the log layout's reason) happen only when the caches hold part of the table; the slot maps
    are taken while they fit in a quarter of the DRAM budget, that quarter included."""
    tr = _every_id_trace()
    whole = tune(tr, 1 << 20, row_bytes=256)
    assert all(p.dram_rows == p.max_id + 1 for p in whole.tables)
    assert {p.layout for p in whole.tables} == {"in_place"}
    maps = sum(home_index_bytes("ssd", "log", p.max_id + 1, 256) for p in whole.tables)
    for dram, layout in ((4 * maps, "log"), (4 * maps - 1, "in_place"), (4 * maps + 4096, "log")):
        part = tune(tr, dram, row_bytes=256)
        assert all(0 < p.dram_rows <= p.max_id for p in part.tables)
        assert {p.layout for p in part.tables} == {layout}, dram
        assert part.used_bytes()[1] <= dram


def test_the_device_cache_takes_the_policy_that_hits_most_at_its_size():
    """Per table, the policy configured for the device cache is the best one at the size chosen."""
    tr = traces.Trace(*_skewed(), ("a", "b"))
    pols = ("lru", "lfu", "clock", "lru+tinylfu")
    res = tune(tr, 1 << 20, 2 << 10, row_bytes=16, policies=pols)
    for t, p in enumerate(res.tables):
        assert 0 < p.device_rows < p.unique_rows
        k, o = dedup_batches(*table_keys(tr, t))
        hits = {pol: int(miss_ratio_curve(k, o, np.array([p.device_rows]), pol, dedup=False)[0]) for pol in pols}
        assert hits[p.device_policy] == max(hits.values()), (p.device_policy, hits)
        assert p.result.levels[0].hits == hits[p.device_policy]


def _skewed() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two tables whose best policy differs: a scan-polluted frequency mix and a recency-friendly one."""
    rng = np.random.default_rng(7)
    ids, tab, offs = [], [], [0]
    for b in range(30):
        hot = rng.integers(0, 40, 200)
        scan = np.arange(1000 + b * 150, 1000 + (b + 1) * 150)
        recent = rng.integers(b * 20, b * 20 + 120, 300)
        batch_ids = np.concatenate([hot, scan, recent])
        batch_tab = np.concatenate([np.zeros(350, np.int32), np.ones(300, np.int32)])
        ids.append(batch_ids)
        tab.append(batch_tab)
        offs.append(offs[-1] + len(batch_ids))
    return np.concatenate(ids).astype(np.int64), np.concatenate(tab), np.array(offs, np.int64)


def test_totals_and_bandwidth_follow_the_levels_and_the_cost_model():
    """Hit ratios per level (the DRAM level is the second when a device cache sits above it), modelled
    seconds per batch with the home's reads costed, and accesses per byte of each table's rows."""
    tr = _every_id_trace()
    res = tune(tr, 6 << 10, 2 << 10, row_bytes=256, cost=COSTS)
    assert any(p.device_rows and p.dram_rows for p in res.tables)
    acc = dev = dram = 0
    secs = 0.0
    for p in res.tables:
        lv = p.result.levels
        d = lv[0].hits if p.device_rows else 0
        m = lv[-1].hits if p.dram_rows else 0
        assert p.result.home_reads == p.accesses - d - m
        assert p.bandwidth_per_byte == pytest.approx(p.accesses / (p.unique_rows * 256))
        acc, dev, dram = acc + p.accesses, dev + d, dram + m
        secs += (d + m) * 7e-9 + p.result.home_reads * 62500e-9
    tot = res.totals()
    assert tot["accesses"] == acc and tot["device_hit_ratio"] == pytest.approx(dev / acc)
    assert tot["dram_hit_ratio"] == pytest.approx(dram / acc) and dram > 0
    assert tot["seconds_per_batch"] == pytest.approx(secs / tr.num_batches)
    assert tot["all_dram_seconds_per_batch"] == pytest.approx(acc * 7e-9 / tr.num_batches)


def test_tune_refuses_negative_ids():
    """No store table can look up a negative id: tuning such a trace is an error naming the table."""
    tr = traces.Trace(np.array([3, -1, 3], np.int64), np.zeros(3, np.int32), np.array([0, 1, 3]), ("neg",))
    with pytest.raises(InvalidInputError, match="table 'neg' has negative ids"):
        tune(tr, 1 << 20, row_bytes=16)


# --------------------------------------------------------------------------- trainer
def _train_cfg(tmp_path, edits: dict[str, str] = {}, **kw):
    """test_trainer's config shrunk to 32-sample batches, with text edits (old -> new) applied."""
    from test_trainer import config_text

    from embstore.training.trainer import TrainConfig

    text = config_text(**kw).replace("batch_size = 256", "batch_size = 32")
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return TrainConfig.from_toml(p)


@pytest.mark.slow  # three short training runs
def test_resume_in_a_later_epoch_equals_the_uninterrupted_run(tmp_path):
    """A run resumed in its second epoch continues at the right batch of that epoch."""
    from embstore.training.trainer import train

    cfg = _train_cfg(tmp_path, {"[schedule]": "[schedule]\nepochs = 2"}, batches=3, ckpt_every=2)
    full = train(cfg, tmp_path / "full", progress=False)
    assert full.step == 6
    part = train(cfg, tmp_path / "part", progress=False, stop_at=5)
    assert part.stopped_early and part.step == 5
    resumed = train(cfg, tmp_path / "part", resume=True, progress=False)
    assert resumed.resumed_from == 4 and resumed.step == 6
    np.testing.assert_array_equal(np.array(resumed.losses), np.array(full.losses))


def test_schedule_steps_stops_the_run(tmp_path):
    """``steps`` > 0 ends training after that many steps, before the epoch ends."""
    from embstore.training.trainer import train

    res = train(_train_cfg(tmp_path, batches=10, steps=4), tmp_path / "run", progress=False)
    assert res.step == 4 and len(res.losses) == 4 and [s for s, _ in res.evals] == [4]


def _criteo_line(i: int) -> str:
    dense = [str((i * 7 + j) % 5) for j in range(13)]
    cats = [format(i % 100, "x"), format((i * 3) % 400, "x"), format(i * 11, "x")]
    return "\t".join([str(i % 2), *dense, *cats]) + "\n"


@pytest.mark.parametrize("eval_max, eval_samples", [(0, 10), (2, 8)])
def test_one_process_criteo_keeps_its_last_partial_batch(tmp_path, eval_max, eval_samples):
    """One process trains on the last partial batch (only ranks must drop it); the evaluation reads the
    held-out file to its end, or its first ``eval_max_batches`` batches."""
    from embstore.training.trainer import train

    day = tmp_path / "day.tsv"
    day.write_text("".join(_criteo_line(i) for i in range(10)))
    cfg = _train_cfg(tmp_path, {'kind = "synthetic"': f'kind = "criteo"\ntrain_paths = ["{day}"]\n'
                                f'eval_paths = ["{day}"]\neval_max_batches = {eval_max}',
                                "batch_size = 32": "batch_size = 4"})
    res = train(cfg, tmp_path / "run", progress=False)
    assert res.step == 3 and res.malformed_lines == 0
    assert [s for s, _ in res.evals] == [3] and res.evals[0][1].samples == eval_samples


@pytest.mark.parametrize("edit, key", [
    ({"bag_max = 2": "bag_max = 0"}, "data.bag_max"),
    ({"bag_max = 2": "bag_max = 2\nbag_min = 3"}, "data.bag_min"),
    ({'kind = "synthetic"': 'kind = "criteo"\ntrain_paths = ["x.tsv"]\nholdout_every = 1'}, "data.holdout_every"),
    ({"sparse_lr = 0.1": "sparse_lr = 0"}, "schedule.sparse_lr"),
    ({"dense_lr = 0.05": "dense_lr = 0.0"}, "schedule.dense_lr"),
])
def test_config_errors_name_the_key_before_anything_is_written(tmp_path, edit, key):
    """Bag sizes, a criteo run with no held-out split and zero learning rates are refused while parsing,
    as ConfigErrors naming the key (bag sizes used to fail later, as an unnamed InvalidInputError)."""
    from embstore.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _train_cfg(tmp_path, edit)
    assert err.value.key == key


def test_resume_without_a_checkpoint_is_a_config_error(tmp_path):
    """--resume with nothing to resume from is refused, not a fresh run."""
    from embstore.errors import ConfigError
    from embstore.training.trainer import train

    with pytest.raises(ConfigError, match="no checkpoint") as err:
        train(_train_cfg(tmp_path, batches=2), tmp_path / "run", resume=True, progress=False)
    assert err.value.key == "resume" and not (tmp_path / "run" / "store").exists()


# --------------------------------------------------------------------------- replay CLI
def test_replay_json_costs_misses_at_the_home_per_batch_and_rounds_fractions_up_to_a_row(tmp_path, monkeypatch,
                                                                                          capsys):
    """replay's modelled time: hits at DRAM cost, misses at the --home tier's, per batch; bytes fetched are
    the misses' rows; a tiny fraction still gives a one-row cache."""
    saved = costmodel.save(COSTS, tmp_path / "costs.json")
    monkeypatch.setattr(costmodel, "DEFAULT_PATH", saved)
    tr = _every_id_trace()
    path = tmp_path / "t.npz"
    traces.save(tr, path)
    assert main(["replay", str(path), "--policy", "lru", "--capacity", "50,0.001", "--home", "rocksdb",
                 "--row-bytes", "16", "--json"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["capacity_rows"] for r in recs] == [50, 1]
    for r in recs:
        misses = r["accesses"] - r["hits"]
        assert r["bytes_fetched"] == misses * 16
        want = (r["hits"] * 7.0 + misses * 3000.0) * 1e-9 / tr.num_batches
        assert r["modelled_seconds_per_batch"] == pytest.approx(want)


def test_replay_per_table_refuses_negative_ids(tmp_path, capsys):
    """Per-table replay of a table with negative ids is a one-line error, as tune's is."""
    path = tmp_path / "neg.npz"
    traces.save(traces.Trace(np.array([3, -1, 3], np.int64), np.zeros(3, np.int32), np.array([0, 1, 3]), ("neg",)),
                path)
    assert main(["replay", str(path), "--per-table", "--capacity", "1"]) == 2
    assert "table 'neg' has negative ids" in capsys.readouterr().err


def test_each_rank_takes_its_own_slice_of_a_global_batch():
    """Distributed training: rank r's dense features and labels are samples [r * B/W, (r + 1) * B/W) of the
    global batch, so the ranks together see every sample once (rank 0's slice everywhere passed the
    two-process test, whose ranks then trained on the same samples)."""
    import torch

    from embstore.training.data import ClickBatch
    from embstore.training.distributed import DistContext
    from embstore.training.trainer import local_part

    b, world = 12, 3
    batch = ClickBatch(torch.arange(b * 2, dtype=torch.float32).reshape(b, 2), torch.arange(b, dtype=torch.float32),
                       [], [])
    parts = [local_part(batch, DistContext(r, world)) for r in range(world)]
    assert all(len(d) == len(y) == b // world for d, y in parts)
    assert torch.equal(torch.cat([d for d, _ in parts]), batch.dense)
    assert torch.equal(torch.cat([y for _, y in parts]), batch.labels)


def test_a_global_batch_that_does_not_split_over_the_ranks_is_a_config_error(tmp_path):
    """32 samples over 3 ranks cannot be split evenly: refused naming data.batch_size, over 2 and 4 accepted."""
    from embstore.errors import ConfigError
    from embstore.training.trainer import Batches

    cfg = _train_cfg(tmp_path)
    for world in (1, 2, 4):
        Batches(cfg, world)
    with pytest.raises(ConfigError, match="3 ranks") as err:
        Batches(cfg, 3)
    assert err.value.key == "data.batch_size"
