"""The single compiled, sharded train step (METHOD.md §4 schedule, §5 metrics).

``step = make_train_step(config, mesh)``; ``state, metrics = step(state, batch, ref_params)`` is ONE
``jax.jit`` with explicit in/out shardings and the state donated. Per rollout batch:

(a) old policy: with one mini-batch of one micro-batch (the default) the gradient forward itself,
    under stop_gradient, gives logp_old (so r = 1) and ICT's u. Otherwise a no-grad old-policy pass
    over the whole rollout batch (micro-batch by micro-batch) gives them, fixed for every update.
    ``rl.loss.old_logp: sampler`` takes logp_old from the sampler instead (u still from the old pass);
(b) kl_coef > 0: a reference pass with ``ref_params`` gives logp_ref;
(c) a scan over mini-batches (whole groups). With several micro-batches a no-grad statistics pass over
    the mini-batch first gives H1, the STAPO quantile, the global top-k mask and every loss denominator;
    then micro-batch gradients are accumulated and one AdamW update (global-norm clipping first) is
    applied. A non-finite loss or gradient skips that update (``train/skipped``).

Statistics never materialise float32 ``[B, T, V]`` logits: hidden states go to
:func:`ict_jax.stats_from_hidden` (blocks of ``stats.chunk`` positions).

One-pass head: when d loss / d logp is known before the forward pass (fused schedule so r = 1,
``kl_coef = 0``, logp_old not from the sampler, and a mask that ignores the statistics: ``dense`` and
``random``), the gradient is taken through :func:`ict_jax.token_stats.stats_and_surrogate`, which
applies it to each block's softmax while the block is in memory (three vocabulary matmuls per token
instead of four). Same gradient to float32 rounding; the other methods keep the two-pass form.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from ict_jax.config import Config
from ict_jax.grpo import loss_denominators, policy_loss, zero_std_groups
from ict_jax.selectors import select
from ict_jax.sharding import batch_sharding, check_prompts_divide, replicated
from ict_jax.token_stats import TokenStats, stats_and_surrogate, stats_from_hidden

F32 = jnp.float32
#: Built-in selectors whose mask does not read the token statistics (the one-pass head applies).
_STATS_FREE_SELECTORS = ("dense", "random")


@flax.struct.dataclass
class RolloutBatch:
    """One rollout batch, B = P*G rows prompt-major (row = p*G + j); Lr = max_new_tokens.

    ``tokens[B, Lp+Lr]``: the prompt left-padded to Lp, then the response right-padded to Lr;
    ``attention_mask`` marks real tokens of both; ``response_valid[B, Lr]`` the response tokens that
    count (the EOS included). ``row_valid[B]`` is 0 for filler rows of a bucketed batch.
    ``correct[B]`` is 1 where the final answer was right (``reward/accuracy``).
    """

    tokens: Int[Array, "B L"]
    attention_mask: Int[Array, "B L"]
    response_valid: Float[Array, "B Lr"]
    rewards: Float[Array, "B"]
    advantages: Float[Array, "B"]
    sampler_logp: Float[Array, "B Lr"]
    truncated: Float[Array, "B"]
    row_valid: Float[Array, "B"]
    correct: Float[Array, "B"]

    @property
    def response_len(self) -> int:
        return self.response_valid.shape[1]


@flax.struct.dataclass
class TrainState:
    """Policy parameters, optimizer state, the rollout-batch count and the run's root RNG key.

    ``graphdef`` (static, not saved) rebuilds the model from ``params`` inside the jitted step.
    """

    params: Any  # nnx.State of the policy's nnx.Param variables
    opt_state: Any
    step: Int[Array, ""]  # rollout batches done (METHOD §2 warm-up and the random-mask stream)
    rng: Any  # root key, uint32[2]
    graphdef: Any = flax.struct.field(pytree_node=False, default=None)

    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.params)


def build_rollout_batch(prompt_ids: Int[Array, "P Lp"], prompt_mask: Int[Array, "P Lp"], rollout: Any,
                        rewards: Float[Array, "B"], *, config: Config, correct: Float[Array, "B"] | None = None,
                        row_valid: Float[Array, "B"] | None = None) -> RolloutBatch:
    """A :class:`RolloutBatch` from left-padded prompts, an :class:`ict_jax.Rollout` of G samples per
    prompt and per-row rewards; advantages by METHOD §3 (``config.rl.adv``)."""
    from ict_jax.grpo import group_advantages

    G = config.rollout.num_samples
    B = rollout.tokens.shape[0]
    rewards = jnp.asarray(rewards, F32)
    row_valid = jnp.ones((B,), F32) if row_valid is None else jnp.asarray(row_valid, F32)
    correct = (rewards >= 1.0).astype(F32) if correct is None else jnp.asarray(correct, F32)
    ids = jnp.repeat(jnp.asarray(prompt_ids, jnp.int32), G, axis=0)
    pm = jnp.repeat(jnp.asarray(prompt_mask, jnp.int32), G, axis=0)
    valid = rollout.valid.astype(jnp.int32)
    adv = group_advantages(rewards, G, config.rl.adv.scale_rewards, config.rl.adv.eps, row_valid)
    return RolloutBatch(tokens=jnp.concatenate([ids, rollout.tokens.astype(jnp.int32)], axis=1),
                        attention_mask=jnp.concatenate([pm, valid], axis=1), response_valid=valid.astype(F32),
                        rewards=rewards, advantages=adv, sampler_logp=rollout.logp.astype(F32),
                        truncated=rollout.truncated.astype(F32), row_valid=row_valid, correct=correct)


# ------------------------------------------------------------------------------------------------
# Optimizer and state
# ------------------------------------------------------------------------------------------------
def make_optimizer(config: Config, *, lr: float | None = None, total_updates: int | None = None
                   ) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW with linear warmup and a constant or cosine schedule."""
    o = config.optim
    peak = o.lr if lr is None else lr
    total = total_updates or max(1, config.train.steps * config.train.mini_batches)
    warm = min(o.lr_warmup_steps, total)
    if o.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0 if warm else peak, peak, warm, max(total, warm + 1), 0.0)
    elif warm:
        sched = optax.join_schedules([optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak)], [warm])
    else:
        sched = optax.constant_schedule(peak)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip),
                       optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def init_train_state(config: Config, model: Any, *, tx: optax.GradientTransformation | None = None) -> TrainState:
    """A :class:`TrainState` for ``model`` (already placed on its mesh); the optimizer state follows the
    parameters' shardings."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = tx or make_optimizer(config)
    opt_state = init_opt_state(tx, params)
    step, rng = jnp.zeros((), jnp.int32), jax.random.PRNGKey(config.seed)
    sh = jax.tree.leaves(params)[0].sharding if jax.tree.leaves(params) else None
    # committed like the parameters (on a mesh: replicated over it), so the first call of the step
    # sees the same input placement as every later one (one executable, not two)
    target = replicated(sh.mesh) if isinstance(sh, jax.sharding.NamedSharding) else sh
    if target is not None:
        step, rng = jax.device_put((step, rng), target)
    return TrainState(params=params, opt_state=opt_state, step=step, rng=rng, graphdef=graphdef)


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` placed like the parameters (moments sharded as their parameter, counts
    replicated), in one jitted call."""
    return jax.jit(tx.init, out_shardings=_opt_state_shardings(tx, params))(params)


