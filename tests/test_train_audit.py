"""Audit of `embstore train` end to end: metrics against their definitions, resume from every checkpoint,
a SIGKILL during a checkpoint or a restore, refused resumes that leave the live store alone, and data or
config that cannot train refused with a typed error before a store is made."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from embstore.cli import main
from embstore.errors import ConfigError, CorruptStoreError, EmbstoreError
from embstore.training.metrics import auc, evaluate, log_loss_logits
from embstore.training.trainer import TrainConfig, train

CFG = """
[data]
kind = "synthetic"
batch_size = 32
train_batches = 6
eval_batches = 1
bag_max = 2
[model]
dense_arch = [8, 4]
over_arch = [8, 1]
[store]
defaults = { dim = 4, tiers = [{ kind = "dram", capacity = "1KiB", policy = "lru" }, { kind = "mmap" }] }
[[store.table]]
name = "a"
num_embeddings = 100
[[store.table]]
name = "b"
num_embeddings = 50
[schedule]
checkpoint_every = 1
eval_every = 2
dense_lr = 0.05
sparse_lr = 0.1
seed = 1
"""


def write_cfg(tmp: Path, text: str = CFG, name: str = "cfg.toml") -> Path:
    p = tmp / name
    p.write_text(text)
    return p


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def same_run(a, b) -> None:
    np.testing.assert_array_equal(np.array(a.losses), np.array(b.losses))
    assert [(s, e.auc, e.log_loss, e.ne, e.samples) for s, e in a.evals] == \
           [(s, e.auc, e.log_loss, e.ne, e.samples) for s, e in b.evals]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted 6-step run with a checkpoint after every step: (config path, out, result)."""
    root = tmp_path_factory.mktemp("full")
    cfg = write_cfg(root)
    res = train(TrainConfig.from_toml(cfg), root / "run", progress=False)
    assert res.step == 6 and [s for s, _ in res.evals] == [2, 4, 6]
    return cfg, root / "run", res


# --------------------------------------------------------------------------- metrics
def brute_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def ref_log_loss(y: np.ndarray, z: np.ndarray) -> float:
    """-log sigmoid(z) for a click, -log(1 - sigmoid(z)) = -log sigmoid(-z) otherwise, one sample at a time."""
    def softplus(x: float) -> float:  # log(1 + e^x) without overflow
        return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))
    return sum(softplus(-zi) if yi else softplus(zi) for yi, zi in zip(y, z)) / len(y)


