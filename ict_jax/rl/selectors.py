"""Token selectors of docs/method.md §2: scores in, mask out.

Every mask is float32 ``[B, T]`` with values in {0., 1.} and ``M <= valid`` (the loss applies it as
``jnp.where(M > 0, x, 0)``). Rows are P prompts x G rollouts, prompt-major (row = p*G + j).

Counting (docs/method.md §2): a candidate set with n valid positions keeps k = 0 if n = 0, else
k = max(1, ceil(rho n)), computed in integers from rho = a/b (:mod:`ict_jax.rl.quantile`). Candidates are
ranked by a stable descending sort of the score with invalid positions last, ties to the lower flat
index (row-major over the global [P*G, T] batch); positions of rank < k are kept (``ties: position``,
the default), or every valid position whose score is >= the k-th largest score of its set (``ties: all``:
more than k when the cut falls inside an exact tie). Candidate sets by scope: ``sequence`` = one
response (row), ``group`` = the G responses of a prompt, ``batch`` = the whole mini-batch,
``micro_batch`` (20-Entropy's official code) = each of :func:`select`'s ``micro_batches`` contiguous
micro-batches. The functions take the global arrays: under ``jit`` with a sharded batch XLA inserts the
collectives, so the mask is the one a single device computes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int, Key

from ict_jax.config import STAPO_TAU_H, ConfigError, SelectorSection, Ties, build_section
from ict_jax.rl.quantile import keep_count, rho_fraction, valid_quantile
from ict_jax.rl.token_stats import ALL_STATS, DEFAULT_COMPUTE, TokenStats

# RNG stream of the random selector (its id lives with every other stream's, ict_jax.rng): scores from
# fold_in(fold_in(fold_in(root, RANDOM_MASK_STREAM), step), minibatch) (docs/method.md §2).
from ict_jax.rng import RANDOM_MASK_STREAM, stream_key

#: ``selectable``: u at or below this is "never selectable" (u = 0 in exact arithmetic: the group has not
#: diverged at t, or the rollout is alone there; float32 rounding leaves such u below 1e-7, tested).
SELECTABLE_U_MIN = 1e-6
# the functions' defaults, docs/method.md §2's table; their registrations below write the same names (the one
# place each selector's defaults are written: a selector's mask function and its registration sit together)
_ICT_RHO, _ICT_SCOPE = 0.10, "sequence"
_ENTROPY_RHO, _ENTROPY_SCOPE = 0.20, "batch"
_STAPO = SelectorSection(method="stapo")

Mask = Float[Array, "B T"]
Valid = Float[Array, "B T"] | Bool[Array, "B T"]
_SCOPES = ("sequence", "group", "batch")
_TIES = ("position", "all")


def _as_bool(valid) -> jax.Array:
    return jnp.asarray(valid) > 0


def _sets(x: jax.Array, scope: str, group_size: int | None) -> jax.Array:
    """Reshape ``[B, T]`` into candidate sets ``[S, L]`` (row-major order kept, so a lower position
    within a set is a lower global flat index)."""
    B, T = x.shape
    if scope == "sequence":
        return x
    if scope == "batch":
        return x.reshape(1, B * T)
    if scope == "group":
        if group_size is None or group_size < 1 or B % group_size:
            raise ValueError(f"scope 'group' needs a group_size that divides B={B}; got {group_size}")
        return x.reshape(B // group_size, group_size * T)
    if scope == "micro_batch":
        raise ValueError("scope 'micro_batch' splits a mini-batch into micro-batches: select(..., micro_batches=n) "
                         "does it; on one micro-batch's arrays use scope 'batch'")
    raise ValueError(f"scope: {scope!r}; allowed: {list(_SCOPES)}")


def topk_mask(
    score: Float[Array, "B T"], valid: Valid, *, rho: float, scope: str, group_size: int | None = None,
    ties: Ties = "position",
) -> Mask:
    """Keep the top ``k = max(1, ceil(rho n))`` valid positions of each candidate set (docs/method.md §2).

    Stable sort on the keys (invalid, -score): invalid last, descending score, ties to the lower flat
    index. ``ties='position'`` (default): rank r < k is kept, exactly k. ``ties='all'``: every valid
    position whose score is >= s_k, the score at rank k - 1 (the k-th largest), so a cut inside an exact
    tie keeps the whole tie (more than k); elsewhere the same mask. ``-0.0`` and ``0.0`` compare equal.
    Returns float32 {0, 1}.
    """
    if ties not in _TIES:
        raise ValueError(f"ties: {ties!r}; allowed: {list(_TIES)}")
    a, b = rho_fraction(rho)
    shape = score.shape
    valid = _as_bool(valid)
    s = _sets(jnp.asarray(score, jnp.float32), scope, group_size)
    v = _sets(valid, scope, group_size)
    S, L = s.shape
    k = keep_count(jnp.sum(v, axis=1), a, b)  # [S]
    idx = lax.broadcasted_iota(jnp.int32, (S, L), 1)
    # sorted position r holds flat index perm[r]; keep if r < k
    _, neg_sorted, perm = lax.sort((jnp.where(v, 0, 1).astype(jnp.int32), -s, idx), dimension=1,
                                   is_stable=True, num_keys=2)
    if ties == "all":
        # s_k = -neg_sorted[k - 1] (valid positions sort first, so rank k - 1 < n is valid); k = 0 keeps none
        kth = -jnp.take_along_axis(neg_sorted, jnp.maximum(k - 1, 0)[:, None], axis=1)
        keep = v & (s >= kth) & (k > 0)[:, None]
        return keep.reshape(shape).astype(jnp.float32)
    keep_sorted = idx < k[:, None]
    # scatter back: sort (perm, keep) by perm
    _, keep = lax.sort((perm, keep_sorted), dimension=1, is_stable=True, num_keys=1)
    return (keep & v).reshape(shape).astype(jnp.float32)


def dense_mask(valid: Valid) -> Mask:
    """GRPO: M = valid (docs/method.md §2)."""
    return _as_bool(valid).astype(jnp.float32)


def ict_mask(
    js: Float[Array, "B T"], valid: Valid, *, group_size: int | None = None, rho: float = _ICT_RHO,
    scope: str = _ICT_SCOPE, ties: Ties = "position",
) -> Mask:
    """ICT: the top-rho fraction of valid tokens by u = JS(p || Pbar) (docs/method.md §1-2), per ``scope``;
    ``ties`` as in :func:`topk_mask`."""
    return topk_mask(js, valid, rho=rho, scope=scope, group_size=group_size, ties=ties)


def entropy_mask(
    H1: Float[Array, "B T"], valid: Valid, *, group_size: int | None = None, rho: float = _ENTROPY_RHO,
    scope: str = _ENTROPY_SCOPE, ties: Ties = "position",
) -> Mask:
    """20-Entropy: the top-rho fraction of valid tokens by Shannon entropy H1, global over the
    mini-batch by default (docs/method.md §2); ``ties`` as in :func:`topk_mask`. The official code's
    micro-batch convention is this with scope ``batch`` on one micro-batch's arrays (:func:`select` with
    scope ``micro_batch`` does it for every micro-batch)."""
    return topk_mask(H1, valid, rho=rho, scope=scope, group_size=group_size, ties=ties)


def frequent_mask(
    js: Float[Array, "B T"], valid: Valid, *, group_size: int | None = None, rho: float = _ICT_RHO,
    scope: str = _ICT_SCOPE, ties: Ties = "position",
) -> Mask:
    """Control, the paper's "90%-frequent" tokens: the complement of ICT's mask among the valid tokens,
    M = valid and not ict_mask(js, rho, scope, ties), i.e. the bottom 1 - rho by u (docs/method.md §2);
    under ``ties='all'`` the tokens strictly below ICT's cut. A response whose every valid token ICT
    selects (n = 1 under ``sequence``) has no selected token."""
    ict = ict_mask(js, valid, group_size=group_size, rho=rho, scope=scope, ties=ties)
    return (_as_bool(valid) & (ict <= 0)).astype(jnp.float32)


def selectable_mask(js: Float[Array, "B T"], valid: Valid, *, u_min: float = SELECTABLE_U_MIN) -> Mask:
    """Control, "dense minus the never-selectable tokens": M = valid and u > ``u_min`` (docs/method.md
    §2). Tokens with u = 0 (before the group diverges, or a rollout alone at t) can never be in ICT's
    mask while other tokens of the response have u > 0; this keeps everything else, with dense counts."""
    return (_as_bool(valid) & (jnp.asarray(js, jnp.float32) > u_min)).astype(jnp.float32)


def random_mask(
    key: Key[Array, ""] | jax.Array, valid: Valid, *, group_size: int | None = None, rho: float = _ICT_RHO,
    scope: str = _ICT_SCOPE, ties: Ties = "position",
) -> Mask:
    """Control: ict's counts with Uniform[0, 1) scores drawn from ``key`` (docs/method.md §2). :func:`select`
    passes ``fold_in(fold_in(fold_in(root_key, RANDOM_MASK_STREAM), step), minibatch)``. ``ties``: as in
    :func:`topk_mask` (float32 uniforms tie rarely, so ``all`` keeps ict's counts but for such a draw)."""
    valid = _as_bool(valid)
    u = jax.random.uniform(key, valid.shape, jnp.float32)
    return topk_mask(u, valid, rho=rho, scope=scope, group_size=group_size, ties=ties)


def stapo_quantile(H1: Float[Array, "B T"], valid: Valid, tau_h: float) -> Float[Array, ""]:
    """The ``tau_h`` quantile of H1 over the n entries marked by ``valid`` (STAPO's candidate set): sort
    them, linear interpolation at position (n-1) tau_h (NumPy's 'linear' method); the position is split
    exactly in integers from tau_h = a/b (:func:`ict_jax.rl.quantile.valid_quantile`). Returns +inf when
    n = 0 (nothing is then silenced)."""
    return valid_quantile(H1, valid, tau_h, empty=jnp.inf)


def stapo_candidates(
    logp: Float[Array, "B T"], adv: Float[Array, " B"] | Float[Array, "B T"], valid: Valid, *, tau_p: float,
    quantile_over: str,
) -> tuple[jax.Array, jax.Array]:
    """``(low, over)``: the tokens with A > 0 and p(o_t) < tau_p (``low``), and the set STAPO's entropy
    quantile is taken over (``over``): every valid token (``valid``) or ``low`` itself
    (``low_prob_positive``), docs/method.md §2. Both bool ``[B, T]``."""
    if quantile_over not in STAPO_TAU_H:
        raise ValueError(f"stapo_quantile_over: {quantile_over!r}; allowed: {list(STAPO_TAU_H)}")
    valid = _as_bool(valid)
    adv = jnp.asarray(adv, jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv
    low = valid & (adv > 0) & (jnp.exp(jnp.asarray(logp, jnp.float32)) < tau_p)
    return low, (valid if quantile_over == "valid" else low)


def stapo_mask(
    logp: Float[Array, "B T"], H1: Float[Array, "B T"], adv: Float[Array, " B"] | Float[Array, "B T"],
    valid: Valid, *, tau_p: float = _STAPO.tau_p, tau_h: float | None = None,
    quantile_over: str = _STAPO.stapo_quantile_over,
) -> Mask:
    """STAPO: M = valid and not silenced; (i, t) is silenced when A_i > 0 and p(o_t) < tau_p and
    H1 < q (strict '<'), q the ``tau_h`` quantile of H1 over the mini-batch's candidate set
    ``quantile_over`` (docs/method.md §2): ``low_prob_positive`` (default, STAPO v1: the tokens with
    A > 0 and p < tau_p; tau_h 0.75) or ``valid`` (all valid tokens; tau_h 0.8). ``tau_h`` None = the
    reading's default (``config.STAPO_TAU_H``). An empty candidate set silences nothing."""
    low, over = stapo_candidates(logp, adv, valid, tau_p=tau_p, quantile_over=quantile_over)
    q = stapo_quantile(H1, over, STAPO_TAU_H[quantile_over] if tau_h is None else tau_h)
    silenced = low & (H1 < q)
    return (_as_bool(valid) & ~silenced).astype(jnp.float32)


# --------------------------------------------------------------------------------------------------
# Registry and the entry point
# --------------------------------------------------------------------------------------------------
class SelectorFn(Protocol):
    def __call__(self, stats: TokenStats, adv: jax.Array, valid: jax.Array, *, key: jax.Array,
                 step: Any, config: SelectorSection, group_size: int | None) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Registered:
    """A registered selector: its function, whether the warm-up applies, the statistics it reads (``needs``;
    None = not declared), its default ``rho`` and ``scope`` (None = it has none), whether it is a top-k cut
    (``topk``: it reads ``rl.selector.ties``), its ``params`` dataclass (None = it takes none), whether
    ``fn`` takes the ``minibatch`` / ``params`` keywords, and whether it offers ``rl.selector.scope:
    micro_batch`` (``micro_batch``: 20-Entropy's official convention)."""

    fn: SelectorFn
    warmup: bool
    needs: tuple[str, ...] | None
    rho: float | None = None
    scope: str | None = None
    topk: bool = False
    params: type | None = None
    takes_minibatch: bool = False
    takes_params: bool = False
    micro_batch: bool = False


_REGISTRY: dict[str, Registered] = {}
#: user-facing aliases of registered selectors (``grpo`` is GRPO's name for ``dense``)
ALIASES: dict[str, str] = {"grpo": "dense"}


def _takes(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: call it without the keyword
        return False
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _checked_needs(name: str, needs: Sequence[str] | None) -> tuple[str, ...] | None:
    if needs is None:
        return None
    if isinstance(needs, str):
        raise TypeError(f"needs: a sequence of statistic names, e.g. ({needs!r},); got the string {needs!r}")
    needs = tuple(dict.fromkeys(needs))
    bad = [n for n in needs if n not in ALL_STATS]
    if bad:
        raise ValueError(f"selector {name!r}: needs {bad} are not statistics; allowed: {list(ALL_STATS)}")
    return needs


def register_selector(name: str, fn: SelectorFn, *, needs: Sequence[str] | None = None, warmup: bool = False,
                      rho: float | None = None, scope: str | None = None, topk: bool = False,
                      params: type | None = None, micro_batch: bool = False, overwrite: bool = False) -> None:
    """Register ``fn(stats, adv, valid, *, key, step, config, group_size) -> mask [B, T]`` under
    ``name`` for :func:`select` and the train step (``rl.selector.method: <name>``). This is the one place
    a selector's name, the statistics it reads, its warm-up and its defaults are written.

    ``needs`` names the :class:`~ict_jax.rl.token_stats.TokenStats` fields ``fn`` reads (of
    :data:`~ict_jax.rl.token_stats.ALL_STATS`): ``("js",)`` for a mask of u, ``("H1",)``, ``("logp",
    "H1")``, ``()`` for one that reads none (``dense``, ``random``). The train step computes what a
    selector needs (u and Q(o_t) of the old policy, docs/method.md §2; the rest of the current one), and
    takes its one-pass head when it needs nothing; :func:`select` refuses statistics that lack a field
    the selector needs. ``None`` (not declared) reads as "everything the step computes by default"
    (:data:`~ict_jax.rl.token_stats.DEFAULT_COMPUTE`) and is not checked.

    ``key`` is the root key (derive a stream with ``fold_in``); with ``warmup=True``, :func:`select`
    returns M = valid while ``step < config.warmup_steps``. A ``fn`` that accepts a ``minibatch`` keyword
    (or ``**kwargs``) also gets the mini-batch index within the rollout step (fold it into its key for a
    fresh draw per mini-batch, as ``random`` does).

    ``rho`` and ``scope``: the defaults that ``rl.selector.rho: null`` / ``scope: null`` resolve to
    (:func:`resolved_rho`, :func:`resolved_scope`); ``topk``: the mask is a top-k cut, so it reads
    ``rl.selector.ties``. ``params``: a frozen dataclass of the selector's own settings, read from the
    mapping ``rl.selector.params`` (:func:`selector_params`: unknown keys and wrong types are one-line
    errors naming ``rl.selector.params.<key>``); a ``fn`` that accepts a ``params`` keyword gets the
    instance. ``micro_batch``: the selector offers ``rl.selector.scope: micro_batch`` (each micro-batch of
    ``train.micro_batches`` its own candidate set; 20-Entropy's official code); :func:`check_selector`
    refuses that scope for a selector registered without it."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"selector {name!r} is already registered (pass overwrite=True to replace it)")
    if name in ALIASES:
        raise ValueError(f"selector {name!r}: the name is an alias of {ALIASES[name]!r}")
    if params is not None and not (dataclasses.is_dataclass(params) and isinstance(params, type)):
        raise TypeError(f"selector {name!r}: params must be a dataclass type; got {params!r}")
    if rho is not None:
        rho_fraction(rho)  # at most 4 decimals, in (0, 1]
    _REGISTRY[name] = Registered(fn, bool(warmup), _checked_needs(name, needs), rho, scope, bool(topk), params,
                                 _takes(fn, "minibatch"), _takes(fn, "params"), bool(micro_batch))


def registered_selectors() -> tuple[str, ...]:
    """The registered selectors' names, sorted (aliases such as ``grpo`` aside: :data:`ALIASES`)."""
    return tuple(sorted(_REGISTRY))


def _entry(method: str) -> Registered:
    name = canonical_method(method)
    if name not in _REGISTRY:
        raise ValueError(f"rl.selector.method: selector {method!r} is not registered; "
                         f"known: {list(registered_selectors())}")
    return _REGISTRY[name]


def canonical_method(method: str) -> str:
    """The registered name ``method`` stands for: an alias (:data:`ALIASES`, ``grpo`` -> ``dense``) resolved,
    any other name itself."""
    return ALIASES.get(method, method)


def selector_info(method: str) -> Registered:
    """The registration of ``method`` (an alias resolves); ValueError naming the registered ones."""
    return _entry(method)


def selector_needs(method: str) -> tuple[str, ...]:
    """The statistics the selector ``method`` reads (``grpo`` = ``dense``): its registered ``needs``, or
    :data:`~ict_jax.rl.token_stats.DEFAULT_COMPUTE` when it declared none."""
    needs = _entry(method).needs
    return DEFAULT_COMPUTE if needs is None else needs


def selector_warmup(method: str) -> bool:
    """Whether the warm-up applies to the selector ``method`` (``grpo`` = ``dense``): its first
    ``rl.selector.warmup_steps`` RL steps train on every valid token (:func:`select`)."""
    return _entry(method).warmup


def selectors_where(methods: Sequence[str] = (), **flags: bool) -> tuple[str, ...]:
    """The selectors whose registration has each flag given (``warmup=True``, ``topk=True``): the built-in
    ones in registration order, then those of ``methods`` (a report's own methods, aliases resolved) that
    a plugin registered. What help and report texts list."""
    named = [canonical_method(m) for m in methods]
    names = [*BUILTIN_SELECTORS, *(m for m in dict.fromkeys(named) if m in _REGISTRY and m not in BUILTIN_SELECTORS)]
    return tuple(n for n in names if all(getattr(_REGISTRY[n], k) == v for k, v in flags.items()))


def resolved_rho(config: SelectorSection) -> float | None:
    """``rl.selector.rho``, or the selector's registered default (None for a selector without one)."""
    return config.rho if config.rho is not None else _entry(config.method).rho


def resolved_scope(config: SelectorSection) -> str | None:
    """``rl.selector.scope``, or the selector's registered default (None for a selector without one)."""
    return config.scope if config.scope is not None else _entry(config.method).scope


def selector_params(config: SelectorSection) -> Any:
    """The selector's ``params`` dataclass built from ``rl.selector.params`` (None when it registered none);
    :class:`~ict_jax.config.ConfigError` (one line naming the key) for an unknown key or a wrong type."""
    cls = _entry(config.method).params
    if cls is None:
        if config.params:
            raise ConfigError(f"rl.selector.params: selector {config.method!r} takes no params "
                              f"(got {sorted(config.params)}); its settings are rl.selector's own keys")
        return None
    return build_section(cls, dict(config.params), "rl.selector.params")


def check_selector(config: SelectorSection) -> None:
    """The run's selector, checked when the run is built: ``rl.selector.method`` names a registered selector
    (or an alias), ``rl.selector.scope: micro_batch`` only for a selector that offers it, and its ``params``
    build. Raises :class:`~ict_jax.config.ConfigError` (one line)."""
    if canonical_method(config.method) not in _REGISTRY:
        names = sorted((*_REGISTRY, *ALIASES))
        raise ConfigError(f"rl.selector.method: {config.method!r} is not a registered selector; registered: "
                          f"{', '.join(names)} (a plugin module registers more: plugins: [module])")
    if config.scope == "micro_batch" and not _entry(config.method).micro_batch:
        offered = ", ".join(n for n in sorted(_REGISTRY) if _REGISTRY[n].micro_batch)
        raise ConfigError(f"rl.selector.scope: 'micro_batch' is 20-Entropy's official convention and is offered "
                          f"for method {offered} only; got method {config.method!r} (use sequence, group or batch)")
    selector_params(config)


def _dense(stats, adv, valid, *, key, step, config, group_size):
    return dense_mask(valid)


def _ict(stats, adv, valid, *, key, step, config, group_size):
    return ict_mask(stats.js, valid, group_size=group_size, rho=resolved_rho(config),
                    scope=resolved_scope(config), ties=config.ties)


def _entropy(stats, adv, valid, *, key, step, config, group_size):
    return entropy_mask(stats.H1, valid, group_size=group_size,
                        rho=resolved_rho(config), scope=resolved_scope(config), ties=config.ties)


def _stapo(stats, adv, valid, *, key, step, config, group_size):
    return stapo_mask(stats.logp, stats.H1, adv, valid,
                      tau_p=config.tau_p, tau_h=config.resolved_tau_h, quantile_over=config.stapo_quantile_over)


def random_key(key: jax.Array, step: Any, minibatch: Any = 0) -> jax.Array:
    """The random control's key for rollout step ``step`` and mini-batch ``minibatch`` of it:
    fold_in(fold_in(fold_in(key, RANDOM_MASK_STREAM), step), minibatch) (docs/method.md §2)."""
    return stream_key(key, RANDOM_MASK_STREAM, step, minibatch)


def _random(stats, adv, valid, *, key, step, config, group_size, minibatch=0):
    return random_mask(random_key(key, step, minibatch), valid, group_size=group_size, rho=resolved_rho(config),
                       scope=resolved_scope(config), ties=config.ties)


def _frequent(stats, adv, valid, *, key, step, config, group_size):
    return frequent_mask(stats.js, valid, group_size=group_size, rho=resolved_rho(config),
                         scope=resolved_scope(config), ties=config.ties)


def _selectable(stats, adv, valid, *, key, step, config, group_size):
    return selectable_mask(stats.js, valid)


# the built-in selectors: docs/method.md §2's table (docs/config.md's `method` row lists each, a test checks it)
register_selector("dense", _dense, needs=())
register_selector("ict", _ict, needs=("js",), warmup=True, rho=_ICT_RHO, scope=_ICT_SCOPE, topk=True)
register_selector("entropy", _entropy, needs=("H1",), rho=_ENTROPY_RHO, scope=_ENTROPY_SCOPE, topk=True,
                  micro_batch=True)
register_selector("stapo", _stapo, needs=("logp", "H1"))
# random and frequent take ict's counts: its (rho, scope)
register_selector("random", _random, needs=(), warmup=True, rho=_ICT_RHO, scope=_ICT_SCOPE, topk=True)
register_selector("frequent", _frequent, needs=("js",), warmup=True, rho=_ICT_RHO, scope=_ICT_SCOPE, topk=True)
register_selector("selectable", _selectable, needs=("js",), warmup=True)
#: the selectors this module registers, in registration order (what docs/config.md's ``method`` row lists);
#: plugins add others
BUILTIN_SELECTORS: tuple[str, ...] = tuple(_REGISTRY)


def _per_micro_batch(call: Any, micro_batches: int, stats: TokenStats, adv: jax.Array, valid: jax.Array) -> jax.Array:
    """``call(stats, adv, valid)`` on each of ``micro_batches`` contiguous row blocks of the mini-batch (the
    train step's micro-batches, :func:`ict_jax.rl.train_step.micro_batched_grads`), as one ``vmap``; the
    masks put back in row order."""
    B = jnp.shape(valid)[0]
    if micro_batches < 1 or B % micro_batches:
        raise ValueError(f"scope 'micro_batch': micro_batches={micro_batches} must be >= 1 and divide the "
                         f"mini-batch's {B} rows")

    def split(x):
        return None if x is None else jnp.reshape(x, (micro_batches, B // micro_batches) + jnp.shape(x)[1:])

    out = jax.vmap(call)(TokenStats(*map(split, stats)), split(jnp.asarray(adv)), split(jnp.asarray(valid)))
    return jnp.reshape(out, jnp.shape(valid))


def select(
    method: str,
    stats: TokenStats,
    adv: Float[Array, " B"] | Float[Array, "B T"],
    valid: Valid,
    *,
    key: jax.Array,
    step: Int[Array, ""] | int,
    config: SelectorSection,
    group_size: int | None = None,
    minibatch: Int[Array, ""] | int = 0,
    micro_batches: int = 1,
) -> Mask:
    """The train step's one entry point: the mask of ``method`` (``'grpo'`` = ``'dense'``) (docs/method.md §2).

    ``key`` is the run's root key (``random`` derives :func:`random_key`: fold_in(fold_in(fold_in(key,
    RANDOM_MASK_STREAM), step), minibatch)); ``step`` is the 0-based rollout-batch count and
    ``minibatch`` the index of the mini-batch within the rollout step (traced ints are fine). For
    ``ict``, ``random``, ``frequent`` and ``selectable`` (and selectors registered with
    ``warmup=True``), ``step < config.warmup_steps`` gives M = valid, as traced data (no
    recompilation). ``group_size`` (G) is needed by the ``group`` scope only. Scope ``micro_batch``
    (20-Entropy's official code): the mini-batch's rows are cut into ``micro_batches`` contiguous
    micro-batches (the train step's) and the selector runs on each as on a mini-batch of scope ``batch``;
    with ``micro_batches=1`` that is scope ``batch``. ``stats`` must hold every
    statistic the selector was registered as reading (:func:`selector_needs`; a ValueError names the
    first one missing). Returns float32 {0, 1} ``[B, T]`` with M <= valid.
    """
    entry = _entry(method)
    fn, warmup = entry.fn, entry.warmup
    missing = [n for n in entry.needs or () if getattr(stats, n) is None]
    if missing:
        raise ValueError(f"selector {method!r} needs stats.{missing[0]}; compute it in the statistics pass")
    dense = dense_mask(valid)
    extra = {"minibatch": minibatch} if entry.takes_minibatch else {}
    if entry.takes_params:
        extra["params"] = selector_params(config)
    if resolved_scope(config) == "micro_batch":
        per_set = dataclasses.replace(config, scope="batch")
        m = _per_micro_batch(
            lambda st, a, v: jnp.asarray(fn(st, a, v, key=key, step=step, config=per_set, group_size=group_size,
                                            **extra), jnp.float32), micro_batches, stats, adv, valid)
    else:
        m = fn(stats, adv, valid, key=key, step=step, config=config, group_size=group_size, **extra)
    m = jnp.where(dense > 0, jnp.asarray(m, jnp.float32), 0.0)  # M <= valid, whatever fn returns
    if warmup:
        m = jnp.where(jnp.asarray(step) < config.warmup_steps, dense, m)
    return m
