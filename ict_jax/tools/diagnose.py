"""The paper's token diagnostics on a real model (``ict-jax diagnose``, docs/results.md "Is our u the paper's u?").

For every setting (group size G x sampling temperature T) :func:`collect` samples G responses to each of
a data set's prompts, scores them with the data set's verifiable reward, recomputes every response
token's statistics (docs/method.md §1: logp, H1, H2, max_v p, and u with Q(o_t) under every reading of
``stats.u_form``) and selects tokens with every selector (docs/method.md §2) through the train step's
entry point :func:`ict_jax.rl.selectors.select`, one sampling batch being the mini-batch. :func:`diagnostics`
then computes, in float64 NumPy, the paper's diagnostics of the selected tokens (docs/method.md §5):

- the sorted u of a response (a mean normalised curve per reading) and two elbow measures: the ratio E
  of its slopes over the ranks 2-10 % and 10-30 % (1 = a straight line; large = a sharp drop inside the
  top 10 %), and the knee (the rank fraction farthest from the curve's chord);
- p(o_t), the purity beta = sum_v p^2 = exp(-H2) and max_v p of the selected tokens (mean, median, sd:
  the paper's "0.18 +- 0.09" may be any of them), and Q(o_t), the compared distribution's mass on the
  sampled token;
- the high/low-entropy ratio, with the median of H1 over the setting's valid tokens (docs/method.md §5)
  and with its top-20 % threshold (the share of selected tokens in the top 20 % is 0.2 for a selector
  blind to entropy);
- the most frequent selected and unselected tokens (decoded), and how many of the forking tokens (where
  a response leaves a sibling that shared its whole prefix: :func:`fork_positions`) are selected;
- u against position, and the correlation between a response's mean u and its advantage.

:func:`run_diagnose` does every setting and writes ``diagnose.json``, the Markdown report and the plots
(:mod:`ict_jax.tools.diagnose_report`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.config import SelectorSection
from ict_jax.data.prompts import pad_left
from ict_jax.data.templates import BOXED_INSTRUCTION, MC_INSTRUCTION, format_prompt
from ict_jax.rewards.pool import RewardPool
from ict_jax.rl.losses import group_advantages
from ict_jax.rl.selectors import select
from ict_jax.rl.token_stats import U_FORMS, TokenStats, stats_from_hidden
from ict_jax.sampling.sampler import make_generate_fn
from ict_jax.tools.diagnose_report import format_markdown, plot_setting

__all__ = ["PAPER", "Setting", "collect", "diagnostics", "fork_positions", "outcome_advantages", "reanalyse",
           "run_diagnose", "selector_specs", "sorted_u_curve"]

#: The paper's token diagnostics of ICT's selected tokens (docs/method.md §5; Qwen2.5, GSM8K / MATH).
PAPER = {
    "p_mean": 0.18, "p_sd": 0.09,  # "mean probability of the selected tokens 0.18 +- 0.09" (A.3.3)
    "h_ratio_median": (1.03, 0.99),  # high/low-entropy ratio, GSM8K / MATH
    "elbow": "sharp elbow near the top 10 % (A.4.1)",
    "tokens": ("problem-specific content words (\"remainder\", \"duck\", \"seventh\"); \"####\", \"the\", \"is\" "
               "unselected"),
    "adv_corr": "high u goes with positive-advantage responses (A.3.4)",
}
#: Rank fractions of the sorted-u curves.
GRID = np.linspace(0.0, 1.0, 101)
#: Responses shorter than this are left out of the sorted-u curves (10 % of them is under one token).
MIN_TOKENS_FOR_CURVE = 20
#: Width of the position bins of "u against position".
POSITION_BIN = 16
#: How many of the most frequent selected / unselected tokens are listed.
TOP_TOKENS = 15
_RANDOM_KEY = 0x44494147  # "DIAG": the random selector's root key (folded with the batch index)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One sampling setting: G responses per prompt at temperature T."""

    group_size: int
    temperature: float

    @property
    def name(self) -> str:
        return f"G{self.group_size}_T{self.temperature:g}"


