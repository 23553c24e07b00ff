"""`embstore train`: config parsing, learning a planted signal, resume == uninterrupted, metrics vs brute force."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embstore.errors import ConfigError
from embstore.training.metrics import auc, evaluate, log_loss, log_loss_logits, normalized_entropy
from embstore.training.distributed import DistContext
from embstore.training.trainer import TrainConfig, build_store, train

TIERS = '[{ kind = "dram", capacity = "8KiB", policy = "lru" }, { kind = "mmap" }]'


def config_text(*, shuffle: bool = False, batches: int = 120, eval_every: int = 0, ckpt_every: int = 0,
                steps: int = 0, extra_store: str = "", dtype: str = "float32", lookahead: int = 2,
                interaction: str = "dot", ckpt_store: str = "copy", sparse_opt: str = "rowwise_adagrad") -> str:
    return textwrap.dedent(f"""
        [data]
        kind = "synthetic"
        batch_size = 256
        train_batches = {batches}
        eval_batches = 16
        bag_max = 2
        shuffle_labels = {str(shuffle).lower()}
        [model]
        dense_arch = [16, 8]
        over_arch = [32, 1]
        interaction = "{interaction}"
        dcn_layers = 2
        dcn_low_rank = 4
        sparse_optimizer = "{sparse_opt}"
        [store]
        defaults = {{ dim = 8, dtype = "{dtype}", init = {{ kind = "uniform", scale = 0.05 }}, tiers = {TIERS} }}
        [[store.table]]
        name = "a"
        num_embeddings = 1000
        [[store.table]]
        name = "b"
        num_embeddings = 500
        [[store.table]]
        name = "c"
        num_embeddings = 300
        hash = {{ kind = "mod" }}
        {extra_store}
        [schedule]
        steps = {steps}
        eval_every = {eval_every}
        checkpoint_every = {ckpt_every}
        checkpoint_store = "{ckpt_store}"
        lookahead = {lookahead}
        dense_lr = 0.05
        sparse_lr = 0.1
        seed = 3
        """)


def load(tmp_path: Path, **kw) -> TrainConfig:
    p = tmp_path / "cfg.toml"
    p.write_text(config_text(**kw))
    return TrainConfig.from_toml(p)


def test_planted_signal_is_learned_and_shuffled_control_is_not(tmp_path):
    res = train(load(tmp_path), tmp_path / "run", progress=False)
    ctl = train(load(tmp_path, shuffle=True), tmp_path / "ctl", progress=False)
    auc_signal, auc_ctl = res.evals[-1][1].auc, ctl.evals[-1][1].auc
    print(f"one epoch: AUC {auc_signal:.3f} (planted signal) vs {auc_ctl:.3f} (shuffled labels)")
    assert auc_signal > 0.75
    assert auc_ctl < 0.55
    assert res.evals[-1][1].ne < 1.0
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["step"] == 120 and m["evals"][-1]["auc"] == pytest.approx(auc_signal)


def test_dcn_interaction_learns(tmp_path):
    res = train(load(tmp_path, interaction="dcn", batches=80), tmp_path / "run", progress=False)
    assert res.evals[-1][1].auc > 0.7


@pytest.mark.parametrize("ckpt_store", ["copy", "in_place"])
def test_resume_equals_uninterrupted(tmp_path, ckpt_store):
    cfg = load(tmp_path, batches=40, eval_every=10, ckpt_every=15, ckpt_store=ckpt_store)
    full = train(cfg, tmp_path / "full", progress=False)
    # killed after step 21 (past the checkpoint at 15: with "copy" the store has moved on since it)
    stop = 21 if ckpt_store == "copy" else 15
    part = train(cfg, tmp_path / "part", progress=False, stop_at=stop)
    assert part.stopped_early and part.step == stop
    resumed = train(cfg, tmp_path / "part", resume=True, progress=False)
    assert resumed.step == full.step == 40
    np.testing.assert_array_equal(np.array(resumed.losses), np.array(full.losses))
    assert [e.auc for _, e in resumed.evals] == [e.auc for _, e in full.evals]


def test_resume_with_quantised_rows(tmp_path):
    cfg = load(tmp_path, batches=30, ckpt_every=10, dtype="float16", sparse_opt="adam")
    full = train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "part", progress=False, stop_at=14)
    resumed = train(cfg, tmp_path / "part", resume=True, progress=False)
    np.testing.assert_array_equal(np.array(resumed.losses), np.array(full.losses))


def test_resuming_a_finished_run_says_so_and_trains_nothing(tmp_path, capsys, caplog):
    from types import SimpleNamespace

    from embstore.training.trainer import run_from_args

    cfg_path = tmp_path / "t.toml"
    cfg_path.write_text(config_text(batches=3))
    args = SimpleNamespace(config=str(cfg_path), out=str(tmp_path / "run"), resume=False, progress=False)
    assert run_from_args(args) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    args.resume = True
    with caplog.at_level("INFO", logger="embstore.training.trainer"):
        assert run_from_args(args) == 0
    assert "nothing to train: the run in" in capsys.readouterr().out
    assert any("resumed from" in r.message and "at step 3" in r.message for r in caplog.records)


def test_existing_store_needs_resume(tmp_path):
    cfg = load(tmp_path, batches=2)
    train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="--resume"):
        train(cfg, tmp_path / "run", progress=False)


@pytest.mark.parametrize("edit, key", [
    (("[schedule]", "[schedule]\nbogus = 1"), "schedule.bogus"),
    (('over_arch = [32, 1]', 'over_arch = [32, 2]'), "model.over_arch"),
    (('over_arch = [32, 1]', 'over_arch = "32-1"'), "model.over_arch"),
    (('kind = "synthetic"', 'kind = "parquet"'), "data.kind"),
    (('batch_size = 256', 'batch_size = true'), "data.batch_size"),
    (('num_embeddings = 1000', 'num_embeddings = 0'), "table.num_embeddings"),
    (('lookahead = 2', 'lookahead = -1'), "schedule.lookahead"),
    (('lookahead = 2', 'lookahead = 2\nannounce = -3'), "schedule.announce"),
    (('seed = 3', 'seed = -1'), "schedule.seed"),
    (('bag_max = 2', 'bag_max = 2\nzipf_alpha = nan'), "data.zipf_alpha"),
    (('bag_max = 2', 'bag_max = 2\nsignal = inf'), "data.signal"),
    (('bag_max = 2', 'bag_max = 2\nid_space = ["x", 5, 5]'), "data.id_space"),
    (('bag_max = 2', 'bag_max = 2\nid_space = [10.5, 5, 5]'), "data.id_space"),
    (('bag_max = 2', 'bag_max = 2\nid_space = [5000, 5, 5]'), "data.id_space"),  # "a" has 1000 rows, no hash
    (('bag_max = 2', 'bag_max = 2\nnum_dense = -2'), "data.num_dense"),
    (('bag_max = 2', 'bag_max = 2\neval_max_batches = -1'), "data.eval_max_batches"),
    (('bag_max = 2', 'bag_max = 2\ntrain_paths = [1]'), "data.train_paths"),
    (('dcn_layers = 2', 'dcn_layers = 0'), "model.dcn_layers"),
    (('dcn_low_rank = 4', 'dcn_low_rank = -1'), "model.dcn_low_rank"),
    (('dense_arch = [16, 8]', 'dense_arch = [16, 4]'), "model.dense_arch"),
])
def test_config_errors_name_the_key(tmp_path, edit, key):
    p = tmp_path / "cfg.toml"
    p.write_text(config_text().replace(*edit))
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_toml(p)
    assert err.value.key == key


def test_announcing_batches_to_the_store_trains_the_same_numbers(tmp_path):
    """schedule.announce tells the 8 KiB caches batches 3 beyond the look-ahead: only which rows stay cached
    changes, so the losses are those of a run told nothing, step for step."""
    plain = train(load(tmp_path, batches=30, eval_every=10), tmp_path / "plain", progress=False)
    p = tmp_path / "told.toml"
    p.write_text(config_text(batches=30, eval_every=10).replace("lookahead = 2", "lookahead = 2\nannounce = 3"))
    cfg = TrainConfig.from_toml(p)
    assert cfg.schedule.announce == 3
    told = train(cfg, tmp_path / "told", progress=False)
    assert told.losses == plain.losses and len(told.losses) == 30


def test_hashed_table_takes_any_id_space(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_text(config_text().replace("bag_max = 2", "bag_max = 2\nid_space = [1000, 500, 1_000_000_000]"))
    assert TrainConfig.from_toml(p).data.id_space == (1000, 500, 10**9)


def test_empty_held_out_split_is_a_config_error(tmp_path):
    """Criteo data whose every line is malformed leaves nothing to evaluate: a typed error, not torch.cat's."""
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n" * 7)
    text = config_text(batches=2).replace('kind = "synthetic"',
                                          f'kind = "criteo"\ntrain_paths = ["{bad}"]\nholdout_every = 3')
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(text)
    with pytest.raises(ConfigError, match="held-out split has no samples") as err:
        train(TrainConfig.from_toml(cfg_path), tmp_path / "out", progress=False)
    assert err.value.key == "data"


