"""Plain-Python reference caches for the policy tests: a directory told announced batches, and the optimum."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import strategies as st

from embstore.policies import CacheDirectory

INF = 1 << 62

# directory operations: ("announce" | "access" | "remove", distinct keys) | ("advance", []); remove is what a
# hierarchy does to a batch's inserts when a level below fails
KEYS = st.lists(st.integers(0, 15), max_size=10, unique=True)
OPS = st.lists(st.one_of(st.tuples(st.just("announce"), KEYS), st.tuples(st.just("access"), KEYS),
                         st.tuples(st.just("advance"), st.just([])), st.tuples(st.just("remove"), KEYS)),
               max_size=60)


class AnnouncedReference:
    """``CacheDirectory`` with announcements (``embstore.lookahead``), for ``lru`` and ``lfu`` without
    admission, written for clarity: dicts and ``min``/``max`` over residents, no lists or heaps.

    Rows without an announced use are ranked by the base policy: LRU by the tick of their last hit or
    insertion, LFU by (frequency, tick); the victim is the smallest. Rows with one wait for it: the victim
    among them is the one used last, by the position of that use in everything announced (batch by batch,
    each batch in the order given). Slots come from a stack that hands out slot 0 first.
    """

    def __init__(self, capacity: int, policy: str) -> None:
        assert policy in ("lru", "lfu")
        self.capacity, self.lfu = capacity, policy == "lfu"
        self.free = list(range(capacity - 1, -1, -1))
        self.slot: dict[int, int] = {}  # resident key -> slot
        self.base: dict[int, tuple[int, int]] = {}  # resident key without an announced use -> (freq, tick)
        self.nuse: dict[int, int] = {}  # resident key with one -> the position of its next use
        self.saved: dict[int, int] = {}  # ... and its frequency, for when it returns to the base policy
        self.pending: dict[int, deque[tuple[int, int]]] = {}  # key -> (batch, position) of its unspent uses
        self.told = 0  # uses announced so far (the next one's position)
        self.batches: deque[list[int]] = deque()  # announced batches not advanced past
        self.tick = 0
        self.seq = 0  # next batch to announce
        self.clock = 0  # the current batch
        self.bypassed = 0  # rows the last access declined to admit

    def _to_base(self, k: int, freq: int) -> None:
        self.tick += 1
        self.base[k] = (freq if self.lfu else 0, self.tick)

    def _wait(self, k: int, nu: int, freq: int) -> None:
        self.base.pop(k, None)
        self.nuse[k], self.saved[k] = nu, freq

    def _rerank(self, k: int, nu: int, freq: int) -> None:
        if nu != INF:
            self.nuse[k] = nu
        else:
            del self.nuse[k]
            self._to_base(k, freq)

    def _spend(self, k: int) -> int:
        q = self.pending.get(k)
        if q and q[0][0] == self.clock:
            q.popleft()
        if not q:
            self.pending.pop(k, None)
            return INF
        return q[0][1]

    def announce(self, keys: list[int]) -> None:
        for k in keys:
            q = self.pending.setdefault(k, deque())
            q.append((self.seq, self.told))
            if len(q) == 1 and k in self.base:
                self._wait(k, self.told, self.base[k][0])
            self.told += 1
        self.batches.append(list(keys))
        self.seq += 1

    def advance(self) -> bool:
        if not self.batches:
            return False
        for k in self.batches.popleft():
            q = self.pending.get(k)
            if q and q[0][0] == self.clock:
                nu = self._spend(k)
                if k in self.nuse:
                    self._rerank(k, nu, self.saved[k])
        self.clock += 1
        return True

    def remove(self, keys: list[int]) -> list[int]:
        """Drop resident ``keys`` (their announced uses stay pending); the slots they held, -1 where absent."""
        out = []
        for k in keys:
            s = self.slot.pop(k, -1)
            out.append(s)
            if s >= 0:
                self.base.pop(k, None)
                self.nuse.pop(k, None)
                self.free.append(s)
                self._freed(s)
        return out

    # the base policy's part, which a subclass with another base policy replaces
    def _hit(self, k: int, nu: int) -> None:
        """A hit on resident ``k``, whose next announced use is now ``nu``."""
        if k in self.nuse:
            self.saved[k] += 1
            self._rerank(k, nu, self.saved[k])
        else:
            self._to_base(k, self.base[k][0] + 1)

    def _base_victim(self) -> int:
        return min(self.base, key=self.base.__getitem__)

    def _freed(self, s: int) -> None:
        """Slot ``s`` lost its row (evicted or removed)."""

    def access(self, keys: list[int]) -> tuple[list[int], list[bool], list[int]]:
        """(slot per key, -1 when bypassed or pushed out within the batch; hit per key; evicted keys)."""
        slots, hits, evicted = [], [], []
        self.bypassed = 0
        inserted_at: dict[int, int] = {}  # key inserted by this batch -> its position
        for i, k in enumerate(keys):
            nu = self._spend(k)
            if k in self.slot:
                slots.append(self.slot[k])
                hits.append(True)
                self._hit(k, nu)
                continue
            hits.append(False)
            if self.free:
                s = self.free.pop()
            else:
                if len(self.nuse) >= self.capacity:
                    v = max(self.nuse, key=self.nuse.__getitem__)
                    if nu >= self.nuse[v]:
                        slots.append(-1)
                        self.bypassed += 1
                        continue
                    del self.nuse[v]
                else:
                    v = self._base_victim()
                    del self.base[v]
                s = self.slot.pop(v)
                self._freed(s)
                if v in inserted_at:
                    slots[inserted_at.pop(v)] = -1
                else:
                    evicted.append(v)
            self.slot[k] = s
            inserted_at[k] = i
            if nu != INF:
                self._wait(k, nu, 1)
            else:
                self._to_base(k, 1)
            slots.append(s)
        return slots, hits, evicted


def optimum_with_bypass(keys: list[int], capacity: int) -> int:
    """The most hits any cache of ``capacity`` rows can get on ``keys`` (it may decline to admit a row):
    every choice tried, over the reachable sets of resident rows."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for x in keys:
        nxt: dict[frozenset[int], int] = {}
        for held, hits in best.items():
            if x in held:
                options = [(held, hits + 1)]
            else:
                options = [(held, hits)]
                if len(held) < capacity:
                    options.append((held | {x}, hits))
                else:
                    options += [((held - {y}) | {x}, hits) for y in held]
            for state, h in options:
                nxt[state] = max(nxt.get(state, -1), h)
        best = nxt
    return max(best.values())


