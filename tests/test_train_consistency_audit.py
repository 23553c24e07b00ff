"""Audit of the training run: what a crash leaves to serve, NE over one-class labels, absurd config sizes.

1. A SIGKILLed ``embstore train`` (a child process) must leave the store serving one consistent
   (model, rows) pair or no model with a clear error: never the dense layers of one run beside rows another
   run moved on, nor ``dense.pt`` of one save beside ``model.json`` of another.
2. Held-out labels of one class leave NE (and AUC) undefined: NaN, printed as such, and ``null`` in
   ``metrics.json``, which stays strict JSON.
3. Every bad number in the train TOML is one line naming its key, exit code 2, before a store is made;
   sizes too large for memory included.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import embstore
from embstore.cli import main
from embstore.errors import ConfigError, InvalidInputError
from embstore.training.metrics import evaluate, log_loss_logits, normalized_entropy
from embstore.training.registry import MODELS_DIR, list_models, load_model
from embstore.training.dlrm import DLRM
from embstore.training.trainer import TrainConfig, check_memory, dense_parameter_counts, train

CFG = """
[data]
kind = "synthetic"
batch_size = 32
train_batches = {batches}
eval_batches = 1
bag_max = 2
[model]
dense_arch = [8, 4]
over_arch = [8, 1]
[store]
defaults = {{ dim = 4, tiers = [{{ kind = "dram", capacity = "1KiB", policy = "lru" }}, {{ kind = "mmap" }}] }}
[[store.table]]
name = "a"
num_embeddings = 100
[[store.table]]
name = "b"
num_embeddings = 50
[schedule]
epochs = {epochs}
steps = {steps}
eval_every = {every}
checkpoint_every = {every}
checkpoint_store = "{mode}"
dense_lr = 0.05
sparse_lr = 0.1
seed = 1
"""


def write_cfg(tmp: Path, name: str = "cfg.toml", *, batches: int = 6, epochs: int = 1, steps: int = 4,
              every: int = 0, mode: str = "copy") -> Path:
    p = tmp / name
    p.write_text(CFG.format(batches=batches, epochs=epochs, steps=steps, every=every, mode=mode))
    return p


def rows(store_path: Path) -> dict[str, np.ndarray]:
    with embstore.open(store_path) as store:
        return {t: store[t].lookup(np.arange(n, dtype=np.int64)) for t, n in (("a", 100), ("b", 50))}


def dense_of(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "dense.pt", weights_only=True)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_rows(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def checkpoint_dense(run: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The latest checkpoint's folder and its dense parameters (what the trainer saves as dense.pt)."""
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    state = torch.load(ckpt / "rank0.pt", weights_only=True)
    return ckpt, {k: v for k, v in state["model"].items() if not k.startswith("sparse_arch.")}


def assert_no_model_clearly(store_path: Path) -> None:
    assert list_models(store_path) == []
    with embstore.open(store_path) as store, pytest.raises(InvalidInputError, match="no model 'dlrm'.*interrupted"):
        load_model(store, "dlrm")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run: (config, out, its model's dense.pt, its rows)."""
    root = tmp_path_factory.mktemp("reference")
    cfg = write_cfg(root)
    train(TrainConfig.from_toml(cfg), root / "run", progress=False)
    store = root / "run" / "store"
    assert list_models(store) == ["dlrm"]
    return cfg, root / "run", dense_of(store / MODELS_DIR / "dlrm"), rows(store)


# --------------------------------------------------------------------------- 1. crash consistency
RESUME_CHILD = textwrap.dedent("""
    import sys
    from embstore.training.trainer import TrainConfig, train
    train(TrainConfig.from_toml(sys.argv[1]), sys.argv[2], resume=True, progress=False)
""")


def kill_after_line(args: list[str], prefix: str) -> None:
    """Run a child, SIGKILL it once it printed a line starting with ``prefix``."""
    child = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"the child ended before printing {prefix!r}: {child.communicate()[1][-2000:]}")
            if line.startswith(prefix):
                break
        else:
            pytest.fail(f"no {prefix!r} line within 120 s")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.communicate()


