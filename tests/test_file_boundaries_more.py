"""More bad files at embstore's boundaries (the rest of ``test_file_boundaries.py``'s audit).

* A torch file (Meta trace, kept model, checkpoint) must pass its zip CRC-32s: torch.load does not check.
* A kept model's ``model.json`` / ``dense.pt`` is checked, types, bounds and shapes, before anything is
  built from it: a damaged width is a ``CorruptStoreError`` naming the file, never an allocation of that
  size, a torch traceback or a changed store; a server starts and reloads around it.
* Output files (training curves and metrics, ``bench --json``, ``eval_hashing --json``) are replaced
  atomically: a full disk (a real one, a tiny tmpfs) leaves the previous file whole.
* A gzipped Meta trace inflates only so far (a gzip bomb cannot fill the temporary folder), and a
  temporary folder too small for a real trace says so, not "corrupt trace".
* A FIFO, a directory or a device named as an input file is a typed error naming it, not a hang.
* CSV traces take ASCII decimal integers only, and every error names its line.
"""

from __future__ import annotations

import errno
import gzip
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import embstore
from embstore import costmodel, traces
from embstore.bulk import import_rows, open_npy
from embstore.cli import main
from embstore.config import StoreConfig
from embstore.errors import ConfigError, CorruptStoreError, InvalidInputError
from embstore.hashing import LearnedHash
from embstore.hashing._format import read_arrays
from embstore.server.app import create_app
from embstore.server.settings import ServerSettings
from embstore.server.testing import ServerThread
from embstore.training.registry import load_model
from embstore.training.trainer import EvalResult, TrainConfig, TrainResult, plot_curves, train
from faultfs import needs_mount
from test_cli import store_path  # noqa: F401 (a fixture)
from test_file_boundaries import TRAIN, cli_fails, run, trained  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers
def fill(folder: Path) -> None:
    """Fill the file system holding ``folder`` to the last byte (a real ENOSPC for the next write)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        while True:  # the last page or so that a 4 KiB write no longer fitted
            try:
                if not f.write(b"\0"):
                    break
            except OSError:
                break


def returns_within(fn: Callable[[], Any], fifo: Path | None = None, seconds: float = 30.0) -> Any:
    """``fn()`` run in a thread: what it returns, or what it raises. A call still blocked after ``seconds``
    (a loader stuck in ``open()`` of a FIFO) fails the test instead of hanging the suite; the FIFO's
    write end is opened meanwhile so that the stuck thread gets EOF and ends."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test's thread below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for _ in range(500):  # it may open the FIFO again after each EOF
            if fifo is not None:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: no reader at this instant
                    pass
            thread.join(0.01)
            if not thread.is_alive():
                break
        pytest.fail(f"blocked for over {seconds} s (on {fifo})")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


# --------------------------------------------------------------------------- kept models (registry)
@pytest.fixture()
def model_dir(run) -> tuple[Path, Path, dict]:
    """(store, its models/dlrm folder, model.json's contents) of a private copy of a trained run."""
    _, out, _ = run
    folder = out / "store" / "models" / "dlrm"
    return out / "store", folder, json.loads((folder / "model.json").read_text())


def _state(store: Path) -> bytes:
    """The store's manifest (tables and their layouts): what loading a model must not change."""
    return (store / "manifest.json").read_bytes()


def _load_fails(store: Path, names: Path, match: str) -> str:
    before = _state(store)
    with embstore.open(store) as s, pytest.raises(CorruptStoreError) as e:
        load_model(s, "dlrm")
    assert str(names) in str(e.value) and re.search(match, str(e.value)), str(e.value)
    assert _state(store) == before
    return str(e.value)