def test_example_configs_parse():
    root = Path(__file__).resolve().parents[1] / "examples"
    for name in ("train_synthetic.toml", "train_criteo.toml"):
        cfg = TrainConfig.from_dict(__import__("tomllib").loads((root / name).read_text()))
        assert cfg.store.tables


# --------------------------------------------------------------------------- metrics
def brute_auc(y: np.ndarray, s: np.ndarray) -> float:
    """P(score of a random positive > a random negative) + 0.5 P(tie), over all pairs."""
    pos, neg = s[y == 1], s[y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), min_size=2, max_size=40))
def test_auc_matches_pairwise_count_with_ties(pairs):
    y = np.array([p[0] for p in pairs], dtype=float)
    s = np.array([p[1] for p in pairs], dtype=float) / 5
    if y.min() == y.max():
        assert math.isnan(auc(y, s))
    else:
        assert auc(y, s) == pytest.approx(brute_auc(y, s))


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(-8, 8)), min_size=1, max_size=30))
def test_log_loss_and_ne_match_definitions(pairs):
    y = np.array([p[0] for p in pairs], dtype=float)
    z = np.array([p[1] for p in pairs])
    p = 1 / (1 + np.exp(-z))
    ref = -sum(math.log(pi) if yi else math.log(1 - pi) for yi, pi in zip(y, p)) / len(y)
    assert log_loss(y, p) == pytest.approx(ref, rel=1e-6, abs=1e-9)
    assert log_loss_logits(y, z) == pytest.approx(ref, rel=1e-6, abs=1e-9)
    rate = y.mean()
    if not 0 < rate < 1:  # one class: a base entropy of 0 leaves NE undefined (tests/test_train_consistency_audit.py)
        assert math.isnan(normalized_entropy(y, p)) and math.isnan(evaluate(y, z).ne)
        return
    h = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert normalized_entropy(y, p) == pytest.approx(ref / h, rel=1e-6)
    assert evaluate(y, z).log_loss == pytest.approx(ref, rel=1e-6, abs=1e-9)


