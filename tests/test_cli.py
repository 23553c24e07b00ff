"""The command line: create, import, export, stats, demo, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.cli import main
from faultfs import needs_mount

CONFIG = """
[[table]]
name = "emb"
num_embeddings = 300
dim = 8
tiers = [{ kind = "dram", capacity = "1KiB", policy = "lru" }, { kind = "ssd" }]
"""


@pytest.fixture()
def store_path(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    return tmp_path / "s"


def test_import_export_round_trip(store_path, tmp_path) -> None:
    rows = np.random.default_rng(0).standard_normal((200, 8)).astype(np.float32)
    np.save(tmp_path / "in.npy", rows)
    assert main(["import", str(store_path), "emb", str(tmp_path / "in.npy"), "--start", "50"]) == 0
    assert main(["export", str(store_path), "emb", str(tmp_path / "out.npy")]) == 0
    out = np.load(tmp_path / "out.npy")
    assert out.shape == (300, 8)
    np.testing.assert_array_equal(out[50:250], rows)
    with embstore.open(store_path) as s:  # untouched rows keep their initial values
        np.testing.assert_array_equal(out[:50], s["emb"].lookup(np.arange(50, dtype=np.int64)))


def test_import_rejects_bad_files_and_changes_nothing(store_path, tmp_path, capsys) -> None:
    bad = np.ones((10, 8), np.float32)
    bad[7, 3] = np.inf
    np.save(tmp_path / "bad.npy", bad)
    np.save(tmp_path / "wrongdim.npy", np.ones((4, 5), np.float32))
    np.save(tmp_path / "ints.npy", np.ones((4, 8), np.int32))
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with embstore.open(store_path) as s:
        before = s["emb"].lookup(np.arange(300, dtype=np.int64))
    for name, needle in [("bad.npy", "row 7"), ("wrongdim.npy", "shape (n, 8)"), ("ints.npy", "floating"),
                         ("junk.npy", "not a readable")]:
        assert main(["import", str(store_path), "emb", str(tmp_path / name)]) == 2
        assert needle in capsys.readouterr().err
    assert main(["import", str(store_path), "emb", str(tmp_path / "bad.npy"), "--start", "295"]) == 2
    assert main(["import", str(store_path), "nope", str(tmp_path / "bad.npy")]) == 2
    assert "known tables: emb" in capsys.readouterr().err
    with embstore.open(store_path) as s:
        np.testing.assert_array_equal(s["emb"].lookup(np.arange(300, dtype=np.int64)), before)


def test_import_of_an_empty_file_is_a_clear_error(store_path, tmp_path, capsys) -> None:
    (tmp_path / "empty.npy").write_bytes(b"")
    assert main(["import", str(store_path), "emb", str(tmp_path / "empty.npy")]) == 2
    err = capsys.readouterr().err
    assert "not a readable .npy array" in err and "import emb:" not in err  # no closing count for failed work


@needs_mount
def test_export_to_a_full_disk_fails_cleanly_and_keeps_the_old_file(store_path, tiny_tmpfs, capsys) -> None:
    big = tiny_tmpfs.path / "big.toml"
    big.write_text(CONFIG.replace("name = \"emb\"", "name = \"big\"").replace("num_embeddings = 300",
                                                                             "num_embeddings = 300_000"))
    with embstore.open(store_path) as s:
        s.create_table(embstore.StoreConfig.from_toml(big).tables[0])
    big.unlink()
    target = tiny_tmpfs.path / "rows.npy"
    assert main(["export", str(store_path), "emb", str(target)]) == 0
    small = np.load(target)
    assert main(["export", str(store_path), "big", str(target)]) == 1  # 9.6 MB into a 4 MiB tmpfs
    assert "No space left on device" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(target), small)
    assert sorted(p.name for p in tiny_tmpfs.path.iterdir()) == ["rows.npy"]


def test_create_errors(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("dim = 8", "dim = 8\nflavour = 'x'"))
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 2
    assert "table.flavour" in capsys.readouterr().err
    cfg.write_text(CONFIG)
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 2
    assert "already holds a store" in capsys.readouterr().err
    assert main(["create", str(tmp_path / "t"), "--config", str(tmp_path / "missing.toml")]) == 2
    (tmp_path / "binary.toml").write_bytes(b"\xf5\x00[[table]]")
    for config, words in [(tmp_path / "binary.toml", "not UTF-8"), (tmp_path, "is a directory")]:
        assert main(["create", str(tmp_path / "t"), "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
        assert main(["train", str(config)]) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_serve_refuses_a_bad_port_and_an_unreadable_token(store_path, tmp_path, capsys) -> None:
    for port in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(store_path), "--port", port])
        assert e.value.code == 2 and "TCP port in 0-65535" in capsys.readouterr().err
    (tmp_path / "token").write_bytes(b"\xff\xfe")
    assert main(["serve", str(store_path), "--port", "0", "--token-file", str(tmp_path / "token")]) == 2
    assert "cannot be read as a text token" in capsys.readouterr().err
    assert main(["serve", str(store_path), "--port", "0", "--token-file", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_stats_json(store_path, capsys) -> None:
    assert main(["stats", str(store_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["emb"]["dim"] == 8 and set(out["emb"]["tiers"]) == {"dram", "ssd"}


def test_help_of_every_verb() -> None:
    top = subprocess.run([sys.executable, "-m", "embstore.cli", "--help"], capture_output=True, text=True)
    assert top.returncode == 0
    for verb in ("create", "import", "export", "stats", "demo"):
        assert verb in top.stdout
        r = subprocess.run([sys.executable, "-m", "embstore.cli", verb, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage: embstore " + verb in r.stdout


def test_train_help_states_each_default_once_and_truly(capsys) -> None:
    """`train --help` printed '(default: train_out)' twice and '--no-progress ... (default: True)'
    (the store_false dest's default), which reads as progress being off by default."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("(default: train_out)") == 1
    assert "(default: True)" not in out and "(default: False)" not in out


def test_import_of_a_zip_archive_is_a_clear_error(store_path, tmp_path, capsys) -> None:
    """np.load opens any zip (an .npz, a torch.save file) as an NpzFile: import crashed with an
    AttributeError traceback (exit 1) instead of naming the file."""
    import torch

    np.savez(tmp_path / "rows.npz", rows=np.ones((4, 8), np.float32))
    torch.save(torch.ones(4, 8), tmp_path / "rows.pt")
    for name in ("rows.npz", "rows.pt"):
        assert main(["import", str(store_path), "emb", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert name in err and "zip archive" in err and "Traceback" not in err


def test_hash_fit_of_an_empty_npy_is_a_clear_error(tmp_path, capsys) -> None:
    (tmp_path / "ids.npy").write_bytes(b"")
    np.savez(tmp_path / "z.npy", ids=np.arange(10))  # an .npz under a .npy name
    for name in ("ids.npy", "z.npy.npz"):
        assert main(["hash", "fit", str(tmp_path / name), "--buckets", "10", "--out", str(tmp_path / "m"),
                     "--quiet"]) == 2
        assert "embstore hash fit: error:" in capsys.readouterr().err


def test_export_refuses_the_store_own_files_and_bad_targets_before_reading(store_path, tmp_path, capsys) -> None:
    """``export STORE T STORE/manifest.json`` replaced the manifest with rows: the store never opened again."""
    (tmp_path / "d").mkdir()
    files = sorted(store_path.rglob("*"))
    for target in (store_path / "manifest.json", store_path / "x.npy", tmp_path / "d",
                   tmp_path / "no" / "x.npy", tmp_path / "c.toml" / "x.npy"):
        assert main(["export", str(store_path), "emb", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ".tmp" not in err
    assert sorted(store_path.rglob("*")) == files
    with embstore.open(store_path) as s:
        assert list(s.tables) == ["emb"]


def test_bad_paths_exit_2_not_1(store_path, tmp_path, capsys) -> None:
    """A parent that is a file (ENOTDIR) or a name too long is the input's fault: they exited with 1."""
    (tmp_path / "f").write_text("")
    for argv in (["create", str(tmp_path / "f" / "s"), "--config", str(tmp_path / "c.toml")],
                 ["create", str(tmp_path / "s2"), "--config", str(tmp_path / "f" / "c.toml")],
                 ["export", str(store_path), "emb", str(tmp_path / ("x" * 300 + ".npy"))]):
        assert main(argv) == 2, argv
        assert "Traceback" not in capsys.readouterr().err


@needs_mount
def test_a_full_disk_during_import_exits_1(tiny_tmpfs, tmp_path, capsys) -> None:
    """A tier's ENOSPC is a DiskFullError, an EmbstoreError, so it exited 2 as if the input were wrong;
    the README promises 1 when the machine failed."""
    cfg = tmp_path / "big.toml"
    cfg.write_text(CONFIG.replace("num_embeddings = 300", "num_embeddings = 300_000"))
    assert main(["create", str(tiny_tmpfs.path / "s"), "--config", str(cfg)]) == 0
    np.save(tmp_path / "rows.npy", np.ones((200_000, 8), np.float32))  # 6.4 MB into a 4 MiB tmpfs
    assert main(["import", str(tiny_tmpfs.path / "s"), "emb", str(tmp_path / "rows.npy")]) == 1
    err = capsys.readouterr().err
    assert "embstore import: error:" in err and "No space left on device" in err and "Traceback" not in err


def test_out_of_memory_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys) -> None:
    from embstore import tracegen

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.3 TiB")

    monkeypatch.setattr(tracegen, "generate", no_memory)
    assert main(["trace", "gen", "--zipf", "1", "--out", str(tmp_path / "t.npz")]) == 1
    err = capsys.readouterr().err
    assert err == "embstore trace gen: error: out of memory (Unable to allocate 7.3 TiB)\n"


@pytest.mark.parametrize("bad_row", [3, 70_000])
def test_import_checks_the_row_format_whole_before_writing(tmp_path, capsys, bad_row) -> None:
    """A float16 table refuses values beyond +-65504, but import checked that per 65,536-row chunk while
    writing: a bad row in a later chunk left the earlier chunks imported, and the error counted rows from
    the chunk (row 4464 for row 70,000)."""
    cfg = tmp_path / "h.toml"
    cfg.write_text(CONFIG.replace("dim = 8", 'dim = 4\ndtype = "float16"').replace("300", "100_000"))
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    rows = np.ones((80_000, 4), np.float32)
    rows[bad_row, 2] = 1e6
    np.save(tmp_path / "rows.npy", rows)
    with embstore.open(tmp_path / "s") as s:
        before = s["emb"].lookup(np.arange(80_000, dtype=np.int64))
    assert main(["import", str(tmp_path / "s"), "emb", str(tmp_path / "rows.npy")]) == 2
    err = capsys.readouterr().err
    assert f"row {bad_row}: rows must fit float16" in err and "nothing imported" in err
    with embstore.open(tmp_path / "s") as s:
        np.testing.assert_array_equal(s["emb"].lookup(np.arange(80_000, dtype=np.int64)), before)


def test_help_does_not_import_torch() -> None:
    """`embstore --help` (and every verb but train/serve work) must not pay torch's ~1.4 s import."""
    code = ("import sys\nfrom embstore.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("content, says", [(None, "file '{f}' does not exist"),
                                           ("x = [", "file '{f}': not valid TOML")])
def test_a_bad_config_file_is_named_not_called_a_config_key(tmp_path, capsys, content, says) -> None:
    f = tmp_path / "c.toml"
    if content is not None:
        f.write_text(content)
    assert main(["create", str(tmp_path / "s"), "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert says.format(f=f) in err and "config key" not in err, err


def test_serve_names_the_token_file_flag(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[table]]\nname = "a"\nnum_embeddings = 10\ndim = 4\ntiers = [{ kind = "mmap" }]\n')
    assert main(["create", str(tmp_path / "s"), "--config", str(cfg)]) == 0
    assert main(["serve", str(tmp_path / "s"), "--token-file", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"--token-file: {tmp_path / 'none'} does not exist" in err and "config key" not in err, err


def test_import_of_bytes_that_are_no_npy_says_so_not_pickle(store_path, tmp_path, capsys) -> None:
    (tmp_path / "random.npy").write_bytes(bytes(range(7, 107)))
    assert main(["import", str(store_path), "emb", str(tmp_path / "random.npy")]) == 2
    err = capsys.readouterr().err
    assert "no .npy header" in err and "pickle" not in err, err


def _help(capsys, *verb: str) -> str:
    """``embstore VERB --help`` with its whitespace folded (argparse wraps lines anywhere)."""
    with pytest.raises(SystemExit) as exc:
        main([*verb, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("verb, says", [
    (("serve",), ["GET /v1/models,", "POST /v1/models/NAME/predict", "concurrent writes share one fdatasync of it"]),
    (("replay",), ["samples per batch (default: the whole file is one batch)", "one DRAM cache",
                   "counts the same hits as --per-table"]),
    (("tune",), ["samples per batch (default: the whole file is one batch)", "default: from --dim and --dtype",
                 "without it, the TOML is printed after the summary"]),
    (("hash", "fit"), ["(default: the whole file is one batch)", "unseen-id hash (default 0)"]),
    (("trace", "gen"), ["--zipf ALPHA Zipf exponent of id popularity, in [0, 10]"]),
    (("bench",), ["--json F.json"]),
    (("stats",), ["counters count this process's own work since the open", "GET /v1/tables/NAME and /metrics"]),
    (("import",), ["Write physical rows START.. of TABLE (after hashing, as export writes them)",
                   "first physical row to write"]),
])
def test_help_texts_state_their_defaults_and_limits(capsys, verb, says) -> None:
    """Session 12's audit of every --help: defaults left unsaid, a limit stated wrong (--zipf '>= 0'), a
    PUT's 'one flush' that is one fdatasync of the write-ahead log, endpoints left out."""
    out = _help(capsys, *verb)
    for text in says:
        assert text in out, (verb, text)
    assert "share one flush" not in out


def test_trace_gen_zipf_limit_is_the_one_its_help_states(tmp_path, capsys) -> None:
    argv = ["trace", "gen", "--batches", "1", "--batch-size", "4", "--tables", "1", "--ids", "50"]
    assert main([*argv, "--zipf", "10", "--out", str(tmp_path / "a.npz")]) == 0
    assert main([*argv, "--zipf", "10.5", "--out", str(tmp_path / "b.npz")]) == 2
    assert "[0, 10]" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["-a", ".a", "a" * 129, "a b", ""])
def test_a_bad_table_name_error_states_the_rule_it_broke(name) -> None:
    """'-a' was told to 'use 1-128 letters, digits, '_', '-' or '.'', which it does: the rule is also
    about the first character."""
    with pytest.raises(embstore.ConfigError) as exc:
        embstore.TableConfig(name, 10, 4)
    assert exc.value.key == "table.name" and "starting with a letter, digit or '_'" in exc.value.reason
    for good in ("a-", "_.x", "9", "a" * 128):
        assert embstore.TableConfig(good, 10, 4).name == good