@pytest.mark.parametrize("change, names, says", [
    ({"dense_arch": [10**9, 4]}, "dense.pt", "widths need"),  # was a 52 GB allocation: a RuntimeError
    ({"over_arch": [2**31 - 1, 1]}, "dense.pt", "widths need"),
    ({"dense_arch": [10**12, 4]}, "model.json", "dense_arch must be an integer from 1 to"),
    ({"embedding_dim": 10**12, "dense_arch": [8, 10**12]}, "model.json", "embedding_dim must be an integer"),
    ({"dense_arch": [2**70, 4]}, "model.json", "dense_arch must be an integer"),  # past int64: torch's overflow
    ({"dense_arch": [6, 4]}, "dense.pt", r"shape \(8, \d+\), but model.json's widths need \(6, \d+\)"),
    ({"dense_arch": [0, 4]}, "model.json", "dense_arch must be an integer from 1"),
    ({"dense_arch": [-8, 4]}, "model.json", "dense_arch must be an integer from 1"),
    ({"dense_arch": ["8", 4]}, "model.json", "dense_arch must be an integer"),
    ({"dense_arch": [8.0, 4]}, "model.json", "dense_arch must be an integer"),
    ({"dense_arch": [True, 4]}, "model.json", "dense_arch must be an integer"),
    ({"dense_arch": 8}, "model.json", "dense_arch must be a non-empty list"),
    ({"dense_arch": []}, "model.json", "dense_arch must be a non-empty list"),
    ({"dense_arch": [8, 5]}, "model.json", "must end in the embedding dim"),
    ({"over_arch": [8, 2]}, "model.json", "must end in 1"),
    ({"dense_in_features": 0}, "model.json", "dense_in_features must be an integer from 1"),
    ({"dense_in_features": 14}, "dense.pt", "widths need"),
    ({"embedding_dim": 8, "dense_arch": [8, 8]}, "dense.pt", "widths need"),
    ({"interaction": "cross"}, "model.json", "interaction must be"),
    ({"interaction": "dcn"}, "dense.pt", "missing"),
    ({"dcn_layers": 0}, "model.json", "dcn_layers must be an integer from 1"),
    ({"dcn_low_rank": -1}, "model.json", "dcn_low_rank must be an integer from 0"),
    ({"sparse_optimizer": "lion"}, "model.json", "sparse_optimizer must be one of"),
    ({"tables": []}, "model.json", "tables must be"),
    ({"tables": ["a", "a"]}, "model.json", "tables must be"),
    ({"tables": [7]}, "model.json", "tables must be"),
    ({"tables": ["nope"]}, "model.json", "names table 'nope', which the store lacks"),
    ({"over_arch": None}, "model.json", "over_arch must be a non-empty list"),
    ({"layers": 3}, "model.json", r"unknown key\(s\) \['layers'\]"),
])
def test_a_damaged_model_json_is_corrupt_naming_the_file_before_anything_is_built(model_dir, change, names, says):
    """Regression: the DLRM was built from model.json's widths before any check: 10**12 was a huge
    allocation (a RuntimeError, or with a smaller width gigabytes filled and initialised before the shape
    check), 0, -8 and "8" were InvalidInputErrors from the layer builder, a width past int64 an overflow
    from torch."""
    store, folder, spec = model_dir
    (folder / "model.json").write_text(json.dumps({**spec, **change}))
    _load_fails(store, folder / names, says)