@pytest.mark.parametrize("mode", ["in_place", "copy"])
def test_a_sigkill_while_a_run_trains_on_leaves_no_stale_model(tmp_path, mode):
    """Regression (in_place): a run resumed past a finished one moved the rows while the finished run's
    dense.pt stayed in STORE/models/dlrm; killed there, the store served those dense layers over rows they
    were not trained with, silently. Now the model is retired before the rows move: after the kill there is
    no model, with an error that says why, and resuming to the end saves one that is the last checkpoint's.
    (copy was already safe: the resume restores the checkpoint's copy, which never holds a model.)"""
    run, store = tmp_path / "run", tmp_path / "run" / "store"
    train(TrainConfig.from_toml(write_cfg(tmp_path, "first.toml", mode=mode)), run, progress=False)
    first_dense, first_rows = dense_of(store / MODELS_DIR / "dlrm"), rows(store)

    longer = write_cfg(tmp_path, "longer.toml", epochs=100_000, steps=0, every=1, mode=mode)
    kill_after_line([RESUME_CHILD, str(longer), str(run)], "step 7:")  # the step-6 checkpoint flushed its rows

    if list_models(store):  # whatever is served must be the pair saved together
        with embstore.open(store) as s:
            load_model(s, "dlrm")
        assert same_tensors(dense_of(store / MODELS_DIR / "dlrm"), first_dense)
        assert same_rows(rows(store), first_rows), "the first run's dense layers are served over moved rows"
    assert_no_model_clearly(store)

    res = train(TrainConfig.from_toml(write_cfg(tmp_path, "end.toml", epochs=2, steps=0, every=0, mode=mode)),
                run, resume=True, progress=False)
    assert res.step == 12 and list_models(store) == ["dlrm"]
    ckpt, want = checkpoint_dense(run)
    assert ckpt.name == "step_12" and same_tensors(dense_of(store / MODELS_DIR / "dlrm"), want)
    if mode == "copy":
        assert same_rows(rows(store), rows(ckpt / "store"))
    with embstore.open(store) as s:
        load_model(s, "dlrm")


SAVE_CHILD = textwrap.dedent("""
    import dataclasses, os, signal, sys, torch, embstore
    from embstore.training import registry
    store = embstore.open(sys.argv[1])
    model = registry.load_model(store, "dlrm")
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if not k.startswith("sparse_arch."):
                v.add_(1.0)
    spec = dataclasses.replace(model.spec, tables=tuple(reversed(model.spec.tables)))
    real = registry.atomic_write
    def dying(path, data):  # the crash: SIGKILL as model.json is about to be written
        if os.path.basename(path) == "model.json":
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)
    registry.atomic_write = dying
    registry.save_model(store.path, "dlrm", spec, model)
""")


def test_a_sigkill_between_a_saves_two_files_leaves_no_mixed_model(reference, tmp_path):
    """Regression: save_model replaced dense.pt, then model.json; killed between them, the model loaded with
    the new save's weights under the old save's model.json (here: the tables in another order, so every
    weight met the other table's bags), silently. Now model.json goes first and comes back last."""
    _, run, ref_dense, _ = reference
    store = tmp_path / "store"
    shutil.copytree(run / "store", store)
    old_spec = json.loads((store / MODELS_DIR / "dlrm" / "model.json").read_text())
    kill_after_line([SAVE_CHILD, str(store)], "dying")
    if list_models(store):  # the old pair or the new one, never a mix
        spec, dense = json.loads((store / MODELS_DIR / "dlrm" / "model.json").read_text()), dense_of(
            store / MODELS_DIR / "dlrm")
        if spec == old_spec:
            assert same_tensors(dense, ref_dense), "the old model.json is served with the new save's dense.pt"
        else:
            assert spec["tables"] == ["b", "a"]
            assert same_tensors(dense, {k: v + 1.0 for k, v in ref_dense.items()})
    assert_no_model_clearly(store)


TRAIN_CHILD = textwrap.dedent("""
    import os, signal, sys
    from embstore.training import registry
    from embstore.training.trainer import TrainConfig, train
    real = registry.atomic_file
    def dying(path):  # the crash: SIGKILL between the rows' flush and the model's first file
        if os.path.basename(path) == "dense.pt":
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path)
    registry.atomic_file = dying
    train(TrainConfig.from_toml(sys.argv[1]), sys.argv[2], progress=False)
""")


