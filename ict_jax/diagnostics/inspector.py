"""The token inspector: which tokens of a group of responses ICT, 20-Entropy and STAPO would train on.

:func:`token_report` samples G responses to one prompt, recomputes every response token's docs/method.md §1
statistics (logp, H1, H2 and the JS score u against the group-mean distribution) with the train step's
statistics-of-a-group function (:func:`ict_jax.rl.group_stats.group_stats`: the hidden states that
predict them, then :func:`ict_jax.rl.token_stats.stats_from_hidden`), and selects the same tokens three
times through the train step's entry point :func:`ict_jax.rl.selectors.select`: ICT, 20-Entropy and
STAPO (docs/method.md §2), each with the selector settings of the run being inspected
(:func:`column_selectors`).
:func:`~ict_jax.diagnostics.inspector_page.render_html` turns the report into one self-contained HTML page
(inline CSS and JS, no external resources): every token coloured by its JS score, outlined when
selected, its statistics on hover, and the ICT / entropy / STAPO masks side by side. ``ict-jax inspect``
does both (docs/inspector.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.config import SelectorSection, StatsSection, from_dict
from ict_jax.data.prompts import encode_prompt
from ict_jax.diagnostics.inspector_page import MASKS
from ict_jax.model.tokenizers import decode_responses
from ict_jax.rl.group_stats import GroupStatsRequest, compiled_group_stats, group_rows
from ict_jax.rl.losses import group_advantages
from ict_jax.rl.selectors import (
    canonical_method,
    resolved_rho,
    resolved_scope,
    select,
    stapo_candidates,
    stapo_quantile,
)
from ict_jax.rl.token_stats import TokenStats
from ict_jax.sampling.sampler import generate

__all__ = ["checkpoint_selector", "column_selectors", "token_report"]

_STATS = ("logp", "H1", "H2", "js")

#: Advantage source recorded in the report when no rewards are given.
ASSUMED_POSITIVE = ("assumed positive: no rewards were given, so every response is treated as having "
                    "A > 0 (STAPO then silences every token it would silence in a correct response)")

#: A run's method -> the page column that shows it (``random`` keeps ICT's counts, docs/method.md §2).
_OWN_COLUMN = {"ict": "ict", "random": "ict", "entropy": "entropy", "stapo": "stapo"}


# ------------------------------------------------------------------------------------------------
# The selector settings of each column
# ------------------------------------------------------------------------------------------------
def checkpoint_selector(meta: Mapping[str, Any] | None) -> SelectorSection:
    """The selector section a run trained with, rebuilt (and validated) from a checkpoint's metadata
    (``meta["config"]["rl"]["selector"]``, as :class:`~ict_jax.train.trainer.Trainer` saves it); the
    ``ict_jax.config`` defaults for whatever it does not hold (``meta`` None: no checkpoint)."""
    section: Any = meta or {}
    for key in ("config", "rl", "selector"):
        section = section.get(key) if isinstance(section, Mapping) else None
    return from_dict({"rl": {"selector": dict(section or {})}}).rl.selector


def column_selectors(
    run: SelectorSection | None = None, *, rho_ict: float | None = None, rho_entropy: float | None = None,
    ict_scope: str | None = None, entropy_scope: str | None = None, tau_p: float | None = None,
    tau_h: float | None = None,
) -> dict[str, SelectorSection]:
    """The :class:`~ict_jax.config.SelectorSection` of each page column (``ict``, ``entropy``, ``stapo``)
    for a run trained with ``run`` (None = the ``ict_jax.config`` defaults).

    The column of the run's own method (``random`` -> the ICT column: same counts) takes the run's rho
    and scope; the other columns take their method's registered defaults (``rl.selectors.register_selector``).
    ``tau_p`` and ``tau_h`` come from ``run`` (they are set whatever the method). Arguments that are not None override.
    ``warmup_steps`` is 0: the masks are those after the warm-up.
    """
    run = SelectorSection() if run is None else run
    own = _OWN_COLUMN.get(canonical_method(run.method))
    given = {"ict": (rho_ict, ict_scope), "entropy": (rho_entropy, entropy_scope), "stapo": (None, None)}
    columns = {}
    for method in MASKS:
        rho, scope = (run.rho, run.scope) if method == own else (None, None)  # None: the method's default
        rho_over, scope_over = given[method]
        columns[method] = dataclasses.replace(
            run, method=method, rho=rho if rho_over is None else float(rho_over),
            scope=scope if scope_over is None else scope_over, warmup_steps=0,
            tau_p=run.tau_p if tau_p is None else float(tau_p), tau_h=run.tau_h if tau_h is None else float(tau_h))
    return columns


# ------------------------------------------------------------------------------------------------
# The steps of a report
# ------------------------------------------------------------------------------------------------
def _token_text(tokenizer: Any, token_id: int) -> str:
    """The decoded text of one token, special tokens kept (``<eos>`` is shown, not dropped)."""
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:  # a tokenizer whose decode has no skip_special_tokens
        return tokenizer.decode([int(token_id)])


def _group_stats(model: Any, ids: np.ndarray, tokens: np.ndarray, valid: np.ndarray,
                 request: GroupStatsRequest) -> TokenStats:
    """docs/method.md §1 statistics of the G responses ``tokens [G, N]`` to the one prompt ``ids [1, Lp]``
    in ``request``'s reading of u: :func:`ict_jax.rl.group_stats.compiled_group_stats`, the train step's
    statistics-of-a-group function (jitted once per model graph and request)."""
    graphdef, state = nnx.split(model)
    full, full_mask = group_rows(ids, np.ones_like(ids), tokens, valid, request.group_size)
    return compiled_group_stats(graphdef, request)(state, full, full_mask, jnp.asarray(valid))[request.u_forms[0]]


def _stats_request(stats: StatsSection | None, G: int, sampling_temperature: float,
                   **override: Any) -> GroupStatsRequest:
    """The statistics of a report: the ``stats`` section (None = the config defaults) with the fields given
    in ``override`` (``temperature``, ``chunk``, ``u_form``; None = the section's), T_s None = the
    sampling temperature."""
    section = dataclasses.replace(stats or StatsSection(), **{k: v for k, v in override.items() if v is not None})
    return GroupStatsRequest.from_section(section, group_size=G, temperature=sampling_temperature, compute=_STATS)


def _stapo_threshold(st: TokenStats, adv: jax.Array, valid: np.ndarray, stapo: SelectorSection) -> float:
    """STAPO's entropy quantile q over its candidate set in this group (+inf when the set is empty)."""
    _, over = stapo_candidates(st.logp, adv, jnp.asarray(valid), tau_p=stapo.tau_p,
                               quantile_over=stapo.stapo_quantile_over)
    return float(stapo_quantile(st.H1, over, stapo.resolved_tau_h))


def _advantages(rewards: Sequence[float] | Callable[[str], float] | None, texts: list[str],
                G: int) -> tuple[list[float] | None, jax.Array, str]:
    """(rewards as floats or None, advantages [G], where they came from) for STAPO."""
    if rewards is None:
        return None, jnp.ones((G,), jnp.float32), ASSUMED_POSITIVE
    reward_list = [float(rewards(t)) for t in texts] if callable(rewards) else [float(r) for r in rewards]
    if len(reward_list) != G:
        raise ValueError(f"rewards: expected {G} values (one per response), got {len(reward_list)}")
    adv = group_advantages(jnp.asarray(reward_list, jnp.float32), G)
    return reward_list, adv, "rewards: A = group_advantages(rewards, G) (docs/method.md §3, scale 'group')"


def _select_columns(stats: TokenStats, adv: jax.Array, valid: np.ndarray,
                    columns: Mapping[str, SelectorSection], seed: int) -> dict[str, jax.Array]:
    """Each column's mask through the train step's :func:`select`, over the one group (its mini-batch)."""
    vj = jnp.asarray(valid)
    return {name: select(col.method, stats, adv, vj, key=jax.random.key(int(seed)), step=0, config=col,
                         group_size=vj.shape[0])
            for name, col in columns.items()}


def _responses(tokenizer: Any, arrays: Mapping[str, np.ndarray], truncated: np.ndarray, texts: list[str],
               reward_list: list[float] | None) -> list[dict[str, Any]]:
    """One dict per response with its per-token list over its valid positions."""
    tokens, valid = arrays["tokens"], arrays["valid"]
    responses = []
    for i in range(tokens.shape[0]):
        n = int(valid[i].sum())
        toks = [{"id": int(tokens[i, t]), "text": _token_text(tokenizer, tokens[i, t]),
                 **{k: float(arrays[k][i, t]) for k in _STATS},
                 **{k: bool(arrays[k][i, t] > 0) for k in MASKS}} for t in range(n)]
        responses.append({"index": i, "text": texts[i], "length": n, "truncated": bool(truncated[i]),
                          "reward": None if reward_list is None else reward_list[i],
                          "advantage": float(arrays["advantages"][i]), "tokens": toks})
    return responses


def _summary(arrays: Mapping[str, np.ndarray], q: float) -> dict[str, Any]:
    valid = arrays["valid"]
    n_valid = int(valid.sum())
    ict_sel, ent_sel = arrays["ict"] > 0, arrays["entropy"] > 0
    union = int((ict_sel | ent_sel).sum())
    return {
        "valid_tokens": n_valid,
        "ict_selected": int(ict_sel.sum()),
        "entropy_selected": int(ent_sel.sum()),
        "stapo_silenced": int((valid & (arrays["stapo"] <= 0)).sum()),
        "ict_entropy_overlap": int((ict_sel & ent_sel).sum()),
        "ict_entropy_jaccard": (int((ict_sel & ent_sel).sum()) / union) if union else 0.0,
        "stapo_h1_quantile": q if math.isfinite(q) else None,
        **{f"{k}_mean": (float(arrays[k][valid].mean()) if n_valid else 0.0) for k in _STATS},
        "js_max": float(arrays["js"][valid].max()) if n_valid else 0.0,
    }


def _settings(run: SelectorSection, columns: Mapping[str, SelectorSection], **sampling: Any) -> dict[str, Any]:
    """The report's settings: sampling, each column's selector parameters, the run's selector."""
    ict, ent, stapo = columns["ict"], columns["entropy"], columns["stapo"]
    return {**sampling, "rho_ict": float(resolved_rho(ict)), "rho_entropy": float(resolved_rho(ent)),
            "ict_scope": resolved_scope(ict), "entropy_scope": resolved_scope(ent), "tau_p": float(stapo.tau_p),
            "tau_h": float(stapo.resolved_tau_h), "stapo_quantile_over": stapo.stapo_quantile_over,
            "run_selector": {"method": run.method, "rho": resolved_rho(run), "scope": resolved_scope(run),
                             "tau_p": float(run.tau_p), "tau_h": float(run.resolved_tau_h),
                             "stapo_quantile_over": run.stapo_quantile_over}}


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
def token_report(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    num_samples: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    template: str = "none",
    selector: SelectorSection | None = None,
    rho_ict: float | None = None,
    rho_entropy: float | None = None,
    ict_scope: str | None = None,
    entropy_scope: str | None = None,
    tau_p: float | None = None,
    tau_h: float | None = None,
    rewards: Sequence[float] | Callable[[str], float] | None = None,
    stats: StatsSection | None = None,
    stats_temperature: float | None = None,
    chunk: int | None = None,
    u_form: str | None = None,
) -> dict[str, Any]:
    """Sample ``num_samples`` (G) responses to ``prompt`` and compute, for every response token, the
    docs/method.md §1 statistics and the ICT, 20-Entropy and STAPO masks (docs/method.md §2).

    - ``template``: how the prompt is wrapped (:func:`ict_jax.data.prompts.encode_prompt`, the prompt front
      door: ``"none"`` = as is, ``"plain"``, ``"qwen_chat"``).
    - Sampling: :func:`ict_jax.sampling.sampler.generate`, key ``jax.random.key(seed)``, the tokenizer's EOS ids.
    - Statistics: :func:`ict_jax.rl.group_stats.group_stats` (the train step's: the hidden states of
      prompt + response that predict each response token, then blocks of positions) under the ``stats``
      section of the inspected run (None = the ``ict_jax.config`` defaults): p = softmax(logits / T_s),
      T_s = its ``temperature`` (None: the sampling ``temperature``, as in training), u in its reading
      ``u_form`` (docs/method.md §1), blocks of its ``chunk`` positions. ``stats_temperature``,
      ``chunk`` and ``u_form`` override the section when not None.
    - Masks: :func:`ict_jax.rl.selectors.select` with each column's section of :func:`column_selectors`
      (``selector`` = the inspected run's selector config, None = the ``ict_jax.config`` defaults;
      ``rho_ict``, ``rho_entropy``, ``ict_scope``, ``entropy_scope``, ``tau_p``, ``tau_h`` override it
      when not None), all over this one group (the "mini-batch" of the entropy and STAPO quantiles is
      the group); 1 = kept, 0 = silenced.
    - STAPO needs advantages: with ``rewards`` (G floats, or a callable ``text -> reward`` applied to
      each decoded response) A = :func:`ict_jax.rl.losses.group_advantages` (scale ``group``); without,
      every response gets A = 1 (``advantage_source`` says so: :data:`ASSUMED_POSITIVE`).

    Returns a dict of plain Python values plus ``arrays`` (numpy, ``[G, N]``): ``tokens``, ``valid``,
    ``logp``, ``H1``, ``H2``, ``js``, ``ict``, ``entropy``, ``stapo``, ``advantages``. ``responses``
    holds one dict per response with ``tokens``: a list of ``{"id", "text", "logp", "H1", "H2", "js",
    "ict", "entropy", "stapo"}`` over its valid positions (the ending EOS included), ``text`` being the
    token decoded on its own with special tokens kept. ``settings`` holds each column's rho / scope /
    tau and ``run_selector`` (the run's method, rho, scope, tau_p, tau_h).
    """
    G, N = int(num_samples), int(max_new_tokens)
    if G < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    request = _stats_request(stats, G, float(temperature), temperature=stats_temperature, chunk=chunk, u_form=u_form)
    run = SelectorSection() if selector is None else selector
    columns = column_selectors(run, rho_ict=rho_ict, rho_entropy=rho_entropy, ict_scope=ict_scope,
                               entropy_scope=entropy_scope, tau_p=tau_p, tau_h=tau_h)
    enc = encode_prompt(prompt, tokenizer, template=template, vocab_size=model.config.vocab_size, max_new_tokens=N,
                        max_positions=model.config.max_position_embeddings, where="the prompt (after templating)")
    ids = enc.ids[None]
    ro = generate(model, ids, np.ones_like(ids), jax.random.key(int(seed)), num_samples=G, max_new_tokens=N,
                  temperature=float(temperature), eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))
    tokens, valid = np.asarray(ro.tokens, np.int32), np.asarray(ro.valid, bool)
    st = _group_stats(model, ids, tokens, valid, request)
    texts = decode_responses(tokenizer, tokens, valid)
    reward_list, adv, source = _advantages(rewards, texts, G)
    masks = _select_columns(st, adv, valid, columns, seed)
    arrays: dict[str, Any] = {"tokens": tokens, "valid": valid,
                              **{k: np.asarray(getattr(st, k), np.float32) for k in _STATS},
                              **{k: np.asarray(m, np.float32) for k, m in masks.items()},
                              "advantages": np.asarray(adv, np.float32)}
    q = _stapo_threshold(st, adv, valid, columns["stapo"])
    settings = _settings(run, columns, num_samples=G, max_new_tokens=N, temperature=float(temperature),
                         stats_temperature=request.temperature, seed=int(seed), template=template,
                         u_form=request.u_forms[0], chunk=request.chunk)
    return {"prompt": prompt, "prompt_text": enc.text, "prompt_ids": enc.ids.tolist(), "settings": settings,
            "advantage_source": source,
            "responses": _responses(tokenizer, arrays, np.asarray(ro.truncated, bool), texts, reward_list),
            "summary": _summary(arrays, q), "arrays": arrays}