@pytest.mark.parametrize("text, says", [
    ("", "cannot be read"), ("[]", "JSON list, not an object"), ("{", "cannot be read"),
    ("[" * 100_000 + "]" * 100_000, "cannot be read: RecursionError"),
    (b"{\xff}", "cannot be read: UnicodeDecodeError"), ('{"tables": ["a"]}', r"lacks the key\(s\)"),
], ids=["empty", "list", "cut", "deep", "latin1", "partial"])
def test_an_unreadable_model_json_is_corrupt_naming_it(model_dir, text, says):
    store, folder, _ = model_dir
    (folder / "model.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    _load_fails(store, folder / "model.json", says)


def test_a_missing_key_of_model_json_is_named(model_dir):
    store, folder, spec = model_dir
    del spec["over_arch"]
    (folder / "model.json").write_text(json.dumps(spec))
    _load_fails(store, folder / "model.json", r"lacks the key\(s\) \['over_arch'\]")


@pytest.mark.parametrize("damage, says", [
    (lambda d: {**d, "extra.weight": torch.zeros(2)}, "unexpected"),
    (lambda d: {k: v for k, v in list(d.items())[1:]}, "missing"),
    (lambda d: {k: v.to(torch.int64) for k, v in d.items()}, "not a dense floating-point"),
    (lambda d: {k: v.to_sparse() if v.ndim == 2 else v for k, v in d.items()}, "not a dense floating-point"),
    (lambda d: list(d.values()), "not a dict of named tensors"),
    (lambda d: {k: 1.0 for k in d}, "not a dict of named tensors"),
])
def test_a_dense_pt_that_does_not_match_model_json_is_corrupt(model_dir, damage, says):
    store, folder, _ = model_dir
    dense = torch.load(folder / "dense.pt", weights_only=True)
    torch.save(damage(dense), folder / "dense.pt")
    _load_fails(store, folder / "dense.pt", says)


def test_a_feasible_but_wrong_width_is_refused_without_allocating_it(model_dir):
    """A width that fits in memory but is not what dense.pt holds (here 4 GiB of weights) is refused from
    the shapes alone: the child process may not map another 1 GiB, so building the layer first fails."""
    store, folder, spec = model_dir
    spec["dense_arch"] = [2**28 // spec["dense_in_features"] * 4, 4]
    (folder / "model.json").write_text(json.dumps(spec))
    code = f"""
import resource, sys
import embstore
from embstore.errors import CorruptStoreError
from embstore.training.registry import load_model
s = embstore.open({str(store)!r})
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
soft = vm + (1 << 30) if hard == resource.RLIM_INFINITY else min(vm + (1 << 30), hard)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
try:
    load_model(s, "dlrm")
except CorruptStoreError as exc:
    print("refused:", exc)
    sys.exit(0)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "refused:" in proc.stdout and "widths need" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("which", ["model.json", "dense.pt"])
def test_a_fifo_as_a_model_file_is_refused_not_waited_on(model_dir, which):
    store, folder, _ = model_dir
    fifo = fifo_at(folder / which)
    with embstore.open(store) as s, pytest.raises(CorruptStoreError, match="FIFO") as e:
        returns_within(lambda: load_model(s, "dlrm"), fifo)
    assert str(fifo) in str(e.value)


def _predict_body(spec: dict) -> dict:
    return {"dense": [[0.5] * spec["dense_in_features"]], "sparse": {t: [[1, 2]] for t in spec["tables"]}}


def test_a_server_starts_and_reloads_around_a_damaged_model(model_dir, caplog):
    """`serve` and `/v1/admin/reload` with a damaged model.json: the model answers 503 with the one-line
    reason naming the file, the store is served, and the log holds no traceback."""
    store, folder, spec = model_dir
    good = (folder / "model.json").read_text()
    (folder / "model.json").write_text(json.dumps({**spec, "dense_arch": [10**9, spec["embedding_dim"]]}))
    with caplog.at_level("ERROR"), ServerThread(create_app(ServerSettings(store=store))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        resp = http.post("/v1/models/dlrm/predict", json=_predict_body(spec))
        assert resp.status_code == 503, resp.text
        assert "CorruptStoreError" in resp.text and "dense.pt" in resp.text and "widths need" in resp.text
        assert http.get("/v1/tables/a").status_code == 200  # the store is served
        (folder / "model.json").write_text(good)
        assert http.post("/v1/admin/reload").status_code == 200
        assert http.post("/v1/models/dlrm/predict", json=_predict_body(spec)).status_code == 200
        (folder / "model.json").write_text(json.dumps({**spec, "over_arch": ["8", 1]}))
        assert http.post("/v1/admin/reload").status_code == 200
        resp = http.post("/v1/models/dlrm/predict", json=_predict_body(spec))
        assert resp.status_code == 503 and "model.json" in resp.text and "over_arch" in resp.text, resp.text
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert any("model.json" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- torch files' CRCs
def flip_bit_in(path: Path, data: bytes) -> None:
    """Flip the lowest bit of the first byte of ``data`` (a tensor's bytes) where it lies in ``path``."""
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    assert at >= 0 and raw.find(data, at + 1) < 0
    raw[at] ^= 1
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_a_meta_traces_tensor_is_corrupt_not_another_trace(tmp_path, capsys):
    """Regression (found by test_file_boundaries' bit-flip test): torch.load does not check the zip's
    CRC-32s, so a flipped bit in the ids loaded as a trace with id 0 where the file said 1."""
    p = tmp_path / "t.pt"
    torch.save((torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3, 3, 4]), torch.tensor([[1, 2], [0, 1]])), p)
    flip_bit_in(p, np.array([1, 2, 3, 4], "<i8").tobytes())
    with pytest.raises(CorruptStoreError, match="fails its CRC-32 check"):
        traces.load(p)
    cli_fails(capsys, ["trace", "stats", p], p)
    gz = tmp_path / "t.pt.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    with pytest.raises(CorruptStoreError, match=r"\(gzipped\): member .* fails its CRC-32 check"):
        traces.load(gz)


def _first_weight(state: dict) -> bytes:
    return next(v for v in state.values() if isinstance(v, torch.Tensor) and v.ndim == 2).numpy().tobytes()


def test_a_flipped_bit_in_a_kept_models_weights_is_corrupt_not_another_model(model_dir):
    """Regression: a flipped bit in dense.pt loaded as a model with one weight changed, silently."""
    store, folder, _ = model_dir
    flip_bit_in(folder / "dense.pt", _first_weight(torch.load(folder / "dense.pt", weights_only=True)))
    _load_fails(store, folder / "dense.pt", "fails its CRC-32 check")


def test_a_flipped_bit_in_a_checkpoints_weights_is_corrupt_not_another_model(run, capsys):
    """Regression: a flipped bit in a checkpoint resumed training from a weight that was never trained."""
    cfg, out, pt = run
    flip_bit_in(pt, _first_weight(torch.load(pt, weights_only=True)["model"]))
    with pytest.raises(CorruptStoreError, match="fails its CRC-32 check") as e:
        train(TrainConfig.from_toml(cfg), out, resume=True, progress=False)
    assert str(pt) in str(e.value)
    cli_fails(capsys, ["train", cfg, "--out", out, "--resume", "--no-progress"], pt)


# --------------------------------------------------------------------------- outputs on a full disk
# Each previous file is one page: a writer that truncates it first frees that page, so the new contents
# (larger here) are what no longer fit; written atomically, the previous file stays as it was.
PREVIOUS = b'{"previous": 1}'


def _result() -> TrainResult:
    ev = EvalResult(auc=0.6, log_loss=0.5, ne=0.9, ctr=0.2, samples=100)
    return TrainResult(step=40, losses=list(np.linspace(0.7, 0.4, 40)), evals=[(20, ev), (40, ev)])


@needs_mount
def test_training_curves_on_a_full_disk_keep_the_previous_png(tiny_tmpfs, tmp_path):
    """Regression: ``fig.savefig(path)`` drew into the target, so a full disk left a truncated curves.png."""
    plot_curves(_result(), tmp_path / "curves.png")
    new = (tmp_path / "curves.png").read_bytes()
    assert new.startswith(b"\x89PNG") and len(new) > 8192
    png = tiny_tmpfs.path / "curves.png"
    png.write_bytes(PREVIOUS)
    fill(tiny_tmpfs.path)
    with pytest.raises(OSError) as e:
        plot_curves(_result(), png)
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tiny_tmpfs.path.iterdir()) == ["curves.png", "filler"]  # no temp file
    assert png.read_bytes() == PREVIOUS


