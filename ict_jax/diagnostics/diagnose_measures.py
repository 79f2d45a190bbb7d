"""The paper's token diagnostics computed from a setting's per-token arrays, in float64 NumPy
(docs/method.md §5; ``ict-jax diagnose`` collects the arrays: :mod:`ict_jax.diagnostics.diagnose`).

- :func:`sorted_u_curve`: the sorted u of a response (a mean normalised curve per reading) and two elbow
  measures: the ratio E of its slopes over the ranks 2-10 % and 10-30 % (1 = a straight line; large =
  a sharp drop inside the top 10 %), and the knee (the rank fraction farthest below the curve's chord);
- :func:`diagnostics`: per selector, p(o_t), the purity beta = sum_v p^2 = exp(-H2) and max_v p of the
  selected tokens (mean, median, sd), Q(o_t), the high/low-entropy ratio (median and top-20 % of H1),
  the most frequent selected and unselected tokens, the forking tokens selected
  (:func:`fork_positions`), u against position, and the correlation of a response's mean u with its
  advantage, plain, within groups, over finished responses and given the response length
  (:func:`ict_jax.diagnostics.diagnose_advantage.advantage_correlations`); and what the selector reaches, by
  the train step's own functions (:mod:`ict_jax.rl.coverage`, float32): ``reach``, the shares of its
  tokens that are EOS, after the group's shortest response, on truncated responses and with A < 0
  (:func:`~ict_jax.rl.coverage.reach_shares`), and ``selected_by_position``, the share of each 16-token
  bin's valid tokens it selects (:func:`~ict_jax.rl.coverage.selected_share_by_bin`; None for a bin
  without valid tokens).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping

import jax
import numpy as np

from ict_jax.diagnostics.diagnose_advantage import advantage_correlations
from ict_jax.rl.coverage import REACH_KEYS, reach_shares, selected_share_by_bin
from ict_jax.rl.saturation import CEILING_FRACTION, u_ceiling

#: :func:`~ict_jax.rl.saturation.u_ceiling` compiled once per shape and reading (not op by op)
_u_ceiling = jax.jit(u_ceiling, static_argnames=("group_size", "u_form"))
#: :mod:`ict_jax.rl.coverage` compiled once per shape (not op by op)
_reach_shares = jax.jit(reach_shares, static_argnames=("group_size",))
_share_by_bin = jax.jit(selected_share_by_bin, static_argnames=("bin_size",))

#: Rank fractions of the sorted-u curves.
GRID = np.linspace(0.0, 1.0, 101)
#: Responses shorter than this are left out of the sorted-u curves (10 % of them is under one token).
MIN_TOKENS_FOR_CURVE = 20
#: Width of the position bins of "u against position".
POSITION_BIN = 16
#: How many of the most frequent selected / unselected tokens are listed.
TOP_TOKENS = 15


def _summary(x: np.ndarray) -> dict[str, float | None]:
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return {"mean": None, "median": None, "sd": None, "n": 0}
    return {"mean": float(x.mean()), "median": float(np.median(x)), "sd": float(x.std(ddof=1)) if x.size > 1 else 0.0,
            "n": int(x.size)}


def sorted_u_curve(js: np.ndarray, valid: np.ndarray, min_tokens: int = MIN_TOKENS_FOR_CURVE) -> dict[str, Any]:
    """The mean over responses of the normalised sorted u (u / max u, descending, against the rank
    fraction r / (n - 1)) on :data:`GRID`, and its elbow measures:

    - ``E`` = slope over ranks 2-10 % / slope over 10-30 % of the mean curve (1 = straight line; the
      larger, the sharper the drop inside the top 10 %); ``E_response_median``: the median of each
      response's own E;
    - ``knee``: the rank fraction where the mean curve is farthest below its chord (Kneedle; None when
      the curve is nowhere below its chord);
    - ``flat_share``: the share of responses whose sorted u has no drop (max u = 0).

    Responses with fewer than ``min_tokens`` valid tokens are left out (``responses`` counts the rest)."""
    curves, es, flat = [], [], 0
    for u, v in zip(js, valid):
        x = np.sort(np.asarray(u, np.float64)[v])[::-1]
        if x.size < min_tokens:
            continue
        if x[0] <= 0:
            flat += 1
            continue
        c = np.interp(GRID, np.linspace(0.0, 1.0, x.size), x / x[0])
        curves.append(c)
        es.append(_elbow(c))
    n = len(curves) + flat
    if not curves:
        return {"grid": GRID.tolist(), "curve": None, "E": None, "E_response_median": None, "knee": None,
                "responses": n, "flat_share": (flat / n) if n else None}
    mean = np.mean(curves, axis=0)
    finite = [e for e in es if math.isfinite(e)]
    return {"grid": GRID.tolist(), "curve": mean.tolist(), "E": _elbow(mean),
            "E_response_median": float(np.median(finite)) if finite else None, "knee": _knee(mean),
            "responses": n, "flat_share": flat / n}


def _at(c: np.ndarray, r: float) -> float:
    return float(np.interp(r, GRID, c))


def _elbow(c: np.ndarray) -> float:
    """slope(2 % -> 10 %) / slope(10 % -> 30 %) of a descending curve on :data:`GRID`."""
    top = (_at(c, 0.02) - _at(c, 0.10)) / 0.08
    mid = (_at(c, 0.10) - _at(c, 0.30)) / 0.20
    return top / mid if mid > 0 else (math.inf if top > 0 else 1.0)


def _knee(c: np.ndarray) -> float | None:
    """The rank fraction where the curve lies farthest below its chord; None when it never does (a
    concave curve: u stays high and falls at the end, no elbow)."""
    gap = (c[0] + (c[-1] - c[0]) * GRID) - c
    return float(GRID[int(np.argmax(gap))]) if gap.max() > 1e-9 else None


def fork_positions(tokens: np.ndarray, valid: np.ndarray, group: np.ndarray) -> np.ndarray:
    """bool ``[R, N]``: the forking tokens, the positions t where a response leaves a sibling that shared
    its whole prefix (every token before t; all of the group at t = 0), i.e. where at least one such
    sibling samples another token. A response has no fork once no sibling shares its prefix.
    ``group`` ``[R]`` names each row's prompt."""
    R, N = tokens.shape
    out = np.zeros((R, N), bool)
    for g in np.unique(group):
        rows = np.flatnonzero(group == g)
        for i in rows:
            same = np.ones(len(rows), bool)  # siblings (and i itself) sharing i's prefix so far
            for t in range(int(valid[i].sum())):
                peers = same & valid[rows, t]
                if peers.sum() > 1 and np.any(tokens[rows[peers], t] != tokens[i, t]):
                    out[i, t] = True
                same &= valid[rows, t] & (tokens[rows, t] == tokens[i, t])
                if same.sum() <= 1:
                    break  # alone from here on: no later fork
    return out


