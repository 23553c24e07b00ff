"""The store directory: config, manifest and one folder per table.

::

    STORE/
      config.toml        the tables' config (what `create` was given, normalised)
      manifest.json      format version and per-table layout; replaced atomically
      tables/NAME/       the table's tier files (home/, cache-N.mmap, ...)
      wal/               write-ahead log of ``update_logged`` writes not flushed yet (``embstore.wal``)
      .creating          only while ``create`` runs: what a crash leaves with it is debris, not a store
      LOCK               flock'ed while a Store has the directory open (see ``_lock_store``)

Both metadata files are written to a temporary file, fsynced and moved into
place with ``os.replace`` (then the directory is fsynced), so a crash leaves
either the old or the new version, never a torn one. Between the two files a
crash is repaired by the next open: the config is written first, and a table
it names that the manifest lacks (also one added to config.toml by hand) is
created empty, its entry added to the manifest. A table folder holding
``.relayout`` is being re-laid out (``ensure_state_dim``): it holds no rows,
and the next open of the table deletes its tier files before building them.
"""

from __future__ import annotations

import builtins
import dataclasses
import fcntl
import functools
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from embstore.atomic import atomic_file, atomic_write, fsync_dir
from embstore.config import HashKind, StoreConfig, TableConfig
from embstore.files import not_a_regular_file
from embstore.errors import (ConfigError, CorruptStoreError, EmbstoreError, StoreClosedError, StoreExistsError, StoreInUseError,
                             StoreNotFoundError, TableExistsError, UnknownTableError, tier_io_error)
from embstore.hierarchy import Hierarchy
from embstore.rows import RowFormat, initial_rows
from embstore.table import Table
from embstore.tiers.base import close_all
from embstore.tiers.factory import HOME_DIR, build_tiers
from embstore.wal import WAL_DIR, WriteAheadLog, read_records

log = logging.getLogger("embstore.store")

FORMAT = "embstore/1"
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
CREATING_FILE = ".creating"
LOCK_FILE = "LOCK"
RELAYOUT_FILE = ".relayout"

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _beside_close(method: _Method) -> _Method:
    """Run the Store method under its lifecycle lock, refused once the store is closed: close() waits
    for it. A table created or re-laid out meanwhile would stay open after the close (its tier files
    and locks held, the store's lock given up), and a flush's end deletes log segments, by then the
    next owner's."""
    @functools.wraps(method)
    def run(self: "Store", *args: Any, **kwargs: Any) -> Any:
        with self._lifecycle:
            self._check_open()
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


