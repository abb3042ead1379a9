"""Rounds of a benchmark cell, shared by bench_forward.py and bench_decode.py: every
implementation timed `rounds` times in an order rotated each round (round r starts at impls[r]),
so that none always runs first or right after the same one, then each one's rounds merged into
one result by their medians."""

from __future__ import annotations

import statistics
from typing import Callable


def timed_rounds(impls: list[str], time_one: Callable[[str, int], dict], rounds: int) -> dict[str, list[dict]]:
    """name -> its `rounds` results, time_one(name, round) called in the rotated orders."""
    timed = {name: [] for name in impls}
    for r in range(rounds):
        shift = r % len(impls)
        for name in impls[shift:] + impls[:shift]:
            timed[name].append(time_one(name, r))
    return timed


def merge_rounds(results: list[dict], keys: tuple[str, ...], kept: str) -> dict:
    """One implementation's rounds as one result: the median of each of `keys` it has, the
    rounds' `kept` values under "<kept>_rounds", the rest from the first round; a round without
    `kept` (it failed) makes the result that round's."""
    failed = [r for r in results if kept not in r]
    if failed or len(results) == 1:
        return (failed or results)[0]
    merged = dict(results[0])
    for key in keys:
        if key in merged:
            merged[key] = statistics.median(r[key] for r in results)
    merged[f"{kept}_rounds"] = [r[kept] for r in results]
    return merged
