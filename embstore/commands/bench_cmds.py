"""`embstore bench`: run the benchmark scripts under tools/bench/ and print their ratios."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from embstore.atomic import atomic_write
from embstore import strict_json
from embstore.commands.argtypes import unwritable

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"


def available() -> dict[str, Path]:
    """Benchmark name -> script (tools/bench/bench_NAME.py of this checkout)."""
    if not BENCH_DIR.is_dir():
        return {}
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def register(sub: argparse._SubParsersAction) -> None:
    names = ", ".join(available()) or "(none found: run from a source checkout)"
    p = sub.add_parser("bench", help="run the benchmarks, printing ratios against their baselines",
                       description="Run benchmark scripts from tools/bench/. Each measures embstore and its "
                                   f"baseline in the same run and prints the ratio. Available: {names}.")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes (a minute or so each)")
    p.add_argument("--json", default=None, metavar="F.json", help="also write all figures to this JSON file")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run each named benchmark (all by default); one that fails (a missing baseline tool, a crash) is
    reported in one line and the others still run; exit status 1 when any failed."""
    scripts = available()
    unknown = [n for n in args.names if n not in scripts]
    if unknown or not scripts:
        print(f"embstore bench: error: unknown benchmark {unknown[0] if unknown else ''!r}; "
              f"available: {', '.join(scripts) or 'none (tools/bench/ not found)'}", file=sys.stderr)
        return 2
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        # checked before the runs, which take minutes, rather than when their figures are written
        print(f"embstore bench: error: --json {args.json!r}: not a file in an existing directory", file=sys.stderr)
        return 2
    if args.json and (why := unwritable(args.json)) is not None:
        print(f"embstore bench: error: --json: cannot write {args.json!r}: {why}", file=sys.stderr)
        return 2
    results, failed = {}, []
    for name in args.names or list(scripts):
        print(f"== {name} ==", flush=True)
        try:
            spec = importlib.util.spec_from_file_location(f"embstore_bench_{name}", scripts[name])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            results[name] = module.main(["--quick"] if args.quick else [])
        except (Exception, SystemExit) as exc:  # SystemExit: a script's own usage or setup error
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                continue
            failed.append(name)
            logging.getLogger("embstore.cli").debug("benchmark %s failed", name, exc_info=True)
            print(f"embstore bench: {name} failed: {exc if str(exc) else type(exc).__name__}", file=sys.stderr)
    if args.json:
        # atomically: a full disk keeps the previous figures, not a truncated JSON file; an undefined figure
        # (a ratio over nothing, a benchmark's NaN or infinity) is null: strict JSON
        atomic_write(args.json, strict_json.dumps(results, indent=2, default=_plain).encode())
    if failed:
        print(f"embstore bench: {len(failed)} of {len(failed) + len(results)} failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def _plain(value: object) -> object:
    """JSON for the numpy scalars and arrays in the figures (``float`` alone turned ints into floats and
    failed on arrays), NaN and infinities as null: json.dumps checks what this returns for them too."""
    return strict_json.json_safe(value.tolist() if hasattr(value, "tolist") else float(value))
