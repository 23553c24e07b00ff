"""The HTML status page at ``GET /``: tables, tier occupancy, hit ratios, request rates.

Rendered on the server from the same snapshot ``/metrics`` formats, and
reloaded by the browser every few seconds (``<meta http-equiv="refresh">``),
so it needs no script.
"""

from __future__ import annotations

from html import escape
from typing import Any

REFRESH_SECONDS = 2

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
h2 { margin-bottom: 0.2em; }
.muted { color: #777; }
"""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ratio(hits: int, misses: int) -> str:
    total = hits + misses
    return _pct(hits / total) if total else "-"


def render(store_path: str, snapshot: dict[str, dict[str, Any]], rates: dict[str, float],
           totals: dict[str, int], reloads: int, state: str) -> str:
    """The page for a per-table ``snapshot`` (see ``app.snapshot``) and per-endpoint request rates."""
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
           "<title>embstore server</title>", f"<style>{_STYLE}</style></head><body>",
           f"<h1>embstore</h1><p class='muted'>store <code>{escape(store_path)}</code> &middot; {escape(state)} "
           f"&middot; {reloads} reload(s) &middot; refreshes every {REFRESH_SECONDS} s</p>",
           "<h2>Tables</h2>"]
    if not snapshot:
        out.append("<p class='muted'>no tables</p>")
    for name, s in snapshot.items():
        pc = s["pooled_cache"]
        b = s["batching"]
        out.append(f"<h3 class='table-name'>{escape(name)}</h3>"
                   f"<p>{s['num_embeddings']:,} rows &times; {s['dim']} {escape(s['dtype'])} &middot; "
                   f"{s['lookups']:,} ids looked up &middot; pooled cache hit ratio "
                   f"{_ratio(pc['hits'], pc['misses'])} ({pc['entries']:,} bags) &middot; "
                   f"{b['requests']:,} lookup requests in {b['batches']:,} tier reads</p>")
        out.append("<table><tr><th>tier</th><th>occupancy</th><th>resident rows</th><th>capacity rows</th>"
                   "<th>hits</th><th>misses</th><th>hit ratio</th><th>evictions</th></tr>")
        for tier, c in s["stats"].items():
            cap = c.get("capacity_rows", 0)
            occ = _pct(c.get("resident_rows", 0) / cap) if cap else "-"
            out.append(f"<tr><td>{escape(tier)}</td><td>{occ}</td><td>{c.get('resident_rows', 0):,}</td>"
                       f"<td>{cap:,}</td><td>{c.get('hits', 0):,}</td><td>{c.get('misses', 0):,}</td>"
                       f"<td>{_ratio(c.get('hits', 0), c.get('misses', 0))}</td>"
                       f"<td>{c.get('evictions', 0):,}</td></tr>")
        out.append("</table>")
    out.append("<h2>Requests</h2><table><tr><th>endpoint</th><th>requests/s (last 10 s)</th><th>total</th></tr>")
    for endpoint in sorted(totals):
        out.append(f"<tr><td>{escape(endpoint)}</td><td>{rates.get(endpoint, 0.0):.1f}</td>"
                   f"<td>{totals[endpoint]:,}</td></tr>")
    out.append("</table></body></html>")
    return "".join(out)