def token_text(tokenizer: Any, token_id: int) -> str:
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode([int(token_id)])


def _top_tokens(tokens: np.ndarray, sel: np.ndarray, valid: np.ndarray, tokenizer: Any, k: int = TOP_TOKENS
                ) -> tuple[list, list]:
    """(most frequent selected, most frequent unselected): ``[text, count, selection rate of the id]``."""
    all_counts = Counter(tokens[valid].tolist())
    s_counts = Counter(tokens[sel].tolist())
    u_counts = Counter(tokens[valid & ~sel].tolist())
    fmt = lambda counts: [[token_text(tokenizer, t), c, s_counts.get(t, 0) / all_counts[t]]  # noqa: E731
                          for t, c in counts.most_common(k)]
    return fmt(s_counts), fmt(u_counts)


def _ratio(hi: int, lo: int) -> float | None:
    """hi / lo; None when lo = 0 (the counts are reported beside it)."""
    return hi / lo if lo else None


def _u_summary(u: np.ndarray, valid: np.ndarray, ceiling: np.ndarray) -> dict[str, Any]:
    """u over the valid tokens: its summary, p90, max, the share at 0, and ``u_at_ceiling``: the share of
    valid tokens within 5 % of the reading's largest u there (``rl.saturation``)."""
    if not valid.any():
        return _summary(u[valid]) | {"p90": None, "max": None, "zero_share": None, "u_at_ceiling": None}
    at_ceiling = valid & (ceiling > 0) & (u >= CEILING_FRACTION * ceiling)
    return _summary(u[valid]) | {"p90": float(np.quantile(u[valid], 0.9)), "max": float(u[valid].max()),
                                 "zero_share": float((u[valid] <= 0).mean()),
                                 "u_at_ceiling": float(at_ceiling.sum() / valid.sum())}


def reach(sel: np.ndarray, valid: np.ndarray, truncated: np.ndarray, adv: np.ndarray, group_size: int
          ) -> dict[str, float]:
    """What a selection reaches (:func:`ict_jax.rl.coverage.reach_shares`, the train step's metrics): its
    shares keyed without the ``mask/`` prefix (``selected_eos_frac``, ...). Every row counts; rows
    prompt-major in groups of ``group_size``."""
    m = _reach_shares(sel, valid, np.asarray(truncated, np.float32), np.asarray(adv, np.float32), group_size)
    return {k.split("/", 1)[1]: float(m[k]) for k in REACH_KEYS}


def share_by_bin(sel: np.ndarray, valid: np.ndarray) -> list[float | None]:
    """The share of each :data:`POSITION_BIN`-token bin's valid tokens that ``sel`` selects
    (:func:`ict_jax.rl.coverage.selected_share_by_bin`), None for a bin without valid tokens."""
    share, n = (np.asarray(x) for x in _share_by_bin(sel, valid, bin_size=POSITION_BIN))
    return [float(s) if c else None for s, c in zip(share, n)]