class Store:
    """An open store; use :func:`create` or :func:`open` rather than this constructor."""

    def __init__(self, path: Path, config: StoreConfig, manifest: dict[str, Any], lock_fd: int,
                 fresh: frozenset[str] = frozenset()) -> None:
        """``fresh``: the tables being created (by ``create``, or added from the config), whose homes do not
        exist yet; every other table's home must."""
        self.path = path
        self._lock_fd = lock_fd  # released by close(); by the caller if this constructor raises
        self.config = config
        self._manifest = manifest
        self.tables: dict[str, Table] = {}
        self._closed = False
        self._wal = WriteAheadLog(path / WAL_DIR)
        self._wal_lock = threading.Lock()  # the log's order is the order writes are applied in
        self._sync_lock = threading.Lock()  # one log sync or seal at a time (WriteAheadLog.synced); then _wal_lock
        self._lifecycle = threading.Lock()  # close() against flush, create_table, ensure_state_dim (_beside_close)
        try:
            for cfg in config.tables:
                self.tables[cfg.name] = self._open_table(cfg, fresh=cfg.name in fresh)
        except BaseException:  # release the tables opened so far: their tier locks would bar a retry
            close_all(list(self.tables.values()))
            raise

    # --- tables --------------------------------------------------------------------
    def _open_table(self, cfg: TableConfig, entry: dict[str, Any] | None = None, fresh: bool = False) -> Table:
        entry = entry if entry is not None else self._manifest["tables"].get(cfg.name)
        if entry is None:
            raise CorruptStoreError(f"{self.path / MANIFEST_FILE}: table {cfg.name!r} is in the config "
                                    "but not in the manifest")
        layout = _layout(cfg)
        changed = {k: (v, layout[k]) for k, v in entry.items() if k in layout and v != layout[k]}
        if changed:  # a home of another width may not notice (rocksdb): its rows would decode as garbage
            what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise CorruptStoreError(f"{self.path / CONFIG_FILE}: table {cfg.name!r} was created with another "
                                    f"layout ({what}); only its tiers may change")
        mapper = None
        if cfg.hash.kind is not HashKind.NONE:
            from embstore.hashing import build_hash

            mapper = build_hash(cfg.hash, cfg.num_embeddings, self.path, table=cfg.name,
                                store_tables={t.name for t in self.config.tables} | {cfg.name})
        dim = mapper.physical_dim(cfg.dim) if mapper is not None else cfg.dim
        fmt = RowFormat(dim, cfg.dtype, int(entry.get("state_dim", 0)))
        num_rows = mapper.num_rows if mapper is not None else cfg.num_embeddings
        table_dir = self.path / entry["dir"]
        relayout = (table_dir / RELAYOUT_FILE).exists()  # ensure_state_dim's old tier files, partly deleted maybe
        if not fresh and not relayout:
            _check_home_present(table_dir / HOME_DIR, cfg.name)
        table_dir.mkdir(parents=True, exist_ok=True)
        if relayout:
            _clear_tier_files(table_dir)
        caches, home = build_tiers(cfg.tiers, fmt.row_bytes, num_rows, table_dir)
        table = Table(cfg, fmt, Hierarchy(caches, home, lambda ids: _initial(cfg, fmt, ids)), mapper)
        table.store_flush = self.flush  # an import's flush must also retire the log's older writes
        if relayout:
            try:
                _drop_relayout_mark(table_dir)
            except BaseException:
                close_all([table])
                raise
        return table

    def __getitem__(self, name: str) -> Table:
        self._check_open()
        try:
            return self.tables[name]
        except KeyError:
            raise UnknownTableError(name, list(self.tables)) from None

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    @_beside_close
    def create_table(self, config: TableConfig | dict[str, Any], state_dim: int = 0) -> Table:
        """Add a table; its config and the manifest are persisted before it is returned."""
        cfg = config if isinstance(config, TableConfig) else TableConfig.from_dict(config)
        if cfg.name in self.tables:
            raise TableExistsError(f"table {cfg.name!r} already exists in {self.path}")
        manifest = json.loads(json.dumps(self._manifest))
        folder = self.path / _entry(cfg, state_dim)["dir"]
        # Nothing changes until the new metadata is written: a refused table leaves neither an entry in
        # the manifest the next create_table would persist (the store would not reopen) nor its files.
        # A folder already there is not in the manifest, the commit record: debris of a failed attempt.
        shutil.rmtree(folder, ignore_errors=True)
        table: Table | None = None
        old_config = (self.path / CONFIG_FILE).read_bytes()
        try:
            cfg = _adopt_mappings(self.path, StoreConfig((cfg,)), Path.cwd()).tables[0]  # copies a learned map in
            entry = manifest["tables"][cfg.name] = _entry(cfg, state_dim)  # with the adopted mapping's path
            new_config = StoreConfig((*self.config.tables, cfg))
            table = self._open_table(cfg, entry, fresh=True)  # validates hash files etc. before anything is persisted
            _write_config(self.path, new_config)  # from here a crash leaves the table, added by the next open
            _write_manifest(self.path, manifest)
        except BaseException:
            if table is not None:
                close_all([table])
            if self._restore_config(old_config, cfg.name):
                shutil.rmtree(folder, ignore_errors=True)
            raise
        self._manifest = manifest
        self.config = new_config
        self.tables[cfg.name] = table
        log.info("created table %s in %s", cfg.name, self.path)
        return table

    def _restore_config(self, old: bytes, name: str) -> bool:
        """Put back config.toml as it was before a failed create_table; False if that failed too (then the
        next open adds the table, empty, so its folder and learned-hash mapping must stay)."""
        try:
            if (self.path / CONFIG_FILE).read_bytes() != old:
                atomic_write(self.path / CONFIG_FILE, old)
            return True
        except OSError as exc:
            log.error("create_table(%r) failed and %s could not be restored (%s): the next open of %s adds "
                      "the table, empty", name, self.path / CONFIG_FILE, exc, self.path)
            return False

    @_beside_close
    def ensure_state_dim(self, name: str, state_dim: int) -> Table:
        """Give table ``name`` room for ``state_dim`` float32 optimizer-state columns beside each row.

        Training calls this so that one tier read or write moves a row and its
        optimizer state together. A table that already has that layout is
        returned as is; an empty table (nothing ever written: its home holds no
        row and no cache a dirty one; rows a lookup cached are initial values,
        which the seed gives again) is re-laid out in place; a table holding rows
        in another layout is refused rather than silently dropping its state
        (export and re-import it instead).
        """
        table = self[name]
        if table.format.state_dim == state_dim:
            return table
        if state_dim < 0:
            raise ValueError(f"state_dim must be >= 0, got {state_dim}")
        if table.hierarchy.home.resident_rows or any(c.dirty.any() for c in table.hierarchy.caches):
            raise TableExistsError(
                f"table {name!r} holds rows with {table.format.state_dim} optimizer-state columns; training with "
                f"this optimizer needs {state_dim}. Export its rows (embstore export), create a new store, and "
                "import them before training")
        table.close()
        manifest = json.loads(json.dumps(self._manifest))
        manifest["tables"][name]["state_dim"] = state_dim
        try:
            # The mark makes the old tier files debris whichever manifest a crash leaves: _open_table (now,
            # or at the next open) deletes them, then the mark, and only then builds the tiers.
            _mark(self.path / manifest["tables"][name]["dir"] / RELAYOUT_FILE)
            _write_manifest(self.path, manifest)
        except BaseException:
            self.tables[name] = self._open_table(table.config)  # the old layout, empty as before
            raise
        self._manifest = manifest
        self.tables[name] = self._open_table(table.config)
        log.info("table %s now stores %d optimizer-state columns per row", name, state_dim)
        return self.tables[name]

    # --- lifecycle -------------------------------------------------------------------
    @_beside_close
    def flush(self) -> None:
        """Make every write acknowledged so far durable."""
        with self._sync_lock, self._wal_lock:
            sealed = self._wal.seal()  # what was logged before this point is applied: the flush covers it
        for t in self.tables.values():
            t.flush()
        with self._wal_lock:
            self._wal.drop_before(sealed)

    def update_logged(self, name: str, ids: Any, rows: Any) -> None:
        """``store[name].update(ids, rows)``, first appended to the store's write-ahead log, so that
        :meth:`sync_log` makes it durable without a flush (the HTTP server acknowledges PUTs so).
        A crash before the next flush is repaired by the next :func:`open`, which replays the log. A
        write that fails to apply (a full disk under a write-back) is cut from the log before it raises."""
        table = self[name]
        arr, vals = table.check_update(ids, rows)  # a write that would be refused is not logged
        with self._wal_lock:
            self._check_open()  # again under the lock: a close() that ran meanwhile must not see it logged
            self._wal.append(name, arr, vals)
            try:
                table.update(arr, vals)
            except BaseException:  # the caller learns that the write failed: a replay must not bring it back
                self._wal.retract()
                raise

    def sync_log(self) -> None:
        """Make every ``update_logged`` write so far durable: one ``fdatasync`` of the log, run outside
        the store's lock; callers that queue behind a sync share the next one (group commit), and a
        caller whose writes an earlier sync or flush covered returns at once."""
        self._check_open()
        with self._wal_lock:
            target = self._wal.position()
        with self._sync_lock:
            with self._wal_lock:
                fd, seq, end = self._wal.sync_handle(target)
            if fd < 0:
                return
            try:
                os.fdatasync(fd)
            except OSError as exc:
                with self._wal_lock:
                    self._wal.sync_failed(seq)
                raise tier_io_error("write-ahead log", "sync", exc) from exc
            finally:
                os.close(fd)
            with self._wal_lock:
                self._wal.synced(seq, end)

    def _replay_log(self) -> None:
        """Apply what the write-ahead log holds (writes acknowledged before a crash), flush, drop it."""
        replayed = 0
        for name, ids, rows in read_records(self.path / WAL_DIR):
            if name not in self.tables:
                raise CorruptStoreError(f"{self.path / WAL_DIR}: a logged write to unknown table {name!r}")
            try:
                self.tables[name].update(ids, rows)
            except EmbstoreError as exc:
                raise CorruptStoreError(f"{self.path / WAL_DIR}: a logged write to {name!r} cannot be "
                                        f"applied: {exc}") from exc
            replayed += 1
        if (self.path / WAL_DIR).is_dir() and any((self.path / WAL_DIR).iterdir()):
            self.flush()  # seals nothing (no segment is open), so every segment goes
            log.warning("%s was not closed cleanly: replayed %d logged writes from its write-ahead log",
                        self.path, replayed)

    def close(self) -> None:
        """Flush and close the tables, then give up the store. A second close (another thread's) returns
        once the first has finished: a caller may reopen the store once its close returns."""
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            try:
                self._close()
            finally:  # even after a failure: the tiers are released, and the next open repairs from the log
                _unlock_store(self._lock_fd)

    def _close(self) -> None:
        try:
            with self._sync_lock, self._wal_lock:
                sealed = self._wal.seal()
        except BaseException:  # the tables still flush and close (releasing their tier locks, so that the
            try:               # store can be opened again); the log stays, replayed by the next open
                close_all(list(self.tables.values()))
            finally:
                self._wal.close()
            raise
        close_all(list(self.tables.values()))  # every table, even when one fails (then raises)
        with self._wal_lock:
            self._wal.drop_before(sealed)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Store {str(self.path)!r} tables={list(self.tables)}>"