def run_side_by_side(d: CacheDirectory, ref: AnnouncedReference, ops) -> None:
    """Apply ``ops`` to a directory and a reference; every answer must match (slots, hits, evictions,
    bypasses, removed slots, whether an advance had a batch to pass)."""
    for op, keys in ops:
        if op == "announce":
            d.announce(np.array(keys, np.int64))
            ref.announce(keys)
        elif op == "advance":
            assert d.advance() == ref.advance()
        elif op == "remove":
            assert d.remove(np.array(keys, np.int64)).tolist() == ref.remove(keys)
        else:
            r = d.access(np.array(keys, np.int64))
            slots, hits, evicted = ref.access(keys)
            assert r.slots.tolist() == slots, (op, keys)
            assert r.hit.tolist() == hits
            assert r.evicted_keys.tolist() == evicted
            assert r.rejected == ref.bypassed
    assert d.announced == len(ref.batches)


def best_reads_served(steps, capacity: int) -> int:
    """Brute force: the most reads any cache of ``capacity`` rows (no bypass: a read or written row lands,
    evicting any resident row if full) serves under the pipeline's reads and write-backs."""
    events = [(int(x), rd) for _, r, w in steps for rd, arr in ((True, r), (False, w)) for x in arr.tolist()]
    memo: dict = {}

    def go(i: int, held: frozenset) -> int:
        if i == len(events):
            return 0
        if (i, held) in memo:
            return memo[(i, held)]
        x, rd = events[i]
        hit = int(rd and x in held)
        if x in held or len(held) < capacity:
            best = go(i + 1, held | {x})
        else:
            best = max(go(i + 1, (held - {v}) | {x}) for v in held)
        memo[(i, held)] = hit + best
        return hit + best
    return go(0, frozenset())