def selector_specs(u_forms: Sequence[str], rho: float = 0.1) -> dict[str, tuple[SelectorSection, str]]:
    """name -> (selector section with no warm-up, the reading of u it reads) for every selector the
    diagnostics compare: per reading ``ict[r]``, ``frequent[r]`` (the paper's complement) and
    ``selectable[r]`` (valid and u > 0); then ``entropy``, ``stapo[low_prob_positive]``, ``stapo[valid]``,
    ``random`` (ICT's counts) and ``all`` (every valid token: the reference row)."""
    specs: dict[str, tuple[SelectorSection, str]] = {}
    for form in u_forms:
        for method in ("ict", "frequent", "selectable"):
            specs[f"{method}[{form}]"] = (SelectorSection(method=method, rho=rho if method != "selectable" else None,
                                                          warmup_steps=0), form)
    default = u_forms[0]
    specs["entropy"] = (SelectorSection(method="entropy", warmup_steps=0), default)
    for over in ("low_prob_positive", "valid"):
        specs[f"stapo[{over}]"] = (SelectorSection(method="stapo", stapo_quantile_over=over, warmup_steps=0), default)
    specs["random"] = (SelectorSection(method="random", rho=rho, warmup_steps=0), default)
    specs["all"] = (SelectorSection(method="dense", warmup_steps=0), default)
    return specs


# ------------------------------------------------------------------------------------------------
# Sampling, rewards, statistics and masks
# ------------------------------------------------------------------------------------------------
def outcome_advantages(correct: np.ndarray, G: int, row_valid: np.ndarray | None = None) -> np.ndarray:
    """GRPO advantages (docs/method.md §3, scale ``group``) of the verifiable outcome R = 1 if correct else
    0, the paper's reward. (The data set's own reward may differ: reasoning-gym scores a wrong but
    extractable answer 0.01, which would make "gave an answer" look like a positive advantage.)"""
    rv = None if row_valid is None else jnp.asarray(row_valid, jnp.float32)
    return np.asarray(group_advantages(jnp.asarray(correct, jnp.float32), G, "group", 1e-6, rv))



def _prompt_ids(dataset: Any, tokenizer: Any, template: str, vocab: int) -> list[np.ndarray]:
    instruction = MC_INSTRUCTION if getattr(dataset, "scorer", None) == "mc" else BOXED_INSTRUCTION
    out = []
    for i, ex in enumerate(dataset):
        ids = np.asarray(tokenizer.encode(format_prompt(ex.prompt, template, tokenizer, instruction=instruction)),
                         np.int32)
        if ids.size == 0:
            raise ValueError(f"prompt {i} encodes to zero tokens")
        if ids.max() >= vocab:
            raise ValueError(f"prompt {i} has token id {int(ids.max())}; the model's vocabulary has {vocab} ids")
        out.append(ids)
    return out


def _stats_fn(graphdef: Any, G: int, N: int, t_s: float, chunk: int, u_forms: tuple[str, ...]) -> Callable:
    """One jitted pass: hidden states of prompt + response, then every statistic under every reading
    (logp, H1, H2, pmax once; js and pbar_tok per reading)."""

    @jax.jit
    def fn(state, full, full_mask, valid):
        m = nnx.merge(graphdef, state)
        hidden, targets = m.predicting_states(full, full_mask, N)
        w = m.unembedding()
        base = stats_from_hidden(hidden, w, targets, valid, group_size=G, temperature=t_s, chunk=chunk,
                                 compute=("logp", "H1", "H2", "pmax"))
        per = {form: stats_from_hidden(hidden, w, targets, valid, group_size=G, temperature=t_s, chunk=chunk,
                                       compute=("js", "pbar_tok"), u_form=form) for form in u_forms}
        return base, per

    return fn


