"""`embstore bench`: run the benchmark scripts under tools/bench/ and print their ratios."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

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
    p.add_argument("--json", default=None, help="also write all figures to this JSON file")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    scripts = available()
    unknown = [n for n in args.names if n not in scripts]
    if unknown or not scripts:
        print(f"embstore bench: error: unknown benchmark {unknown[0] if unknown else ''!r}; "
              f"available: {', '.join(scripts) or 'none (tools/bench/ not found)'}", file=sys.stderr)
        return 2
    results = {}
    for name in args.names or list(scripts):
        print(f"== {name} ==", flush=True)
        spec = importlib.util.spec_from_file_location(f"embstore_bench_{name}", scripts[name])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        results[name] = module.main(["--quick"] if args.quick else [])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))
    return 0
