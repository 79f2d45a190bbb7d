"""The single compiled, sharded train step (docs/method.md §4 schedule, §5 metrics).

``step = make_train_step(config, mesh)``; ``state, metrics = step(state, batch, ref_params)`` is ONE
``jax.jit`` with explicit in/out shardings and the state donated. Per rollout batch
(:func:`step_fn`), one function per part of the schedule of docs/method.md §4:

(a) :func:`fused_grads`: with one mini-batch of one micro-batch (the default) the gradient forward
    itself, under stop_gradient, gives logp_old (so r = 1) and ICT's u;
(b) :func:`old_policy_pass`: otherwise a no-grad old-policy pass over the whole rollout batch (micro-batch
    by micro-batch) gives them, fixed for every update. ``rl.loss.old_logp: sampler`` takes logp_old
    from the sampler instead (u still from the old pass). With kl_coef > 0 it also runs the reference
    pass with ``ref_params`` for logp_ref (a LoRA state: its own base with the adapters off, no copy);
(c) :func:`micro_batched_grads`: a scan over mini-batches (whole groups, :func:`mini_batch_update`).
    With several micro-batches a no-grad statistics pass over the mini-batch first gives H1, the STAPO
    quantile, the global top-k mask and every loss denominator; then micro-batch gradients are
    accumulated. With one mini-batch that pass and (b)'s old-policy pass are the same forward over the
    same rows under the same parameters: it runs once (:attr:`StepPlan.shared_nograd`).
    :func:`apply_update` applies one AdamW update (global-norm clipping first); a non-finite loss or
    gradient skips that update (``train/skipped``).

Micro-batches may hold part of a group: once the statistics pass has fixed the mask and every
denominator over the whole mini-batch, a micro-batch's loss is a partial sum over its rows, whatever
rows they are. Only u (ICT's score, from the old-policy pass) compares a rollout with its group: that
pass runs in chunks of whole groups, whole groups per shard (:func:`old_pass_chunks`). A micro-batch
then needs only as many rows as the mesh has batch shards (:func:`check_step_inputs`), e.g. 4 rows of
a group of 8 per chip (docs/tpu.md: the 7B recipe).

Statistics never materialise float32 ``[B, T, V]`` logits: hidden states go to
:func:`ict_jax.stats_from_hidden` (blocks of ``stats.chunk`` positions) through
:func:`ict_jax.rl.group_stats.group_stats`, the one statistics-of-a-group function (the token inspector
and diagnose call it too).

One-pass head: when d loss / d logp is known before the forward pass (fused schedule so r = 1,
``kl_coef = 0``, logp_old not from the sampler, and a selector registered as reading no statistics,
``needs=()``: ``dense`` and ``random``), the gradient is taken through
:func:`ict_jax.rl.token_stats.stats_and_surrogate` (:func:`one_pass_surrogate`), which applies it to
each block's softmax while the block is in memory (three vocabulary matmuls per token instead of four).
Same gradient to float32 rounding; the other methods keep the two-pass form (:func:`loss_and_aux`).

Response buckets (docs/loss.md): :func:`make_train_step` runs a batch at its longest response
rounded up to a bucket of ``rollout.max_new_tokens`` (:func:`bucket_of`), one program per bucket; the
program cuts the response axis first (:func:`step_fn`), keeps the uncut width for Dr.GRPO's T and
chooses the mask at it (:func:`plan_select`), so gradients and metrics are the uncut step's.

The static choices (method, schedule, which statistics each pass computes) are read from the config
once into a :class:`StepPlan`; what the mask reads comes from the selector registry
(:func:`ict_jax.rl.selectors.selector_needs`), so a selector a user registers trains like a built-in one.
:func:`jit_step` builds the ``jax.jit`` (shardings, donation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from ict_jax.buckets import bucket_for, response_buckets
from ict_jax.config import Config, LossSection, SelectorSection
from ict_jax.rl.batch import RolloutBatch, response_extent, trim_response
from ict_jax.rl.group_stats import GroupStatsRequest, group_stats, head_inputs
from ict_jax.rl.losses import LossDenominators, loss_denominators, micro_batch_loss, policy_loss
from ict_jax.rl.metrics import step_metrics, update_norm
from ict_jax.rl.selectors import canonical_method, select, selector_needs
from ict_jax.rl.state import ModelDef, TrainState, check_lora_state, kl_reference, make_optimizer
from ict_jax.rl.token_stats import ALL_STATS, GROUP_STATS, TokenStats, stats_and_surrogate
from ict_jax.sharding import batch_sharding, check_prompts_divide, replicated

F32 = jnp.float32
#: What every gradient forward and the no-grad statistics pass of schedule (c) compute (the §5 metrics);
#: the group statistics (u, Q(o_t)) come from the old policy (docs/method.md §2).
_CURRENT_COMPUTE = ("logp", "H1", "H2")

#: (grads, loss, loss metrics, mask, statistics, logp_old used) of one mini-batch.
MiniBatchGrads = tuple[Any, jax.Array, dict[str, jax.Array], jax.Array, TokenStats, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static choices of one train step, read from the :class:`~ict_jax.config.Config` once."""

    group_size: int  # G
    method: str  # the canonical selector name
    selector: SelectorSection
    loss: LossSection
    mini_batches: int
    micro_batches: int
    temperature: float  # of the statistics
    chunk: int  # positions per statistics block
    need_js: bool  # u is needed: a mask that reads u (ict, frequent, selectable), or the §5 js metrics
    tx: optax.GradientTransformation
    u_form: str = "aligned"  # the reading of u (docs/method.md §1, stats.u_form)
    batch_shards: int = 1  # data x fsdp of the mesh the step runs on
    needs: tuple[str, ...] = ("js",)  # what the mask reads (the selector registry's ``needs``)
    min_response_bucket: int | None = None  # rollout.min_response_bucket: None = no response buckets
    # set per compiled program (make_train_step, step_fn): the response bucket the batch is cut to (None =
    # uncut) and the batch's uncut response width (rollout.max_new_tokens: Dr.GRPO's T, the masks' width)
    response_len: int | None = None
    response_width: int | None = None

    @classmethod
    def from_config(cls, config: Config, tx: optax.GradientTransformation, batch_shards: int = 1) -> StepPlan:
        method = canonical_method(config.rl.selector.method)
        needs = selector_needs(method)
        return cls(group_size=config.rollout.num_samples, method=method, selector=config.rl.selector,
                   loss=config.rl.loss, mini_batches=config.train.mini_batches,
                   micro_batches=config.train.micro_batches, temperature=config.stats_temperature,
                   chunk=config.stats.chunk, need_js="js" in needs or config.stats.js_metrics, tx=tx,
                   u_form=config.stats.u_form, batch_shards=batch_shards, needs=needs,
                   min_response_bucket=config.rollout.min_response_bucket)

    @property
    def fused(self) -> bool:
        """docs/method.md §4 (a): the gradient forward gives logp_old and u."""
        return self.mini_batches == 1 and self.micro_batches == 1

    @property
    def use_kl(self) -> bool:
        return self.loss.kl_coef > 0

    @property
    def old_group_compute(self) -> tuple[str, ...]:
        """The group statistics (u, Q(o_t)) the mask or the §5 metrics read: the old policy's
        (docs/method.md §2), from the gradient forward when fused, else from the old-policy pass."""
        return tuple(s for s in ALL_STATS if s in GROUP_STATS and (s in self.needs or (s == "js" and self.need_js)))

    @property
    def current_compute(self) -> tuple[str, ...]:
        """Statistics of the gradient forward (and of schedule (c)'s no-grad pass): everything for the §5
        metrics and what the mask reads; u and Q(o_t) (two more vocabulary passes) only where this forward
        is the old policy."""
        extra = tuple(s for s in self.needs if s not in _CURRENT_COMPUTE and s not in GROUP_STATS)
        return _CURRENT_COMPUTE + extra + (self.old_group_compute if self.fused else ())

    @property
    def shared_nograd(self) -> bool:
        """One mini-batch of several micro-batches: the old-policy pass and schedule (c)'s no-grad
        statistics pass are the same forward (the same parameters over the same rows), so the old-policy
        pass computes both passes' statistics once (:attr:`shared_compute`) and the micro-batches
        read them."""
        return self.mini_batches == 1 and not self.fused

    @property
    def shared_compute(self) -> tuple[str, ...]:
        """The statistics of the old-policy pass: logp and the group statistics, and under
        :attr:`shared_nograd` also the statistics pass's (:attr:`current_compute`)."""
        want = ("logp",) + self.old_group_compute + (self.current_compute if self.shared_nograd else ())
        return tuple(s for s in ALL_STATS if s in want)

    @property
    def one_pass(self) -> bool:
        """docs/method.md §4 with r = 1 (fused, logp_old = this forward's logp) and no KL: d loss / d logp
        depends on the mask and denominators only, so for masks that ignore the statistics it is known
        before the forward pass."""
        return self.fused and not self.use_kl and self.loss.old_logp != "sampler" and not self.needs


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------
def _split(x: Any, n: int) -> Any:
    """[B, ...] -> [n, B/n, ...] for every leaf (contiguous rows; whole groups when n divides the groups)."""
    return jax.tree.map(lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), x)


