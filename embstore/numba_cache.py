"""numba's on-disk kernel cache, keyed on the whole embstore source tree instead of each kernel's own file.

numba stamps a ``cache=True`` function's cache entry with its own source file only, so a kernel that
calls an ``@njit`` helper from another module (``kernels.py`` -> ``hash_index.mix64``, ``training/_kernels``
-> ``prefetch``) keeps loading machine code with the *old* helper inlined after only the helper's file
changed: a documented numba limitation, harmless for a wheel install, silent stale kernels in an editable
checkout after a ``git pull`` or ``checkout`` that touches only the callee. Here the stamp of every
embstore kernel is one digest of every ``.py`` file of the distribution (``embstore/``, ``tiers/``,
``hashing/``, ``server/``, ``training/``), so any source change recompiles each kernel once, when it next
runs, and nothing stale ever runs.

Cost: one read and SHA-256 of the ~85 source files (~0.75 MB) per process, on the first ``cache=True``
decoration (a few ms next to numba's own import); after an edit anywhere, every kernel used recompiles
once. The cache directory is the one numba picks today: the locators subclass numba's file-backed ones in
numba's own order (``NUMBA_CACHE_DIR``, the source tree's ``__pycache__``, the user-wide cache) and change
only the stamp. ``NUMBA_CACHE_LOCATOR_CLASSES`` (numba's own override) bypasses them.

numba's locator list is private API: if it differs (a future numba), ``install`` logs once at debug level
and leaves numba's default behaviour, never failing the import.

Imported first thing by ``embstore/__init__.py``: every embstore module (``tiers``, ``hashing``,
``training`` and ``server`` are only importable as ``embstore.*``) runs after it, so every kernel is
decorated with these locators in place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from typing import Any, Iterable, Iterator

log = logging.getLogger("embstore.numba_cache")

SUBPACKAGES = ("embstore.tiers", "embstore.hashing", "embstore.server", "embstore.training")
"""The packages that pyproject's ``[tool.setuptools.package-dir]`` maps outside ``embstore/``."""

_NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
"""numba's file-backed locators, in the order numba tries them (so the cache directory does not move)."""

_STAMP_TAG = "embstore-source-tree-v1"
_logged: set[str] = set()
_installed: dict[tuple[str, ...], list[type]] = {}


def _debug_once(key: str, message: str, *args: Any) -> None:
    """A fallback is news the first time, noise after (and no user's concern: numba's default still works)."""
    if key not in _logged:
        _logged.add(key)
        log.debug(message, *args, exc_info=True)


def _py_files(roots: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(name in the digest, real path) of each ``.py`` file under ``roots``; the name is root-relative so a
    moved checkout keeps its stamp."""
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, os.path.dirname(root))
                    yield rel.replace(os.sep, "/"), os.path.realpath(path)


def _digest(files: Iterable[tuple[str, str]]) -> str:
    """Content, not mtime (as numba's own stamp): a checkout that rewrites identical files recompiles nothing."""
    h = hashlib.sha256()
    for name, path in sorted(files):
        h.update(name.encode() + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        except OSError:  # vanished mid-checkout: still a stamp, just one that will not match next time
            h.update(b"unreadable")
    return h.hexdigest()


class SourceTree:
    """The ``.py`` files under some directories, and one digest of them all, computed once per process."""

    def __init__(self, roots: Iterable[str | os.PathLike[str]]) -> None:
        self.roots = tuple(sorted({os.path.realpath(r) for r in roots}))
        self._files: list[tuple[str, str]] | None = None
        self._paths: frozenset[str] = frozenset()
        self._stamp: tuple[str, str] | None = None

    def _scan(self) -> None:
        if self._files is None:
            files = list(_py_files(self.roots))
            self._paths = frozenset(path for _, path in files)
            self._files = files

    def contains(self, py_file: str) -> bool:
        self._scan()
        return os.path.realpath(py_file) in self._paths

    def stamp(self) -> tuple[str, str]:
        if self._stamp is None:
            self._scan()
            assert self._files is not None
            self._stamp = (_STAMP_TAG, _digest(self._files))
        return self._stamp


class TreeLocatorMixin:
    """Claims only functions defined in its tree's files and stamps them with the tree's digest; the rest
    (cache path, writability checks) is the numba locator it is mixed into."""

    _tree: SourceTree

    def get_source_stamp(self) -> tuple[str, str]:
        return self._tree.stamp()

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        """``None`` (numba tries its next locator) for a function outside the tree, or when anything fails."""
        try:
            if not cls._tree.contains(py_file):
                return None
            locator = super().from_function(py_func, py_file)  # type: ignore[misc]
            if locator is not None:
                locator.get_source_stamp()  # fail here, where numba can fall back, not in its Cache()
            return locator
        except Exception:
            _debug_once("locate", "embstore's numba cache locator failed for %s; numba's default used", py_file)
            return None


def package_dirs() -> list[str]:
    """embstore's source directories: this file's package plus the subpackages mapped elsewhere (an editable
    checkout's ``tiers/``...; inside ``embstore/`` in a wheel, where the set removes the duplicate)."""
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    for name in SUBPACKAGES:
        spec = importlib.util.find_spec(name)  # finds without importing (embstore itself is mid-import)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    return dirs


def _locators(caching: Any, tree: SourceTree) -> list[type]:
    classes = []
    for name in _NUMBA_LOCATORS:
        base = getattr(caching, name)
        if not (isinstance(base, type) and callable(getattr(base, "from_function", None))
                and callable(getattr(base, "get_source_stamp", None))):
            raise TypeError(f"numba.core.caching.{name} is not the locator class this was written against")
        classes.append(type("Tree" + name, (TreeLocatorMixin, base), {"_tree": tree, "__module__": __name__}))
    return classes


def install(roots: Iterable[str | os.PathLike[str]] | None = None) -> bool:
    """Put locators for ``roots`` (default: embstore's own directories) in front of numba's.

    False when numba's private caching API is not the one this was written against: numba's default
    (per-file stamps) then stays in force. Installing the same roots twice is a no-op.
    """
    try:
        from numba.core import caching

        tree = SourceTree(package_dirs() if roots is None else roots)
        if tree.roots in _installed:
            return True
        registry = caching.CacheImpl._locator_classes
        if not isinstance(registry, list):
            raise TypeError(f"numba's CacheImpl._locator_classes is a {type(registry).__name__}, not a list")
        classes = _locators(caching, tree)
        registry[:0] = classes
        _installed[tree.roots] = classes
        return True
    except Exception:
        _debug_once("install", "numba's cache API differs from the one embstore.numba_cache knows; kernels "
                    "use numba's per-file cache stamps (stale if only a callee's module changes)")
        return False


INSTALLED = install()
"""Whether embstore's kernels are stamped with the whole source tree in this process."""
