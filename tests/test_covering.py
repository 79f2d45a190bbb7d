"""tests/covering.py, the covering designs of the slow tests' matrices: hand-checked cases, and the
covering property (every level, every pair of levels) on more shapes. Pure Python, no JAX."""

from __future__ import annotations

import itertools

import pytest

from covering import covering, each_level_once  # tests/ is on sys.path under pytest


def _missing_pairs(factors, cases):
    """The (factor i, level, factor j, level) pairs that no case holds."""
    return [(i, x, j, y) for i, j in itertools.combinations(range(len(factors)), 2)
            for x in factors[i] for y in factors[j] if not any(c[i] == x and c[j] == y for c in cases)]


def test_each_level_once_by_hand():
    methods, aggs = ["dense", "ict", "entropy", "stapo", "random"], ["seq", "tok", "sum"]
    assert each_level_once(methods, aggs) == [
        ("dense", "seq"), ("ict", "tok"), ("entropy", "sum"), ("stapo", "seq"), ("random", "tok")]
    assert each_level_once(methods, aggs, offset=1) == [
        ("dense", "tok"), ("ict", "sum"), ("entropy", "seq"), ("stapo", "tok"), ("random", "sum")]
    # together 10 of the 15 pairs: the longer list first, offsets apart modulo len(b) share no pair
    assert not set(each_level_once(methods, aggs)) & set(each_level_once(methods, aggs, offset=1))
    assert each_level_once([1, 2], "xyz") == [(1, "x"), (2, "y"), (1, "z")]  # the longer second
    assert each_level_once("ab", "xy") == [("a", "x"), ("b", "y")]
    assert each_level_once("a", "xyz", offset=4) == [("a", "y"), ("a", "z"), ("a", "x")]


def test_each_level_once_holds_every_level_in_max_len_cases():
    for na, nb, offset in itertools.product(range(1, 8), range(1, 8), range(4)):
        cases = each_level_once(range(na), range(nb), offset)
        assert len(cases) == max(na, nb)
        assert {a for a, _ in cases} == set(range(na)) and {b for _, b in cases} == set(range(nb))


def test_covering_by_hand():
    assert covering() == [()]
    assert covering("abc") == [("a",), ("b",), ("c",)]
    assert covering("ab", [1, 2, 3]) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2), ("b", 3)]
    # 2 x 2 x 2: the four cases of the half fraction (an orthogonal array), not the eight of the product
    assert covering([0, 1], [0, 1], [0, 1]) == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
    # the bucket matrix's shape: every (method, agg) once, micro chosen so each micro meets every method and agg
    cases = covering(["dense", "ict", "entropy", "stapo", "random"], ["seq", "tok", "sum"], [1, 4])
    assert cases == [
        ("dense", "seq", 1), ("dense", "tok", 4), ("dense", "sum", 1),
        ("ict", "seq", 4), ("ict", "tok", 1), ("ict", "sum", 4),
        ("entropy", "seq", 1), ("entropy", "tok", 4), ("entropy", "sum", 1),
        ("stapo", "seq", 1), ("stapo", "tok", 4), ("stapo", "sum", 1),
        ("random", "seq", 1), ("random", "tok", 4), ("random", "sum", 1)]
    # the factors' order is kept in each case whatever their sizes (the largest, [1..5], last here)
    assert covering([1, 4], "xyz", [1, 2, 3, 4, 5])[:4] == [(1, "x", 1), (1, "x", 3), (1, "x", 4), (1, "x", 5)]


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3, 3), (5, 3, 2), (2, 5, 3), (2, 2, 2, 2), (4, 3, 3, 2), (2, 3, 4, 5),
                                   (5, 3, 2, 2, 2), (1, 4, 1), (6, 1, 6)], ids=lambda s: "x".join(map(str, s)))
def test_covering_holds_every_pair_in_few_cases(sizes):
    factors = [[f"f{k}l{i}" for i in range(n)] for k, n in enumerate(sizes)]
    cases = covering(*factors)
    assert not _missing_pairs(factors, cases)
    assert len(set(cases)) == len(cases) and all(len(c) == len(sizes) for c in cases)
    largest = sorted(sizes)[-2:]
    assert largest[0] * largest[1] <= len(cases) < 1.5 * largest[0] * largest[1] + 2  # near the bound
    assert len(cases) <= max(1, len(list(itertools.product(*factors))))
    assert covering(*factors) == cases  # deterministic


def test_covering_and_each_level_once_refuse_an_empty_factor():
    with pytest.raises(ValueError, match="every factor needs at least one level"):
        covering("ab", [])
    with pytest.raises(ValueError, match="every factor needs at least one level"):
        each_level_once([], "ab")