def _merge(x: Any) -> Any:
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), x)


def _split_or_none(x: Any, n: int) -> Any:
    return None if x is None else _split(x, n)


def _stop(stats: TokenStats) -> TokenStats:
    return TokenStats(*(None if s is None else jax.lax.stop_gradient(s) for s in stats))


def _valid(batch: RolloutBatch, mask_truncated: bool) -> jax.Array:
    v = (batch.response_valid > 0) & (batch.row_valid[:, None] > 0)
    if mask_truncated:
        v = v & (batch.truncated[:, None] <= 0)
    return v.astype(F32)


def plan_select(plan: StepPlan, stats: TokenStats, adv: jax.Array, valid: jax.Array, key: jax.Array,
                step: jax.Array, minibatch: jax.Array | int) -> jax.Array:
    """The mask of the plan's selector (:func:`ict_jax.rl.selectors.select`), chosen at the batch's uncut
    response width (``plan.response_width``): on a batch cut to a response bucket the cut columns come
    back as padding (valid 0, statistics 0, as they were) for the selector and go again after it, so
    every selector, a registered one included, gives the uncut batch's mask (``random`` draws its
    uniforms at ``[B, max_new_tokens]``; the counts and ties of top-k read valid positions only)."""
    T = valid.shape[1]
    extra = 0 if plan.response_width is None else plan.response_width - T
    widen = (lambda x: x) if extra <= 0 else (lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, extra))))
    mask = select(plan.method, TokenStats(*map(widen, stats)), adv, widen(valid), key=key, step=step,
                  config=plan.selector, group_size=plan.group_size, minibatch=minibatch,
                  micro_batches=plan.micro_batches)
    return mask[:, :T]


