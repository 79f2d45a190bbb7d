"""The statistics of groups of responses under a model: ONE function from a model's graph and parameters,
prompt + response tokens and the valid response positions to the docs/method.md §1 statistics, under
every requested reading of u.

    request = GroupStatsRequest(group_size=G, compute=ALL_STATS, u_forms=("aligned", "loo"), chunk=64)
    fn = compiled_group_stats(graphdef, request)                       # jitted once per (graphdef, request)
    tokens, mask = group_rows(prompt_ids, prompt_mask, responses, valid, G)
    by_form = fn(params, tokens, mask, valid)                          # {"aligned": TokenStats, "loo": ...}

The train step's statistics passes (:func:`ict_jax.rl.train_step.batch_stats`, inside its own jit), the
token inspector (:mod:`ict_jax.diagnostics.inspector`) and diagnose (:mod:`ict_jax.diagnostics.diagnose`) all call
:func:`group_stats`. The model is read through the graph only (``nnx.merge``, then its
``predicting_states`` and ``unembedding``): ``rl`` never imports ``ict_jax.model``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ict_jax.config import StatsSection
from ict_jax.rl.state import as_model_def
from ict_jax.rl.token_stats import ALL_STATS, DEFAULT_COMPUTE, GROUP_STATS, U_FORMS, TokenStats, stats_from_hidden


@dataclasses.dataclass(frozen=True)
class GroupStatsRequest:
    """What a statistics pass computes (hashable: a static argument and a cache key).

    ``group_size`` G (rows ``p*G + j``; read only by the group statistics ``js`` and ``pbar_tok``, so a
    request without them may get part of a group); ``temperature`` T_s; ``chunk`` the largest block of
    positions; ``compute`` the statistics (of :data:`~ict_jax.rl.token_stats.ALL_STATS`); ``u_forms``
    the readings of u the group statistics are computed under (docs/method.md §1)."""

    group_size: int
    temperature: float = 1.0
    chunk: int = StatsSection.chunk
    compute: tuple[str, ...] = DEFAULT_COMPUTE
    u_forms: tuple[str, ...] = (StatsSection.u_form,)

    def __post_init__(self):
        bad = [c for c in self.compute if c not in ALL_STATS]
        if bad:
            raise ValueError(f"compute: unknown statistics {bad}; allowed: {list(ALL_STATS)}")
        if not self.u_forms or any(f not in U_FORMS for f in self.u_forms):
            raise ValueError(f"stats.u_form: {list(self.u_forms)}; name readings from {list(U_FORMS)}")
        if not self.temperature > 0:
            raise ValueError(f"stats.temperature: {self.temperature} must be > 0")
        if self.chunk < 1:
            raise ValueError(f"stats.chunk: {self.chunk} must be >= 1")

    @classmethod
    def from_section(cls, section: StatsSection, *, group_size: int, temperature: float,
                     compute: Sequence[str] = DEFAULT_COMPUTE,
                     u_forms: Sequence[str] | None = None) -> GroupStatsRequest:
        """The request of a ``stats`` config section: its chunk, its T_s (``section.temperature``, None =
        ``temperature``, the sampling one) and its reading of u (``u_forms`` None = ``section.u_form``)."""
        t_s = temperature if section.temperature is None else section.temperature
        return cls(int(group_size), float(t_s), int(section.chunk), tuple(compute),
                   (section.u_form,) if u_forms is None else tuple(u_forms))


def head_inputs(params: Any, graphdef: Any, tokens: Int[Array, "B L"], attention_mask: Int[Array, "B L"],
                response_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hidden states that predict the last ``response_len`` tokens ``[B, N, D]``, the unembedding
    ``[D, V]``, those tokens ``[B, N]``) of the model ``graphdef`` + ``params``. ``graphdef``: the model's
    graphdef, or a :class:`~ict_jax.rl.state.ModelDef` (LoRA: the frozen base, and whether the adapters
    run)."""
    md = as_model_def(graphdef)
    model = md.merge(params)
    hidden, targets = model.predicting_states(tokens, attention_mask, response_len, adapters=md.adapters)
    return hidden, model.unembedding(), targets


