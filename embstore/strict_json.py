"""Strict JSON for figures that can be undefined.

An AUC over one-class labels, a hit ratio over no accesses, a percentile over no samples are NaN. Python's
``json.dumps`` writes NaN and infinities as bare ``NaN`` / ``Infinity``, which strict parsers (``jq``,
JavaScript, Go) refuse; embstore writes them as ``null`` instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None (JSON null), through dicts, lists and tuples
    (tuples become lists, as json.dumps makes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``json_safe(value)`` that refuses any NaN it still meets (``allow_nan=False``)."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


__all__ = ["dumps", "json_safe"]