def batch_stats(plan: StepPlan, params: Any, graphdef: Any, mb: RolloutBatch, valid: jax.Array,
                compute: tuple[str, ...]) -> TokenStats:
    """The docs/method.md §1 statistics ``compute`` of ``mb`` under ``params`` (blocks of positions):
    :func:`ict_jax.rl.group_stats.group_stats` in the plan's reading of u. Only the group statistics
    (u = ``js``, ``pbar_tok``) read the group; without them ``mb`` may hold part of a group."""
    request = GroupStatsRequest(plan.group_size, plan.temperature, plan.chunk, tuple(compute), (plan.u_form,))
    return group_stats(params, graphdef, mb.tokens, mb.attention_mask, valid, request)[plan.u_form]


def nograd_stats(plan: StepPlan, params: Any, graphdef: Any, batch: RolloutBatch, valid: jax.Array,
                 compute: tuple[str, ...], n: int) -> TokenStats:
    """Statistics over a batch in ``n`` micro-batch-sized chunks (a scan), without gradient."""
    params = jax.lax.stop_gradient(params)

    def body(_, xs):
        mb, v = xs
        return None, batch_stats(plan, params, graphdef, mb, v, compute)

    _, out = jax.lax.scan(body, None, (_split(batch, n), _split(valid, n)))
    return _merge(out)