def _initial(cfg: TableConfig, fmt: RowFormat, ids: Any) -> Any:
    """Encoded rows a never-written id reads as (the hierarchy's fallback below the home)."""
    return fmt.encode(initial_rows(cfg.init, ids, fmt.dim))


def _check_home_present(home: Path, name: str) -> None:
    """CorruptStoreError when the home of a table made before is gone or empty: each home kind would
    otherwise make a new, empty one in its place, and every row of the table would silently read as its
    initial value."""
    try:
        present = any(home.iterdir())
    except FileNotFoundError:
        present = False
    except NotADirectoryError:
        present = True  # the home tier says what is wrong with it
    except OSError as exc:
        raise tier_io_error("store", f"listing {home}", exc) from exc
    if not present:
        raise CorruptStoreError(f"{home}: the home of table {name!r}, which holds its rows, is missing or empty "
                                "(deleted?); restore it from a backup, or remove the table from config.toml and "
                                "manifest.json to drop it")


def _layout(cfg: TableConfig) -> dict[str, Any]:
    """What fixes how a table's stored rows read back; recorded at creation, checked at every open
    (stores made before it was recorded are not checked)."""
    return {"num_embeddings": cfg.num_embeddings, "dim": cfg.dim, "dtype": cfg.dtype.value,
            "init": cfg.init.to_dict(), "hash": cfg.hash.to_dict()}  # never-written rows, the id -> row map


