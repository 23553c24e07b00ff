"""An audit of the command line's boundary: bad values, paths and traces for every verb.

Each refused input must exit non-zero with one ``embstore VERB: error: ...`` line on stderr naming the bad
value (argparse's usage lines before it are fine), never a traceback, a hang or a half-written output.
What the audit found (each test says what it was):

- ``replay``/``tune --announce`` beyond int64 was an ``OverflowError`` traceback (exit 1), and ``2**63`` an
  ``IndexError``: telling a cache more batches ahead than the trace has is telling it to the end.
- ``serve --request-timeout inf`` (or over a day), ``--flush-interval 86401`` and a token file holding
  ``a b`` were refused as ``config key 'request_timeout'`` / ``'token'``: settings keys the user never typed.
- ``tune --dim 100000`` ran the whole tuning and then failed as ``config key 'table.dim'``, and
  ``--row-bytes 99999999999999999996`` was an ``OverflowError`` traceback.
- ``replay`` and ``tune`` of a trace with no accesses answered with zeros: a plot of nothing, a store
  config of one-row tables sized on no evidence (``hash fit`` already refused such a trace).
- An output on a read-only file system (``--plot``, ``--out``, ``export FILE``, ``bench --json``) was
  found only when written, after the work (minutes on real traces), and exited 1 as a failure of the
  machine, while ``hash fit`` said 2 for the same path.

Kept as they are, by design and pinned elsewhere: ``--capacity 0`` (no cache: the baseline) and
``--dram 0`` are valid; a fraction that rounds to no row is one row; ``trace stats`` of an empty trace
reports zeros (it inspects, it does not size anything).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embstore import traces
from embstore.cli import build_parser, main
from embstore.commands import bench_cmds, serve_cmds
from faultfs import _run, needs_mount
from test_cli import CONFIG


def cli(capsys, argv: list) -> tuple[int, str, str]:
    """Run the CLI in-process on real files: (exit status, stdout, stderr). An exception escaping ``main``
    would be the traceback a user sees, and fails the test by itself."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors (and --help)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, argv: list, *needles: str) -> str:
    """Exit 2 and one error line, the last on stderr (argparse's usage lines may come before it), holding
    every needle; returns that line."""
    rc, _, err = cli(capsys, argv)
    assert rc == 2, (argv, rc, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("embstore ") and ": error: " in lines[-1], err
    assert all(line.startswith(("usage: ", " ")) for line in lines[:-1]), err
    for needle in needles:
        assert needle in lines[-1], (needle, err)
    return lines[-1]


def trace_of(ids, table, offsets, names) -> traces.Trace:
    return traces.Trace(np.array(ids, np.int64), np.array(table, np.int32), np.array(offsets, np.int64), names)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("audit")
    rng = np.random.default_rng(0)
    ids = rng.zipf(1.3, 600) % 400
    traces.save(trace_of(ids, np.arange(600) % 2, [0, 200, 400, 600], ("a", "b")), d / "t.npz")
    traces.save(trace_of([], [], [0], ("a",)), d / "empty.npz")
    traces.save(trace_of([], [], [0, 0, 0], ("a",)), d / "empty_batches.npz")
    (d / "header.csv").write_text("table,id\n")
    (d / "c.toml").write_text(CONFIG)
    np.save(d / "rows.npy", np.ones((10, 8), np.float32))
    assert main(["create", str(d / "s"), "--config", str(d / "c.toml")]) == 0
    return {"dir": d, "trace": d / "t.npz", "empty": d / "empty.npz", "empty_batches": d / "empty_batches.npz",
            "header": d / "header.csv", "store": d / "s", "rows": d / "rows.npy"}


# --------------------------------------------------------------------------- bad values of every flag

BAD_VALUES = [
    # (the verb and its arguments up to the flag, {trace}/{store}/{rows}/{out} filled in; the bad value; what the
    # error line says)
    (["tune", "{trace}", "--dram"], "-1", "'-1'"),
    (["tune", "{trace}", "--dram"], "abc", "'abc'"),
    (["tune", "{trace}", "--dram"], "1e3", "'1e3'"),
    (["tune", "{trace}", "--dram"], "1.5", "'1.5' is not a whole number of bytes"),
    (["tune", "{trace}", "--dram", "1MiB", "--device"], "-1", "'-1'"),
    (["tune", "{trace}", "--dram", "1MiB", "--policy"], "nosuch", "'nosuch'"),
    (["tune", "{trace}", "--dram", "1MiB", "--dtype"], "float64", "'float64'"),
    (["tune", "{trace}", "--dram", "1MiB", "--dim"], "100000", "expected an integer in [1, 65536], got 100000"),
    (["replay", "{trace}", "--capacity"], "-1", "capacity '-1'"),
    (["replay", "{trace}", "--capacity"], "1.5", "capacity '1.5'"),
    (["replay", "{trace}", "--capacity"], "0.0", "capacity '0.0'"),
    (["replay", "{trace}", "--capacity"], "abc", "capacity 'abc'"),
    (["replay", "{trace}", "--capacity"], "2GB", "capacity '2GB'"),
    (["replay", "{trace}", "--capacity"], "10,", "capacity ''"),
    (["replay", "{trace}", "--capacity"], "nan", "capacity 'nan'"),
    (["replay", "{trace}", "--policy"], "nosuch", "'nosuch'"),
    (["replay", "{trace}", "--policy"], "lru,", "''"),
    (["replay", "{trace}", "--policy"], "lru+nosuch", "'lru+nosuch'"),
    (["replay", "{trace}", "--announce"], "1.5", "'1.5'"),
    (["replay", "{trace}", "--lookahead"], "-1", "-1"),
    (["replay", "{trace}", "--row-bytes"], "0", "got 0"),
    (["replay", "{trace}", "--home"], "tape", "'tape'"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--batch-size"], "0", "got 0"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--tables"], "0", "got 0"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--pooling"], "-1", "got -1"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--ids"], "abc", "'abc'"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--drift"], "2", "'2'"),
    (["trace", "gen", "--out", "{out}", "--zipf"], "nan", "got nan"),
    (["trace", "gen", "--out", "{out}", "--like"], "dlrm2099", "'dlrm2099'"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--tables"], "100000000000",
     "tables must be at most 1,048,576, got 100000000000"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--batches"], "1000000000000", "lookups; at most"),
    (["trace", "gen", "--zipf", "1", "--out", "{out}", "--ids"], "99999999999999999999999",
     "ids must be at most 2**63 - 1"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets"], "0", "--buckets: expected an integer >= 2"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets"], "1e3", "'1e3'"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets"], "99999999999999999999999", "--buckets:"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets", "10", "--reserved-fraction"], "1",
     "--reserved-fraction:"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets", "10", "--iterations"], "100000000000000",
     "--iterations:"),
    (["hash", "fit", "{trace}", "--quiet", "--out", "{out}", "--buckets", "10", "--table"], "nosuch", "'nosuch'"),
    (["import", "{store}", "emb", "{rows}", "--start"], "abc", "'abc'"),
    (["import", "{store}", "emb", "{rows}", "--start"], "99999999999999999999999",
     "rows 99999999999999999999999.."),
    (["export", "{store}", "emb", "{out}", "--rows"], "301", "rows must be in [0, 300], got 301"),
    (["serve", "{store}", "--max-ids"], "0", "got 0"),
    (["serve", "{store}", "--max-body-bytes"], "0", "'0'"),
    (["serve", "{store}", "--pooled-cache-bytes"], "-1", "'-1'"),
    (["serve", "{store}", "--request-timeout"], "nan", "'nan'"),
    (["serve", "{store}", "--batch-wait-ms"], "nan", "'nan'"),
    (["demo", "--steps"], "0", "got 0"),
]