# test_file_boundaries's run, 30 steps long with an evaluation at each (and no checkpoints)
LONG_TRAIN = (TRAIN.replace("train_batches = 2", "train_batches = 30").replace("eval_every = 2", "eval_every = 1")
              .replace("checkpoint_every = 1", "checkpoint_every = 0"))


@needs_mount
def test_training_metrics_on_a_full_disk_keep_the_previous_file(tiny_tmpfs, tmp_path, monkeypatch):
    """Regression: metrics.json was opened with "w" (truncated), then written: a disk that was full by the
    end of a run left it cut short. The disk here fills right after the model is saved; 30 evaluations
    make metrics.json over a page."""
    from embstore.training import trainer

    cfg = tmp_path / "t.toml"
    cfg.write_text(LONG_TRAIN)
    out = tiny_tmpfs.path / "run"
    out.mkdir()
    (out / "metrics.json").write_bytes(PREVIOUS)
    real = trainer.save_model

    def save_then_fill(*args: Any, **kw: Any) -> Any:
        folder = real(*args, **kw)
        fill(tiny_tmpfs.path)
        return folder

    monkeypatch.setattr(trainer, "save_model", save_then_fill)
    monkeypatch.setattr(trainer, "plot_curves", lambda *a, **kw: None)  # 30 plots: 15 s; tested above
    with pytest.raises(OSError) as e:
        train(TrainConfig.from_toml(cfg), out, progress=False)
    assert (out / "metrics.json").read_bytes() == PREVIOUS
    assert e.value.errno == errno.ENOSPC and "metrics.json" in str(e.value)
    assert not [p for p in out.iterdir() if p.name.startswith(".metrics")]