def _entry(cfg: TableConfig, state_dim: int) -> dict[str, Any]:
    return {"dir": f"tables/{cfg.name}", "state_dim": state_dim, **_layout(cfg)}


def _check_entries(path: Path, tables: dict[str, Any]) -> None:
    """CorruptStoreError unless every table entry is what :func:`create` writes: its folder
    ``tables/NAME`` (never a path out of the store, whose files a re-layout would delete) and
    a ``state_dim`` >= 0."""
    for name, entry in tables.items():
        ok = (isinstance(entry, dict) and entry.get("dir") == f"tables/{name}"
              and type(entry.get("state_dim", 0)) is int and entry.get("state_dim", 0) >= 0)
        if not ok:
            raise CorruptStoreError(f"{path}: the entry of table {name!r} is damaged (expected "
                                    f'{{"dir": "tables/{name}", "state_dim": N >= 0}}, got {entry!r})')


def _write_file(target: Path, data: bytes) -> None:
    """:func:`atomic_write`, a failure raised as a typed error (DiskFullError on ENOSPC)."""
    try:
        atomic_write(target, data)
    except OSError as exc:
        raise tier_io_error("store", f"writing {target}", exc) from exc


def _mark(target: Path) -> None:
    """Create the empty file ``target`` durably. Not with atomic_write: a crash must leave the mark or
    nothing, not a temporary file that is neither."""
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        fsync_dir(target.parent)
    except OSError as exc:
        raise tier_io_error("store", f"creating {target}", exc) from exc


