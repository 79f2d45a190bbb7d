"""The advantage diagnostic of docs/method.md §5 (does high u go with positive-advantage responses?), in
float64 NumPy, plain and with response length controlled (:mod:`ict_jax.diagnostics.diagnose_measures` calls
:func:`advantage_correlations` per reading of u; docs/results.md "The advantage diagnostic").

Each response contributes one point: its mean u over its valid tokens and its advantage A. A long
response differs from a short one in its outcome (a truncated response has no answer) and in its mean u
(u depends on the position in a response), so a plain correlation over responses can be length alone. The measures:

- ``adv_corr``: Pearson and Spearman over the responses with A ≠ 0, the plain correlation
  (ranks by a stable sort: tied values get consecutive ranks in row order);
- ``adv_corr_within``: both variables with their group's mean subtracted (a response is compared with
  the other responses to its prompt only), Pearson and Spearman (tied values share their average rank)
  over the responses of the groups that carry a signal: at least 2 responses whose advantages differ;
- ``adv_corr_finished``: the same over the finished responses (not truncated) only: each group keeps its
  finished responses and counts when at least 2 of them have different advantages;
- ``adv_corr_partial_length``: the partial correlation of mean u and A given the response length (its
  number of valid tokens) and the group: the group-demeaned mean u and A are each residualised on the
  group-demeaned length by least squares (no intercept: the demeaned variables have mean 0), and the
  residuals are correlated (Pearson). By the Frisch-Waugh-Lovell theorem this is the correlation of the
  residuals of a regression on the length and one indicator per group. When the length does not vary
  within any group (``length_varies`` false, e.g. every response truncated) nothing is residualised and
  it equals ``adv_corr_within``'s Pearson.

Each reports ``n`` (responses) and ``groups`` beside it (the plain one ``n`` only). A correlation is
None, with the reason in ``why`` (None when defined), when no group counts, when too few degrees of
freedom are left (fewer than 2: n - groups, one less with the length residualised; 1 left makes any
correlation ±1), or when a variable does not vary within the groups (the plain one: fewer than 3
responses, or no variation).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["advantage_correlations", "average_ranks", "group_demeaned", "signal_rows", "within_group_corr"]

#: A residual vector whose norm is below this fraction of its variable's norm is rounding noise (no variation).
RESIDUAL_TOL = 1e-10


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``; values that are exactly equal share the mean of their ranks."""
    x = np.asarray(x, np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # the 0-based rank before each distinct value
    return (first + (counts + 1) / 2.0)[inverse.reshape(-1)]


def group_demeaned(x: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``x`` less the mean of ``x`` over its row's group."""
    x = np.asarray(x, np.float64)
    _, inverse = np.unique(group, return_inverse=True)
    inverse = inverse.reshape(-1)
    means = np.bincount(inverse, weights=x) / np.bincount(inverse)
    return x - means[inverse]


def signal_rows(adv: np.ndarray, group: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """bool ``[R]``: the kept rows of the groups whose kept rows are at least 2 with different advantages."""
    adv, group, keep = np.asarray(adv, np.float64), np.asarray(group), np.asarray(keep, bool)
    out = np.zeros(len(adv), bool)
    for g in np.unique(group[keep]):
        m = keep & (group == g)
        if m.sum() >= 2 and adv[m].max() > adv[m].min():
            out |= m
    return out


def _count(n: int, plural: str) -> str:
    """``n`` things, singular for 1 ("1 group", "1 finished response", "1 degree of freedom")."""
    if n != 1:
        return f"{n} {plural}"
    return f"1 {plural.replace('degrees', 'degree').replace('responses', 'response').replace('groups', 'group')}"


def _varies(residual: np.ndarray, original: np.ndarray) -> bool:
    """Whether ``residual`` is more than rounding noise of ``original``."""
    scale = float(np.linalg.norm(original))
    return scale > 0 and float(np.linalg.norm(residual)) > RESIDUAL_TOL * scale


def _residual(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``y`` less its least-squares fit on ``x`` (no intercept)."""
    return y - (x @ y) / (x @ x) * x


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def within_group_corr(mean_u: np.ndarray, adv: np.ndarray, group: np.ndarray, keep: np.ndarray, *,
                      length: np.ndarray | None = None, which: str = "responses") -> dict[str, Any]:
    """The within-group correlation of ``mean_u`` and ``adv`` over the ``keep`` rows of the groups that carry
    a signal (:func:`signal_rows`): ``{"pearson", "spearman", "n", "groups", "why"}``; with ``length``
    the partial correlation given it (Pearson only: ``{"pearson", "n", "groups", "length_varies", "why"}``).
    ``which`` names the kept rows in ``why`` ("responses", "finished responses")."""
    group = np.asarray(group)
    rows = signal_rows(adv, group, keep)
    n, k = int(rows.sum()), int(len(np.unique(group[rows])))
    out: dict[str, Any] = {"pearson": None, "n": n, "groups": k, "why": None}
    out |= {"spearman": None} if length is None else {"length_varies": False}
    if k == 0:
        return out | {"why": f"no group had two {which} with different advantages"}
    g = group[rows]
    u_raw, a_raw = np.asarray(mean_u, np.float64)[rows], np.asarray(adv, np.float64)[rows]
    u, a = group_demeaned(u_raw, g), group_demeaned(a_raw, g)
    dof = n - k
    if length is not None:
        c_raw = np.asarray(length, np.float64)[rows]
        c = group_demeaned(c_raw, g)
        if _varies(c, c_raw):
            u, a, dof = _residual(u, c), _residual(a, c), dof - 1
            out["length_varies"] = True
    given = " once length is accounted for" if out.get("length_varies") else ""
    if dof < 2:
        return out | {"why": f"{_count(n, which)} in {_count(k, 'groups')} leave {_count(dof, 'degrees of freedom')}"
                             f"{given} (a correlation needs 2)"}
    if not _varies(u, u_raw):
        return out | {"why": f"mean u does not vary within the groups{given}"}
    if not _varies(a, a_raw):
        return out | {"why": f"A does not vary within the groups{given}"}
    out["pearson"] = _pearson(u, a)
    if length is None:
        out["spearman"] = _pearson(average_ranks(u), average_ranks(a))
    return out


def _plain_corr(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Pearson and Spearman correlation (None with fewer than 3 points or no variance)."""
    n = len(x)
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        why = ("no group had responses with different advantages" if n == 0 else
               f"{_count(n, 'responses')} with A ≠ 0 (a correlation needs 3)" if n < 3 else
               "mean u or A does not vary")
        return {"pearson": None, "spearman": None, "n": n, "why": why}
    rank = lambda a: np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(np.float64)  # noqa: E731
    return {"pearson": _pearson(x, y), "spearman": _pearson(rank(x), rank(y)), "n": n, "why": None}


def advantage_correlations(mean_u: np.ndarray, adv: np.ndarray, group: np.ndarray, length: np.ndarray,
                           truncated: np.ndarray, responded: np.ndarray) -> dict[str, dict[str, Any]]:
    """Every advantage correlation of one reading of u (module docstring): ``adv_corr`` (with ``mean_u_pos``
    and ``mean_u_neg``, the mean of mean u over responses with A > 0, A < 0), ``adv_corr_within``,
    ``adv_corr_finished``, ``adv_corr_partial_length``. Per response ``[R]``: ``mean_u``, ``adv``,
    ``group`` (its prompt), ``length`` (valid tokens), ``truncated``, ``responded`` (at least one valid
    token: only these count)."""
    mean_u, adv = np.asarray(mean_u, np.float64), np.asarray(adv, np.float64)
    responded = np.asarray(responded, bool)
    finished = responded & ~np.asarray(truncated, bool)
    informative = responded & (adv != 0)
    pos, neg = responded & (adv > 0), responded & (adv < 0)
    plain = _plain_corr(mean_u[informative], adv[informative]) | {
        "mean_u_pos": float(mean_u[pos].mean()) if pos.any() else None,
        "mean_u_neg": float(mean_u[neg].mean()) if neg.any() else None}
    within = within_group_corr(mean_u, adv, group, responded)
    fin = within_group_corr(mean_u, adv, group, finished, which="finished responses")
    partial = within_group_corr(mean_u, adv, group, responded, length=length)
    return {"adv_corr": plain, "adv_corr_within": within, "adv_corr_finished": fin,
            "adv_corr_partial_length": partial}