@needs_mount
def test_bench_json_on_a_full_disk_keeps_the_previous_file(tiny_tmpfs, tmp_path, monkeypatch, capsys):
    """Regression: ``Path(args.json).write_text`` truncated the previous figures before a full disk cut the
    new ones short. The benchmark is a script of its own in a folder of benchmarks (a real run of the
    verb, with the figures it returns)."""
    from embstore.commands import bench_cmds

    (tmp_path / "bench_figures.py").write_text("def main(argv):\n    return {'ratio': list(range(20000))}\n")
    monkeypatch.setattr(bench_cmds, "BENCH_DIR", tmp_path)
    assert main(["bench", "figures", "--json", str(tmp_path / "ok.json")]) == 0
    assert json.loads((tmp_path / "ok.json").read_text()) == {"figures": {"ratio": list(range(20000))}}
    target = tiny_tmpfs.path / "figures.json"
    target.write_bytes(PREVIOUS)
    fill(tiny_tmpfs.path)
    capsys.readouterr()
    assert main(["bench", "figures", "--json", str(target)]) == 1
    err = capsys.readouterr().err
    assert target.read_bytes() == PREVIOUS
    assert "No space left" in err and str(target) in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tiny_tmpfs.path.iterdir()) == ["figures.json", "filler"]


@needs_mount
def test_eval_hashing_json_on_a_full_disk_keeps_the_previous_file(tiny_tmpfs, monkeypatch):
    """Regression: tools/eval_hashing.py wrote --json with ``write_text`` (truncate, then write). 40 tables
    make the figures over a page."""
    spec = importlib.util.spec_from_file_location("eval_hashing_for_boundaries", ROOT / "tools" / "eval_hashing.py")
    ev = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ev)  # its dataclasses look their module up there
    spec.loader.exec_module(ev)
    target = tiny_tmpfs.path / "figures.json"
    target.write_bytes(PREVIOUS)
    fill(tiny_tmpfs.path)
    with pytest.raises(OSError) as e:
        ev.main(["--tables", "40", "--ids", "100", "--groups", "4", "--train-batches", "2", "--eval-batches", "1",
                 "--batch-size", "32", "--variants", "mod", "--epochs", "1", "--dim", "4", "--quiet",
                 "--json", str(target)])
    assert target.read_bytes() == PREVIOUS
    assert e.value.errno == errno.ENOSPC and str(target) in str(e.value)  # the run finished; its figures did not fit