def _write_config(path: Path, config: StoreConfig) -> None:
    _write_file(path / CONFIG_FILE, config.to_toml().encode())


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest, after making the table folders' entries durable (it commits them)."""
    try:
        if (path / "tables").is_dir():
            fsync_dir(path / "tables")
    except OSError as exc:
        raise tier_io_error("store", f"syncing {path / 'tables'}", exc) from exc
    _write_file(path / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True).encode())


def _clear_tier_files(folder: Path) -> None:
    """Delete the tier files of a table that holds no rows; its learned-hash mapping (``hash*``, named by
    the config) and a re-layout mark stay."""
    try:
        for item in folder.iterdir():
            if not item.name.startswith("hash") and item.name != RELAYOUT_FILE:
                shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
        fsync_dir(folder)
    except OSError as exc:
        raise tier_io_error("store", f"deleting the tier files in {folder}", exc) from exc


def _drop_relayout_mark(folder: Path) -> None:
    """End a re-layout once its new tiers are built: until the mark is gone, a crash leaves tier files the
    next open deletes (they hold no rows); once it is, rows may land in them, and a table without its home
    is damage (:func:`_check_home_present`)."""
    try:
        (folder / RELAYOUT_FILE).unlink()
        fsync_dir(folder)
    except OSError as exc:
        raise tier_io_error("store", f"removing {folder / RELAYOUT_FILE}", exc) from exc


