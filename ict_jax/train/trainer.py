"""The RL loop: draw prompts -> generate G responses each -> score -> advantages -> train step.

The only module that knows every other one (docs/architecture.md). Per rollout-batch step s:

1. the next P prompts from the seeded, resumable prompt iterator;
2. ``generate`` with the CURRENT policy parameters (the train state's own arrays: no copy, no weight
   sync), key ``fold_in(fold_in(root, SAMPLER_STREAM), s)``;
3. responses decoded and scored by the reward worker pool, all checks of the batch in parallel worker
   processes (in a multi-process run each process scores its share of the rows). The next rollout
   needs the updated weights, so scoring cannot overlap the next generation on-policy;
4. advantages (docs/method.md §3) and one call of the compiled train step (docs/method.md §4);
5. docs/method.md §5 metrics logged, evaluation every ``train.eval_every`` steps, a checkpoint every
   ``train.save_every`` steps and at the end.

A non-finite loss or gradient skips that update inside the step (``train/skipped``); three such
steps in a row stop the run with :class:`TrainingDiverged`, leaving the last good checkpoint intact.
Every random stream is ``fold_in(root, STREAM)`` then ``fold_in(step)``, and the data position is
saved with the checkpoint, so ``--resume`` continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ict_jax.config import Config
from ict_jax.data.prompts import pad_left
from ict_jax.model.weights import save_hf
from ict_jax.rl.sft import make_sft_step, sft_arrays
from ict_jax.rl.batch import build_rollout_batch
from ict_jax.rl.state import TrainState, init_opt_state, init_train_state, reference_params
from ict_jax.sharding import shard_batch, to_host
from ict_jax.train.logs import RunLogger, metrics_to_floats, plot_metrics
from ict_jax.train.run import build_run, run_eval

SAMPLER_STREAM = 0x53414D50  # "SAMP"
MAX_NONFINITE_IN_A_ROW = 3


def _informative(rewards: np.ndarray, G: int) -> np.ndarray:
    """Per group: the G rewards are not all equal (docs/method.md §3: max > min)."""
    r = rewards.reshape(-1, G)
    return r.max(axis=1) > r.min(axis=1)


class TrainingDiverged(RuntimeError):
    """Three consecutive non-finite updates: the run stopped, the last good checkpoint is intact."""


def sft_target(example: Any, kind: str) -> str:
    """The SFT target text of an example: its worked solution if the dataset has one, else the gold
    answer in the form the scorer of ``kind`` extracts."""
    solution = example.meta.get("solution") if isinstance(example.meta, dict) else None
    if solution:
        return str(solution)
    a = str(example.answer)
    return {"exact": a, "gsm8k": f"#### {a}", "mc": f"The answer is ({a}).",
            "gym": f"<answer>{a}</answer>"}.get(kind, f"The answer is \\boxed{{{a}}}.")


class Trainer:
    """Build everything a run needs from a :class:`Config`, then :meth:`run` it."""

    def __init__(self, config: Config, *, resume: bool = False, progress: bool = True,
                 profile_steps: tuple[int, int] | None = None, model: Any = None, tokenizer: Any = None):
        self.cfg = config
        self.resume = resume
        self.progress = progress
        self.profile_steps = profile_steps
        self.run = build_run(config, resume=resume, model=model, tokenizer=tokenizer)
        self.run_dir = Path(config.run_dir)

    # -- SFT warm start ------------------------------------------------------------------------------
    def sft(self) -> dict[str, float]:
        """``train.sft_steps`` of supervised warm start on the training prompts' targets."""

        cfg, r = self.cfg, self.run
        steps, bs = cfg.train.sft_steps, cfg.train.sft_batch_size
        if steps <= 0:
            return {}
        sft = make_sft_step(cfg, r.mesh)
        params = r.state.params
        sft_state = TrainState(params=params, opt_state=init_opt_state(sft.tx, params), step=r.state.step,
                               rng=r.state.rng, graphdef=r.state.graphdef)
        enc, kinds, tok = r.prompts.encoded, r.prompts.kinds, r.tokenizer
        eos = tok.eos_ids[0]
        targets = [tok.encode(sft_target(ex, k)) + [eos] for ex, k in zip(enc.examples, kinds)]
        t_len = cfg.rollout.max_new_tokens
        keep = [i for i, t in enumerate(targets) if len(t) <= t_len]
        if not keep:
            raise ValueError(f"no SFT target fits in rollout.max_new_tokens={t_len}")
        rng = np.random.default_rng([cfg.seed, 0x5F7])
        logger = RunLogger(self.run_dir, total_steps=steps, progress=self.progress, desc="sft",
                           tensorboard=False)
        last: dict[str, float] = {}
        for s in range(steps):
            idx = rng.choice(keep, size=bs, replace=len(keep) < bs)
            arrays = sft_arrays([enc.ids[i] for i in idx], [targets[i] for i in idx],
                                prompt_len=cfg.rollout.max_prompt_len, target_len=t_len, pad_id=tok.pad_id)
            sft_state, m = sft(sft_state, *map(jnp.asarray, arrays))
            last = metrics_to_floats(m)
            logger.log(s, last, phase="sft")
        logger.close()
        # RL starts from the warm-started weights with a fresh RL optimizer state; the KL reference is
        # the warm-started policy, saved so that a resumed run can rebuild it (ict_jax.train.run)
        r.model = sft_state.model()
        r.state = init_train_state(cfg, r.model)
        if cfg.rl.loss.kl_coef > 0:
            r.ref_params = reference_params(r.state, r.model.config.resolved_compute_dtype())
        if not (self.run_dir / "sft_model").exists():
            host = nnx.merge(r.state.graphdef, to_host(r.state.params))  # every process joins the gather
            if jax.process_index() == 0:
                save_hf(host, self.run_dir / "sft_model")
        return last

    # -- one RL step -----------------------------------------------------------------------------
    def _generate_and_score(self, state: Any, key: Any) -> tuple[Any, Any, np.ndarray]:
        """The next P prompts, G responses each (host arrays) and their rewards."""
        r = self.run
        pb = next(r.iterator)
        ids, mask = (shard_batch((pb.ids, pb.mask), r.mesh) if r.mesh.size > 1
                     else (jnp.asarray(pb.ids), jnp.asarray(pb.mask)))
        ro = to_host(r.generate(state.params, ids, mask, key))
        return pb, ro, self._score(pb, ro.tokens, ro.valid)

    def _rollout_batch(self, step: int, state: Any) -> tuple[Any, dict[str, float]]:
        """Prompts -> G responses -> rewards -> a :class:`RolloutBatch` placed on the mesh.

        Every process holds the same host data (the same seeded prompt iterator) and builds the same
        batch; each process scores only its share of the rows and the rewards are all-gathered.

        ``rl.adv.drop_zero_std_groups`` (DAPO dynamic sampling): a group whose G rewards are all equal
        carries no policy gradient; up to ``rl.adv.max_refill`` further prompt batches are drawn and
        their informative groups take the dropped groups' places. Slots still empty after that stay in
        the batch with ``row_valid = 0`` (out of the loss and its denominators)."""

        cfg, r = self.cfg, self.run
        G = cfg.rollout.num_samples
        t0 = time.perf_counter()
        key = jax.random.fold_in(jax.random.fold_in(state.rng, SAMPLER_STREAM), step)
        pb, ro, rewards = self._generate_and_score(state, key)
        ids, mask = pb.ids, pb.mask
        group_ok = pb.valid.astype(bool)
        refills = 0
        if cfg.rl.adv.drop_zero_std_groups:
            group_ok &= _informative(rewards, G)
            ids, mask, rewards = ids.copy(), mask.copy(), rewards.copy()
            while not group_ok.all() and refills < cfg.rl.adv.max_refill:
                refills += 1
                pb2, ro2, rew2 = self._generate_and_score(state, jax.random.fold_in(key, refills))
                donors = list(np.flatnonzero(pb2.valid.astype(bool) & _informative(rew2, G)))
                holes = list(np.flatnonzero(~group_ok))
                if not donors:
                    continue
                width = max(ids.shape[1], pb2.ids.shape[1])
                ids, mask = pad_left(ids, width, r.tokenizer.pad_id, mask)
                ids2, mask2 = pad_left(pb2.ids, width, r.tokenizer.pad_id, pb2.mask)
                fields = {f: np.array(getattr(ro, f)) for f in ("tokens", "valid", "logp", "lengths", "truncated")}
                for hole, donor in zip(holes, donors):
                    ids[hole], mask[hole] = ids2[donor], mask2[donor]
                    rows, rows2 = slice(hole * G, (hole + 1) * G), slice(donor * G, (donor + 1) * G)
                    for f, arr in fields.items():
                        arr[rows] = np.asarray(getattr(ro2, f))[rows2]
                    rewards[rows] = rew2[rows2]
                    group_ok[hole] = True
                ro = ro.replace(**fields)
        t_roll = time.perf_counter() - t0
        correct = (rewards >= cfg.rl.reward.correct).astype(np.float32)
        row_valid = np.repeat(group_ok.astype(np.float32), G)
        batch = to_host(build_rollout_batch(ids, mask, ro, rewards, config=cfg, correct=correct,
                                            row_valid=row_valid))
        n_tokens = float(np.asarray(batch.response_valid).sum())  # on the host copy (multi-process safe)
        batch = shard_batch(batch, r.mesh) if r.mesh.size > 1 else jax.tree.map(jnp.asarray, batch)
        return batch, {"time/rollout_s": t_roll, "rollout/kept_row_frac": float(row_valid.mean()),
                       "rollout/refills": float(refills), "_tokens": n_tokens}

    def _score(self, pb: Any, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Rewards of all rows; each process checks its contiguous share of rows in the worker pool."""
        r, G = self.run, self.cfg.rollout.num_samples
        B = tokens.shape[0]
        n_proc, me = jax.process_count(), jax.process_index()
        per = -(-B // n_proc)
        mine = range(me * per, min(B, (me + 1) * per))
        eos = set(r.tokenizer.eos_ids)
        texts = [r.tokenizer.decode([int(t) for t, v in zip(tokens[i], valid[i]) if v and int(t) not in eos])
                 for i in mine]
        kinds = [r.prompts.kinds[int(pb.indices[i // G])] for i in mine]
        golds = [pb.examples[i // G].answer for i in mine]
        metas = [pb.examples[i // G].meta for i in mine]
        local = np.zeros(per, np.float32)
        if texts:
            local[:len(texts)] = r.pool.score(kinds, texts, golds, metas)
        if n_proc == 1:
            return local[:B]

        return np.asarray(multihost_utils.process_allgather(local)).reshape(-1)[:B]

    # -- the loop --------------------------------------------------------------------------------
    def run_loop(self) -> dict[str, Any]:
        cfg, r = self.cfg, self.run
        start = int(to_host(r.state.step))
        logger = RunLogger(self.run_dir, total_steps=cfg.train.steps, initial_step=start, progress=self.progress)
        nonfinite_in_a_row = 0
        last: dict[str, float] = {}
        try:
            for step in range(start, cfg.train.steps):
                if self.profile_steps and step == self.profile_steps[0]:
                    jax.profiler.start_trace(str(self.run_dir / "profile"))
                batch, times = self._rollout_batch(step, r.state)
                t0 = time.perf_counter()
                r.state, metrics = r.train_step(r.state, batch, r.ref_params)
                m = metrics_to_floats(metrics)
                times["time/update_s"] = time.perf_counter() - t0
                n_tokens = times.pop("_tokens")
                times["throughput/tokens_per_s"] = n_tokens / max(1e-9, times["time/rollout_s"] + times["time/update_s"])
                m.update(times)
                if self.profile_steps and step + 1 == self.profile_steps[1]:
                    jax.profiler.stop_trace()
                nonfinite_in_a_row = nonfinite_in_a_row + 1 if m.get("train/skipped", 0) > 0 else 0
                m["train/nonfinite_in_a_row"] = float(nonfinite_in_a_row)
                logger.log(step, m)
                last = m
                if nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                    raise TrainingDiverged(
                        f"step {step}: {nonfinite_in_a_row} non-finite updates in a row; stopped. The last "
                        f"good checkpoint in {self.run_dir / 'checkpoints'} is intact")
                done = step + 1
                if cfg.train.eval_every and done % cfg.train.eval_every == 0:
                    ev = self.evaluate(done)
                    if ev:
                        logger.log(step, ev, phase="eval")
                        logger.message(f"eval @ step {done}: " + ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
                due = (cfg.train.save_every and done % cfg.train.save_every == 0) or done == cfg.train.steps
                if due and nonfinite_in_a_row:  # only after a good update: the last checkpoint stays good
                    logger.message(f"step {done}: checkpoint skipped after a non-finite update")
                elif due:
                    self.save(done)
        finally:
            logger.close()
        return last

    def save(self, step: int) -> None:
        r = self.run
        meta = {"data": r.iterator.state_dict(), "config": self.cfg.to_dict(),
                "model_config": dataclasses.asdict(r.model_config), "tokenizer": r.tokenizer_spec, "step": step}
        r.checkpointer.save(step, r.state, meta)

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@k on ``data.eval`` with the current policy (docs/method.md §6); {} when no eval set is named."""

        return run_eval(self.cfg, self.run, step)

    def train(self) -> dict[str, Any]:
        """SFT warm start (if configured and not resumed past it), then RL; returns a summary."""
        cfg, r = self.cfg, self.run
        t0 = time.perf_counter()
        summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        if not r.resumed and cfg.train.sft_steps > 0:
            summary["sft"] = self.sft()
            if cfg.data.eval:
                summary["eval_after_sft"] = self.evaluate(0)
        summary["final"] = self.run_loop()
        r.checkpointer.wait()
        if cfg.data.eval:
            summary["eval_final"] = self.evaluate(cfg.train.steps)
        summary["wall_s"] = time.perf_counter() - t0
        if jax.process_index() == 0:
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.exists():
                summary["plot"] = str(plot_metrics(metrics, self.run_dir / "metrics.png"))
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary

    def close(self) -> None:
        self.run.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
