"""Online cache policies against Belady's MIN on dlrm2021-like traces.

    python -m tools.bench.bench_policies [--quick] [--drift R]

For one cache over all tables (rows are (table, id) pairs, per-batch
deduplicated accesses), at 1%, 5% and 10% of the unique rows, prints each
policy's hit ratio and its share of MIN's hit ratio (the baseline, measured in
the same run). Goal: the best policy >= 95% of MIN. ``--drift R`` generates the
trace with temporal locality: each batch, every rank of a table's popularity
ranking passes to a newcomer with probability R (``embstore.tracegen``); the
default 0 is a fixed ranking.

The store's policies are then run again told each batch and the K after it
before it is read (``Table.announce``, what a training pipeline with
``announce=K`` does: ``embstore.lookahead``): inside that window they rank rows
as MIN does, outside it by their own policy. These are store policies, but not
online ones (they know K batches of the future), so they are reported apart
from "best".

Reference points follow (they are not policies the store can run, and do not
count as "best"):

- ``exact-lfu``: an online LFU that remembers the exact count of every row ever
  seen (unbounded memory): a row enters at its count, the victim is the least
  counted resident (least recently used among equals), a row is admitted only
  when its count beats the victim's. On a trace whose popularity is stationary
  (drift 0), ranking rows by count is what any online policy can do at best, so
  this is the ceiling of the frequency-based policies above; with drift, old
  counts mislead it and it is no ceiling.
- ``topk-hindsight``: the best fixed set of rows chosen with the whole trace's
  counts (offline: it knows the future), filled on first access.
- ``oracle-topk`` (drift 0 only): a fixed set of the rows drawn in the most
  of ``ORACLE_BATCHES`` *later* batches of the same generator (a second sample
  of the same popularity, not this trace's draws), filled on first access, no
  other row admitted. On a trace whose popularity never changes, a fixed set of
  the most popular rows is the most an online cache can expect to hit (it can
  only learn the popularity), so this is about what a perfect online policy
  would get.
- ``ahead-K``: what a look-ahead window buys. A cache that sees the current
  batch and the next K (as a training pipeline can: its data loader reads ids
  ahead) and knows, for every row, its next use inside that window: it evicts
  (or declines to admit) the row used latest, as MIN does, and ranks the rows
  with no use in the window by exact-lfu's counts, below every row that has
  one. With K past the trace's end it is MIN with bypass (optimal); with K = 0
  it is exact-lfu that still sees the current batch.
"""

from __future__ import annotations

import argparse
import json

import numba
import numpy as np

from embstore import tracegen
from embstore.belady import _heap_pop, _heap_push, belady_hits, dedup_batches, next_use
from embstore.commands.argtypes import share
from embstore.simulator import miss_ratio_curve
from embstore.traces import dense_keys

POLICIES = ("lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu")
FRACTIONS = (0.01, 0.05, 0.10)


# not cache=True: the cache records the module name the script was loaded under (``__main__``,
# ``tools.bench.bench_policies``, or `embstore bench`'s unnamed module) and a run loaded under another name
# failed to import it (ModuleNotFoundError: No module named '<dynamic>')
@numba.njit
def exact_lfu_hits(keys, num_keys, max_count, capacity):  # pragma: no cover - numba
    """Hits of the exact full-history LFU (see module doc); ``keys`` in ``[0, num_keys)``."""
    cnt = np.zeros(num_keys, np.int64)
    resident = np.zeros(num_keys, np.bool_)
    prv = np.full(num_keys, -1, np.int64)
    nxt = np.full(num_keys, -1, np.int64)
    head = np.full(max_count + 2, -1, np.int64)  # one recency list per count
    tail = np.full(max_count + 2, -1, np.int64)
    n_res = 0
    low = 0
    hits = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        cnt[k] += 1
        c = cnt[k]
        if resident[k]:
            hits += 1
            p, q = prv[k], nxt[k]  # unlink from list c - 1
            if p >= 0:
                nxt[p] = q
            else:
                head[c - 1] = q
            if q >= 0:
                prv[q] = p
            else:
                tail[c - 1] = p
        else:
            if n_res >= capacity:
                while head[low] < 0:
                    low += 1
                if c <= low:
                    continue
                v = head[low]
                head[low] = nxt[v]
                if nxt[v] >= 0:
                    prv[nxt[v]] = -1
                else:
                    tail[low] = -1
                resident[v] = False
                n_res -= 1
            resident[k] = True
            n_res += 1
        prv[k] = tail[c]  # append to list c
        nxt[k] = -1
        if tail[c] >= 0:
            nxt[tail[c]] = k
        else:
            head[c] = k
        tail[c] = k
        low = min(low, c)
        while head[low] < 0:
            low += 1
    return hits