def loss_and_aux(plan: StepPlan, params: Any, graphdef: Any, mb: RolloutBatch, valid: jax.Array,
                 logp_old: jax.Array | None, logp_ref: jax.Array | None, mask: jax.Array | None,
                 denoms: LossDenominators | None, key: jax.Array, step: jax.Array,
                 minibatch: jax.Array | int = 0) -> tuple[jax.Array, tuple]:
    """The loss of docs/method.md §4 on ``mb`` (differentiate w.r.t. ``params``), two-pass head.

    ``logp_old = None`` (fused): the old policy is this forward (stop-gradient); ``mask = None`` (fused):
    the mask and denominators come from this forward's stop-gradient statistics. Aux: (loss metrics,
    mask, stop-gradient statistics, logp_old)."""
    stats = batch_stats(plan, params, graphdef, mb, valid, plan.current_compute)
    if logp_old is None:  # fused: the old policy is the current one
        logp_old = jax.lax.stop_gradient(stats.logp)
    if mask is None:  # fused: select from this forward's (stop-gradient) statistics
        mask = plan_select(plan, _stop(stats), mb.advantages, valid, key, step, minibatch)
        denoms = loss_denominators(valid, mask, plan.loss)
    loss, metrics = micro_batch_loss(stats.logp, logp_old, logp_ref, mb.advantages, valid, mask, config=plan.loss,
                                     denoms=denoms, micro_batches=plan.micro_batches,
                                     max_new_tokens=plan.response_width)
    return loss, (metrics, mask, _stop(stats), logp_old)


def one_pass_surrogate(plan: StepPlan, params: Any, graphdef: Any, mb: RolloutBatch, valid: jax.Array,
                       key: jax.Array, step: jax.Array, minibatch: jax.Array | int = 0) -> tuple[jax.Array, tuple]:
    """The one-pass form of :func:`loss_and_aux` (fused, r = 1, no KL, statistics-free mask): its value
    is sum g * logp, whose gradient is the loss's; the loss itself comes back in the aux, with (loss
    metrics, mask, statistics, logp_old)."""
    sg = jax.lax.stop_gradient
    no_stats = TokenStats(None, None, None, None)
    mask = plan_select(plan, no_stats, mb.advantages, valid, key, step, minibatch)
    denoms = loss_denominators(valid, mask, plan.loss)
    width = plan.response_width

    def loss_at(lp):  # r = exp(lp - sg(lp)) = 1 at any lp: the gradient does not depend on lp
        return policy_loss(lp, sg(lp), None, mb.advantages, valid, mask, config=plan.loss, denoms=denoms,
                           max_new_tokens=width)[0]

    g_logp = jax.grad(loss_at)(jnp.zeros(valid.shape, F32))
    head = head_inputs(params, graphdef, mb.tokens, mb.attention_mask, mb.response_len)
    stats, surrogate = stats_and_surrogate(*head, valid, g_logp,
                                           group_size=plan.group_size, temperature=plan.temperature,
                                           chunk=plan.chunk, compute=plan.current_compute, u_form=plan.u_form)
    logp_old = stats.logp  # already stop-gradient
    loss, metrics = policy_loss(stats.logp, logp_old, None, mb.advantages, valid, mask, config=plan.loss,
                                denoms=denoms, max_new_tokens=width)
    return surrogate, (loss, metrics, mask, stats, logp_old)


