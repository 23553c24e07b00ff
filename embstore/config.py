"""Typed store and table configuration, parsed from TOML.

Every dataclass is frozen and validated in ``__post_init__``; errors are
:class:`~embstore.errors.ConfigError` naming the offending key. ``to_dict``
gives back the TOML shape so a store can persist its own config.
"""

from __future__ import annotations

import enum
import re
from fractions import Fraction
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from embstore.errors import ConfigError
from embstore.files import check_regular_file


class RowDType(str, enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"


class TierKind(str, enum.Enum):
    DEVICE = "device"
    DRAM = "dram"
    MMAP = "mmap"
    SSD = "ssd"
    ROCKSDB = "rocksdb"

    @property
    def can_be_home(self) -> bool:
        return self in (TierKind.SSD, TierKind.ROCKSDB, TierKind.MMAP)


class PolicyKind(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"
    CLOCK = "clock"


class InitKind(str, enum.Enum):
    UNIFORM = "uniform"
    NORMAL = "normal"
    ZEROS = "zeros"


class HashKind(str, enum.Enum):
    NONE = "none"
    MOD = "mod"
    QR = "qr"
    LEARNED = "learned"


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
MAX_DIM = 65536  # values per row of a table (table.dim)
_CAPACITY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, key: str = "capacity") -> int:
    """``6400``, ``"6400"``, ``"64KiB"``, ``"2GiB"`` -> bytes (an int > 0)."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected bytes as an integer or a string like '64KiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _CAPACITY_RE.match(value.replace("_", ""))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(key, f"cannot read {value!r} as a size; use bytes or B/KiB/MiB/GiB/TiB, e.g. '256MiB'")
        exact = Fraction(m.group(1)) * _UNITS[unit]  # exact: a float would round sizes past 2**53
        if _UNITS[unit] == 1 and exact.denominator != 1:
            raise ConfigError(key, f"{value!r} is not a whole number of bytes")
        n = int(exact)  # "0.3KiB": whole bytes, rounded down
    else:
        raise ConfigError(key, f"expected bytes as an integer or a string like '64KiB', got {value!r}")
    if n <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    return n


def _enum(cls: type[enum.Enum], value: Any, key: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(key, f"{value!r} is not one of {allowed}") from None


def _check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; allowed keys: {', '.join(sorted(allowed))}")


def _check_applies(data: Mapping[str, Any], applies: set[str], where: str, what: str) -> None:
    """Refuse a known key that ``what`` (a kind of tier or hash) has no use for: ignoring it silently
    would leave the user believing it took effect."""
    misplaced = sorted(set(data) - applies)
    if misplaced:
        raise ConfigError(f"{where}.{misplaced[0]}", f"does not apply to {what}; its keys: "
                                                     f"{', '.join(sorted(applies))}")


@dataclass(frozen=True)
class PolicySpec:
    """An eviction policy plus an optional TinyLFU admission filter (``"lru+tinylfu"``)."""

    kind: PolicyKind = PolicyKind.LRU
    tinylfu: bool = False

    @classmethod
    def parse(cls, text: str | "PolicySpec", key: str = "policy") -> "PolicySpec":
        if isinstance(text, PolicySpec):
            return text
        if not isinstance(text, str):
            raise ConfigError(key, f"expected a string like 'lru' or 'lru+tinylfu', got {text!r}")
        parts = [p.strip().lower() for p in text.split("+")]
        tinylfu = "tinylfu" in parts
        rest = [p for p in parts if p != "tinylfu"]
        if len(rest) > 1 or parts.count("tinylfu") > 1:
            raise ConfigError(key, f"{text!r}: give one of lru, lfu, clock, optionally '+tinylfu'")
        kind = _enum(PolicyKind, rest[0] if rest else "lru", key)
        return cls(kind, tinylfu)

    def __str__(self) -> str:
        return self.kind.value + ("+tinylfu" if self.tinylfu else "")


_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


@dataclass(frozen=True)
class TierConfig:
    """One level of a table's hierarchy. ``capacity`` is bytes; None for a home tier."""

    kind: TierKind
    capacity: int | None = None
    policy: PolicySpec = field(default_factory=PolicySpec)
    queue_depth: int = 64  # ssd: io_uring submission depth
    block_cache: int = 64 << 20  # rocksdb block cache bytes
    write_buffer: int = 64 << 20  # rocksdb memtable bytes
    compression: str = "none"  # rocksdb: none | lz4 | zstd | snappy
    layout: str = "in_place"  # ssd: "in_place" (rows at fixed slots) | "log" (writes append; tiers/ssd_log.py)
    device: str = "auto"  # device: "auto" (cuda when torch sees a GPU, else cpu) | "cpu" | "cuda" | "cuda:N"

    _ALLOWED = {"kind", "capacity", "policy", "queue_depth", "block_cache", "write_buffer", "compression", "layout",
                "device"}
    _APPLIES = {  # keys a TOML tier of each kind may carry ("policy" too, on a cache: one with a capacity)
        TierKind.DEVICE: {"kind", "capacity", "device"}, TierKind.DRAM: {"kind", "capacity"}, TierKind.MMAP: {"kind", "capacity"},
        TierKind.SSD: {"kind", "queue_depth", "layout"},
        TierKind.ROCKSDB: {"kind", "block_cache", "write_buffer", "compression"},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(TierKind, self.kind, "tiers.kind"))
        object.__setattr__(self, "policy", PolicySpec.parse(self.policy, "tiers.policy"))
        if self.capacity is not None:
            object.__setattr__(self, "capacity", parse_bytes(self.capacity, "tiers.capacity"))
        for key in ("queue_depth",):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
                raise ConfigError(f"tiers.{key}", f"must be an integer in [1, 4096], got {v!r}")
        for key in ("block_cache", "write_buffer"):
            object.__setattr__(self, key, parse_bytes(getattr(self, key), f"tiers.{key}"))
        if self.compression not in ("none", "lz4", "zstd", "snappy"):
            raise ConfigError("tiers.compression", f"{self.compression!r} is not one of 'none', 'lz4', 'zstd', 'snappy'")
        if self.layout not in ("in_place", "log"):
            raise ConfigError("tiers.layout", f"{self.layout!r} is not one of 'in_place', 'log'")
        if self.layout != "in_place" and self.kind is not TierKind.SSD:
            raise ConfigError("tiers.layout", f"only an ssd tier has a layout, not {self.kind.value!r}")
        if not isinstance(self.device, str) or not _DEVICE_RE.fullmatch(self.device):
            raise ConfigError("tiers.device", f"{self.device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.device != "auto" and self.kind is not TierKind.DEVICE:
            raise ConfigError("tiers.device", f"only a device tier has a device, not {self.kind.value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TierConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("tiers", f"each tier must be a table like {{ kind = 'dram' }}, got {data!r}")
        _check_keys(data, cls._ALLOWED, "tiers")
        if "kind" not in data:
            raise ConfigError("tiers.kind", "missing; one of 'device', 'dram', 'mmap', 'ssd', 'rocksdb'")
        tier = cls(**dict(data))
        cache = tier.capacity is not None or not tier.kind.can_be_home
        applies = cls._APPLIES[tier.kind] | ({"policy"} if cache else set())
        if sorted(set(data) - applies) == ["policy"]:  # silently ignored, either would mislead
            raise ConfigError("tiers.policy", f"only a cache tier (one with a capacity) has a policy; this "
                                              f"{tier.kind.value!r} tier is a home")
        _check_applies(data, applies, "tiers", f"a {tier.kind.value!r} tier")
        return tier

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        if self.capacity is not None:
            out["capacity"] = self.capacity
            out["policy"] = str(self.policy)
        if self.kind is TierKind.SSD:
            out["queue_depth"] = self.queue_depth
            out["layout"] = self.layout
        if self.kind is TierKind.ROCKSDB:
            out.update(block_cache=self.block_cache, write_buffer=self.write_buffer, compression=self.compression)
        if self.device != "auto":
            out["device"] = self.device
        return out


@dataclass(frozen=True)
class InitConfig:
    """How never-written rows read: a function of (seed, row index) only."""

    kind: InitKind = InitKind.UNIFORM
    scale: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(InitKind, self.kind, "init.kind"))
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not (0 <= self.scale < float("inf")):
            raise ConfigError("init.scale", f"must be a finite number >= 0, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError("init.seed", f"must be an integer in [0, 2**63), got {self.seed!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "InitConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("init", f"expected a table like {{ kind = 'uniform', scale = 0.01 }}, got {data!r}")
        _check_keys(data, {"kind", "scale", "seed"}, "init")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "scale": self.scale, "seed": self.seed}


@dataclass(frozen=True)
class HashConfig:
    """Raw id -> row mapping applied by the store before the tiers."""

    kind: HashKind = HashKind.NONE
    seed: int = 0  # mod
    collisions: int = 4  # qr: ids sharing one quotient row
    combine: str = "mult"  # qr: mult | add | concat
    mapping: str | None = None  # learned: path of the fitted mapping

    _ALLOWED = {"kind", "seed", "collisions", "combine", "mapping"}
    _APPLIES = {  # keys a TOML hash of each kind may carry; to_dict writes exactly these
        HashKind.NONE: {"kind"}, HashKind.MOD: {"kind", "seed"}, HashKind.QR: {"kind", "collisions", "combine"},
        HashKind.LEARNED: {"kind", "mapping"},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _enum(HashKind, self.kind, "hash.kind"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError("hash.seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.collisions, bool) or not isinstance(self.collisions, int) or self.collisions < 1:
            raise ConfigError("hash.collisions", f"must be an integer >= 1, got {self.collisions!r}")
        if self.combine not in ("mult", "add", "concat"):
            raise ConfigError("hash.combine", f"{self.combine!r} is not one of 'mult', 'add', 'concat'")
        if self.mapping is not None and not isinstance(self.mapping, str):
            raise ConfigError("hash.mapping", f"expected a file path (a string), got {self.mapping!r}")
        if self.kind is HashKind.LEARNED and not self.mapping:
            raise ConfigError("hash.mapping", "a learned hash needs mapping = 'path/to/file' (see `embstore hash fit`)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HashConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("hash", f"expected a table like {{ kind = 'mod' }}, got {data!r}")
        _check_keys(data, cls._ALLOWED, "hash")
        h = cls(**dict(data))
        _check_applies(data, cls._APPLIES[h.kind], "hash", f"a {h.kind.value!r} hash")
        return h

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        if self.kind is HashKind.MOD:
            out["seed"] = self.seed
        elif self.kind is HashKind.QR:
            out.update(collisions=self.collisions, combine=self.combine)
        elif self.kind is HashKind.LEARNED:
            out["mapping"] = self.mapping
        return out


_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: its shape, row format, hash and tiers (fastest first)."""

    name: str
    num_embeddings: int
    dim: int
    dtype: RowDType = RowDType.FLOAT32
    init: InitConfig = field(default_factory=InitConfig)
    hash: HashConfig = field(default_factory=HashConfig)
    tiers: tuple[TierConfig, ...] = (TierConfig(TierKind.SSD),)

    _ALLOWED = {"name", "num_embeddings", "dim", "dtype", "init", "hash", "tiers"}

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):  # match: '$' passed 't\n'
            raise ConfigError("table.name", f"{self.name!r}: use 1-128 letters, digits, '_', '-' or '.', "
                                            "starting with a letter, digit or '_'")
        for key, hi in (("num_embeddings", 2**62), ("dim", MAX_DIM)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ConfigError(f"table.{key}", f"must be an integer in [1, {hi}], got {v!r}")
        object.__setattr__(self, "dtype", _enum(RowDType, self.dtype, "table.dtype"))
        if not isinstance(self.init, InitConfig):  # from_dict refuses anything but a TOML table
            object.__setattr__(self, "init", InitConfig.from_dict(self.init))
        if not isinstance(self.hash, HashConfig):
            object.__setattr__(self, "hash", HashConfig.from_dict(self.hash))
        tiers = tuple(t if isinstance(t, TierConfig) else TierConfig.from_dict(t) for t in self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if not tiers:
            raise ConfigError("table.tiers", "at least one tier (the home) is needed")
        home = tiers[-1]
        if not home.kind.can_be_home:
            raise ConfigError("table.tiers", f"the last tier is every row's home and must be persistent "
                              f"('ssd', 'rocksdb' or 'mmap'), got {home.kind.value!r}")
        if home.capacity is not None:
            raise ConfigError("tiers.capacity", "the home tier holds every row; give no capacity for it")
        for t in tiers[:-1]:
            if t.kind in (TierKind.SSD, TierKind.ROCKSDB):
                raise ConfigError("tiers.kind", f"{t.kind.value!r} can only be the last (home) tier")
            if t.capacity is None:
                raise ConfigError("tiers.capacity", f"cache tier {t.kind.value!r} needs a capacity, e.g. '256MiB'")
        if self.num_embeddings > 2**40 and home.kind is not TierKind.ROCKSDB:
            raise ConfigError("table.num_embeddings", f"{self.num_embeddings} rows need a sparse home; use kind = 'rocksdb'")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TableConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("table", f"expected a [[table]] section, got {data!r}")
        _check_keys(data, cls._ALLOWED, "table")
        for key in ("name", "num_embeddings", "dim"):
            if key not in data:
                raise ConfigError(f"table.{key}", "missing")
        d = dict(data)
        if "tiers" in d:
            if not isinstance(d["tiers"], (list, tuple)):
                raise ConfigError("table.tiers", f"expected a list of tiers, got {d['tiers']!r}")
            d["tiers"] = tuple(d["tiers"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_embeddings": self.num_embeddings,
            "dim": self.dim,
            "dtype": self.dtype.value,
            "init": self.init.to_dict(),
            "hash": self.hash.to_dict(),
            "tiers": [t.to_dict() for t in self.tiers],
        }


def parse_toml(text: str) -> dict[str, Any]:
    """TOML text -> dict; a syntax error is a ``ConfigError`` on key ``config``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"not valid TOML: {exc}") from exc


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file -> dict; a missing, unreadable or non-UTF-8 file is a ``ConfigError`` naming it."""
    name = str(path)
    check_regular_file(path, "config file", lambda why: ConfigError("config", why))  # a FIFO would block forever
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # ENOTDIR: a parent in the path is a file
        raise ConfigError("config", f"file {name!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError("config", f"{name!r} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError("config", f"file {name!r} is not readable (permission denied)") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"file {name!r} is not UTF-8 text (byte {exc.start}), so not TOML") from None
    try:
        return parse_toml(text)
    except ConfigError as exc:
        raise ConfigError("config", f"file {name!r}: {exc.reason}") from exc


def from_toml_file(build: Any, path: str | Path) -> Any:
    """``build(read_toml(path))``, with a bad key's error naming the file too: the user has one line
    to find it by."""
    data = read_toml(path)
    try:
        return build(data)
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{exc.reason} (in {str(path)!r})") from exc


@dataclass(frozen=True)
class StoreConfig:
    """A whole store: its tables."""

    tables: tuple[TableConfig, ...] = ()

    def __post_init__(self) -> None:
        tables = tuple(t if isinstance(t, TableConfig) else TableConfig.from_dict(t) for t in self.tables)
        object.__setattr__(self, "tables", tables)
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError("table.name", f"duplicate table name {dup[0]!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StoreConfig":
        _check_keys(data, {"table"}, "store")
        tables = data.get("table", [])
        if not isinstance(tables, list):
            raise ConfigError("table", "use [[table]] sections (an array of tables)")
        return cls(tuple(TableConfig.from_dict(t) for t in tables))

    @classmethod
    def from_toml(cls, source: str | Path) -> "StoreConfig":
        """Parse a TOML file path (or TOML text when it contains a newline, or a '[' and names no file)."""
        text = str(source)
        if isinstance(source, Path) or ("\n" not in text and ("[" not in text or _names_a_file(text))):
            return from_toml_file(cls.from_dict, text)
        return cls.from_dict(parse_toml(text))

    def to_dict(self) -> dict[str, Any]:
        return {"table": [t.to_dict() for t in self.tables]}

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of something on disk (one-line TOML text is too long or odd for one)."""
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # ENAMETOOLONG, an embedded NUL
        return False


_TOML_ESCAPES = re.compile(r'[\x00-\x1f\x7f"\\]')  # what a TOML basic string may not hold as is


def _toml_escape(m: re.Match[str]) -> str:
    """A quote or backslash behind a backslash; a control character, which no TOML string holds as is,
    as \\uXXXX."""
    c = m.group()
    return "\\" + c if c in '"\\' else f"\\u{ord(c):04x}"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + _TOML_ESCAPES.sub(_toml_escape, v) + '"'
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, Mapping) for x in v):
            return "[\n" + "".join(f"  {_toml_value(x)},\n" for x in v) + "]"
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """Write the small TOML subset our configs use (top-level keys, arrays of tables)."""
    lines: list[str] = []
    for k, v in data.items():
        if not (isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v)):
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in data.items():
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            for item in v:
                lines.append(f"\n[[{k}]]")
                lines.extend(f"{ik} = {_toml_value(iv)}" for ik, iv in item.items())
    return "\n".join(lines).lstrip("\n") + "\n"


__all__ = [
    "ConfigError", "HashConfig", "HashKind", "InitConfig", "InitKind", "PolicyKind", "PolicySpec",
    "RowDType", "StoreConfig", "TableConfig", "TierConfig", "TierKind", "dumps_toml", "from_toml_file", "parse_bytes",
    "parse_toml", "read_toml",
]