def test_a_sigkill_before_the_model_is_saved_leaves_the_rows_and_resume_saves_it(reference, tmp_path):
    """The rows are flushed before the model is written: killed in between, the store holds the finished
    run's rows and no model (a clear error), and ``--resume`` ("nothing to train") saves exactly the model
    of the uninterrupted run."""
    cfg, _, ref_dense, ref_rows = reference
    run = tmp_path / "run"
    kill_after_line([TRAIN_CHILD, str(cfg), str(run)], "dying")
    assert same_rows(rows(run / "store"), ref_rows)
    assert_no_model_clearly(run / "store")
    res = train(TrainConfig.from_toml(cfg), run, resume=True, progress=False)
    assert res.step == res.resumed_from == 4
    assert list_models(run / "store") == ["dlrm"]
    assert same_tensors(dense_of(run / "store" / MODELS_DIR / "dlrm"), ref_dense)
    assert same_rows(rows(run / "store"), ref_rows)


# --------------------------------------------------------------------------- 2. NE over one class
@settings(max_examples=60)
@given(st.sampled_from([0.0, 1.0]), st.lists(st.floats(-40, 40), min_size=1, max_size=40))
def test_ne_of_one_class_labels_is_nan_and_log_loss_is_still_defined(label, logits):
    """Regression: one class made the base entropy ~1.7e-6 (a clamped rate) and NE ~1e5 to 1e7, which read
    as a model far worse than guessing; it is undefined (NaN), as AUC is there."""
    y, z = np.full(len(logits), label), np.array(logits)
    ref = float(np.mean([math.log1p(math.exp(-x)) if label else math.log1p(math.exp(x)) for x in z]))
    ev = evaluate(y, z)
    assert math.isnan(ev.ne) and math.isnan(ev.auc)
    assert ev.log_loss == pytest.approx(ref, rel=1e-9, abs=1e-12) == log_loss_logits(y, z)
    assert math.isnan(normalized_entropy(y, 1 / (1 + np.exp(-z))))
    assert ev.ctr == label and ev.samples == len(y)


def _criteo_line(rng: np.random.Generator, label: int) -> str:
    dense = [str(int(x)) for x in rng.integers(0, 50, 13)]
    return "\t".join([str(label), *dense, *(format(int(x), "x") for x in rng.integers(0, 2**32, 2))]) + "\n"


def strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("label", [0, 1])
def test_a_run_whose_held_out_labels_are_one_class_says_ne_is_undefined(tmp_path, capsys, label):
    """Regression: the run printed 'AUC nan ... NE 408323.6862' and wrote NaN into metrics.json (Python's
    json.dumps does; strict JSON parsers refuse the file). Now the line says why AUC and NE are undefined,
    metrics.json holds null for them, the plot is drawn, and a resume reads the checkpoint back."""
    rng = np.random.default_rng(label)
    train_file, eval_file = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train_file.write_text("".join(_criteo_line(rng, i % 2) for i in range(96)))
    eval_file.write_text("".join(_criteo_line(rng, label) for _ in range(40)))
    text = CFG.format(batches=6, epochs=1, steps=0, every=0, mode="copy").replace(
        'kind = "synthetic"', f'kind = "criteo"\ntrain_paths = ["{train_file}"]\neval_paths = ["{eval_file}"]'
    ).replace("bag_max = 2\n", "").replace("train_batches = 6\n", "").replace("eval_batches = 1\n", "").replace(
        "defaults = { dim = 4,", 'defaults = { dim = 4, hash = { kind = "mod" },')
    cfg = tmp_path / "criteo.toml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "NE undefined: held-out labels are all one class" in printed
    assert "408323" not in printed and "nan" not in printed.lower()
    metrics = strict_json((out / "metrics.json").read_text())
    assert metrics["evals"] and all(e["ne"] is None and e["auc"] is None for e in metrics["evals"])
    assert all(math.isfinite(e["log_loss"]) and e["ctr"] == label for e in metrics["evals"])
    assert (out / "curves.png").stat().st_size > 1000
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", "--resume"]) == 0
    assert "nothing to train" in (again := capsys.readouterr().out) and "NE undefined" in again