# --------------------------------------------------------------------------- gzipped Meta traces
def _meta_bytes(n: int, seed: int = 0) -> bytes:
    """A valid Meta trace of ``n`` random ids in one table (gzip shrinks it about 3 times, as real ones)."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 10**9, n))
    bio = io.BytesIO()
    torch.save((ids, torch.tensor([0, n]), torch.tensor([[n]])), bio)
    return bio.getvalue()


def test_a_gzipped_meta_trace_still_loads(tmp_path):
    p = tmp_path / "t.pt.gz"
    p.write_bytes(gzip.compress(_meta_bytes(1000), compresslevel=1))
    assert len(traces.load(p)) == 1000


@needs_mount
def test_a_gzip_bomb_is_refused_before_it_fills_the_temporary_folder(tiny_tmpfs, tmp_path, monkeypatch, capsys):
    """Regression: a gzipped trace was inflated into the temporary folder with no limit: 20 KB of gzip
    filled the 4 MiB folder (and would fill any other) before torch.load could refuse the contents."""
    monkeypatch.setattr(tempfile, "tempdir", str(tiny_tmpfs.path))
    monkeypatch.setattr(traces, "GZIP_MIN_LIMIT", 1 << 20, raising=False)  # the floor for small files: 256 MiB
    member = gzip.compress(bytes(1 << 20), compresslevel=9)  # 1 MiB of zeros in about 1 KiB
    p = tmp_path / "bomb.pt.gz"
    p.write_bytes(member * 16)  # members concatenated: 16 MiB
    with pytest.raises(CorruptStoreError, match="likely gzip bomb") as e:
        traces.load(p)
    assert str(p) in str(e.value)
    assert list(tiny_tmpfs.path.iterdir()) == []  # the partial inflation is gone
    cli_fails(capsys, ["trace", "stats", p], p)


@needs_mount
def test_a_temporary_folder_too_small_for_a_real_trace_says_so(tiny_tmpfs, tmp_path, monkeypatch, capsys):
    """Regression: ENOSPC while inflating was reported as 'not a readable torch file' (a corrupt trace,
    exit 2); it is the machine's problem (exit 1) and the message says where and what to do."""
    monkeypatch.setattr(tempfile, "tempdir", str(tiny_tmpfs.path))
    p = tmp_path / "big.pt.gz"
    p.write_bytes(gzip.compress(_meta_bytes(1 << 20), compresslevel=1))  # 8 MiB inflated
    with pytest.raises(OSError) as e:
        traces.load(p)
    assert e.value.errno == errno.ENOSPC and "TMPDIR" in str(e.value) and str(p) in str(e.value)
    assert not isinstance(e.value, CorruptStoreError) and list(tiny_tmpfs.path.iterdir()) == []
    assert main(["trace", "stats", str(p)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "TMPDIR" in err, err


# --------------------------------------------------------------------------- FIFOs, directories, devices
def _trace_fifo(tmp_path: Path, name: str) -> Path:
    return fifo_at(tmp_path / name)


@pytest.mark.parametrize("name", ["t.npz", "t.csv", "t.pt", "t.pt.gz", "trace"])
def test_a_fifo_named_as_a_trace_is_refused_not_waited_on(tmp_path, capsys, name):
    """Regression: open() of a FIFO blocks until a writer comes: `trace stats`, `replay` and `tune` hung."""
    p = _trace_fifo(tmp_path, name)
    with pytest.raises(InvalidInputError, match=r"is a FIFO \(named pipe\), not a regular file") as e:
        returns_within(lambda: traces.load(p), p)
    assert str(p) in str(e.value)
    returns_within(lambda: cli_fails(capsys, ["trace", "stats", p], p), p)
    returns_within(lambda: cli_fails(capsys, ["replay", p, "--capacity", "1"], p), p)


def test_a_device_named_as_a_trace_is_refused(capsys):
    """/dev/null was read as an empty CSV ('expected the CSV header'); /dev/zero would never end (and fill
    memory: not tried here)."""
    with pytest.raises(InvalidInputError, match="is a character device, not a regular file"):
        traces.load("/dev/null", format="csv")
    cli_fails(capsys, ["trace", "stats", "/dev/null"], "/dev/null")


def test_a_fifo_or_directory_as_a_config_is_a_config_error(tmp_path, capsys):
    p = fifo_at(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="FIFO") as e:
        returns_within(lambda: StoreConfig.from_toml(p), p)
    assert e.value.key == "config" and str(p) in str(e.value)
    with pytest.raises(ConfigError, match="FIFO"):
        returns_within(lambda: TrainConfig.from_toml(p), p)
    returns_within(lambda: cli_fails(capsys, ["create", tmp_path / "s", "--config", p], p), p)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="is a directory"):
        StoreConfig.from_toml(tmp_path)


def test_a_fifo_as_a_cost_model_is_refused_and_falls_back_loudly(tmp_path, caplog):
    p = fifo_at(tmp_path / "c.json")
    with pytest.raises(InvalidInputError, match="FIFO"):
        returns_within(lambda: costmodel.load(p), p)
    with caplog.at_level("WARNING", logger="embstore.costmodel"):
        assert returns_within(lambda: costmodel.default_model(p), p) == costmodel.CostModel()
    assert any(str(p) in r.getMessage() and "FIFO" in r.getMessage() for r in caplog.records)


def test_a_fifo_as_an_npy_file_is_refused_by_import_and_hash_fit(store_path, tmp_path, capsys):
    p = fifo_at(tmp_path / "rows.npy")
    with pytest.raises(InvalidInputError, match="FIFO"):
        returns_within(lambda: open_npy(p), p)
    with embstore.open(store_path) as s, pytest.raises(InvalidInputError, match="FIFO"):
        returns_within(lambda: import_rows(s["emb"], p), p)
    returns_within(lambda: cli_fails(capsys, ["import", store_path, "emb", p], p), p)
    returns_within(lambda: cli_fails(capsys, ["hash", "fit", p, "--buckets", "10", "--out", tmp_path / "m",
                                              "--quiet"], p), p)
    cli_fails(capsys, ["import", store_path, "emb", tmp_path], tmp_path)  # a directory: said as such


def test_a_fifo_as_a_mapping_file_is_refused(tmp_path):
    p = fifo_at(tmp_path / "m.bin")
    with pytest.raises(CorruptStoreError, match="FIFO") as e:
        returns_within(lambda: read_arrays(p), p)
    assert str(p) in str(e.value)
    with pytest.raises(CorruptStoreError, match="FIFO"):
        returns_within(lambda: LearnedHash.load(p), p)
    with pytest.raises(ConfigError, match="is a directory"):  # unchanged: a directory is the config's fault
        LearnedHash.load(tmp_path)


def test_a_fifo_as_a_learned_hash_mapping_in_a_store_config_is_a_config_error(tmp_path):
    """create() copies a learned hash's mapping into the store: a FIFO there was reported as a file that
    "does not exist"; it is refused as what it is, and no store is left behind."""
    import embstore

    p = fifo_at(tmp_path / "m.ehash")
    cfg = embstore.StoreConfig.from_toml(
        f'[[table]]\nname = "t"\nnum_embeddings = 8\ndim = 4\nhash = {{ kind = "learned", mapping = "{p}" }}\n'
        'tiers = [{ kind = "mmap" }]\n')
    with pytest.raises(ConfigError, match="is a FIFO"):
        returns_within(lambda: embstore.create(tmp_path / "s", cfg), p)
    assert not (tmp_path / "s").exists()


def test_a_fifo_as_criteo_data_is_named_as_such(tmp_path):
    """The reader said a FIFO "does not exist"; it is refused as what it is."""
    from embstore.errors import InvalidInputError
    from embstore.training.data import CriteoReader

    p = fifo_at(tmp_path / "day_0")
    with pytest.raises(InvalidInputError, match="is a FIFO"):
        returns_within(lambda: CriteoReader(p, batch_size=4), p)


@pytest.mark.parametrize("which", ["checkpoint", "marker"])
def test_a_fifo_as_a_checkpoint_or_its_marker_is_refused(run, capsys, which):
    cfg, out, pt = run
    fifo = fifo_at(pt if which == "checkpoint" else out / "checkpoints" / "latest")
    with pytest.raises(CorruptStoreError, match="FIFO") as e:
        returns_within(lambda: train(TrainConfig.from_toml(cfg), out, resume=True, progress=False), fifo)
    assert str(fifo) in str(e.value)
    returns_within(lambda: cli_fails(capsys, ["train", cfg, "--out", out, "--resume", "--no-progress"], fifo), fifo)


# --------------------------------------------------------------------------- CSV traces
@pytest.mark.parametrize("text, says", [
    ("table,id\n0,1_000\n", "line 2: id '1_000'"),
    ("table,id\n0,\u0661\u0662\n", "line 2: id '\u0661\u0662'"),  # Arabic-Indic 12: int() takes it
    ("table,id\n0,\uff17\n", "line 2: id '\uff17'"),  # fullwidth 7
    ("table,id\n0,1\n0,0x10\n", "line 3: id '0x10'"),
    ("table,id\n0,1 2\n", "line 2: id '1 2'"),
    ("table,id\n0,1e3\n", "line 2: id '1e3'"),
    ("table,id\n,5\n", "line 2: the table cell is empty"),
    ("table,id\nuser,5\n,6\n", "line 3: the table cell is empty"),
    ("table,id,batch\n0,1,\n", "line 2: batch ''"),
    ("table,id,batch\n0,1,1_0\n", "line 2: batch '1_0'"),
    ("table,id\n0,1\n\n0,x\n", "line 4: id 'x'"),  # blank lines count: the error names the file's line
    ("table,id\n0,1\n  \n0,2\n\n5\n", "line 6: malformed CSV: rows have 1 columns"),
    ("table,id\n0,1\n-1,5\n", "line 3: table indices must be >= 0"),
    ("table,id\n0,1\n9999999999,2\n", "line 3: table '9999999999' is not an integer in the int32 range"),
    ("table,id\n0,1\n1048576,2\n", "line 3: 1,048,577 tables but no table_names"),
    ("table,id,batch\n0,1,5\n\n0,2,4\n", "line 4: batch numbers must not decrease"),
    ("table,id\n0," + "1" * 5000 + "\n", "line 2: id '1111111111"),  # int() refuses 4300+ digits by itself
], ids=lambda v: v[:30] if isinstance(v, str) and len(v) > 30 else None)
def test_csv_cells_must_be_ascii_integers_and_every_error_names_its_line(tmp_path, capsys, text, says):
    """Regression: ids went through int(), which takes '1_000' and other scripts' digits, so a damaged cell
    became a silently different id; an empty table cell's error, and errors after a blank line, named no
    line or the wrong one."""
    p = tmp_path / "t.csv"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidInputError) as e:
        traces.load(p)
    assert says in str(e.value) and str(p) in str(e.value), str(e.value)
    assert len(str(e.value)) < 400
    cli_fails(capsys, ["trace", "stats", p], p)