@numba.njit
def lookahead_hits(keys, offsets, nxt, num_keys, max_count, capacity, ahead):  # pragma: no cover - numba
    """Hits of ``ahead-K`` (see module doc) with K = ``ahead``; ``nxt`` is ``embstore.belady.next_use(keys)``,
    ``offsets`` the batch boundaries. One max-heap of every resident's rank, stale entries skipped (a row's
    live rank is ``rank[row]``), encoded ``rank * num_keys + row``: a row used in the window ranks by that
    use's position (< n); one without ranks above all of those, by fewer counts, then older last use. A row
    whose next use lies beyond the window waits in that batch's list and is re-ranked when it enters."""
    n = keys.shape[0]
    nb = offsets.shape[0] - 1
    count = np.zeros(num_keys, np.int64)
    resident = np.zeros(num_keys, np.bool_)
    rank = np.full(num_keys, -1, np.int64)
    use = np.zeros(num_keys, np.int64)  # next use of each resident row
    heap = np.empty(2 * n + 1, np.int64)
    size = 0
    batch = np.empty(n, np.int64)
    for b in range(nb):
        batch[offsets[b]:offsets[b + 1]] = b
    waiting = np.full(nb, -1, np.int64)  # per batch, a linked list of (row, its rank when it began waiting)
    wait_next = np.empty(n, np.int64)
    wait_row = np.empty(n, np.int64)
    wait_rank = np.empty(n, np.int64)
    nwait = 0
    used = 0
    hits = 0
    for b in range(nb):
        if b + ahead < nb:  # batch b + ahead enters the window: its resident rows' next uses are known now
            e = waiting[b + ahead]
            while e >= 0:
                r = wait_row[e]
                if resident[r] and rank[r] == wait_rank[e]:
                    rank[r] = use[r]
                    size = _heap_push(heap, size, use[r] * num_keys + r)
                e = wait_next[e]
        window_end = offsets[min(b + ahead + 1, nb)]
        for i in range(offsets[b], offsets[b + 1]):
            x = keys[i]
            count[x] += 1
            q = nxt[i]
            if resident[x]:
                hits += 1
            elif used < capacity:
                resident[x] = True
                used += 1
            else:
                while True:  # the live top of the heap: the victim
                    top = heap[0]
                    y = top % num_keys
                    if resident[y] and rank[y] == top // num_keys:
                        break
                    _, size = _heap_pop(heap, size)
                if top // num_keys >= n:  # no resident row is used in the window: x must out-count y
                    if q >= window_end and count[x] <= count[y]:
                        continue
                elif q >= window_end or q > top // num_keys:  # every resident row is used before x
                    continue
                _, size = _heap_pop(heap, size)
                resident[y] = False
                rank[y] = -1
                resident[x] = True
            use[x] = q
            if q < window_end:
                rank[x] = q
            else:
                rank[x] = n + (max_count + 1 - count[x]) * (n + 1) + (n - i)
                if q < n:
                    wait_row[nwait] = x
                    wait_rank[nwait] = rank[x]
                    wait_next[nwait] = waiting[batch[q]]
                    waiting[batch[q]] = nwait
                    nwait += 1
            size = _heap_push(heap, size, rank[x] * num_keys + x)
    return hits


AHEAD = (1, 4, 16, 32)
ANNOUNCE = (4, 16, 32)  # batches the store policies are told ahead
ANNOUNCED_POLICIES = ("lru+tinylfu", "lfu+tinylfu")

ORACLE_BATCHES = 500  # later batches the popularity oracle counts (quick: 100)