# --------------------------------------------------------------------------- 3. absurd numbers
BASE = textwrap.dedent("""
    [data]
    kind = "synthetic"
    batch_size = 32
    train_batches = 2
    eval_batches = 1
    [model]
    dense_arch = [8, 4]
    over_arch = [8, 1]
    [store]
    defaults = { dim = 4, tiers = [{ kind = "dram", capacity = "1KiB", policy = "lru" }, { kind = "mmap" }] }
    [[store.table]]
    name = "a"
    num_embeddings = 100
    hash = { kind = "mod" }
    [schedule]
    seed = 1
    """)

BIG = 2**70
BAD = [  # (section, key = value lines, the key the error must name)
    *[("data", f"batch_size = {v}", "data.batch_size") for v in
      ("0", "-1", "1.5", '"x"', "true", "1e12", str(10**12), str(2**63), str(BIG))],
    ("data", "num_dense = 0", "data.num_dense"),
    ("data", f"num_dense = {10**12}", "data.num_dense"),
    ("data", f"num_dense = {2**30}", "data.num_dense"),  # with dense_arch [2**20, 4] below: 2**50 weights
    ("data", f"bag_max = {10**12}", "data.bag_max"),
    ("data", f"bag_max = {2**63}", "data.bag_max"),
    ("data", "bag_min = -1", "data.bag_min"),
    ("data", "train_batches = 0", "data.train_batches"),
    ("data", f"eval_batches = {10**13}", "data.eval_batches"),  # 5 PiB of held-out scores
    ("data", f"id_space = [{2**63}]", "data.id_space"),
    ("data", "zipf_alpha = nan", "data.zipf_alpha"),
    ("model", f"dense_arch = [{10**12}, 4]", "model.dense_arch"),
    ("model", f"dense_arch = [{2**31 - 1}, {2**31 - 1}, 4]", "model.dense_arch"),  # 2**62 weights
    ("model", "dense_arch = [" + ", ".join(["4"] * 1001) + "]", "model.dense_arch"),
    ("model", f"over_arch = [{10**11}, 1]", "model.over_arch"),
    ("model", 'interaction = "dcn"\ndcn_layers = 1000000000', "model.dcn_layers"),
    ("model", 'interaction = "dcn"\ndcn_layers = 0', "model.dcn_layers"),
    ("model", f'interaction = "dcn"\ndcn_low_rank = {10**12}', "model.dcn_low_rank"),
    ("model", 'interaction = "dcn"\ndcn_low_rank = -1', "model.dcn_low_rank"),
    ("schedule", "dense_lr = 1e308", "schedule.dense_lr"),
    ("schedule", "sparse_lr = 1e308", "schedule.sparse_lr"),
    ("schedule", "dense_lr = 0", "schedule.dense_lr"),
    ("schedule", "sparse_lr = inf", "schedule.sparse_lr"),
    ("schedule", "epochs = 0", "schedule.epochs"),
    ("schedule", "steps = -1", "schedule.steps"),
    ("schedule", "lookahead = -1", "schedule.lookahead"),
    ("schedule", f"seed = {2**64}", "schedule.seed"),
]


def with_line(section: str, line: str) -> str:
    """BASE with ``line`` in ``section``, the base's own value of each key it sets dropped (TOML refuses two)."""
    keys = {ln.split("=")[0].strip() for ln in line.splitlines()}
    text = "\n".join(ln for ln in BASE.splitlines() if ln.split("=")[0].strip() not in keys) + "\n"
    text = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    if line.startswith(f"num_dense = {2**30}"):
        text = text.replace("dense_arch = [8, 4]", f"dense_arch = [{2**20}, 4]")
    return text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("section,line,key", BAD, ids=[f"{k}={ln.split('=')[-1].strip()[:12]}" for _, ln, k in BAD])