def test_ne_of_base_rate_prediction_is_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0], dtype=float)
    assert normalized_entropy(y, np.full(8, 0.25)) == pytest.approx(1.0)
    assert auc(y, np.full(8, 0.25)) == 0.5


def test_train_verb_runs_a_config(tmp_path, capsys):
    import argparse

    from embstore.commands import train_cmds
    parser = argparse.ArgumentParser()
    train_cmds.register(parser.add_subparsers())
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(config_text(batches=6))
    args = parser.parse_args(["train", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "AUC" in out and "NE" in out and "trained 6 steps" in out


class SyncRecorder:
    """Records which files and folders are fsynced (by inode), and when ``latest`` is replaced: a power cut
    cannot be caused here, so the test checks the syscalls that make a checkpoint survive one."""

    def __init__(self, monkeypatch) -> None:
        self.synced: set[tuple[int, int]] = set()
        self.synced_before_latest: set[tuple[int, int]] | None = None
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            real_fsync(fd)
            st = os.fstat(fd)
            self.synced.add((st.st_dev, st.st_ino))

        def replace(src, dst, **kw) -> None:
            real_replace(src, dst, **kw)
            if Path(dst).name == "latest":
                self.synced_before_latest = set(self.synced)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


def tree_inodes(root: Path) -> dict[Path, tuple[int, int]]:
    """Every file and folder under ``root`` (itself included) by inode."""
    return {p: (p.stat().st_dev, p.stat().st_ino) for p in [root, *root.rglob("*")] if not p.is_symlink()}


def test_a_checkpoints_store_copy_is_durable_before_latest_names_it(tmp_path, monkeypatch):
    """Every file and folder of the checkpoint's store copy is fsynced before the ``latest`` marker moves
    to it (shutil.copytree syncs nothing: after a power cut ``latest`` could name a copy whose files are
    empty); a resume's copy back is durable too before training writes into it."""
    cfg = load(tmp_path, batches=6, ckpt_every=3)
    rec = SyncRecorder(monkeypatch)
    train(cfg, tmp_path / "out", progress=False, stop_at=3)
    copy = tree_inodes(tmp_path / "out" / "checkpoints" / "step_3" / "store")
    assert rec.synced_before_latest is not None
    assert [p for p, ino in copy.items() if ino not in rec.synced_before_latest] == []
    rec.synced.clear()
    store, path = build_store(cfg, tmp_path / "out", DistContext(), resume=True)
    try:
        assert [p for p, ino in tree_inodes(path).items() if ino not in rec.synced] == []
    finally:
        store.close()


def test_an_in_place_resume_past_its_checkpoint_warns_that_it_is_not_exact(tmp_path, caplog):
    """With ``checkpoint_store = "in_place"`` the store is the checkpoint: a run that went on training after
    its last checkpoint (killed at step 21, checkpoint at 15) left rows from step 21 under the step-15
    dense state. Resuming then cannot match the uninterrupted run, and must say so; a run stopped right at
    its checkpoint resumes exactly and silently."""
    cfg = load(tmp_path, batches=40, ckpt_every=15, ckpt_store="in_place")
    full = train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "went_on", progress=False, stop_at=21)
    with caplog.at_level("WARNING", logger="embstore.training.trainer"):
        train(cfg, tmp_path / "went_on", resume=True, progress=False)
    moved = [r.getMessage() for r in caplog.records if "not exact" in r.getMessage()]
    assert len(moved) == 1 and "step_15" in moved[0] and "copy" in moved[0]
    caplog.clear()
    train(cfg, tmp_path / "at_ckpt", progress=False, stop_at=15)
    with caplog.at_level("WARNING", logger="embstore.training.trainer"):
        resumed = train(cfg, tmp_path / "at_ckpt", resume=True, progress=False)
    assert not [r for r in caplog.records if "not exact" in r.getMessage()]
    np.testing.assert_array_equal(np.array(resumed.losses), np.array(full.losses))
