"""A new user's journey: the README's Python examples run as printed, and the command line answers
wrong invocations with one line and exit status 2, never a traceback.

The README marks the fenced blocks this file runs with an HTML comment on the line before the fence:
``<!-- example: FILE -->`` writes the block to FILE in the scratch folder (a config the example reads),
``<!-- example: run -->`` runs the block with ``python`` there, in order. The other blocks are
sketches (they name a running server or a training loop) and stay unrun.
"""

from __future__ import annotations

import ast
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore.cli import build_parser, main
from test_cli import store_path  # noqa: F401 - the same small CLI store fixture

README = Path(__file__).resolve().parents[1] / "README.md"
MARKED_BLOCK = re.compile(r"^<!-- example: (\S+) -->\n```(\w+)\n(.*?)^```", re.M | re.S)


def marked_blocks() -> list[tuple[str, str, str]]:
    """(target, language, code) of every block the README marks as an example, in order."""
    return MARKED_BLOCK.findall(README.read_text())


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``embstore ARGS`` in a child process: its real exit status and stderr, as a user sees them."""
    return subprocess.run([sys.executable, "-m", "embstore.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(status: int, err: str, verb: str, *words: str) -> None:
    err = err.strip()
    assert status == 2, (status, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"embstore {verb}: error: "), err
    for word in words:
        assert word in err, (word, err)


# --------------------------------------------------------------------------- the README's Python examples
def test_readme_python_examples_run_as_printed_and_print_what_they_say(tmp_path: Path) -> None:
    """The store example creates a table through the config shown beside it, and what it prints is
    the per-tier statistics the README describes (unique rows per call: 2 of [3, 17, 3], 4 of the bags)."""
    blocks = marked_blocks()
    scripts = [code for target, lang, code in blocks if target == "run" and lang == "python"]
    assert scripts, "the README marks no runnable Python example"
    for target, _, code in blocks:
        if target != "run":
            (tmp_path / target).write_text(code)
    outputs = []
    for code in scripts:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    stats = ast.literal_eval(outputs[0].strip().splitlines()[-1])
    top = next(iter(stats.values()))
    assert top["hits"] + top["misses"] == 2 + 4
    for tier in stats.values():
        assert set(tier) == {"hits", "misses", "evictions", "bytes_read", "bytes_written", "resident_rows",
                             "capacity_rows"}
    with embstore.open(tmp_path / "my_store") as store:  # the flushed update is there after reopening
        table = store["item_id"]
        assert np.array_equal(table.lookup(np.array([3], np.int64)), np.ones((1, table.dim), np.float32))


# --------------------------------------------------------------------------- serve
def test_serve_a_store_that_cannot_be_opened_is_one_line_and_exit_2(store_path: Path) -> None:
    """In a child process: uvicorn printed the traceback of the app's startup and exited 3."""
    (store_path / "manifest.json").write_text('{"truncated')
    proc = run_cli("serve", str(store_path), "--port", "0")
    assert_one_line_error(proc.returncode, proc.stderr, "serve", "manifest.json cannot be read")