def test_a_bad_number_is_one_line_naming_its_key_before_a_store_is_made(tmp_path, capsys, section, line, key):
    """Regression: batch_size = 10**12 created the store, then died of a MemoryError; 2**63 and bag_max =
    2**63 were numpy ValueError tracebacks; huge widths and num_dense were torch allocation tracebacks;
    dcn_layers = 10**9 and eval_batches = 10**13 ran for hours; id_space = [2**63] and the learning rates past
    float32 were errors that named no key (the lr one after the store was made)."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(with_line(section, line))
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if " WARNING " not in ln and " INFO " not in ln]
    assert len(err) == 1 and err[0].startswith("embstore train: error:"), err
    assert f"'{key}'" in err[0], err[0]
    assert not out.exists() or list(out.iterdir()) == []


def test_the_memory_check_names_the_largest_factor_and_passes_the_examples(tmp_path):
    """check_memory against a given machine size: a batch, the dense layers or the held-out pass larger than
    it is refused naming the factor that makes it so; the shipped example configs fit 4 GiB."""
    def cfg(**data: int) -> TrainConfig:
        p = tmp_path / "c.toml"
        p.write_text(with_line("data", "\n".join(f"{k} = {v}" for k, v in data.items())))
        return TrainConfig.from_toml(p)

    check_memory(cfg(batch_size=1_000_000), 13, ram=2**30)  # ~0.3 GiB a batch
    with pytest.raises(ConfigError, match="batch of 10,000,000 samples") as e:
        check_memory(cfg(batch_size=10_000_000), 13, ram=2**30)
    assert e.value.key == "data.batch_size"
    with pytest.raises(ConfigError) as e:
        check_memory(cfg(batch_size=64, bag_max=10_000_000), 13, ram=2**30)
    assert e.value.key == "data.bag_max"
    with pytest.raises(ConfigError, match="held-out batches") as e:
        check_memory(cfg(eval_batches=1_000_000), 13, ram=2**28)
    assert e.value.key == "data.eval_batches"
    with pytest.raises(ConfigError, match="dense layers hold") as e:
        check_memory(cfg(num_dense=100_000_000), 100_000_000, ram=2**30)
    assert e.value.key == "data.num_dense"
    root = Path(__file__).resolve().parent.parent / "examples"
    for example in sorted(root.glob("train_*.toml")):
        c = TrainConfig.from_toml(example)
        check_memory(c, c.data.num_dense if c.data.kind == "synthetic" else 13, ram=4 * 2**30)


@settings(max_examples=40)
@given(st.integers(1, 4), st.sampled_from([2, 4, 8]), st.integers(1, 20),
       st.lists(st.integers(1, 12), min_size=0, max_size=3), st.lists(st.integers(1, 12), min_size=0, max_size=3),
       st.sampled_from(["dot", "dcn"]), st.integers(1, 3), st.integers(0, 5))
def test_dense_parameter_counts_match_the_model_built(tables, dim, num_dense, bottom, top, interaction, layers, rank):
    """The memory check counts the dense parameters from the widths (torch's size arithmetic overflows on
    absurd ones): the counts equal those of the DLRM built on the meta device, group by group."""
    text = BASE.replace("dense_arch = [8, 4]", f"dense_arch = {[*bottom, dim]}").replace(
        "over_arch = [8, 1]", f'over_arch = {[*top, 1]}\ninteraction = "{interaction}"\ndcn_layers = {layers}\n'
                              f"dcn_low_rank = {rank}").replace("dim = 4", f"dim = {dim}")
    text += "".join(f'[[store.table]]\nname = "t{i}"\nnum_embeddings = 10\n' for i in range(tables - 1))
    cfg = TrainConfig.from_dict(tomllib.loads(text))
    with torch.device("meta"):
        model = DLRM(torch.nn.Module(), tables, dim, num_dense, [*bottom, dim], [*top, 1], interaction, layers, rank)
    built = {"dense_arch": 0, "interaction": 0, "over_arch": 0}
    for name, t in model.state_dict().items():
        built[{"inter_arch": "interaction"}.get(name.split(".")[0], name.split(".")[0])] += t.numel()
    assert dense_parameter_counts(cfg, num_dense) == built