def stats_by_reading(hidden: Float[Array, "B N D"], unembed: Float[Array, "D V"], targets: Int[Array, "B N"],
                     valid: Float[Array, "B N"] | Bool[Array, "B N"],
                     request: GroupStatsRequest) -> dict[str, TokenStats]:
    """``{u_form: TokenStats}`` of :func:`~ict_jax.rl.token_stats.stats_from_hidden` for every reading of
    ``request``: the statistics that do not compare a row with its group are computed once and shared,
    u and Q(o_t) once per reading (one pass in all when there is one reading)."""
    group = tuple(c for c in request.compute if c in GROUP_STATS)
    kw = dict(temperature=request.temperature, chunk=request.chunk)
    if len(request.u_forms) == 1 or not group:
        st = stats_from_hidden(hidden, unembed, targets, valid, group_size=request.group_size if group else 1,
                               compute=request.compute, u_form=request.u_forms[0], **kw)
        return {form: st for form in request.u_forms}
    rest = tuple(c for c in request.compute if c not in GROUP_STATS)
    base = (stats_from_hidden(hidden, unembed, targets, valid, group_size=1, compute=rest, **kw) if rest
            else TokenStats(None, None, None, None))
    out = {}
    for form in request.u_forms:
        per = stats_from_hidden(hidden, unembed, targets, valid, group_size=request.group_size, compute=group,
                                u_form=form, **kw)
        out[form] = base._replace(**{c: getattr(per, c) for c in group})
    return out


def group_stats(params: Any, graphdef: Any, tokens: Int[Array, "B L"], attention_mask: Int[Array, "B L"],
                valid: Float[Array, "B N"] | Bool[Array, "B N"], request: GroupStatsRequest) -> dict[str, TokenStats]:
    """docs/method.md §1 statistics of the last ``N`` tokens of every row under the model
    ``(graphdef, params)``: ``tokens`` / ``attention_mask`` ``[B, L]`` hold prompt + response (rows
    prompt-major, ``request.group_size`` responses a prompt), ``valid [B, N]`` the response positions that
    count. Returns ``{u_form: TokenStats}`` over ``request.u_forms`` (:func:`stats_by_reading`); unjitted
    (the train step calls it inside its own jit; :func:`compiled_group_stats` is the jitted one)."""
    return stats_by_reading(*head_inputs(params, graphdef, tokens, attention_mask, valid.shape[1]), valid, request)


@functools.lru_cache(maxsize=32)
def compiled_group_stats(graphdef: Any, request: GroupStatsRequest) -> Callable[..., dict[str, TokenStats]]:
    """``fn(params, tokens, attention_mask, valid) -> {u_form: TokenStats}``: :func:`group_stats` jitted
    for one model graph and request (built once per pair; one program per shape)."""
    return jax.jit(functools.partial(_group_stats_of, graphdef, request))


def _group_stats_of(graphdef: Any, request: GroupStatsRequest, params: Any, tokens: jax.Array,
                    attention_mask: jax.Array, valid: jax.Array) -> dict[str, TokenStats]:
    return group_stats(params, graphdef, tokens, attention_mask, valid, request)


def group_rows(prompt_ids: Int[Array, "P Lp"], prompt_mask: Int[Array, "P Lp"], responses: Int[Array, "B N"],
               valid: Float[Array, "B N"] | Bool[Array, "B N"], group_size: int) -> tuple[jax.Array, jax.Array]:
    """``(tokens, attention_mask)`` ``[B, Lp + N]`` int32 of B = P * G rows, prompt-major: each
    left-padded prompt repeated ``group_size`` times, then its responses (right-padded; ``valid`` marks
    their real tokens)."""
    if responses.shape[0] != prompt_ids.shape[0] * group_size:
        raise ValueError(f"{responses.shape[0]} responses for {prompt_ids.shape[0]} prompts of group_size={group_size}")
    ids = jnp.repeat(jnp.asarray(prompt_ids, jnp.int32), group_size, axis=0)
    mask = jnp.repeat(jnp.asarray(prompt_mask, jnp.int32), group_size, axis=0)
    return (jnp.concatenate([ids, jnp.asarray(responses, jnp.int32)], axis=1),
            jnp.concatenate([mask, (jnp.asarray(valid) > 0).astype(jnp.int32)], axis=1))
