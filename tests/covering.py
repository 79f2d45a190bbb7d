"""Covering designs for the slow tests' parameter matrices: fewer cases than the Cartesian product, each
factor's every level still run. A test-support module (no tests of its own; tests/test_covering.py checks
it): tests/ is on sys.path under pytest, so a test imports it as ``from covering import covering``.

Why: a full product of methods x aggregations x micro-batches costs CI's slow stage minutes per matrix,
while a fault in one level, or in one combination of two levels, shows in any case that holds it.

- :func:`covering` (two or more factors): every level of every factor and every pair of levels of any two
  factors in at least one case (a pairwise design, strength 2). Its size is at least the product of the
  two largest factors, which it reaches for the slow tests' 5 x 3 x 2 (15 cases, not 30). For exactly two
  factors that is the full product.
- :func:`each_level_once` (two factors): ``max(len(a), len(b))`` cases, a Latin-style diagonal that
  rotates through both lists, so every level of each appears at least once and only some pairs do.

Both are deterministic (no randomness): the same factors give the same cases, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence


def each_level_once(a: Sequence, b: Sequence, offset: int = 0) -> list[tuple]:
    """``(a[k % len(a)], b[(k + offset) % len(b)])`` for ``k < max(len(a), len(b))``: every level of ``a``
    and of ``b`` at least once. ``offset`` starts ``b``'s rotation at its level ``offset``; where ``a`` is
    the longer list (or as long), two offsets that differ modulo ``len(b)`` share no pair, so two tests
    over the same factors cover different pairs."""
    if not a or not b:
        raise ValueError("each_level_once: every factor needs at least one level")
    return [(a[k % len(a)], b[(k + offset) % len(b)]) for k in range(max(len(a), len(b)))]


def covering(*factors: Sequence) -> list[tuple]:
    """Cases (one tuple per case, a level of each factor in the factors' order) in which every level of
    every factor and every pair of levels of any two factors appears at least once.

    In-parameter-order construction: the full product of the two largest factors (ties: the earlier one
    first), then each further factor in turn, largest first: each case takes the level that adds the most
    pairs not yet covered (ties: the earliest level), and a case is added for each pair still missing. The
    cases come sorted by the factors' level order (the first factor slowest)."""
    levels = [list(f) for f in factors]
    if any(not f for f in levels):
        raise ValueError("covering: every factor needs at least one level")
    if len(levels) < 2:
        return [tuple(v) for v in zip(*levels)] if levels else [()]
    order = sorted(range(len(levels)), key=lambda k: -len(levels[k]))  # stable: equal sizes keep their order
    sizes = [len(levels[k]) for k in order]
    rows: list[list[int | None]] = [[i, j] for i in range(sizes[0]) for j in range(sizes[1])]
    for c in range(2, len(sizes)):
        missing = {(p, x, y) for p in range(c) for x in range(sizes[p]) for y in range(sizes[c])}
        for row in rows:  # horizontal: each case takes the level that covers the most missing pairs
            y = max(range(sizes[c]), key=lambda y: sum((p, row[p], y) in missing for p in range(c)))
            row.append(y)
            missing -= {(p, row[p], y) for p in range(c)}
        added: list[list[int | None]] = []
        for p, x, y in sorted(missing):  # vertical: a case added for this factor with p free, or a new one
            row = next((r for r in added if r[c] == y and r[p] is None), None)
            if row is None:
                row = [None] * (c + 1)
                row[c] = y
                added.append(row)
            row[p] = x
        rows += added
    cases = sorted({tuple(0 if v is None else v for v in (row[order.index(k)] for k in range(len(levels))))
                    for row in rows})
    return [tuple(levels[k][i] for k, i in enumerate(case)) for case in cases]