# ------------------------------------------------------------------------------------------------
# The schedules of docs/method.md §4
# ------------------------------------------------------------------------------------------------
def old_pass_chunks(plan: StepPlan, num_prompts: int) -> int:
    """Chunks of the old-policy and reference passes over a rollout batch of ``num_prompts`` groups:
    ``mini_batches x k``, k the largest count up to ``micro_batches`` that cuts a mini-batch into whole
    groups, whole groups per batch shard (u compares a rollout with its group). k = ``micro_batches``
    whenever the micro-batches hold whole groups per shard; fewer, larger chunks otherwise (no-grad
    passes keep no activations for a backward pass)."""
    per_mini = num_prompts // plan.mini_batches
    k = max((d for d in range(1, plan.micro_batches + 1)
             if per_mini % d == 0 and (per_mini // d) % plan.batch_shards == 0), default=1)
    return plan.mini_batches * k


def old_policy_pass(plan: StepPlan, params: Any, ref_params: Any, graphdef: Any, batch: RolloutBatch,
                    valid: jax.Array, ref_def: ModelDef | None = None
                    ) -> tuple[jax.Array | None, jax.Array | None, dict[str, jax.Array]]:
    """docs/method.md §4 (a)-(b): ``(logp_old, logp_ref, group_old)`` over the whole rollout batch:
    ``[B, Lr]`` or None, and the old policy's group statistics by name (``js`` = u, ``pbar_tok``); under
    :attr:`StepPlan.shared_nograd` every statistic of that pass by name (:attr:`StepPlan.shared_compute`:
    it is the micro-batches' statistics pass too).

    With kl_coef > 0 the reference pass gives logp_ref: ``ref_params`` under ``ref_def`` (default: the
    policy's ``graphdef``; LoRA: the base with the adapters off). Unless fused, the no-grad old-policy
    pass gives logp_old and the group statistics the mask or the metrics read
    (:attr:`StepPlan.old_group_compute`); ``old_logp: sampler`` takes logp_old from the sampler. Fused and
    not from the sampler, logp_old is None and ``group_old`` empty: the gradient forward gives them."""
    n = old_pass_chunks(plan, batch.tokens.shape[0] // plan.group_size)
    logp_ref = None
    if plan.use_kl:
        ref_graph = graphdef if ref_def is None else ref_def
        logp_ref = nograd_stats(plan, ref_params, ref_graph, batch, valid, ("logp",), n).logp
    old = None
    if not plan.fused:  # (a): old-policy pass over the whole rollout batch
        old = nograd_stats(plan, params, graphdef, batch, valid, plan.shared_compute, n)
    logp_old = None
    if plan.loss.old_logp == "sampler":
        logp_old = jnp.where(valid > 0, batch.sampler_logp, 0.0)
    elif old is not None:
        logp_old = old.logp
    keep = plan.shared_compute if plan.shared_nograd else plan.old_group_compute
    return logp_old, logp_ref, {} if old is None else {k: getattr(old, k) for k in keep}


def fused_grads(plan: StepPlan, params: Any, graphdef: Any, mb: RolloutBatch, valid: jax.Array,
                logp_old: jax.Array | None, logp_ref: jax.Array | None, key: jax.Array,
                step: jax.Array, minibatch: jax.Array | int = 0) -> MiniBatchGrads:
    """docs/method.md §4 (a), one mini-batch of one micro-batch: one gradient forward whose stop-gradient
    statistics give logp_old (r = 1, unless ``logp_old`` comes from the sampler), u and the mask. The
    one-pass head (:func:`one_pass_surrogate`) where the plan allows it, else :func:`loss_and_aux`."""
    if plan.one_pass:
        grads, (loss, lm, mask, stats, lp_old_used) = jax.grad(one_pass_surrogate, argnums=1, has_aux=True)(
            plan, params, graphdef, mb, valid, key, step, minibatch)
    else:
        (loss, (lm, mask, stats, lp_old_used)), grads = jax.value_and_grad(loss_and_aux, argnums=1, has_aux=True)(
            plan, params, graphdef, mb, valid, logp_old, logp_ref, None, None, key, step, minibatch)
    return grads, loss, lm, mask, stats, lp_old_used


def _micro_batch_grads(plan: StepPlan, params: Any, graphdef: Any, denoms: LossDenominators, key: jax.Array,
                       step: jax.Array, xs: tuple) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """(grads, loss, loss metrics) of one micro-batch with the mini-batch's mask and denominators:
    partial sums of the mini-batch's (docs/loss.md, micro-batching)."""
    mb, valid, logp_old, logp_ref, mask = xs
    (loss, (lm, _, _, _)), grads = jax.value_and_grad(loss_and_aux, argnums=1, has_aux=True)(
        plan, params, graphdef, mb, valid, logp_old, logp_ref, mask, denoms, key, step)
    return grads, loss, lm


def micro_batched_grads(plan: StepPlan, params: Any, graphdef: Any, mb: RolloutBatch, valid: jax.Array,
                        logp_old: jax.Array | None, logp_ref: jax.Array | None, group_old: dict[str, jax.Array],
                        key: jax.Array, step: jax.Array, minibatch: jax.Array | int = 0) -> MiniBatchGrads:
    """docs/method.md §4 (c), a mini-batch of ``micro_batches`` micro-batches: a no-grad statistics pass
    over the mini-batch gives H1, STAPO's quantile, the global top-k mask and every denominator (u is the
    old policy's, ``group_old``, docs/method.md §2); then the micro-batch gradients, losses and metrics are
    summed (the denominators are the mini-batch's, so the sums are the mini-batch's values). Under
    :attr:`StepPlan.shared_nograd` the old-policy pass was that statistics pass: ``group_old`` holds its
    statistics and no second pass runs."""
    n = plan.micro_batches
    if plan.shared_nograd:
        cur = TokenStats(**{k: group_old.get(k) for k in TokenStats._fields})
    else:
        cur = nograd_stats(plan, params, graphdef, mb, valid, plan.current_compute, n)
        cur = cur._replace(**group_old)  # ICT's u comes from the old policy (docs/method.md §2)
    mask = plan_select(plan, cur, mb.advantages, valid, key, step, minibatch)
    denoms = loss_denominators(valid, mask, plan.loss)
    micro = functools.partial(_micro_batch_grads, plan, params, graphdef, denoms, key, step)
    xs = tuple(_split_or_none(a, n) for a in (mb, valid, logp_old, logp_ref, mask))
    shapes = jax.eval_shape(micro, jax.tree.map(lambda a: a[0], xs))
    acc0 = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
    (grads, loss, lm), _ = jax.lax.scan(lambda acc, ys: (jax.tree.map(jnp.add, acc, micro(ys)), None), acc0, xs)
    return grads, loss, lm, mask, cur, logp_old


def apply_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
                 loss: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
    """One optimizer update -> (params, opt_state, grad norm before clipping, skipped). A non-finite
    loss or gradient norm keeps the old params and optimizer state (skipped = True)."""
    gnorm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state), gnorm, ~finite


def mini_batch_update(plan: StepPlan, graphdef: Any, key: jax.Array, step: jax.Array, carry: tuple,
                      xs: tuple) -> tuple[tuple, tuple]:
    """The body of the scan over mini-batches: the gradient by schedule (a) or (c), one optimizer
    update. ``carry = (params, opt_state)``, ``xs = (mini-batch, valid, logp_old, logp_ref, group_old,
    mini-batch index)``; the index reaches the selector (the random control's key, docs/method.md §2)."""
    params, opt_state = carry
    mb, valid, logp_old, logp_ref, group_old, index = xs
    if plan.fused:
        out = fused_grads(plan, params, graphdef, mb, valid, logp_old, logp_ref, key, step, index)
    else:
        out = micro_batched_grads(plan, params, graphdef, mb, valid, logp_old, logp_ref, group_old, key, step,
                                  index)
    grads, loss, lm, mask, stats, lp_old_used = out
    new_params, opt_state, gnorm, skipped = apply_update(plan.tx, params, opt_state, grads, loss)
    lm = dict(lm, **{"grad/norm": gnorm, "optim/update_norm": update_norm(params, new_params),
                     "train/skipped": skipped.astype(F32), "loss/total": loss})
    return (new_params, opt_state), (lm, mask, stats, lp_old_used)


def step_fn(plan: StepPlan, state: TrainState, batch: RolloutBatch, ref_params: Any) -> tuple[TrainState, dict]:
    """One rollout batch, unjitted: the old-policy and reference passes, the scan over mini-batches,
    the §5 metrics (loss metrics averaged over mini-batches, ``train/skipped`` counted). Only
    ``state.params`` is differentiated and updated (with LoRA: the adapters; ``state.frozen`` passes
    through, and the KL reference is the base with the adapters off).

    ``plan.response_len``: the response axis is first cut to that bucket (:func:`trim_response`; only
    trailing padding goes) and every pass runs at its length; the uncut width is kept as
    ``plan.response_width`` for the loss's Dr.GRPO T and the masks (:func:`plan_select`)."""
    plan = dataclasses.replace(plan, response_width=batch.response_len)
    if plan.response_len is not None:
        batch = trim_response(batch, plan.response_len)
    graphdef = state.model_def()
    valid = _valid(batch, plan.loss.mask_truncated)
    ref_params, ref_def = kl_reference(state, ref_params)
    logp_old, logp_ref, group_old = old_policy_pass(plan, state.params, ref_params, graphdef, batch, valid, ref_def)
    body = functools.partial(mini_batch_update, plan, graphdef, state.rng, state.step)
    xs = tuple(_split_or_none(a, plan.mini_batches) for a in (batch, valid, logp_old, logp_ref, group_old))
    xs += (jnp.arange(plan.mini_batches, dtype=jnp.int32),)  # the mini-batch index (docs/method.md §2)
    (params, opt_state), (lms, masks, stats, lp_old_used) = jax.lax.scan(
        body, (state.params, state.opt_state), xs)
    masks, stats, lp_old_used = _merge(masks), _merge(stats), _merge(lp_old_used)
    if not plan.fused:
        stats = stats._replace(**group_old)
    metrics = {k: v.mean() for k, v in lms.items()}
    metrics["train/skipped"] = lms["train/skipped"].sum()
    metrics.update(step_metrics(batch, valid, masks, stats, lp_old_used, plan.group_size, u_form=plan.u_form,
                                selector=plan.selector, mini_batches=plan.mini_batches,
                                micro_batches=plan.micro_batches))
    metrics["train/response_len"] = jnp.float32(batch.response_len)  # the response bucket the update ran at
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    return new_state, metrics


# ------------------------------------------------------------------------------------------------
# jit, shardings and the public entry point
# ------------------------------------------------------------------------------------------------
def check_step_inputs(plan: StepPlan, mesh: jax.sharding.Mesh | None, batch: RolloutBatch,
                      ref_params: Any, lora: bool = False) -> None:
    """Clear errors for a batch the plan cannot split: whole groups per mini-batch and, on a mesh,
    whole groups per shard in the old-policy pass (u compares a rollout with its group); micro-batches
    of equal rows, as many rows per shard. ``lora``: the state trains adapters (its reference is its base)."""
    if lora and ref_params is not None:
        raise ValueError("with LoRA adapters the KL reference is the frozen base with the adapters off: "
                         "pass ref_params=None (no reference copy)")
    if plan.use_kl and ref_params is None and not lora:
        raise ValueError("rl.loss.kl_coef > 0 needs ref_params (see ict_jax.rl.state.reference_params)")
    check_batch_geometry(batch.tokens.shape[0], plan.group_size, plan.mini_batches, plan.micro_batches, mesh)


def check_batch_geometry(num_rows: int, group_size: int, mini_batches: int, micro_batches: int,
                         mesh: jax.sharding.Mesh | None) -> None:
    """ValueError (one line) unless ``num_rows`` rows of groups of ``group_size`` split into
    ``mini_batches`` mini-batches of whole groups and each mini-batch into ``micro_batches`` equal
    micro-batches; on ``mesh``, a mini-batch (the whole batch when fused) must hold whole groups per
    batch shard and a micro-batch a whole number of rows per shard."""
    B, G, mini, micro = num_rows, group_size, mini_batches, micro_batches
    if B % G:
        raise ValueError(f"batch of {B} rows is not a multiple of rollout.num_samples={G}")
    P = B // G
    if P % mini:
        raise ValueError(f"{P} prompts cannot be split into train.mini_batches={mini} mini-batches of whole groups")
    if (B // mini) % micro:
        raise ValueError(f"the {B // mini} rows of a mini-batch cannot be split into train.micro_batches={micro} "
                         "equal micro-batches")
    if mesh is None:
        return
    fused = mini * micro == 1
    check_prompts_divide(P if fused else P // mini, mesh)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = B // (mini * micro)
    if not fused and rows % shards:
        raise ValueError(f"a micro-batch of {rows} rows cannot be split over the mesh's data x fsdp = {shards} batch "
                         f"shards: use fewer train.micro_batches (each shard needs a whole number of rows)")


def jit_step(plan: StepPlan, mesh: jax.sharding.Mesh | None, state: TrainState, batch: RolloutBatch,
             ref_params: Any) -> Callable:
    """``jax.jit`` of :func:`step_fn` with the state donated; on a mesh, the state and reference keep
    their shardings, batch rows are split over ('data', 'fsdp') and the metrics are replicated."""
    fn = functools.partial(step_fn, plan)
    if mesh is None:
        return jax.jit(fn, donate_argnums=(0,))
    st_sh = jax.tree.map(lambda a: a.sharding, state)
    b_sh = jax.tree.map(lambda a: batch_sharding(mesh, a.ndim), batch)
    r_sh = None if ref_params is None else jax.tree.map(lambda a: a.sharding, ref_params)
    return jax.jit(fn, donate_argnums=(0,), in_shardings=(st_sh, b_sh, r_sh), out_shardings=(st_sh, replicated(mesh)))


def _on_mesh(mesh: jax.sharding.Mesh | None) -> Any:
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def make_train_step(config: Config, mesh: jax.sharding.Mesh | None = None, *,
                    tx: optax.GradientTransformation | None = None) -> Callable[..., tuple[TrainState, dict]]:
    """``step(state, batch, ref_params=None) -> (state, metrics)``: ONE jitted program per shape and
    response bucket.

    Response buckets (``rollout.min_response_bucket``, on by default): the step reads the batch's
    longest response that counts (:func:`bucket_of`) and runs at that length rounded up to a bucket of
    :func:`ict_jax.buckets.response_buckets` (powers of two up to the batch's width, max_new_tokens):
    the batch goes in whole and the program cuts its response axis first (:func:`step_fn`), so the
    old-policy pass, the statistics, the masks and the loss cost the tokens generated, not
    max_new_tokens. Gradients and metrics are the uncut step's (only trailing padding goes; Dr.GRPO's T
    and the masks keep the uncut width). One program per bucket, compiled on first use: at most
    ``len(response_buckets(...))`` per batch shape. ``response_len=`` picks a bucket explicitly
    (the batch's width = the uncut step).

    ``mesh``: rows of the batch are split over ('data', 'fsdp'); the state keeps the shardings it
    has (from :func:`ict_jax.init_model` / :func:`ict_jax.load_hf` with the same mesh). The state is
    donated. ``ref_params``: the KL reference (:func:`~ict_jax.rl.state.reference_params`), None when
    ``rl.loss.kl_coef`` is 0 and for a LoRA state (its reference is its base with the adapters off).
    The warm-up switch (``step < warmup_steps``) is traced data: no recompilation.
    ``step.lower(state, batch, ref_params=None)`` gives the ``jax.stages.Lowered`` program (arguments
    may be abstract ``jax.ShapeDtypeStruct`` trees) for ``.compile().memory_analysis()`` and cost
    estimates without running it (the largest bucket unless ``response_len=`` says otherwise).
    ``step.jitted`` maps (argument structures, response bucket) to their ``jax.jit``.
    """
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    plan = StepPlan.from_config(config, tx or make_optimizer(config), batch_shards=shards)
    compiled: dict[Any, Callable] = {}

    def jitted_for(state: TrainState, batch: RolloutBatch, ref_params: Any, response_len: int | None) -> Callable:
        """The jax.jit object for these argument structures and response bucket (built once, with the
        shape checks)."""
        check_lora_state(config, state)
        check_step_inputs(plan, mesh, batch, ref_params, lora=state.frozen is not None)
        n = batch.response_len if response_len is None else response_len
        if not 1 <= n <= batch.response_len:
            raise ValueError(f"response_len={n}: a batch of {batch.response_len} response positions keeps "
                             f"1..{batch.response_len}")
        key = (jax.tree.structure(state), jax.tree.structure(batch), ref_params is None, n)
        if key not in compiled:
            cut = None if n == batch.response_len else n
            compiled[key] = jit_step(dataclasses.replace(plan, response_len=cut), mesh, state, batch, ref_params)
        return compiled[key]

    def step(state: TrainState, batch: RolloutBatch, ref_params: Any = None, *,
             response_len: int | None = None) -> tuple[TrainState, dict]:
        if response_len is None:
            response_len = bucket_of(plan, batch)
        fn = jitted_for(state, batch, ref_params, response_len)
        with _on_mesh(mesh):
            return fn(state, batch, ref_params)

    def lower(state: TrainState, batch: RolloutBatch, ref_params: Any = None, *,
              response_len: int | None = None) -> Any:
        """``jax.stages.Lowered`` of the step for these arguments, which may be abstract
        (``jax.ShapeDtypeStruct`` leaves with shardings): ``step.lower(...).compile().memory_analysis()``
        sizes a step without running or allocating it. ``response_len``: the response bucket to build
        (default: the largest, the batch's own width, which sets the memory a run needs)."""
        fn = jitted_for(state, batch, ref_params, response_len)
        with _on_mesh(mesh):
            return fn.lower(state, batch, ref_params)

    step.jitted = compiled  # for tests and benchmarks (compile counts: one program per response bucket)
    step.lower = lower
    step.plan = plan
    return step


def bucket_of(plan: StepPlan, batch: RolloutBatch) -> int:
    """The response bucket the step runs ``batch`` at: its longest response that counts
    (:func:`ict_jax.rl.batch.response_extent`, the same on every process) rounded up to
    :func:`ict_jax.buckets.response_buckets` of its width and ``plan.min_response_bucket``; the width
    itself when response buckets are off (``rollout.min_response_bucket: null``)."""
    buckets = response_buckets(batch.response_len, plan.min_response_bucket)
    if len(buckets) == 1:
        return batch.response_len
    return bucket_for(max(1, response_extent(batch)), buckets)