def _score(pool: Any, dataset: Any, tokenizer: Any, idx: list[int], real: int, G: int, tokens: np.ndarray,
           valid: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Decode and score the responses of the first ``real`` prompts of ``idx`` (G each; the rest are
    filler rows): ``(texts, reward, correct, row_valid)``, the arrays over every row (filler rows 0)."""
    rows = real * G
    eos = {int(e) for e in tokenizer.eos_ids}
    texts = [tokenizer.decode([int(t) for t, v in zip(tokens[r], valid[r]) if v and int(t) not in eos])
             for r in range(rows)]
    exs = [dataset[i] for i in idx[:real] for _ in range(G)]
    checks = pool.check(dataset.scorer, texts, [ex.answer for ex in exs], [ex.meta for ex in exs])
    reward, correct, row_valid = (np.zeros(len(idx) * G, np.float32) for _ in range(3))
    reward[:rows] = [c.reward for c in checks]
    correct[:rows] = [float(c.correct) for c in checks]
    row_valid[:rows] = 1.0
    return texts, reward, correct, row_valid


def collect(model: Any, tokenizer: Any, dataset: Any, setting: Setting, *, u_forms: Sequence[str] = U_FORMS,
            max_new_tokens: int = 256, batch_rows: int = 64, template: str = "qwen_chat", seed: int = 0,
            rho: float = 0.1, chunk: int = 64, pool: Any = None, stats_temperature: float | None = None,
            say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Sample ``setting.group_size`` responses to every prompt of ``dataset`` (``batch_rows // G`` prompts,
    at least one, a program run: the mini-batch of the batch-scoped selectors), score them, and return the per-token
    arrays (NumPy, rows prompt-major): ``tokens``, ``valid`` ``[R, N]``; ``logp``, ``H1``, ``H2``,
    ``pmax``; ``js`` and ``pbar_tok`` dicts by reading; ``masks`` by selector name
    (:func:`selector_specs`); per row ``reward`` (the data set's), ``correct``, ``advantage``
    (:func:`outcome_advantages`), ``group``, ``truncated``;
    ``texts``; ``timing`` (sampling, statistics, scoring seconds)."""
    u_forms = tuple(u_forms)
    bad = [f for f in u_forms if f not in U_FORMS]
    if bad or not u_forms:
        raise ValueError(f"--u-form {list(u_forms)}: name readings from {list(U_FORMS)}")
    G, T, N = int(setting.group_size), float(setting.temperature), int(max_new_tokens)
    if G < 2:
        raise ValueError(f"G = {G}: the diagnostics compare a response with its group; use G >= 2")
    if not T > 0:
        raise ValueError(f"temperature {T}: must be > 0")
    t_s = T if stats_temperature is None else float(stats_temperature)
    batch_prompts = min(max(1, int(batch_rows) // G), len(dataset))
    prompts = _prompt_ids(dataset, tokenizer, template, model.config.vocab_size)
    Lp = max(len(p) for p in prompts)
    graphdef, state = nnx.split(model)
    gen = make_generate_fn(graphdef, num_samples=G, max_new_tokens=N, temperature=T,
                           eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))
    stats_fn = _stats_fn(graphdef, G, N, t_s, int(chunk), u_forms)
    specs = selector_specs(u_forms, rho)
    key = jax.random.key(int(seed))
    arrays: dict[str, list] = {k: [] for k in ("tokens", "valid", "logp", "H1", "H2", "pmax", "truncated")}
    per_form: dict[str, dict[str, list]] = {f: {"js": [], "pbar_tok": []} for f in u_forms}
    masks: dict[str, list] = {name: [] for name in specs}
    rewards, correct, advantages, texts, groups = [], [], [], [], []
    timing = {"sample_s": 0.0, "stats_s": 0.0, "score_s": 0.0}
    n_prompts = len(prompts)
    for b, start in enumerate(range(0, n_prompts, batch_prompts)):
        idx = list(range(start, min(start + batch_prompts, n_prompts)))
        real = len(idx)
        idx += [idx[-1]] * (batch_prompts - real)  # filler prompts keep one compiled shape; dropped below
        ids, mask = pad_left([prompts[i] for i in idx], Lp, int(tokenizer.pad_id))
        t0 = time.perf_counter()
        ro = gen(state, ids, mask, jax.random.fold_in(key, b))
        tokens, valid, trunc = (np.asarray(x) for x in jax.block_until_ready((ro.tokens, ro.valid, ro.truncated)))
        timing["sample_s"] += time.perf_counter() - t0
        rows = real * G
        t0 = time.perf_counter()
        batch_texts, rew, ok, row_valid = _score(pool, dataset, tokenizer, idx, real, G, tokens, valid)
        timing["score_s"] += time.perf_counter() - t0
        adv = outcome_advantages(ok, G, row_valid)
        full = np.concatenate([np.repeat(ids, G, axis=0), tokens.astype(np.int32)], axis=1)
        full_mask = np.concatenate([np.repeat(mask, G, axis=0), valid.astype(np.int32)], axis=1)
        vmask = valid.copy()
        vmask[rows:] = False  # filler rows count nowhere
        t0 = time.perf_counter()
        base, per = stats_fn(state, jnp.asarray(full), jnp.asarray(full_mask), jnp.asarray(vmask))
        for name, (cfg, form) in specs.items():
            st = TokenStats(base.logp, base.H1, base.H2, per[form].js)
            m = select(cfg.method, st, jnp.asarray(adv), jnp.asarray(vmask), key=jax.random.key(_RANDOM_KEY), step=b,
                       config=cfg, group_size=G)
            masks[name].append(np.asarray(m)[:rows] > 0)
        jax.block_until_ready(base.logp)
        timing["stats_s"] += time.perf_counter() - t0
        for k, x in (("tokens", tokens), ("valid", vmask), ("logp", base.logp), ("H1", base.H1), ("H2", base.H2),
                     ("pmax", base.pmax), ("truncated", trunc)):
            arrays[k].append(np.asarray(x)[:rows])
        for form in u_forms:
            per_form[form]["js"].append(np.asarray(per[form].js)[:rows])
            per_form[form]["pbar_tok"].append(np.asarray(per[form].pbar_tok)[:rows])
        rewards.append(rew[:rows])
        correct.append(ok[:rows] > 0)
        advantages.append(adv[:rows])
        groups.append(np.repeat(np.asarray(idx[:real]), G))
        texts += batch_texts
        say(f"{setting.name}: prompts {start + 1}-{start + real} of {n_prompts} sampled and scored "
            f"({int(ok[:rows].sum())}/{rows} correct)")
    cat = lambda xs: np.concatenate(xs, axis=0)  # noqa: E731
    out = {k: cat(v) for k, v in arrays.items()}
    out["valid"] = out["valid"].astype(bool)
    out["js"] = {f: cat(v["js"]) for f, v in per_form.items()}
    out["pbar_tok"] = {f: cat(v["pbar_tok"]) for f, v in per_form.items()}
    out["masks"] = {k: cat(v) for k, v in masks.items()}
    out.update(reward=cat(rewards), correct=cat(correct), advantage=cat(advantages), group=cat(groups), texts=texts,
               timing=timing, u_forms=u_forms, group_size=G, selector_forms={k: f for k, (_, f) in specs.items()})
    return out


# ------------------------------------------------------------------------------------------------
# The diagnostics (float64 NumPy)
# ------------------------------------------------------------------------------------------------
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
        for k, i in enumerate(rows):
            same = np.ones(len(rows), bool)  # siblings (and i itself) sharing i's prefix so far
            for t in range(int(valid[i].sum())):
                peers = same & valid[rows, t]
                if peers.sum() > 1 and np.any(tokens[rows[peers], t] != tokens[i, t]):
                    out[i, t] = True
                same &= valid[rows, t] & (tokens[rows, t] == tokens[i, t])
                if same.sum() <= 1:
                    break  # alone from here on: no later fork
    return out


def aligned_ceiling(n: np.ndarray) -> np.ndarray:
    """The largest u of the ``aligned`` reading with n rollouts active at t (itself included): p disjoint
    from the n - 1 others, u = 1/2 [ln(2n/(n+1)) + (1/n) ln(2/(n+1)) + (1 - 1/n) ln 2]; 0 for n <= 1
    (0.380 at n = 4, 0.497 at n = 8, 0.585 at n = 16)."""
    n = np.asarray(n, np.float64)
    safe = np.maximum(n, 1.0)
    c = 0.5 * (np.log(2 * safe / (safe + 1)) + np.log(2 / (safe + 1)) / safe + (1 - 1 / safe) * np.log(2.0))
    return np.where(n > 1, c, 0.0)


def _token_text(tokenizer: Any, token_id: int) -> str:
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
    fmt = lambda counts: [[_token_text(tokenizer, t), c, s_counts.get(t, 0) / all_counts[t]]  # noqa: E731
                          for t, c in counts.most_common(k)]
    return fmt(s_counts), fmt(u_counts)


def _ratio(hi: int, lo: int) -> float | None:
    """hi / lo; None when lo = 0 (the counts are reported beside it)."""
    return hi / lo if lo else None


def _corr(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Pearson and Spearman correlation (None with fewer than 3 points or no variance)."""
    n = len(x)
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        return {"pearson": None, "spearman": None, "n": n}
    rank = lambda a: np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(np.float64)  # noqa: E731
    return {"pearson": float(np.corrcoef(x, y)[0, 1]), "spearman": float(np.corrcoef(rank(x), rank(y))[0, 1]),
            "n": n}


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
    active = np.zeros(valid.shape)  # rollouts of the row's group active at t
    for g in np.unique(groups):
        active[groups == g] = valid[groups == g].sum(0)
    ceilings = {"aligned": aligned_ceiling(active), "loo": np.where(active > 1, np.log(2.0), 0.0)}
    shared = valid & (active > 1)  # positions where the ceiling is above 0
    readings = {}
    for form in data["u_forms"]:
        u = np.asarray(data["js"][form], np.float64)
        rows = valid.any(1)
        mean_u = np.where(rows, (u * valid).sum(1) / np.maximum(valid.sum(1), 1), 0.0)
        informative = rows & (adv != 0)  # groups whose rewards differ: A != 0
        readings[form] = {
            "u": _summary(u[valid]) | {"p90": float(np.quantile(u[valid], 0.9)) if valid.any() else None,
                                       "max": float(u[valid].max()) if valid.any() else None,
                                       "zero_share": float((u[valid] <= 0).mean()) if valid.any() else None,
                                       # share of tokens within 5 % of the reading's largest possible u
                                       "ceiling_share": (float((u >= 0.95 * ceilings[form])[shared].mean())
                                                         if form in ceilings and shared.any() else None)},
            "sorted_u": sorted_u_curve(u, valid),
            "u_by_position": by_position(u, valid),
            "adv_corr": _corr(mean_u[informative], adv[informative])
            | {"mean_u_pos": float(mean_u[rows & (adv > 0)].mean()) if (rows & (adv > 0)).any() else None,
               "mean_u_neg": float(mean_u[rows & (adv < 0)].mean()) if (rows & (adv < 0)).any() else None},
        }
    selectors = {}
    for name, sel in data["masks"].items():
        sel = np.asarray(sel, bool) & valid
        form = data["selector_forms"][name]
        q = np.asarray(data["pbar_tok"][form], np.float64)
        hi, lo = int((sel & (H1 > med)).sum()), int((sel & (H1 <= med)).sum())
        hi20, lo20 = int((sel & (H1 > q80)).sum()), int((sel & (H1 <= q80)).sum())
        top_sel, top_unsel = _top_tokens(tokens, sel, valid, tokenizer)
        rows_sel = sel.any(1)
        selectors[name] = {
            "reading": form, "selected": int(sel.sum()), "selected_frac": float(sel.sum() / max(valid.sum(), 1)),
            "rows_without_selected": int((valid.any(1) & ~rows_sel).sum()),
            "p": _summary(p[sel]), "beta": _summary(beta[sel]), "pmax": _summary(pmax[sel]), "qtok": _summary(q[sel]),
            "H1": _summary(H1[sel]),
            "h_ratio_median": _ratio(hi, lo), "h_ratio_top20": _ratio(hi20, lo20),
            "h_counts_median": [hi, lo], "h_counts_top20": [hi20, lo20],
            "top20_share": hi20 / max(hi20 + lo20, 1),
            "forks": int(forks.sum()), "forks_selected": int((forks & sel).sum()),
            "top_selected": top_sel, "top_unselected": top_unsel,
            "selected_by_position": by_position(sel.astype(np.float64), valid),
        }
    n_resp = int(valid.any(1).sum())
    return {
        "responses": n_resp, "valid_tokens": int(valid.sum()), "length_mean": float(valid.sum(1).mean()),
        "truncated_frac": float(np.asarray(data["truncated"]).mean()),
        "accuracy": float(np.asarray(data["correct"]).mean()), "reward_mean": float(np.asarray(data["reward"]).mean()),
        "groups_with_signal": int(sum(np.any(adv[groups == g] != 0) for g in np.unique(groups))),
        "groups": int(len(np.unique(groups))),
        "H1_median": float(med), "H1_q80": q80, "p_all": _summary(p[valid]),
        "position_bins": bins, "readings": readings, "selectors": selectors, "timing": data["timing"],
    }


# ------------------------------------------------------------------------------------------------
# The whole run
# ------------------------------------------------------------------------------------------------
def _examples(data: Mapping[str, Any], tokenizer: Any, form: str, n: int = 2) -> list[dict[str, Any]]:
    """The first ``n`` responses with ICT's selected tokens in brackets (reading ``form``)."""
    sel = data["masks"][f"ict[{form}]"]
    out = []
    for i in range(min(n, len(data["texts"]))):
        parts = []
        for t in range(int(data["valid"][i].sum())):
            text = _token_text(tokenizer, data["tokens"][i, t])
            parts.append(f"[{text}]" if sel[i, t] else text)
        out.append({"row": i, "reward": float(data["reward"][i]), "correct": bool(data["correct"][i]),
                    "marked": "".join(parts)})
    return out


def _save_arrays(data: Mapping[str, Any], path: Path) -> None:
    """The per-token arrays of a setting (to recompute the diagnostics without sampling again)."""
    flat = {k: np.asarray(v) for k, v in data.items()
            if isinstance(v, np.ndarray)}
    for key in ("js", "pbar_tok", "masks"):
        flat.update({f"{key}.{k}": np.asarray(v) for k, v in data[key].items()})
    np.savez_compressed(path, **flat)


def _load_arrays(path: Path, meta: Mapping[str, Any], u_forms: Sequence[str]) -> dict[str, Any]:
    """The :func:`collect` output of a setting from its ``.npz`` (:func:`_save_arrays`) and the settings
    saved in ``diagnose.json``."""
    z = np.load(path)
    data: dict[str, Any] = {k: z[k] for k in z.files if "." not in k}
    for key in ("js", "pbar_tok", "masks"):
        data[key] = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(key + ".")}
    data.update(u_forms=tuple(u_forms), group_size=int(meta["setting"]["group_size"]), timing=meta["timing"],
                texts=[""] * len(data["tokens"]))
    data["selector_forms"] = {k: f for k, (_, f) in selector_specs(u_forms).items()}
    return data


def reanalyse(out: str | Path, tokenizer: Any, *, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Rebuild the diagnostics of a finished :func:`run_diagnose` in ``out`` from its saved per-token arrays
    (no sampling): the advantages from correctness (:func:`outcome_advantages`), the STAPO masks from them
    (the one selector that reads A), then :func:`diagnostics`; rewrites ``diagnose.json``,
    ``diagnose.md`` and the plots. Wall and phase times are the original run's."""
    out = Path(out)
    results = json.loads((out / "diagnose.json").read_text())
    forms = results["u_forms"]
    specs = selector_specs(forms, results["rho"])
    for name, old in results["settings"].items():
        data = _load_arrays(out / f"{name}.npz", old, forms)
        G = data["group_size"]
        data["advantage"] = outcome_advantages(data["correct"], G)
        st = TokenStats(jnp.asarray(data["logp"]), jnp.asarray(data["H1"]), None, None)
        rows_per_batch = results.get("batch_rows", 64) // G * G or G
        for sel_name, (cfg, _) in specs.items():
            if cfg.canonical_method != "stapo":
                continue
            masks = []
            for start in range(0, len(data["tokens"]), rows_per_batch):  # the original mini-batches
                sl = slice(start, start + rows_per_batch)
                sub = TokenStats(st.logp[sl], st.H1[sl], None, None)
                masks.append(np.asarray(select("stapo", sub, jnp.asarray(data["advantage"][sl]),
                                               jnp.asarray(data["valid"][sl]), key=jax.random.key(0), step=0,
                                               config=cfg, group_size=G)) > 0)
            data["masks"][sel_name] = np.concatenate(masks)
        d = diagnostics(data, tokenizer)
        d.update(wall_s=old.get("wall_s"), setting=old["setting"], examples=_examples(data, tokenizer, forms[0]))
        results["settings"][name] = d
        _save_arrays(data, out / f"{name}.npz")
        plot_setting(d, out / f"{name}.png", title=f"{results.get('title', '')} {name}".strip())
        say(f"{name}: reanalysed")
    (out / "diagnose.json").write_text(json.dumps(results, indent=1))
    (out / "diagnose.md").write_text(format_markdown(results))
    return results


def run_diagnose(model: Any, tokenizer: Any, dataset: Any, *, settings: Sequence[Setting],
                 u_forms: Sequence[str] = U_FORMS, max_new_tokens: int = 256, batch_rows: int = 64,
                 template: str = "qwen_chat", seed: int = 0, rho: float = 0.1, chunk: int = 64,
                 reward_workers: int = 1, out: str | Path | None = None, title: str = "",
                 say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every setting: :func:`collect`, :func:`diagnostics`; with ``out`` write ``diagnose.json``,
    ``diagnose.md``, ``<setting>.png`` and the per-token arrays ``<setting>.npz`` there. Returns
    ``{"settings": {name: diagnostics}, ...}``."""
    results: dict[str, Any] = {"title": title, "dataset": getattr(dataset, "name", ""), "prompts": len(dataset),
                               "max_new_tokens": int(max_new_tokens), "batch_rows": int(batch_rows),
                               "u_forms": list(u_forms), "rho": rho, "seed": int(seed), "template": template,
                               "paper": PAPER, "settings": {}}
    outdir = None if out is None else Path(out)
    if outdir is not None:
        outdir.mkdir(parents=True, exist_ok=True)
    with RewardPool(reward_workers, time_limit=5.0) as pool:
        for setting in settings:
            t0 = time.perf_counter()
            data = collect(model, tokenizer, dataset, setting, u_forms=u_forms, max_new_tokens=max_new_tokens,
                           batch_rows=batch_rows, template=template, seed=seed, rho=rho, chunk=chunk, pool=pool,
                           say=say)
            d = diagnostics(data, tokenizer)
            d["wall_s"] = time.perf_counter() - t0
            d["setting"] = {"group_size": setting.group_size, "temperature": setting.temperature}
            d["examples"] = _examples(data, tokenizer, u_forms[0])
            results["settings"][setting.name] = d
            say(f"{setting.name}: done in {d['wall_s']:.0f} s")
            if outdir is not None:
                _save_arrays(data, outdir / f"{setting.name}.npz")
                plot_setting(d, outdir / f"{setting.name}.png", title=f"{title} {setting.name}".strip())
                (outdir / "diagnose.json").write_text(json.dumps(results, indent=1))
                (outdir / "diagnose.md").write_text(format_markdown(results))
    return results
