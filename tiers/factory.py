"""Build a table's tier objects from its config (files live under the table's folder)."""

from __future__ import annotations

from pathlib import Path

from embstore.config import TierConfig, TierKind
from embstore.errors import ConfigError
from embstore.policies import MAX_CAPACITY
from embstore.tiers.base import Tier
from embstore.tiers.cache import CacheTier, DeviceTier, DRAMTier, MmapCacheTier

HOME_DIR = "home"  # the home tier's folder inside its table's folder


def capacity_rows(tier: TierConfig, row_bytes: int) -> int:
    """Rows a cache tier's byte capacity holds; an error when not even one fits."""
    assert tier.capacity is not None
    rows = tier.capacity // row_bytes
    if rows < 1:
        raise ConfigError("tiers.capacity", f"{tier.kind.value} capacity of {tier.capacity} bytes holds no row "
                          f"of {row_bytes} bytes")
    return rows


def device_for(name: str) -> str:
    """The torch device a device tier's ``device`` setting names: "auto" is cuda when torch sees a GPU, else
    the CPU; a GPU that is not there is a ConfigError (an explicit request is not quietly moved to the CPU)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            raise ConfigError("tiers.device", f"{name!r} asked for, but torch sees {count} GPU(s) here; use "
                                              "'auto' (a GPU when there is one, else the CPU) or 'cpu'")
    return name


def build_cache(tier: TierConfig, level: int, row_bytes: int, num_rows: int, directory: Path) -> CacheTier:
    rows = capacity_rows(tier, row_bytes)
    if MAX_CAPACITY < rows < num_rows:  # a cache of the whole table is direct-mapped, without that limit
        raise ConfigError("tiers.capacity", f"{tier.kind.value} capacity of {tier.capacity} bytes is {rows} rows of "
                          f"{row_bytes} bytes; a cache holds at most {MAX_CAPACITY} (2**31 - 1) rows unless it "
                          "holds the whole table")
    if tier.kind is TierKind.DEVICE:
        return DeviceTier(row_bytes, rows, tier.policy, num_rows, device=device_for(tier.device))
    if tier.kind is TierKind.DRAM:
        return DRAMTier(row_bytes, rows, tier.policy, num_rows)
    if tier.kind is TierKind.MMAP:
        return MmapCacheTier(directory / f"cache-{level}.mmap", row_bytes, rows, tier.policy, num_rows)
    raise ConfigError("tiers.kind", f"{tier.kind.value!r} cannot be a cache tier")


def build_home(tier: TierConfig, row_bytes: int, num_rows: int, directory: Path) -> Tier:
    """The persistent tier that holds every row; created on first open."""
    home_dir = directory / HOME_DIR
    if tier.kind is TierKind.SSD:
        from embstore.tiers.ssd import SSDTier
        from embstore.tiers.ssd_log import LogSSDTier

        cls = LogSSDTier if tier.layout == "log" else SSDTier
        return cls(home_dir, num_rows, row_bytes, queue_depth=tier.queue_depth)
    if tier.kind is TierKind.ROCKSDB:
        from embstore.tiers.rocksdb import RocksDBTier

        return RocksDBTier(home_dir, row_bytes, block_cache=tier.block_cache, write_buffer=tier.write_buffer,
                           compression=tier.compression)
    if tier.kind is TierKind.MMAP:
        from embstore.tiers.mmap import MmapTier

        return MmapTier(home_dir, num_rows, row_bytes)
    raise ConfigError("tiers.kind", f"{tier.kind.value!r} cannot be the home tier")


def build_tiers(tiers: tuple[TierConfig, ...], row_bytes: int, num_rows: int,
                directory: Path) -> tuple[list[CacheTier], Tier]:
    caches = [build_cache(t, i, row_bytes, num_rows, directory) for i, t in enumerate(tiers[:-1])]
    return caches, build_home(tiers[-1], row_bytes, num_rows, directory)
