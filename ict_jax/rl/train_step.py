"""The single compiled, sharded train step (docs/method.md §4 schedule, §5 metrics).

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
``random``), the gradient is taken through :func:`ict_jax.rl.token_stats.stats_and_surrogate`, which
applies it to each block's softmax while the block is in memory (three vocabulary matmuls per token
instead of four). Same gradient to float32 rounding; the other methods keep the two-pass form.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ict_jax.config import Config
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.losses import loss_denominators, policy_loss
from ict_jax.rl.metrics import step_metrics
from ict_jax.rl.selectors import select
from ict_jax.rl.state import TrainState, make_optimizer
from ict_jax.rl.token_stats import TokenStats, stats_and_surrogate, stats_from_hidden
from ict_jax.sharding import batch_sharding, check_prompts_divide, replicated

F32 = jnp.float32
#: Built-in selectors whose mask does not read the token statistics (the one-pass head applies).
_STATS_FREE_SELECTORS = ("dense", "random")


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
    fused = n_mini == 1 and n_micro == 1  # docs/method.md §4 (a): the gradient forward gives logp_old and u
    temperature = cfg.stats_temperature
    chunk = cfg.stats.chunk
    use_kl = loss_cfg.kl_coef > 0
    tx = tx or make_optimizer(cfg)
    # statistics each pass computes: everything for the §5 metrics (js costs two more vocab passes)
    need_js = method == "ict" or cfg.stats.js_metrics
    cur_compute = ("logp", "H1", "H2") + (("js",) if fused and need_js else ())
    # docs/method.md §4 with r = 1 (fused, logp_old = this forward's logp) and no KL: d loss / d logp depends on
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
                cur = cur._replace(js=js_old)  # ICT's u comes from the old policy (docs/method.md §2)
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
            raise ValueError("rl.loss.kl_coef > 0 needs ref_params (see ict_jax.rl.state.reference_params)")
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