def _opt_state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
    """Shardings for ``tx.init(params)``: a leaf whose key path ends with a parameter's key path (Adam's
    moments, ...) gets that parameter's sharding; the rest (step counts) is replicated."""
    from jax.tree_util import tree_flatten_with_path, tree_unflatten

    p_leaves, _ = tree_flatten_with_path(params)
    by_path = {tuple(map(str, path)): leaf.sharding for path, leaf in p_leaves}
    if not by_path:
        return None
    any_sh = next(iter(by_path.values()))
    rep = jax.sharding.NamedSharding(any_sh.mesh, jax.sharding.PartitionSpec()) if isinstance(
        any_sh, jax.sharding.NamedSharding) else any_sh
    lengths = sorted({len(k) for k in by_path}, reverse=True)
    o_leaves, treedef = tree_flatten_with_path(jax.eval_shape(tx.init, params))
    out = []
    for path, _leaf in o_leaves:
        key = tuple(map(str, path))
        out.append(next((by_path[key[-n:]] for n in lengths if len(key) >= n and key[-n:] in by_path), rep))
    return tree_unflatten(treedef, out)


def reference_params(state_or_params: Any, dtype: str | Any = "float32") -> Any:
    """A copy of the policy parameters in the compute dtype, for the KL reference (METHOD §4 (b)):
    outside the optimizer, the donation and the checkpoint."""
    params = state_or_params.params if isinstance(state_or_params, TrainState) else state_or_params
    return jax.tree.map(lambda x: jnp.asarray(x, dtype).copy(), params)


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------
def _split(x: Any, n: int) -> Any:
    """[B, ...] -> [n, B/n, ...] for every leaf (contiguous: whole groups stay together)."""
    return jax.tree.map(lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), x)


