"""Streaming HFA's fragment plan: which keys form fragment f, and at which datacenter rounds
each fragment goes to the global tier.

Both sides compute it from the same inputs (the keys of the INIT round, in order, and the
fragment count), so nothing about it travels.
"""

from __future__ import annotations


def fragment_plan(keys: list[tuple[int, int]], fragments: int) -> dict[int, int]:
    """Key -> fragment: whole keys, in key order, split into ``fragments`` runs of about equal
    size (a key goes to the fragment its middle element falls in)."""
    total = sum(n for _, n in keys)
    plan, start = {}, 0
    for key, n in keys:
        middle = start + n / 2
        plan[key] = min(fragments - 1, int(middle * fragments / total)) if total else 0
        start += n
    return plan


def shift(fragment: int, fragments: int, k2: int) -> int:
    """Fragment f goes global at datacenter round r when (r + shift) % K2 == 0: fragment 0 as
    plain HFA, the others staggered by f * K2 / F rounds."""
    return (fragment * k2) // fragments


def is_global(round_index: int, fragment: int, fragments: int, k2: int) -> bool:
    """Whether datacenter round ``round_index`` (1-based, per key) of this fragment is global."""
    return (round_index + shift(fragment, fragments, k2)) % k2 == 0