@pytest.mark.parametrize("argv, value, says", BAD_VALUES,
                         ids=[f"{' '.join(a[:2])} {a[-1]} {v}" for a, v, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_it(files, tmp_path, capsys, argv, value, says):
    subs = {"{trace}": str(files["trace"]), "{store}": str(files["store"]), "{rows}": str(files["rows"]),
            "{out}": str(tmp_path / "out.npz")}
    line = refused(capsys, [subs.get(a, a) for a in argv] + [value], says)
    flag = argv[-1]
    if flag not in ("--start", "--rows", "--table", "--ids", "--tables", "--batches", "--zipf"):
        assert flag in line, line  # the flag the user typed, not a settings or config key
    assert "config key" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_a_fraction_that_rounds_to_no_row_is_one_row_and_zero_is_no_cache(files, capsys):
    rc, out, _ = cli(capsys, ["replay", files["trace"], "--policy", "lru", "--capacity", "0.0001,1e-300,0", "--json"])
    assert rc == 0
    assert [json.loads(r)["capacity_rows"] for r in out.splitlines()] == [1, 0]  # 1e-300 is one row again: once


# --------------------------------------------------------------------------- --announce beyond the trace


@pytest.mark.parametrize("huge", [str(10**21), str(2**63), str(2**63 - 1), "99999999999"])
def test_an_announce_past_the_trace_is_told_to_its_end_not_a_traceback(files, capsys, huge):
    """--announce 10**21 was an OverflowError traceback (exit 1) in policies.simulate, 2**63 an IndexError."""
    argv = ["replay", files["trace"], "--policy", "lru,lfu", "--capacity", "10,50", "--json", "--announce"]
    rc, to_end, _ = cli(capsys, [*argv, "3"])  # the trace has 3 batches
    assert rc == 0
    rc, out, err = cli(capsys, [*argv, huge])
    assert rc == 0 and "Traceback" not in err, err
    assert out.replace(f'"announce": {huge}', '"announce": 3') == to_end
    rc, out, err = cli(capsys, ["tune", files["trace"], "--dram", "64KiB", "--json", "--announce", huge])
    assert rc == 0, err


# --------------------------------------------------------------------------- serve names its flags


@pytest.mark.parametrize("flag, value", [("--request-timeout", "inf"), ("--request-timeout", "1e300"),
                                         ("--request-timeout", "86401"), ("--flush-interval", "inf"),
                                         ("--flush-interval", "86400.5")])
def test_serve_refuses_more_than_a_day_as_its_flag(files, capsys, flag, value):
    """These were refused only by ServerSettings, as "config key 'request_timeout'"."""
    refused(capsys, ["serve", files["store"], "--port", "0", flag, value], f"argument {flag}:", f"'{value}'",
            "[0, 86400]")
    assert serve_cmds.seconds("86400") == 86400.0 and serve_cmds.seconds("0") == 0.0


def test_serve_names_the_token_file_when_its_token_holds_whitespace(files, tmp_path, capsys):
    """A token file holding 'a b' was "config key 'token': must be a non-empty string without whitespace"."""
    (tmp_path / "tok").write_text("a b\n")
    line = refused(capsys, ["serve", files["store"], "--port", "0", "--token-file", tmp_path / "tok"],
                   f"--token-file: the token in {tmp_path / 'tok'} must be")
    assert "config key" not in line


# --------------------------------------------------------------------------- tune's row size


@pytest.mark.parametrize("flags, says", [
    (["--dim", "100000"], "argument --dim: expected an integer in [1, 65536], got 100000"),
    (["--row-bytes", "99999999999999999996"], "--row-bytes means float32 rows"),
    (["--row-bytes", "262148"], "up to 262144"),
    (["--row-bytes", "6"], "a multiple of 4"),
    (["--row-bytes", "8", "--dim", "2"], "not both"),
])
def test_tune_refuses_a_row_size_before_reading_the_trace(tmp_path, capsys, flags, says):
    """--dim 100000 failed as "config key 'table.dim'" after the whole tuning, --row-bytes 1e20 with an
    OverflowError traceback: the trace here does not exist, so only a check made first can answer."""
    line = refused(capsys, ["tune", tmp_path / "missing.npz", "--dram", "1MiB", *flags], says)
    assert "missing.npz" not in line and "config key" not in line


def test_tune_takes_the_largest_row(files, capsys):
    for flags in (["--dim", "65536"], ["--row-bytes", "262144"]):
        rc, out, err = cli(capsys, ["tune", files["trace"], "--dram", "64MiB", "--json", *flags])
        assert rc == 0 and '"row_bytes": 262144' in out, err


# --------------------------------------------------------------------------- a trace with no accesses


@pytest.mark.parametrize("which", ["empty", "empty_batches", "header"])
def test_replay_and_tune_refuse_a_trace_without_accesses_and_write_nothing(files, tmp_path, capsys, which):
    """Both answered with zeros: replay drew a plot of nothing, tune wrote one-row tables sized on nothing."""
    trace = files[which]
    refused(capsys, ["replay", trace, "--plot", tmp_path / "m.png"], f"trace file '{trace}' has no accesses")
    refused(capsys, ["replay", trace, "--per-table", "--json"], "has no accesses; nothing to replay")
    refused(capsys, ["tune", trace, "--dram", "1MiB", "--out", tmp_path / "s.toml"], "nothing to tune")
    refused(capsys, ["hash", "fit", trace, "--buckets", "10", "--out", tmp_path / "m", "--quiet"], "no accesses")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    rc, out, _ = cli(capsys, ["trace", "stats", trace, "--json"])  # inspecting it is fine: zeros
    assert rc == 0 and '"accesses": 0' in out


# --------------------------------------------------------------------------- output paths


OUTPUTS = {  # verb -> argv with {p} the output path (a bench that cannot run if ever reached)
    "replay --plot": ["replay", "{trace}", "--capacity", "5", "--policy", "lru", "--plot", "{p}"],
    "tune --out": ["tune", "{trace}", "--dram", "64KiB", "--out", "{p}"],
    "trace gen --out": ["trace", "gen", "--zipf", "1", "--batches", "2", "--batch-size", "8", "--tables", "1",
                        "--out", "{p}"],
    "hash fit --out": ["hash", "fit", "{trace}", "--buckets", "10", "--quiet", "--out", "{p}"],
    "export": ["export", "{store}", "emb", "{p}"],
    "bench --json": ["bench", "boom", "--json", "{p}"],
}
SUFFIX = {"replay --plot": ".png", "bench --json": ".json", "export": ".npy", "tune --out": ".toml"}


@pytest.fixture()
def fake_bench(tmp_path, monkeypatch):
    script = tmp_path / "bench_boom.py"
    script.write_text("def main(argv):\n    raise RuntimeError('the benchmark ran')\n")
    monkeypatch.setattr(bench_cmds, "available", lambda: {"boom": script})


def _argv(files, verb: str, p) -> list[str]:
    subs = {"{trace}": str(files["trace"]), "{store}": str(files["store"]), "{p}": str(p)}
    return [subs.get(a, a) for a in OUTPUTS[verb]]


@pytest.mark.parametrize("verb", sorted(OUTPUTS))
@pytest.mark.parametrize("where", ["missing directory", "a directory", "under a file"])
def test_an_output_that_cannot_be_a_file_is_refused_before_the_work(files, tmp_path, capsys, fake_bench, verb, where):
    name = "o" + SUFFIX.get(verb, ".npz")
    target = {"missing directory": tmp_path / "nope" / name, "a directory": tmp_path / "d" / name,
              "under a file": tmp_path / "f" / name}[where]
    (tmp_path / "d" / name).mkdir(parents=True)
    (tmp_path / "f").write_text("")
    before = sorted(tmp_path.rglob("*"))
    rc, out, err = cli(capsys, _argv(files, verb, target))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "the benchmark ran" not in err and "hit %" not in out  # refused before the work
    assert sorted(tmp_path.rglob("*")) == before


@pytest.fixture()
def read_only_dir(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    res = _run("mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(path))
    assert res.returncode == 0, res.stderr
    try:
        yield path
    finally:
        if _run("umount", str(path)).returncode != 0:
            _run("umount", "-l", str(path))


@needs_mount
@pytest.mark.parametrize("verb", sorted(OUTPUTS))
def test_an_output_on_a_read_only_file_system_is_refused_before_the_work(files, read_only_dir, capsys, fake_bench,
                                                                         verb):
    """Found only when written, after the work, and exit 1 as if the machine had failed (hash fit: 2)."""
    target = read_only_dir / ("o" + SUFFIX.get(verb, ".npz"))
    rc, out, err = cli(capsys, _argv(files, verb, target))
    assert rc == 2 and "Traceback" not in err, err
    assert err.count("\n") == 1 and "read-only file system" in err and str(target.name) in err, err
    assert "the benchmark ran" not in err and "hit %" not in out
    assert list(read_only_dir.iterdir()) == []


# --------------------------------------------------------------------------- help and real processes


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _verbs(sub, (*path, name))
    if path:
        yield path, parser


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in _verbs(build_parser())])
def test_help_explains_every_option(capsys, path):
    parser = dict((" ".join(p), sp) for p, sp in _verbs(build_parser()))[path]
    rc, out, _ = cli(capsys, [*path.split(), "--help"])
    assert rc == 0 and out.startswith(f"usage: embstore {path}")
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help and action.help != argparse.SUPPRESS, (path, action.dest)
        for opt in action.option_strings:
            assert opt in out, (path, opt)


@pytest.mark.parametrize("argv, code, says", [
    (["replay", "{trace}", "--capacity", "5", "--policy", "lru", "--announce", str(10**21)], 0, None),
    (["replay", "{empty}"], 2, "has no accesses"),
    (["serve", "{store}", "--request-timeout", "inf"], 2, "argument --request-timeout"),
])
def test_the_installed_command_exits_as_promised(files, argv, code, says):
    subs = {"{trace}": str(files["trace"]), "{empty}": str(files["empty"]), "{store}": str(files["store"])}
    res = subprocess.run([sys.executable, "-m", "embstore.cli", *[subs.get(a, a) for a in argv]],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == code and "Traceback" not in res.stderr, res.stderr
    if says:
        assert says in res.stderr.strip().splitlines()[-1]
