"""Streaming HFA's fragment plan: which keys form fragment f, and at which datacenter rounds
each fragment goes to the global tier.

Both sides compute it from the same inputs (the keys of the INIT round, in order, and the
fragment count), so nothing about it travels.
"""

from __future__ import annotations

import bisect
import itertools


def fragment_plan(keys: list[tuple[int, int]], fragments: int) -> dict[int, int]:
    """Key -> fragment: whole keys, in key order, split into ``fragments`` runs whose largest is
    as small as it can be (the peak WAN bytes of a round follow the largest fragment).

    Keys cut at the model's equal fractions (``Buckets(fragments=F)``, the workers' keys of
    streaming HFA) make those runs. Otherwise the smallest feasible largest run is found by
    bisection over a greedy fill; every fragment gets at least one key where there are enough.
    """
    sizes = [n for _, n in keys]
    if fragments <= 1 or not sizes:
        return {key: 0 for key, _ in keys}
    plan = _equal_cuts(keys, fragments)
    if plan is not None:  # the largest is ceil(N / F): none can be smaller
        return plan
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the least cap under which a greedy fill needs at most `fragments` runs
        cap = (lo + hi) // 2
        if len(_fill(sizes, cap, fragments)) <= fragments:
            hi = cap
        else:
            lo = cap + 1
    runs = _fill(sizes, lo, fragments)
    plan, i = {}, 0
    for f, run in enumerate(runs):
        for _ in range(run):
            plan[keys[i][0]] = f
            i += 1
    return plan


def _equal_cuts(keys: list[tuple[int, int]], fragments: int) -> dict[int, int] | None:
    """Key -> fragment where the keys fall on the model's F equal fractions, else None."""
    sizes = [n for _, n in keys]
    total, starts = sum(sizes), list(itertools.accumulate([0, *sizes[:-1]]))
    ends = [total * f // fragments for f in range(fragments + 1)]
    if not sizes or total < fragments or not set(ends[1:-1]) <= set(starts):
        return None
    return {key: bisect.bisect_right(ends, s) - 1 for (key, _), s in zip(keys, starts)}


def _fill(sizes: list[int], cap: int, fragments: int) -> list[int]:
    """Greedy runs (their lengths) of at most ``cap`` each, cut early where the keys left are
    only enough for one each of the fragments left."""
    runs, total, count = [], 0, 0
    for i, n in enumerate(sizes):
        left_keys, left_frags = len(sizes) - i, fragments - len(runs) - 1
        if count and (total + n > cap or left_keys <= left_frags):
            runs.append(count)
            total, count = 0, 0
        total += n
        count += 1
    runs.append(count)
    return runs


def shift(fragment: int, fragments: int, k2: int) -> int:
    """Fragment f goes global at datacenter round r when (r + shift) % K2 == 0: fragment 0 as
    plain HFA, the others staggered by f * K2 / F rounds."""
    return (fragment * k2) // fragments


def is_global(round_index: int, fragment: int, fragments: int, k2: int) -> bool:
    """Whether datacenter round ``round_index`` (1-based, per key) of this fragment is global."""
    return (round_index + shift(fragment, fragments, k2)) % k2 == 0