def _adopt_mappings(store_dir: Path, cfg: StoreConfig, base: Path) -> StoreConfig:
    """Copy learned-hash mapping files into the store so it is self-contained.

    A relative ``mapping`` is taken from ``base`` (the TOML file's folder, or
    the working directory); the config then names the copy, relative to the store.
    """
    tables = []
    for t in cfg.tables:
        if t.hash.kind is HashKind.LEARNED:
            src = Path(t.hash.mapping)
            src = src if src.is_absolute() else base / src
            kind = not_a_regular_file(src)
            if kind is not None:  # a FIFO would block the copy forever
                raise ConfigError("hash.mapping", f"table {t.name!r}: mapping file {str(src)!r} is {kind}, not a "
                                  "regular file")
            if not src.is_file():
                raise ConfigError("hash.mapping", f"table {t.name!r}: mapping file {str(src)!r} does not exist "
                                  "(fit one with `embstore hash fit`)")
            rel = f"tables/{t.name}/hash{src.suffix or '.ehash'}"
            (store_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            with builtins.open(src, "rb") as source, atomic_file(store_dir / rel) as copy:
                shutil.copyfileobj(source, copy)  # durable before the config that names it
            t = dataclasses.replace(t, hash=dataclasses.replace(t.hash, mapping=rel))
        tables.append(t)
    return StoreConfig(tuple(tables))


def _lock_store(path: Path) -> int:
    """An exclusive flock on ``STORE/LOCK``, held while a Store has the directory open: a second open
    (another process, such as ``embstore stats`` beside a server, or this one) would replay and delete the
    first one's write-ahead log under it, losing acknowledged writes, and write tier files behind its
    caches. The lock dies with its process, even on SIGKILL. Returns the descriptor that holds it.

    A failed create() removes the folder it made, LOCK included, before it lets go: a caller that opened
    that LOCK first then locks a file no longer in the folder, while another may have made the folder
    again and locked its new LOCK. So the lock counts only if LOCK is still the file locked; if it was
    replaced, the new one is tried once; if it is gone, or replaced again, the store is in use."""
    lock = path / LOCK_FILE
    for retry in (False, True):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError as exc:
            if retry:  # the folder went since the first try
                break
            raise tier_io_error("store", f"opening {lock}", exc) from exc
        except OSError as exc:
            raise tier_io_error("store", f"opening {lock}", exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, named = os.fstat(fd), os.stat(lock)
        except BlockingIOError:
            os.close(fd)
            raise StoreInUseError(f"{path} is open elsewhere (another process, such as a server, or another open "
                                  "Store in this one); close it first, or go through the server's HTTP API") from None
        except FileNotFoundError:
            os.close(fd)
            break
        except OSError as exc:
            os.close(fd)
            raise tier_io_error("store", f"locking {lock}", exc) from exc
        if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
            return fd
        os.close(fd)
    raise StoreInUseError(f"{path} changed while this process took its lock (a create() of it failed and removed "
                          "it, or another is making it); try again")


def _unlock_store(fd: int) -> None:
    """Release what :func:`_lock_store` took (closing the descriptor drops the flock)."""
    if fd >= 0:
        os.close(fd)


def create(path: str | os.PathLike, config: StoreConfig | str | os.PathLike) -> Store:
    """Create a store at ``path`` (which must not hold one) from a config or a TOML file."""
    p = Path(path)
    from_file = not isinstance(config, StoreConfig) and "\n" not in os.fspath(config)
    cfg = config if isinstance(config, StoreConfig) else StoreConfig.from_toml(os.fspath(config))
    _check_creatable(p)  # refuses a store or another folder before writing a lock file into it
    created = not p.exists()
    lock_fd = -1
    ours = False  # the folder's contents are this create()'s to remove on failure
    store: Store | None = None
    try:
        p.mkdir(parents=True, exist_ok=True)
        lock_fd = _lock_store(p)  # StoreInUseError while another create() (or an open Store) holds it
        # Again under the lock: a create() that held it during the check above may have finished since
        if _check_creatable(p):  # what a create() that died left: nothing in it was acknowledged
            log.warning("%s holds what an interrupted create() left; removing it to create the store again", p)
            _remove_contents(p, keep_dir=True, keep=LOCK_FILE)
        ours = True
        if created:
            fsync_dir(p.parent)
        _mark(p / CREATING_FILE)  # until the manifest is in place, the folder is debris
        cfg = _adopt_mappings(p, cfg, Path(os.fspath(config)).parent if from_file else Path.cwd())
        manifest = {"format": FORMAT, "tables": {t.name: _entry(t, 0) for t in cfg.tables}}
        store = Store(p, cfg, manifest, lock_fd, fresh=frozenset(t.name for t in cfg.tables))  # builds every
        # tier: a refused one (a capacity below a row) raises
        _write_config(p, cfg)
        _write_manifest(p, manifest)  # the commit: from here open() takes it
        (p / CREATING_FILE).unlink()
        fsync_dir(p)
    except BaseException:  # leave no half-made store behind, which neither open() nor a second create() takes
        try:
            if store is not None:
                close_all(list(store.tables.values()))
            if ours:  # never a folder another create() holds or made
                _remove_contents(p, keep_dir=not created)
        except Exception as cleanup:  # the caller needs the first error; what is left keeps its .creating mark
            log.warning("create(%s) failed, and so did removing what it made (%s); a later create() of the "
                        "same path removes it", p, cleanup)
        finally:
            _unlock_store(lock_fd)
        raise
    log.info("created store %s with tables %s", p, [t.name for t in cfg.tables])
    return store


def _check_creatable(p: Path) -> bool:
    """True if ``p`` holds what an interrupted create() left (its ``.creating`` mark, no manifest),
    which the caller removes once it holds the lock (no create() runs there then); False if ``p`` is
    missing or empty but for a lock file; else StoreExistsError."""
    if (p / MANIFEST_FILE).exists():
        raise StoreExistsError(f"{p} already holds a store (open it, or create the new one elsewhere)")
    if (p / CREATING_FILE).exists():
        return True
    if (p / CONFIG_FILE).exists():
        raise StoreExistsError(f"{p} already holds a store (open it, or create the new one elsewhere)")
    if p.exists() and (not p.is_dir() or any(c.name != LOCK_FILE for c in p.iterdir())):
        raise StoreExistsError(f"{p} exists and is not an empty directory")
    return False


def _remove_contents(path: Path, keep_dir: bool, keep: str | None = None) -> None:
    """Delete what create() wrote under ``path`` (and ``path`` itself unless it was there before), but
    not the file named ``keep``."""
    if not keep_dir:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        if child.name == keep:
            continue
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() else child.unlink()


def open(path: str | os.PathLike) -> Store:  # noqa: A001 - the SPEC's name
    """Reopen a store created by :func:`create`; refused (``StoreInUseError``) while another Store has it open."""
    p = Path(path)
    if not (p / MANIFEST_FILE).exists():
        if (p / CREATING_FILE).exists():
            raise StoreNotFoundError(f"no embstore store at {p}: its create() was interrupted (it holds "
                                     f"{CREATING_FILE}); create it again")
        raise StoreNotFoundError(f"no embstore store at {p} (missing {MANIFEST_FILE})")
    lock_fd = _lock_store(p)
    store: Store | None = None
    try:
        manifest = _read_manifest(p)
        try:
            cfg = StoreConfig.from_toml(p / CONFIG_FILE)
        except ConfigError as exc:
            raise CorruptStoreError(f"{p / CONFIG_FILE} cannot be read: {exc}") from exc
        missing = sorted(set(manifest["tables"]) - {t.name for t in cfg.tables})
        if missing:
            raise CorruptStoreError(f"{p / CONFIG_FILE} lacks table {missing[0]!r} listed in the manifest")
        added = _add_config_tables(p, cfg, manifest)
        store = Store(p, cfg, manifest, lock_fd, fresh=frozenset(added))
        if added:
            _write_manifest(p, manifest)
            log.warning("%s: table(s) %s were in %s but not in %s (a create_table interrupted, or added by "
                        "hand): created empty and added to the manifest", p, ", ".join(map(repr, added)),
                        CONFIG_FILE, MANIFEST_FILE)
        store._replay_log()
    except BaseException:
        if store is not None:
            close_all(list(store.tables.values()))
        _unlock_store(lock_fd)
        raise
    if (p / CREATING_FILE).exists():  # create() died after its manifest: the store is whole
        try:
            (p / CREATING_FILE).unlink()
        except OSError as exc:  # harmless where it stays: create() refuses a folder with a manifest
            log.warning("could not remove %s: %s", p / CREATING_FILE, exc)
    return store


def _read_manifest(p: Path) -> dict[str, Any]:
    """The store's manifest, checked: a ``CorruptStoreError`` if it cannot be read or is not one."""
    try:
        manifest = json.loads((p / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptStoreError(f"{p / MANIFEST_FILE} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("tables"), dict):
        raise CorruptStoreError(f"{p / MANIFEST_FILE} is not an {FORMAT} manifest")
    _check_entries(p / MANIFEST_FILE, manifest["tables"])
    return manifest


def _add_config_tables(path: Path, cfg: StoreConfig, manifest: dict[str, Any]) -> list[str]:
    """Give each config table the manifest lacks an entry (in ``manifest``), after deleting what a
    create_table that died left in its folder (tier files of a table that never held a row; a
    learned-hash mapping the config names stays). Returns their names."""
    added = [t for t in cfg.tables if t.name not in manifest["tables"]]
    for t in added:
        entry = manifest["tables"][t.name] = _entry(t, 0)
        if (path / entry["dir"]).is_dir():
            _clear_tier_files(path / entry["dir"])
    return [t.name for t in added]