def test_csv_blank_lines_are_skipped_and_signs_and_spaces_are_taken(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("table,id,batch\n\nuser, +5 ,0\r\n  \nitem,-7,0\nuser,9,2\n\n")
    t = traces.load(p)
    assert t.ids.tolist() == [5, -7, 9] and t.table.tolist() == [0, 1, 0]
    assert t.table_names == ("user", "item") and t.batch_offsets.tolist() == [0, 2, 3]


_ASCII_INT = re.compile(r"[+-]?[0-9]+")
TABLE_CELLS = ["0", "1", "2", "-1", "", "user", "1_0", "\u0663", " 2 "]
ID_CELLS = ["0", "7", "-3", "+2", " 5 ", "", "1_000", "\u0661\u0662", "x", "9223372036854775807",
            "9223372036854775808", "-9223372036854775808"]


def _reference_csv(lines: list[str]) -> tuple[set[int], list[tuple[str, int]]]:
    """(line numbers that are wrong, [(table cell, id)] of the rows): the CSV rules written plainly."""
    rows = [(n, [c.strip() for c in line.split(",")]) for n, line in enumerate(lines, 2) if line.strip()]
    if any(len(r) != 2 for _, r in rows):
        return {n for n, r in rows if len(r) != 2}, []
    wrong = {n for n, r in rows if not (_ASCII_INT.fullmatch(r[1]) and -2**63 <= int(r[1]) < 2**63)}
    if all(_ASCII_INT.fullmatch(r[0]) for _, r in rows):
        wrong |= {n for n, r in rows if int(r[0]) < 0}
    else:
        wrong |= {n for n, r in rows if not r[0]}
    return wrong, [(r[0], int(r[1])) for _, r in rows] if not wrong else []


@settings(max_examples=150)
@given(lines=st.lists(st.one_of(st.just(""), st.just("  "),
                                st.tuples(st.sampled_from(TABLE_CELLS), st.sampled_from(ID_CELLS)).map(",".join),
                                st.sampled_from(["5", "0,1,2"])), max_size=8))
def test_csv_traces_read_as_the_reference_rules_say(tmp_path_factory, lines):
    """Any mix of good and bad cells and blank lines: the trace the reference rules read, or an error that
    names one of the lines the reference finds wrong."""
    p = tmp_path_factory.mktemp("csv") / "t.csv"
    p.write_text("table,id\n" + "".join(f"{line}\n" for line in lines), encoding="utf-8")
    wrong, rows = _reference_csv(lines)
    try:
        t = traces.load(p)
    except InvalidInputError as exc:
        found = re.search(r": line (\d+): ", str(exc))
        assert found and int(found.group(1)) in wrong, (str(exc), wrong)
    else:
        assert not wrong
        assert t.ids.tolist() == [i for _, i in rows]
        assert [t.table_names[k] for k in t.table] == [
            f"table_{int(c)}" if all(_ASCII_INT.fullmatch(c) for c, _ in rows) else c for c, _ in rows]
