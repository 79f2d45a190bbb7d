"""The token inspector: which tokens of a group of responses ICT, 20-Entropy and STAPO would train on.

:func:`token_report` samples G responses to one prompt, recomputes every response token's docs/method.md §1
statistics (logp, H1, H2 and the JS score u against the group-mean distribution) from the model's
hidden states with :func:`ict_jax.stats_from_hidden`, and applies the three docs/method.md §2 masks to the same
tokens. :func:`~ict_jax.tools.inspector_page.render_html` turns the report into one self-contained HTML page (inline CSS and JS, no
external resources): every token coloured by its JS score, outlined when selected, its statistics on
hover, and the ICT / entropy / STAPO masks side by side. ``ict-jax inspect`` does both (docs/inspector.md).

The module imports nothing heavy at import time (the CLI builds its parser from it).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ict_jax.tools.inspector_page import MASKS

__all__ = ["token_report"]

_STATS = ("logp", "H1", "H2", "js")

#: Advantage source recorded in the report when no rewards are given.
ASSUMED_POSITIVE = ("assumed positive: no rewards were given, so every response is treated as having "
                    "A > 0 (STAPO then silences every token it would silence in a correct response)")


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
_STATS_FNS: dict[tuple, Any] = {}  # (graphdef, G, N, T_s, chunk) -> jitted statistics pass


def _token_text(tokenizer: Any, token_id: int) -> str:
    """The decoded text of one token, special tokens kept (``<eos>`` is shown, not dropped)."""
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:  # a tokenizer whose decode has no skip_special_tokens
        return tokenizer.decode([int(token_id)])


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
    rho_ict: float = 0.1,
    rho_entropy: float = 0.2,
    ict_scope: str = "sequence",
    entropy_scope: str = "batch",
    tau_p: float = 0.002,
    tau_h: float = 0.8,
    rewards: Sequence[float] | Callable[[str], float] | None = None,
    stats_temperature: float | None = None,
    chunk: int = 128,
) -> dict[str, Any]:
    """Sample ``num_samples`` (G) responses to ``prompt`` and compute, for every response token, the
    docs/method.md §1 statistics and the ICT, 20-Entropy and STAPO masks (docs/method.md §2).

    - ``template``: how the prompt is wrapped (:func:`ict_jax.data.templates.format_prompt`: ``"none"`` = as is,
      ``"plain"``, ``"qwen_chat"``).
    - Sampling: :func:`ict_jax.generate` with key ``jax.random.key(seed)``, the tokenizer's EOS ids.
    - Statistics: ``hidden_states`` of prompt + response, shifted so that ``hidden[:, t]`` predicts
      response token t, then :func:`ict_jax.stats_from_hidden` with p = softmax(logits / T_s),
      T_s = ``stats_temperature`` (default: the sampling ``temperature``, as in training).
    - Masks: ``ict_mask(js, rho=rho_ict, scope=ict_scope)``, ``entropy_mask(H1, rho=rho_entropy,
      scope=entropy_scope)`` and ``stapo_mask(logp, H1, A, tau_p, tau_h)`` (1 = kept, 0 = silenced),
      all over this one group (the "mini-batch" of the entropy and STAPO quantiles is the group).
    - STAPO needs advantages: with ``rewards`` (G floats, or a callable ``text -> reward`` applied to
      each decoded response) A = :func:`ict_jax.group_advantages` (scale ``group``); without, every
      response gets A = 1 (``advantage_source`` says so: :data:`ASSUMED_POSITIVE`).

    Returns a dict of plain Python values plus ``arrays`` (numpy, ``[G, N]``): ``tokens``, ``valid``,
    ``logp``, ``H1``, ``H2``, ``js``, ``ict``, ``entropy``, ``stapo``, ``advantages``. ``responses``
    holds one dict per response with ``tokens``: a list of ``{"id", "text", "logp", "H1", "H2", "js",
    "ict", "entropy", "stapo"}`` over its valid positions (the ending EOS included), ``text`` being the
    token decoded on its own with special tokens kept.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ict_jax.data.templates import format_prompt
    from ict_jax.rl.losses import group_advantages
    from ict_jax.sampling.sampler import generate
    from ict_jax.rl.selectors import entropy_mask, ict_mask, stapo_mask, stapo_quantile
    from ict_jax.rl.token_stats import stats_from_hidden

    G = int(num_samples)
    if G < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    t_s = float(temperature if stats_temperature is None else stats_temperature)
    if not t_s > 0:
        raise ValueError(f"the statistics temperature must be > 0, got {t_s}")
    text = format_prompt(prompt, template, tokenizer)
    prompt_ids = [int(i) for i in tokenizer.encode(text)]
    if not prompt_ids:
        raise ValueError("the prompt encodes to zero tokens")
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise ValueError(f"the prompt has token id {max(prompt_ids)} but the model's vocabulary has {vocab} ids")
    Lp, N = len(prompt_ids), int(max_new_tokens)

    ids = np.asarray([prompt_ids], np.int32)
    ro = generate(model, ids, np.ones_like(ids), jax.random.key(int(seed)), num_samples=G, max_new_tokens=N,
                  temperature=float(temperature), eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))
    tokens = np.asarray(ro.tokens, np.int32)
    valid = np.asarray(ro.valid, bool)
    truncated = np.asarray(ro.truncated, bool)

    # prompt + response; hidden[:, Lp - 1 + t] predicts response token t
    full = np.concatenate([np.repeat(ids, G, axis=0), tokens], axis=1)
    full_mask = np.concatenate([np.ones((G, Lp), np.int32), valid.astype(np.int32)], axis=1)
    graphdef, state = nnx.split(model)
    fn_key = (graphdef, G, N, t_s, int(chunk))
    stats_fn = _STATS_FNS.get(fn_key)
    if stats_fn is None:
        @jax.jit
        def stats_fn(state, full, full_mask, tokens, valid):
            m = nnx.merge(graphdef, state)
            h = m.hidden_states(full[:, :-1], full_mask[:, :-1])[:, -N:]
            return stats_from_hidden(h, m.unembedding(), tokens, valid, group_size=G, temperature=t_s, chunk=chunk)

        _STATS_FNS[fn_key] = stats_fn
    st = stats_fn(state, jnp.asarray(full), jnp.asarray(full_mask), jnp.asarray(tokens), jnp.asarray(valid))

    eos = set(int(e) for e in tokenizer.eos_ids)
    texts = [tokenizer.decode([int(t) for t, v in zip(tokens[i], valid[i]) if v and int(t) not in eos])
             for i in range(G)]
    if rewards is None:
        reward_list = None
        adv = jnp.ones((G,), jnp.float32)
        source = ASSUMED_POSITIVE
    else:
        reward_list = [float(rewards(t)) for t in texts] if callable(rewards) else [float(r) for r in rewards]
        if len(reward_list) != G:
            raise ValueError(f"rewards: expected {G} values (one per response), got {len(reward_list)}")
        adv = group_advantages(jnp.asarray(reward_list, jnp.float32), G)
        source = "rewards: A = group_advantages(rewards, G) (docs/method.md §3, scale 'group')"

    vj = jnp.asarray(valid)
    masks = {
        "ict": ict_mask(st.js, vj, group_size=G, rho=rho_ict, scope=ict_scope),
        "entropy": entropy_mask(st.H1, vj, group_size=G, rho=rho_entropy, scope=entropy_scope),
        "stapo": stapo_mask(st.logp, st.H1, adv, vj, tau_p=tau_p, tau_h=tau_h),
    }
    q = float(stapo_quantile(st.H1, vj, tau_h))
    arrays: dict[str, Any] = {"tokens": tokens, "valid": valid}
    for name in _STATS:
        arrays[name] = np.asarray(getattr(st, name), np.float32)
    for name, m in masks.items():
        arrays[name] = np.asarray(m, np.float32)
    arrays["advantages"] = np.asarray(adv, np.float32)

    responses = []
    for i in range(G):
        n = int(valid[i].sum())
        toks = []
        for t in range(n):
            toks.append({"id": int(tokens[i, t]), "text": _token_text(tokenizer, tokens[i, t]),
                         **{k: float(arrays[k][i, t]) for k in _STATS},
                         **{k: bool(arrays[k][i, t] > 0) for k in MASKS}})
        responses.append({"index": i, "text": texts[i], "length": n, "truncated": bool(truncated[i]),
                          "reward": None if reward_list is None else reward_list[i],
                          "advantage": float(arrays["advantages"][i]), "tokens": toks})
    n_valid = int(valid.sum())
    ict_sel, ent_sel = arrays["ict"] > 0, arrays["entropy"] > 0
    union = int((ict_sel | ent_sel).sum())
    summary = {
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
    settings = dict(num_samples=G, max_new_tokens=N, temperature=float(temperature), stats_temperature=t_s,
                    seed=int(seed), template=template, rho_ict=float(rho_ict), rho_entropy=float(rho_entropy),
                    ict_scope=ict_scope, entropy_scope=entropy_scope, tau_p=float(tau_p), tau_h=float(tau_h))
    return {"prompt": prompt, "prompt_text": text, "prompt_ids": prompt_ids, "settings": settings,
            "advantage_source": source, "responses": responses, "summary": summary, "arrays": arrays}
