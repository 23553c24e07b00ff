"""numba's cache keyed on the whole source tree (``embstore.numba_cache``): a kernel whose ``@njit`` callee lives
in another module recompiles when only the callee's file changes, instead of loading stale machine code.

Each run is a fresh interpreter (numba's cache only matters across processes) over a two-module package in
``tmp_path``, so the kernels are tiny and compile in well under a second.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
from numba import njit
from numba.core import caching
from numba.core.dispatcher import Dispatcher

import embstore
from embstore import numba_cache

ROOT = Path(__file__).resolve().parents[1]

CALLER = """\
from numba import njit

from cachepkg.callee import g


@njit(cache=True)
def f(x):
    return g(x) * 10
"""
CALLEE = """\
from numba import njit


@njit
def g(x):
    return x + {add}
"""

RUN = """\
import json, sys
sys.path.insert(0, {src!r})
if {use_locator!r}:
    from embstore import numba_cache
    assert numba_cache.install([{pkg!r}])
from cachepkg.caller import f
result = int(f(3))
stats = f.stats
print(json.dumps({{"result": result, "hits": sum(stats.cache_hits.values()), "cache_path": stats.cache_path}}))
"""


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "src" / "cachepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(CALLER)
    (pkg / "callee.py").write_text(CALLEE.format(add=1))
    return pkg


def _change_callee(pkg: Path) -> None:
    """Same size, new content and mtime: only the callee's module changes."""
    callee = pkg / "callee.py"
    before = callee.stat()
    callee.write_text(CALLEE.format(add=2))
    os.utime(callee, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))


def _run(pkg: Path, use_locator: bool, cache_dir: Path | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # Python's own .pyc (same size, mtime in seconds) plays no part
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    code = RUN.format(src=str(pkg.parent), pkg=str(pkg), use_locator=use_locator)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["in_tree", "NUMBA_CACHE_DIR"])
def test_a_callee_change_recompiles_the_caller(tmp_path: Path, where: str) -> None:
    """With the locator: changing only the callee's file gives the callee's new result; a rerun with no
    change loads the cache (the stamp is stable across processes); the cache stays where numba puts it."""
    pkg = _package(tmp_path)
    cache_dir = tmp_path / "numba-cache" if where == "NUMBA_CACHE_DIR" else None
    first = _run(pkg, True, cache_dir)
    assert (first["result"], first["hits"]) == ((3 + 1) * 10, 0)
    if cache_dir is None:
        assert first["cache_path"] == str(pkg / "__pycache__")
    else:
        assert Path(first["cache_path"]).parent == cache_dir
    if cache_dir is None:  # one variant is enough to pin this, and each run costs an interpreter
        again = _run(pkg, True, cache_dir)
        assert (again["result"], again["hits"], again["cache_path"]) == (40, 1, first["cache_path"])
    _change_callee(pkg)
    changed = _run(pkg, True, cache_dir)
    assert (changed["result"], changed["hits"]) == ((3 + 2) * 10, 0)


def test_numba_alone_runs_the_stale_callee(tmp_path: Path) -> None:
    """The problem the locator exists for (numba documents it): without it the caller's cached code, with the
    old callee inlined, is loaded. If this starts failing, numba tracks callees itself and the locator
    can go."""
    pkg = _package(tmp_path)
    assert _run(pkg, False, None)["result"] == 40
    _change_callee(pkg)
    stale = _run(pkg, False, None)
    assert (stale["result"], stale["hits"]) == (40, 1)


def _embstore_dispatchers() -> dict[str, Dispatcher]:
    """Every cached kernel of the distribution, found by importing each module that says ``cache=True``."""
    import importlib

    found = {}
    for prefix, directory in [("embstore", "embstore"), *[(p, p.split(".")[1]) for p in numba_cache.SUBPACKAGES]]:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if "cache=True" not in path.read_text():
                continue
            rel = path.relative_to(ROOT / directory).with_suffix("")
            name = ".".join([prefix, *rel.parts])
            module = importlib.import_module(name)
            for attr, value in vars(module).items():
                if isinstance(value, Dispatcher) and value.__module__ == name and value._cache.cache_path:
                    found[f"{name}.{attr}"] = value
    return found


