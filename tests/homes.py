"""Home tiers by the names tests parametrize over: a kind, or ``ssd-log`` for the ssd tier's log layout."""

from __future__ import annotations

from embstore.config import TierConfig


def home_tier(name: str) -> TierConfig:
    if name == "ssd-log":
        return TierConfig("ssd", layout="log")
    return TierConfig(name)


def tier_kind(name: str) -> str:
    """The kind a home reports in errors and stats."""
    return "ssd" if name == "ssd-log" else name