def test_evaluate_ranks_saturated_logits_apart():
    """Regression: evaluate() took the AUC of sigmoid(logits) in float64, which is exactly 1.0 for every
    logit above ~37 (and 0.0 below ~-745, with an overflow warning): distinct logits became ties."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        n = int(rng.integers(2, 40))
        y = rng.integers(0, 2, n).astype(np.float64)
        y[:2] = (0, 1)
        z = rng.choice([-800.0, -750.0, -3.0, 0.0, 0.0, 2.5, 38.0, 40.0, 60.0], n).astype(np.float32)
        ev = evaluate(y, z)
        assert ev.auc == pytest.approx(brute_auc(y, z.astype(np.float64)), abs=1e-12)
        assert ev.log_loss == pytest.approx(ref_log_loss(y, z.astype(np.float64)), rel=1e-9)
    with np.errstate(over="raise"):
        evaluate(np.array([0.0, 1.0]), np.array([-1000.0, 1000.0]))


def test_log_loss_of_infinite_logits_is_their_limit():
    """Regression: softplus(z) - y * z was inf - inf = NaN for a click with logit +inf (loss 0)."""
    y = np.array([0.0, 1.0, 0.0, 1.0])
    z = np.array([-np.inf, np.inf, 2.0, -3.0])
    assert log_loss_logits(y, z) == pytest.approx(ref_log_loss(y[2:], z[2:]) / 2)
    assert log_loss_logits(np.array([1.0]), np.array([-np.inf])) == math.inf
    assert evaluate(y, z).auc == brute_auc(y, z)


def test_a_nan_score_gives_no_auc():
    """Regression: argsort put NaN scores last and auc() returned a number (0.5 here)."""
    with np.errstate(invalid="ignore"):
        assert math.isnan(auc(np.array([0.0, 1.0, 0.0, 1.0]), np.array([np.nan, 1.0, 2.0, np.nan])))


# --------------------------------------------------------------------------- resume
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_resume_from_any_checkpoint_repeats_the_uninterrupted_run(full, tmp_path, k):
    """The run went on to step 6; resuming from step_k (its store a copy from step k) repeats steps k+1..6
    and their evaluations bit for bit."""
    cfg, out, res = full
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "checkpoints" / "latest").write_text(f"step_{k}")
    resumed = train(TrainConfig.from_toml(cfg), run, resume=True, progress=False)
    assert resumed.resumed_from == k
    same_run(resumed, res)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".store")]  # nothing set aside is left


KILLER = textwrap.dedent("""
    import os, signal, sys, shutil
    from pathlib import Path
    import embstore.atomic, embstore.training.trainer as tr
    where, step = sys.argv[3], int(sys.argv[4])
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    real_copy, real_write, real_open = tr.copy_tree_durably, tr.atomic_write, tr.embstore.open
    def copy(src, dst):
        if where == "copy" and Path(dst).parent.name == f"step_{step}":
            shutil.copytree(src, dst)  # a whole copy, but nothing synced, and no state file yet
            die()
        if where == "restore" and "checkpoints" not in str(dst):
            shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n == "rows.bin"])
            die()  # the live store set aside, a partial copy in its place
        real_copy(src, dst)
    def write(path, data):
        if where == "latest" and Path(path).name == "latest" and data == f"step_{step}".encode():
            die()  # step_N complete, latest still names the one before
        real_write(path, data)
    tr.copy_tree_durably, tr.atomic_write = copy, write
    tr.train(tr.TrainConfig.from_toml(sys.argv[1]), sys.argv[2], resume=where == "restore", progress=False)
    """)


@pytest.mark.parametrize("where", ["copy", "latest"])
def test_a_sigkill_during_a_checkpoint_leaves_the_previous_one_to_resume(full, tmp_path, where):
    cfg, _, res = full
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(cfg), str(run), where, "4"], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert (run / "checkpoints" / "latest").read_text() == "step_3"
    resumed = train(TrainConfig.from_toml(cfg), run, resume=True, progress=False)
    assert resumed.resumed_from == 3
    same_run(resumed, res)


def test_a_sigkill_during_a_resumes_restore_is_resumed_again(full, tmp_path):
    """A resume killed while copying the checkpoint's store into place: the next resume restores it again
    (and a refused one would have put the live store back)."""
    cfg, out, res = full
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "checkpoints" / "latest").write_text("step_2")
    live = tree(run / "store")
    proc = subprocess.run([sys.executable, "-c", KILLER, str(cfg), str(run), "restore", "0"], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert tree(run / ".store.before_resume") == live
    resumed = train(TrainConfig.from_toml(cfg), run, resume=True, progress=False)
    same_run(resumed, res)
    assert not (run / ".store.before_resume").exists()


# --------------------------------------------------------------------------- refused resumes
def _foreign(cfg: Path) -> str:
    return cfg.read_text().replace("dense_arch = [8, 4]", "dense_arch = [16, 4]")


def _renamed(cfg: Path) -> str:
    return cfg.read_text().replace('name = "b"', 'name = "z"')


def _cut_rows(run: Path) -> None:
    (run / "checkpoints" / "step_6" / "store" / "tables" / "a" / "home" / "rows.bin").write_bytes(b"x")


def _no_manifest(run: Path) -> None:
    (run / "checkpoints" / "step_6" / "store" / "manifest.json").unlink()


@pytest.mark.parametrize("config, damage, names", [
    (_foreign, None, "step_6/rank0.pt"),
    (_renamed, None, "'z'"),
    (None, _cut_rows, "step_6/store"),
    (None, _no_manifest, "step_6/store"),
])
def test_a_refused_resume_leaves_the_live_store_alone(full, tmp_path, capsys, config, damage, names):
    """Regression: the live store was deleted and replaced by the checkpoint's copy before that copy was
    opened and before the checkpoint's state was fitted to the model, so a checkpoint of another config, or
    one whose store copy is damaged, was refused only after the live store was gone (for a damaged copy,
    with an error naming the live store's files)."""
    cfg, out, _ = full
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "checkpoints" / "latest").write_text("step_6")
    cfg = write_cfg(tmp_path, config(cfg)) if config else cfg
    if damage:
        damage(run)
    (run / "store" / "marker").write_text("the live store")  # differs from every checkpoint's copy
    before = tree(run / "store")
    with pytest.raises(EmbstoreError) as err:
        train(TrainConfig.from_toml(cfg), run, resume=True, progress=False)
    assert names in str(err.value)
    if damage:
        assert isinstance(err.value, CorruptStoreError) and f"{run}/store/" not in str(err.value)
    assert tree(run / "store") == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "curves.png", "metrics.json", "store"]
    rc = main(["train", str(cfg), "--out", str(run), "--resume", "--no-progress"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " INFO " not in ln]
    assert rc == 2 and len(lines) == 1 and names in lines[0]
    assert tree(run / "store") == before


# --------------------------------------------------------------------------- data and config
CRITEO = CFG.replace('kind = "synthetic"', 'kind = "criteo"\ntrain_paths = ["TRAIN"]\neval_paths = ["EVAL"]') \
            .replace("bag_max = 2\n", "").replace(
                'defaults = { dim = 4,', 'defaults = { dim = 4, hash = { kind = "mod" },')


def _line(rng: np.random.Generator, label: str = "1") -> str:
    dense = [str(int(x)) for x in rng.integers(0, 50, 13)]
    return "\t".join([label, *dense, *(format(int(x), "x") for x in rng.integers(0, 2**32, 2))]) + "\n"


@pytest.mark.parametrize("body", [
    "",  # empty
    "\n\n",  # blank lines only
    "1\t2\t3\n" * 5,  # wrong column count
    "LABEL2",  # labels outside {0, 1}
    "DENSEX",  # non-numeric dense fields
    "BIGID",  # a categorical token beyond int64 (17 hex digits)
])
def test_training_data_without_a_sample_is_refused_before_a_store_is_made(tmp_path, capsys, body):
    """Regression: an empty or all-malformed train file 'trained 0 steps', wrote a checkpoint and a model,
    and exited 0."""
    rng = np.random.default_rng(0)
    good = tmp_path / "good.tsv"
    good.write_text("".join(_line(rng, str(i % 2)) for i in range(40)))
    if body == "LABEL2":
        body = "".join(_line(rng, "2") for _ in range(5))
    elif body == "DENSEX":
        body = "".join("\t".join(["1", "x", *_line(rng).split("\t")[2:]]) for _ in range(5))
    elif body == "BIGID":
        body = "".join("\t".join([*_line(rng).split("\t")[:14], "1" * 17, "ff"]) + "\n" for _ in range(5))
    bad = tmp_path / "bad.tsv"
    bad.write_text(body)
    cfg = write_cfg(tmp_path, CRITEO.replace("TRAIN", str(bad)).replace("EVAL", str(good)))
    with pytest.raises(ConfigError, match="training split has no samples") as err:
        train(TrainConfig.from_toml(cfg), tmp_path / "out", progress=False)
    assert err.value.key == "data.train_paths"
    assert list((tmp_path / "out").iterdir()) == []  # no store left that would need --resume or a new --out
    assert main(["train", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if " WARNING " not in ln]
    assert len(err_lines) == 1 and "training split has no samples" in err_lines[0]
    # the same file as held-out data: refused before training, not after it
    cfg = write_cfg(tmp_path, CRITEO.replace("TRAIN", str(good)).replace("EVAL", str(bad)), "held.toml")
    with pytest.raises(ConfigError, match="held-out split has no samples"):
        train(TrainConfig.from_toml(cfg), tmp_path / "out2", progress=False)
    assert list((tmp_path / "out2").iterdir()) == []


@pytest.mark.parametrize("seed, ok", [(2**44, True), (2**63 - 1, True), (2**64 - 1, True), (2**64, False),
                                      (10**23, False)])
def test_a_large_seed_trains_or_is_refused_by_name(tmp_path, seed, ok):
    """Regression: a seed above ~2**44 overflowed the synthetic data's salt (OverflowError traceback), one
    above 2**64 - 1 torch.manual_seed (ValueError traceback)."""
    cfg = write_cfg(tmp_path, CFG.replace("seed = 1", f"seed = {seed}").replace("train_batches = 6",
                                                                               "train_batches = 1"))
    if not ok:
        with pytest.raises(ConfigError) as err:
            TrainConfig.from_toml(cfg)
        assert err.value.key == "schedule.seed"
        return
    res = train(TrainConfig.from_toml(cfg), tmp_path / "out", progress=False)
    assert res.step == 1 and math.isfinite(res.losses[0])