def popularity_oracle_hits(keys: np.ndarray, counts: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Hits on ``keys`` at each capacity ``c`` in ``caps`` of a cache that admits only the ``c`` rows with the
    highest ``counts`` (ties: the lower key) and keeps them: every access to one of them but its first."""
    order = np.lexsort((np.arange(counts.size), -counts))
    rank = np.empty(counts.size, np.int64)
    rank[order] = np.arange(counts.size)
    ranks = rank[keys]
    first = rank[np.unique(keys)]
    return np.array([int(np.count_nonzero(ranks < c) - np.count_nonzero(first < c)) for c in caps.tolist()],
                    np.int64)


def later_popularity(size: dict, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """(the bench trace's per-batch deduplicated keys, each row's count of the ``extra`` batches after it
    that draw it), over one key space: the generator's batches are a prefix of a longer run of it
    (drift 0: a drifting ranking has no popularity to learn)."""
    tr = tracegen.generate("dlrm2021", seed=0, **{**size, "batches": size["batches"] + extra})
    dense = dense_keys(tr)[0]
    off = tr.batch_offsets
    cut = int(off[size["batches"]])
    first = dedup_batches(dense[:cut], off[:size["batches"] + 1])[0]
    later = dedup_batches(dense[cut:], off[size["batches"]:] - cut)[0]
    return first, np.bincount(later, minlength=int(dense.max()) + 1 if dense.size else 0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small trace")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    ap.add_argument("--drift", type=share, default=0.0, metavar="R",
                    help="share of each table's popularity ranking replaced per batch (default 0)")
    args = ap.parse_args(argv)
    size = dict(batches=20, batch_size=2048, tables=4, ids=200_000) if args.quick else \
        dict(batches=100, batch_size=8192, tables=8, ids=2_000_000)
    tr = tracegen.generate("dlrm2021", seed=0, drift=args.drift, **size)
    keys, off = dedup_batches(dense_keys(tr)[0], tr.batch_offsets)
    uniq = int(np.unique(keys).size)
    caps = np.array([max(1, int(f * uniq)) for f in FRACTIONS], np.int64)
    out: dict = {"drift": args.drift, "accesses": int(keys.size), "unique_rows": uniq, "fractions": list(FRACTIONS),
                 "capacities": caps.tolist(), "belady_hit_ratio": [], "policies": {}, "references": {}}
    n = keys.size
    mins = np.array([belady_hits(keys, int(c)) for c in caps])
    out["belady_hit_ratio"] = (mins / n).tolist()
    print(f"drift {args.drift:g}: {n:,} deduplicated accesses, {uniq:,} unique rows; hit ratio (share of MIN)")
    print(f"{'policy':<15}" + "".join(f"{f'{100 * f:.0f}% ({c:,})':>22}" for f, c in zip(FRACTIONS, caps)))
    print(f"{'belady':<15}" + "".join(f"{100 * m / n:21.2f}%" for m in mins))

    def row(name: str, hits: np.ndarray, into: dict) -> None:
        share = np.where(mins > 0, hits / np.maximum(mins, 1), 1.0)
        into[name] = {"hit_ratio": (hits / n).tolist(), "share_of_belady": share.tolist()}
        print(f"{name:<15}" + "".join(f"{100 * h / n:12.2f}% ({100 * s:5.1f}%)" for h, s in zip(hits, share)))

    for pol in POLICIES:
        row(pol, miss_ratio_curve(keys, off, caps, pol, dedup=False), out["policies"])
    best = [max(out["policies"][p]["share_of_belady"][i] for p in POLICIES) for i in range(len(caps))]
    out["best_share_of_belady"] = best
    print("best share of MIN: " + ", ".join(f"{100 * b:.1f}%" for b in best) + "  (goal >= 95%)")
    print("store policies told each batch and the K after it (Table.announce; a training pipeline's window):")
    out["announced"] = {}
    for ahead in ANNOUNCE:
        for pol in ANNOUNCED_POLICIES:
            row(f"{pol} K={ahead}", miss_ratio_curve(keys, off, caps, pol, dedup=False, announce=ahead),
                out["announced"])
        share_k = [max(out["announced"][f"{p} K={ahead}"]["share_of_belady"][i] for p in ANNOUNCED_POLICIES)
                   for i in range(len(caps))]
        out[f"best_share_announced_{ahead}"] = share_k
        print(f"best share of MIN told {ahead} batches ahead: " + ", ".join(f"{100 * b:.1f}%" for b in share_k))
    print("reference points (not store policies; see module doc):")
    k = int(keys.max()) + 1 if keys.size else 0
    counts = np.bincount(keys, minlength=k)
    mc = int(counts.max()) if k else 0
    row("exact-lfu", np.array([exact_lfu_hits(keys, k, mc, int(c)) for c in caps]), out["references"])
    top = np.sort(counts)[::-1]
    row("topk-hindsight", np.array([int((top[:c] - 1).clip(0).sum()) for c in caps]), out["references"])
    if args.drift == 0:
        first, later = later_popularity(size, 100 if args.quick else ORACLE_BATCHES)
        assert first.size == keys.size  # the same accesses, keyed afresh
        row("oracle-topk", popularity_oracle_hits(first, later, caps), out["references"])
    nxt = next_use(keys)
    for ahead in AHEAD:
        row(f"ahead-{ahead}", np.array([lookahead_hits(keys, off, nxt, k, mc, int(c), ahead) for c in caps]),
            out["references"])
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