def _merge(x: Any) -> Any:
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), x)


def _valid(batch: RolloutBatch, mask_truncated: bool) -> jax.Array:
    v = (batch.response_valid > 0) & (batch.row_valid[:, None] > 0)
    if mask_truncated:
        v = v & (batch.truncated[:, None] <= 0)
    return v.astype(F32)


def _masked_mean(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.where(w > 0, x, 0.0).sum() / jnp.maximum(w.sum(), 1.0)


def _sorted_valid(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Ascending sort of x over valid entries (invalid pushed to +inf) and the count n."""
    flat = jnp.where(valid > 0, x, jnp.inf).reshape(-1)
    return jnp.sort(flat), (valid > 0).sum()


def step_metrics(batch: RolloutBatch, valid: jax.Array, mask: jax.Array, stats: TokenStats,
                 logp_old: jax.Array, group_size: int) -> dict[str, jax.Array]:
    """METHOD §5 metrics of the rollout batch, masks and statistics (device scalars)."""
    rv = batch.row_valid > 0
    sel = mask * valid
    n_rows = jnp.maximum(rv.sum(), 1)
    m: dict[str, jax.Array] = {
        "reward/mean": jnp.where(rv, batch.rewards, 0.0).sum() / n_rows,
        "reward/accuracy": jnp.where(rv, batch.correct, 0.0).sum() / n_rows,
        "adv/zero_std_group_frac": zero_std_groups(batch.rewards, group_size, batch.row_valid).mean(),
        "response/length_mean": jnp.where(rv, batch.response_valid.sum(-1), 0.0).sum() / n_rows,
        "response/truncated_frac": jnp.where(rv, batch.truncated, 0.0).sum() / n_rows,
        "mask/selected_frac": sel.sum() / jnp.maximum(valid.sum(), 1.0),
        "rollout/logp_abs_diff_mean": _masked_mean(jnp.abs(batch.sampler_logp - logp_old), valid),
    }
    if stats.logp is not None:
        m["mask/selected_prob_mean"] = _masked_mean(jnp.exp(jax.lax.stop_gradient(stats.logp)), sel)
    if stats.H1 is not None:
        srt, n = _sorted_valid(stats.H1, valid)
        med = srt[jnp.maximum(n - 1, 0) // 2]  # lower median of H1 over valid tokens
        hi = ((sel > 0) & (stats.H1 > med)).sum()
        lo = ((sel > 0) & (stats.H1 <= med)).sum()
        m["mask/high_low_entropy_ratio"] = hi / jnp.maximum(lo, 1)
        m["stats/H1_mean"] = _masked_mean(stats.H1, valid)
        m["stats/H1_selected_mean"] = _masked_mean(stats.H1, sel)
    if stats.H2 is not None:
        m["stats/H2_mean"] = _masked_mean(stats.H2, valid)
        m["stats/H2_selected_mean"] = _masked_mean(stats.H2, sel)
    if stats.js is not None:
        srt, n = _sorted_valid(stats.js, valid)
        pos = jnp.maximum(n - 1, 0).astype(F32) * 0.9  # linear interpolation, as numpy's default
        lo_i = jnp.floor(pos).astype(jnp.int32)
        hi_i = jnp.minimum(lo_i + 1, jnp.maximum(n - 1, 0))
        p90 = srt[lo_i] + (srt[hi_i] - srt[lo_i]) * (pos - lo_i)
        m["stats/js_mean"] = _masked_mean(stats.js, valid)
        m["stats/js_p90"] = jnp.where(n > 0, p90, 0.0)
        m["stats/js_selected_mean"] = _masked_mean(stats.js, sel)
    return m


# ------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------
def make_train_step(config: Config, mesh: jax.sharding.Mesh | None = None, *,
                    tx: optax.GradientTransformation | None = None) -> Callable[..., tuple[TrainState, dict]]:
    """``step(state, batch, ref_params=None) -> (state, metrics)``: ONE jitted program per shape.

    ``mesh``: rows of the batch are split over ('data', 'fsdp'); the state keeps the shardings it
    has (from :func:`ict_jax.init_model` / :func:`ict_jax.load_hf` with the same mesh). The state is
    donated. The warm-up switch (``step < warmup_steps``) is traced data: no recompilation.
    ``step.lower(state, batch, ref_params=None)`` gives the ``jax.stages.Lowered`` program (arguments
    may be abstract ``jax.ShapeDtypeStruct`` trees) for ``.compile().memory_analysis()`` and cost
    estimates without running it.
    """
    cfg = config
    G = cfg.rollout.num_samples
    sel_cfg = cfg.rl.selector
    method = sel_cfg.canonical_method
    loss_cfg = cfg.rl.loss
    n_mini, n_micro = cfg.train.mini_batches, cfg.train.micro_batches
    fused = n_mini == 1 and n_micro == 1  # METHOD §4 (a): the gradient forward gives logp_old and u
    temperature = cfg.stats_temperature
    chunk = cfg.stats.chunk
    use_kl = loss_cfg.kl_coef > 0
    tx = tx or make_optimizer(cfg)
    # statistics each pass computes: everything for the §5 metrics (js costs two more vocab passes)
    need_js = method == "ict" or cfg.stats.js_metrics
    cur_compute = ("logp", "H1", "H2") + (("js",) if fused and need_js else ())
    # METHOD §4 with r = 1 (fused, logp_old = this forward's logp) and no KL: d loss / d logp depends on
    # the mask and denominators only, so for masks that ignore the statistics it is known up front.
    one_pass = (fused and not use_kl and loss_cfg.old_logp != "sampler"
                and method in _STATS_FREE_SELECTORS)

    def head_inputs(params, graphdef, mb: RolloutBatch):
        """(hidden states that predict the response tokens, unembedding, response tokens)."""
        model = nnx.merge(graphdef, params)
        Lr = mb.response_len
        # hidden[:, t] predicts tokens[:, t + 1]: drop the last input token, keep the last Lr states
        h = model.hidden_states(mb.tokens[:, :-1], mb.attention_mask[:, :-1])[:, -Lr:]
        return h, model.unembedding(), mb.tokens[:, -Lr:]

    def stats_of(params, graphdef, mb: RolloutBatch, valid, compute) -> TokenStats:
        return stats_from_hidden(*head_inputs(params, graphdef, mb), valid, group_size=G,
                                 temperature=temperature, chunk=chunk, compute=compute)

    def nograd_pass(params, graphdef, batch: RolloutBatch, valid, compute, n: int) -> TokenStats:
        """Statistics over a batch in ``n`` micro-batch-sized chunks, without gradient."""
        params = jax.lax.stop_gradient(params)

        def body(_, xs):
            mb, v = xs
            return None, stats_of(params, graphdef, mb, v, compute)

        _, out = jax.lax.scan(body, None, (_split(batch, n), _split(valid, n)))
        return _merge(out)

    def loss_fn(params, graphdef, mb, valid, logp_old, logp_ref, mask, denoms, key, step):
        stats = stats_of(params, graphdef, mb, valid, cur_compute)
        sg = jax.lax.stop_gradient
        if logp_old is None:  # fused: the old policy is the current one
            logp_old = sg(stats.logp)
        if mask is None:  # fused: select from this forward's (stop-gradient) statistics
            sg_stats = TokenStats(*(None if s is None else sg(s) for s in stats))
            mask = select(method, sg_stats, mb.advantages, valid, key=key, step=step, config=sel_cfg,
                          group_size=G)
            denoms = loss_denominators(valid, mask, loss_cfg)
        loss, metrics = policy_loss(stats.logp, logp_old, logp_ref, mb.advantages, valid, mask,
                                    config=loss_cfg, denoms=denoms)
        return loss, (metrics, mask, TokenStats(*(None if s is None else sg(s) for s in stats)), logp_old)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def surrogate_fn(params, graphdef, mb, valid, key, step):
        """The one-pass form of ``loss_fn`` (fused, r = 1, no KL, statistics-free mask): its value is
        sum g * logp, whose gradient is the loss's; the loss itself comes back in the aux."""
        sg = jax.lax.stop_gradient
        no_stats = TokenStats(None, None, None, None)
        mask = select(method, no_stats, mb.advantages, valid, key=key, step=step, config=sel_cfg,
                      group_size=G)
        denoms = loss_denominators(valid, mask, loss_cfg)

        def loss_at(lp):  # r = exp(lp - sg(lp)) = 1 at any lp: the gradient does not depend on lp
            return policy_loss(lp, sg(lp), None, mb.advantages, valid, mask, config=loss_cfg, denoms=denoms)[0]

        g_logp = jax.grad(loss_at)(jnp.zeros(valid.shape, F32))
        stats, surrogate = stats_and_surrogate(*head_inputs(params, graphdef, mb), valid, g_logp,
                                               group_size=G, temperature=temperature, chunk=chunk,
                                               compute=cur_compute)
        logp_old = stats.logp  # already stop-gradient
        loss, metrics = policy_loss(stats.logp, logp_old, None, mb.advantages, valid, mask, config=loss_cfg,
                                    denoms=denoms)
        return surrogate, (loss, metrics, mask, stats, logp_old)

    surrogate_grad_fn = jax.grad(surrogate_fn, has_aux=True)

    def update(params, opt_state, grads, loss):
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), gnorm, ~finite

    def step_fn(state: TrainState, batch: RolloutBatch, ref_params):
        graphdef = state.graphdef
        valid = _valid(batch, loss_cfg.mask_truncated)
        logp_ref = None
        if use_kl:
            logp_ref = nograd_pass(ref_params, graphdef, batch, valid, ("logp",), n_mini * n_micro).logp
        old = None
        if not fused:  # (a): old-policy pass over the whole rollout batch
            old = nograd_pass(state.params, graphdef, batch, valid, ("logp", "js") if need_js else ("logp",),
                              n_mini * n_micro)
        logp_old_all = None
        if loss_cfg.old_logp == "sampler":
            logp_old_all = jnp.where(valid > 0, batch.sampler_logp, 0.0)
        elif old is not None:
            logp_old_all = old.logp

        def one_update(carry, xs):
            params, opt_state = carry
            mb, v, lp_old, lp_ref, js_old = xs
            if one_pass:
                grads, (loss, lm, mask, stats, lp_old_used) = surrogate_grad_fn(
                    params, graphdef, mb, v, state.rng, state.step)
            elif fused:
                (loss, (lm, mask, stats, lp_old_used)), grads = grad_fn(
                    params, graphdef, mb, v, lp_old, lp_ref, None, None, state.rng, state.step)
            else:
                cur = nograd_pass(params, graphdef, mb, v, ("logp", "H1", "H2"), n_micro)
                cur = cur._replace(js=js_old)  # ICT's u comes from the old policy (METHOD §2)
                mask = select(method, cur, mb.advantages, v, key=state.rng, step=state.step, config=sel_cfg,
                              group_size=G)
                denoms = loss_denominators(v, mask, loss_cfg)

                def micro(ys):
                    mmb, mv, mlo, mlr, mm = ys
                    (l, (mlm, _, _, _)), g = grad_fn(params, graphdef, mmb, mv, mlo, mlr, mm, denoms,
                                                     state.rng, state.step)
                    return g, l, mlm

                split_mu = lambda a: None if a is None else _split(a, n_micro)  # noqa: E731
                xs_mu = (split_mu(mb), split_mu(v), split_mu(lp_old), split_mu(lp_ref), split_mu(mask))
                shapes = jax.eval_shape(micro, jax.tree.map(lambda a: a[0], xs_mu))
                acc0 = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
                # denominators are the mini-batch's: the micro-batch losses, grads and metrics add up
                (grads, loss, lm), _ = jax.lax.scan(
                    lambda acc, ys: (jax.tree.map(jnp.add, acc, micro(ys)), None), acc0, xs_mu)
                stats, lp_old_used = cur, lp_old
            params, opt_state, gnorm, skipped = update(params, opt_state, grads, loss)
            lm = dict(lm, **{"grad/norm": gnorm, "train/skipped": skipped.astype(F32), "loss/total": loss})
            return (params, opt_state), (lm, mask, stats, lp_old_used)

        split = lambda a: None if a is None else _split(a, n_mini)  # noqa: E731
        js_old = None if old is None else old.js
        (params, opt_state), (lms, masks, stats, lp_old_used) = jax.lax.scan(
            one_update, (state.params, state.opt_state),
            (split(batch), split(valid), split(logp_old_all), split(logp_ref), split(js_old)))
        masks, stats, lp_old_used = _merge(masks), _merge(stats), _merge(lp_old_used)
        if old is not None:
            stats = stats._replace(js=old.js)
        metrics = {k: v.mean() for k, v in lms.items()}
        metrics["train/skipped"] = lms["train/skipped"].sum()
        metrics.update(step_metrics(batch, valid, masks, stats, lp_old_used, G))
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
        return new_state, metrics

    compiled: dict[Any, Callable] = {}

    def jitted_for(state: TrainState, batch: RolloutBatch, ref_params: Any) -> Callable:
        """The jax.jit object for these argument structures (built once, with the shape checks)."""
        if use_kl and ref_params is None:
            raise ValueError("rl.loss.kl_coef > 0 needs ref_params (see ict_jax.train_step.reference_params)")
        B = batch.tokens.shape[0]
        if B % G:
            raise ValueError(f"batch of {B} rows is not a multiple of rollout.num_samples={G}")
        P = B // G
        if P % (n_mini * n_micro):
            raise ValueError(f"{P} prompts cannot be split into train.mini_batches={n_mini} x "
                             f"train.micro_batches={n_micro} whole groups")
        if mesh is not None:
            check_prompts_divide(P // (n_mini * n_micro) if not fused else P, mesh)
        key = (jax.tree.structure(state), jax.tree.structure(batch), ref_params is None)
        fn = compiled.get(key)
        if fn is None:
            if mesh is None:
                fn = jax.jit(step_fn, donate_argnums=(0,))
            else:
                st_sh = jax.tree.map(lambda a: a.sharding, state)
                b_sh = jax.tree.map(lambda a: batch_sharding(mesh, a.ndim), batch)
                r_sh = None if ref_params is None else jax.tree.map(lambda a: a.sharding, ref_params)
                fn = jax.jit(step_fn, donate_argnums=(0,), in_shardings=(st_sh, b_sh, r_sh),
                             out_shardings=(st_sh, replicated(mesh)))
            compiled[key] = fn
        return fn

    def step(state: TrainState, batch: RolloutBatch, ref_params: Any = None) -> tuple[TrainState, dict]:
        fn = jitted_for(state, batch, ref_params)
        if mesh is not None:
            with jax.set_mesh(mesh):
                return fn(state, batch, ref_params)
        return fn(state, batch, ref_params)

    def lower(state: TrainState, batch: RolloutBatch, ref_params: Any = None) -> Any:
        """``jax.stages.Lowered`` of the step for these arguments, which may be abstract
        (``jax.ShapeDtypeStruct`` leaves with shardings): ``step.lower(...).compile().memory_analysis()``
        sizes a step without running or allocating it."""
        fn = jitted_for(state, batch, ref_params)
        if mesh is not None:
            with jax.set_mesh(mesh):
                return fn.lower(state, batch, ref_params)
        return fn.lower(state, batch, ref_params)

    step.jitted = compiled  # for tests and benchmarks (compile counts)
    step.lower = lower
    return step