def test_serve_an_address_in_use_or_unknown_is_one_line_and_exit_2(store_path: Path, capsys) -> None:
    """uvicorn logged these after opening the store, between its start-up lines, and exited 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = main(["serve", str(store_path), "--port", str(port)])
    assert_one_line_error(status, capsys.readouterr().err, "serve", f"cannot listen on 127.0.0.1:{port}", "in use")
    status = main(["serve", str(store_path), "--host", "no-such-host.invalid", "--port", "0"])
    assert_one_line_error(status, capsys.readouterr().err, "serve", "--host 'no-such-host.invalid'")
    with embstore.open(store_path):  # the refused servers left the store closed
        pass


def test_serve_byte_flags_take_sizes_and_name_the_flag_when_wrong(capsys) -> None:
    args = build_parser().parse_args(["serve", "s", "--pooled-cache-bytes", "1MiB", "--max-body-bytes", "2KiB"])
    assert (args.pooled_cache_bytes, args.max_body_bytes) == (1 << 20, 2048)
    assert build_parser().parse_args(["serve", "s", "--pooled-cache-bytes", "0"]).pooled_cache_bytes == 0
    for flag, value in [("--pooled-cache-bytes", "-5"), ("--max-body-bytes", "0"), ("--max-body-bytes", "lots")]:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "s", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}:" in err and "config key" not in err, err


# --------------------------------------------------------------------------- hash fit, demo, import/export
@pytest.mark.parametrize("flag, value, words", [
    ("--buckets", "1", "expected an integer >= 2"), ("--dim", "0", "expected a positive integer"),
    ("--iterations", "-1", "expected a positive integer"), ("--context-size", "0", "expected a positive integer"),
    ("--seed", "-1", "expected an integer >= 0"), ("--dedicated-fraction", "2", "expected a number in [0, 1]"),
    ("--reserved-fraction", "nan", "expected a number in [0, 1]"),
    ("--batch-size", "0", "expected a positive integer")])
def test_hash_fit_refuses_bad_numbers_before_reading_the_trace(tmp_path, capsys, flag, value, words) -> None:
    """A fit's trace may take minutes to read: a bad number is refused first, naming the flag (these
    were refused by the fit, after the trace was read, as "config key 'dim'")."""
    argv = ["hash", "fit", str(tmp_path / "missing.npz"), "--buckets", "100", "--out", str(tmp_path / "h"),
            flag, value]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusal
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and flag in err and words in err and "missing.npz" not in err, err


def test_hash_fit_names_the_flag_of_a_value_only_the_fit_can_refuse(tmp_path, capsys) -> None:
    ids = np.arange(50, dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    assert main(["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "10", "--out", str(tmp_path / "h"),
                 "--reserved-fraction", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("embstore hash fit: error: --reserved-fraction: ") and "config key" not in err, err
    assert not (tmp_path / "h").exists()


def test_demo_refuses_a_file_as_its_output_folder_and_steps_below_one(tmp_path, capsys) -> None:
    (tmp_path / "afile").write_text("mine")
    assert main(["demo", "--quick", "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "Errno" not in err, err
    assert (tmp_path / "afile").read_text() == "mine"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--quick", "--steps", "0"])
    assert e.value.code == 2 and "argument --steps: expected a positive integer" in capsys.readouterr().err


def test_every_verb_explains_its_positional_arguments(capsys) -> None:
    """``--help`` of import/export/stats listed STORE, TABLE with no word about them."""
    for verb in ("create", "import", "export", "stats", "serve"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        positional = out.split("positional arguments:")[1].split("options:")[0]
        names = [line for line in positional.splitlines() if re.match(r"  \S", line)]
        assert names and all(len(line.split()) > 1 for line in names), (verb, positional)


def test_import_progress_counts_towards_the_rows_of_the_file(store_path, tmp_path, capsys) -> None:
    """Off a terminal the import's progress lines said '10 row', with no total to measure it against."""
    rows = np.arange(80, dtype=np.float32).reshape(10, 8)
    np.save(tmp_path / "rows.npy", rows)
    assert main(["import", str(store_path), "emb", str(tmp_path / "rows.npy"), "--start", "5"]) == 0
    assert "import emb: 10/10 row (100%)" in capsys.readouterr().err
    with embstore.open(store_path) as store:
        assert np.array_equal(store["emb"].lookup(np.arange(5, 15, dtype=np.int64)), rows)


@pytest.mark.parametrize("verb", ["replay", "tune"])
def test_a_bad_policy_names_the_flag_not_a_config_key(verb, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([verb, "t.npz", *(["--dram", "1MiB"] if verb == "tune" else []),
                                   "--policy", "lru,lru+foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --policy: 'lru+foo': give one of lru, lfu, clock" in err, err
    assert "config key" not in err