def test_every_embstore_kernel_uses_the_tree_locator() -> None:
    dispatchers = _embstore_dispatchers()
    assert len(dispatchers) >= 60  # ~80 cache=True kernels today; a broken search finds none
    assert numba_cache.INSTALLED
    stamps = set()
    for name, dispatcher in dispatchers.items():
        locator = dispatcher._cache._impl.locator
        assert isinstance(locator, numba_cache.TreeLocatorMixin), name
        stamps.add(locator.get_source_stamp())
    assert len(stamps) == 1  # one digest of the whole tree, not one per file


def test_subpackages_mirror_pyproject_package_dir() -> None:
    """The tree is embstore/ plus the subpackages pyproject maps elsewhere; a new mapping must join it."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert sorted(mapping) == sorted(["embstore", *numba_cache.SUBPACKAGES])
    dirs = {os.path.realpath(d) for d in numba_cache.package_dirs()}
    assert dirs == {os.path.realpath(Path(embstore.__file__).parent.parent / d) for d in mapping.values()}


def test_the_stamp_follows_content_not_mtime(tmp_path: Path) -> None:
    """A checkout that rewrites identical files recompiles nothing; any content change, or a new file,
    anywhere in the tree does; __pycache__ and non-.py files are not part of it."""
    pkg = _package(tmp_path)

    def stamp() -> tuple[str, str]:
        return numba_cache.SourceTree([pkg]).stamp()

    base = stamp()
    os.utime(pkg / "callee.py", ns=(0, 10**18))
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.py").write_text("junk")
    (pkg / "notes.txt").write_text("junk")
    assert stamp() == base
    (pkg / "sub").mkdir()
    (pkg / "sub" / "new.py").write_text("")
    with_new = stamp()
    assert with_new != base
    _change_callee(pkg)
    assert stamp() not in (base, with_new)


def test_claims_only_files_in_its_tree(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    tree = numba_cache.SourceTree([pkg])
    locator_cls = numba_cache._locators(caching, tree)[1]
    assert issubclass(locator_cls, caching.InTreeCacheLocator)
    py_func = njit(lambda x: x).py_func
    outside = tmp_path / "elsewhere.py"  # a real file numba's own locator would take
    outside.write_text(CALLER)
    assert caching.InTreeCacheLocator.from_function(py_func, str(outside)) is not None
    assert locator_cls.from_function(py_func, str(outside)) is None
    inside = locator_cls.from_function(py_func, str(pkg / "caller.py"))
    assert inside.get_source_stamp() == tree.stamp()
    assert inside.get_cache_path() == str(pkg / "__pycache__")


def _broken_locator_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(caching, "InTreeCacheLocator")


def _tuple_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", tuple(caching.CacheImpl._locator_classes))


def _no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(caching.CacheImpl, "_locator_classes")


@pytest.mark.parametrize("break_numba", [_broken_locator_class, _tuple_registry, _no_registry])
def test_a_different_numba_api_falls_back_with_one_debug_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture,
                                                              break_numba: Any) -> None:
    monkeypatch.setattr(numba_cache, "_logged", set())
    before = list(getattr(caching.CacheImpl, "_locator_classes", []))
    break_numba(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="embstore.numba_cache"):
        assert numba_cache.install([tmp_path]) is False
        assert numba_cache.install([tmp_path / "other"]) is False
    assert [(r.levelno, r.name) for r in caplog.records] == [(logging.DEBUG, "embstore.numba_cache")]
    monkeypatch.undo()
    assert caching.CacheImpl._locator_classes == before


def test_a_locator_that_fails_leaves_the_function_to_numba(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _package(tmp_path)
    tree = numba_cache.SourceTree([pkg])
    monkeypatch.setattr(tree, "stamp", lambda: (_ for _ in ()).throw(OSError("gone")))
    monkeypatch.setattr(numba_cache, "_logged", set())
    locator_cls = numba_cache._locators(caching, tree)[1]
    assert locator_cls.from_function(njit(lambda x: x).py_func, str(pkg / "caller.py")) is None


def test_import_survives_a_numba_without_the_api(tmp_path: Path) -> None:
    """A future numba without these classes: embstore imports, and its kernels cache the default way."""
    code = textwrap.dedent("""\
        from numba.core import caching
        default = list(caching.CacheImpl._locator_classes)
        del caching.InTreeCacheLocator
        import embstore, embstore.kernels
        assert not embstore.numba_cache.INSTALLED
        assert caching.CacheImpl._locator_classes == default
        locator = embstore.kernels.scatter_rows._cache._impl.locator
        assert type(locator) in default, type(locator)
        print("ok")
        """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_LOCATOR_CLASSES"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