def diagnostics(data: Mapping[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The docs/method.md §5 diagnostics of one setting's :func:`collect` output (module docstring)."""
    valid = np.asarray(data["valid"], bool)
    tokens = np.asarray(data["tokens"])
    H1 = np.asarray(data["H1"], np.float64)
    p = np.exp(np.asarray(data["logp"], np.float64))
    beta = np.exp(-np.asarray(data["H2"], np.float64))
    pmax = np.asarray(data["pmax"], np.float64)
    Hv = np.sort(H1[valid])
    med = Hv[(Hv.size - 1) // 2] if Hv.size else math.inf  # the lower median (docs/method.md §5)
    q80 = float(np.quantile(Hv, 0.8)) if Hv.size else math.inf
    forks = fork_positions(tokens, valid, np.asarray(data["group"]))
    adv = np.asarray(data["advantage"], np.float64)
    N = tokens.shape[1]
    bins = list(range(0, N, POSITION_BIN))
    pos = np.broadcast_to(np.arange(N), tokens.shape)

    def by_position(x: np.ndarray, w: np.ndarray) -> list[float | None]:
        out = []
        for b in bins:
            m = w & (pos >= b) & (pos < b + POSITION_BIN)
            out.append(float(x[m].mean()) if m.any() else None)
        return out

    groups = np.asarray(data["group"])
    truncated = np.asarray(data["truncated"], bool)
    length = valid.sum(1)
    responded = length > 0
    readings = {}
    for form in data["u_forms"]:
        u = np.asarray(data["js"][form], np.float64)
        # the largest u the reading allows at each token (rows prompt-major, G a prompt: rl.saturation)
        ceiling = np.asarray(_u_ceiling(valid, int(data["group_size"]), form), np.float64)
        mean_u = np.where(responded, (u * valid).sum(1) / np.maximum(length, 1), 0.0)
        readings[form] = {
            "u": _u_summary(u, valid, ceiling),
            "sorted_u": sorted_u_curve(u, valid),
            "u_by_position": by_position(u, valid),
        } | advantage_correlations(mean_u, adv, groups, length, truncated, responded)
    selectors = {}
    for name, sel in data["masks"].items():
        sel = np.asarray(sel, bool) & valid
        form = data["selector_forms"][name]
        q = np.asarray(data["pbar_tok"][form], np.float64)
        hi, lo = int((sel & (H1 > med)).sum()), int((sel & (H1 <= med)).sum())
        hi20, lo20 = int((sel & (H1 > q80)).sum()), int((sel & (H1 <= q80)).sum())
        top_sel, top_unsel = _top_tokens(tokens, sel, valid, tokenizer)
        rows_sel = sel.any(1)
        ties = data.get("ties", {}).get(name)
        selectors[name] = {
            "reading": form, "selected": int(sel.sum()), "selected_frac": float(sel.sum() / max(valid.sum(), 1)),
            # the share of the selected tokens that the tie rule decided (rl.saturation.tie_decided)
            "tie_share": float((np.asarray(ties, bool) & sel).sum() / sel.sum()) if ties is not None and sel.any()
            else None,
            "rows_without_selected": int((valid.any(1) & ~rows_sel).sum()),
            "p": _summary(p[sel]), "beta": _summary(beta[sel]), "pmax": _summary(pmax[sel]), "qtok": _summary(q[sel]),
            "H1": _summary(H1[sel]),
            "h_ratio_median": _ratio(hi, lo), "h_ratio_top20": _ratio(hi20, lo20),
            "h_counts_median": [hi, lo], "h_counts_top20": [hi20, lo20],
            "top20_share": hi20 / max(hi20 + lo20, 1),
            "forks": int(forks.sum()), "forks_selected": int((forks & sel).sum()),
            "top_selected": top_sel, "top_unselected": top_unsel,
            "selected_by_position": share_by_bin(sel, valid),
            "reach": reach(sel, valid, truncated, adv, int(data["group_size"])),
        }
    n_resp = int(valid.any(1).sum())
    return {
        "responses": n_resp, "valid_tokens": int(valid.sum()), "length_mean": float(valid.sum(1).mean()),
        "truncated_frac": float(np.asarray(data["truncated"]).mean()), "truncated": int(truncated.sum()),
        "accuracy": float(np.asarray(data["correct"]).mean()), "reward_mean": float(np.asarray(data["reward"]).mean()),
        "groups_with_signal": int(sum(np.any(adv[groups == g] != 0) for g in np.unique(groups))),
        "groups": int(len(np.unique(groups))),
        "H1_median": float(med), "H1_q80": q80, "p_all": _summary(p[valid]),
        "position_bins": bins, "readings": readings, "selectors": selectors, "timing": data["timing"],
    }


# ------------------------------------------------------------------------------------------------
# The whole run
# ------------------------------------------------------------------------------------------------
def marked_examples(data: Mapping[str, Any], tokenizer: Any, form: str, n: int = 2) -> list[dict[str, Any]]:
    """The first ``n`` responses with ICT's selected tokens in brackets (reading ``form``)."""
    sel = data["masks"][f"ict[{form}]"]
    out = []
    for i in range(min(n, len(data["texts"]))):
        parts = []
        for t in range(int(data["valid"][i].sum())):
            text = token_text(tokenizer, data["tokens"][i, t])
            parts.append(f"[{text}]" if sel[i, t] else text)
        out.append({"row": i, "reward": float(data["reward"][i]), "correct": bool(data["correct"][i]),
                    "marked": "".join(parts)})
    return out
