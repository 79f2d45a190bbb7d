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

import contextlib
import dataclasses
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ict_jax.config import Config
from ict_jax.data.prompts import pad_left
from ict_jax.model.weights import load_hf, save_hf
from ict_jax.rewards.checks import CUSTOM_KIND, sft_target
from ict_jax.rl.sft import make_sft_step, sft_arrays
from ict_jax.rl.batch import build_rollout_batch
from ict_jax.rl.dynamic_sampling import informative_groups
from ict_jax.rl.state import TrainState, init_opt_state, init_train_state, reference_params
from ict_jax.sharding import shard_batch, to_host
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.logs import (RunLogger, format_eval, metrics_to_floats, plot_metrics, read_metrics,
                                truncate_metrics)
from ict_jax.train.record import check_resume, read_config, read_resumes, read_summary, run_finished, write_summary
from ict_jax.train.run import SFT_CHECKPOINTS, SFT_MODEL, build_run, model_overrides, run_eval
from ict_jax.train.tracking import WandbTracker

SAMPLER_STREAM = 0x53414D50  # "SAMP"
MAX_NONFINITE_IN_A_ROW = 3


class TrainingDiverged(RuntimeError):
    """Three consecutive non-finite updates: the run stopped, the last good checkpoint is intact."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped after the step in progress and saved a checkpoint; ``--resume`` continues."""


class _StopFlag:
    requested = False


@contextlib.contextmanager
def stop_after_step(say: Any) -> Iterator[_StopFlag]:
    """The first Ctrl-C (SIGINT) sets ``flag.requested``: the loop finishes its step, saves a checkpoint
    and raises :class:`Interrupted`. A second Ctrl-C stops at once. Only in the main thread of a
    single-process run (elsewhere Ctrl-C raises KeyboardInterrupt as usual)."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        say("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)")

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class Trainer:
    """Build everything a run needs from a :class:`Config`, then :meth:`train` it.

    ``resume``: continue the run in ``run_dir`` (docs/checkpoints.md "Resume"): from its last RL
    checkpoint, else its finished SFT warm start, else its last SFT checkpoint. A finished run whose
    ``train.steps`` was not raised is not built at all: :attr:`finished` holds its summary and
    :meth:`train` returns it unchanged."""

    def __init__(self, config: Config, *, resume: bool = False, progress: bool = True,
                 profile_steps: tuple[int, int] | None = None, model: Any = None, tokenizer: Any = None):
        self.cfg = config
        self.resume = resume
        self.progress = progress
        self.profile_steps = profile_steps
        self.run_dir = Path(config.run_dir)
        self.finished: dict[str, Any] | None = None
        self.run = None
        self._logger: RunLogger | None = None
        self._tracker: Any = None
        self._summary: dict[str, Any] = {}
        self._last_eval: tuple[int, dict[str, float]] | None = None
        self._wall_clock: tuple[float, float] | None = None  # (wall_s before this invocation, its start)
        if resume and run_finished(self.run_dir):
            previous = read_config(self.run_dir)
            if previous is not None:
                check_resume(previous, config)
            summary = read_summary(self.run_dir) or {}
            done = summary.get("steps", previous.train.steps if previous is not None else config.train.steps)
            if config.train.steps <= int(done):
                self.finished = summary
                return
        self.run = build_run(config, resume=resume, model=model, tokenizer=tokenizer)
        if resume:
            self._summary = read_summary(self.run_dir) or {}
            metrics = self.run_dir / "metrics.jsonl"
            point = self.run.resume_point
            if jax.process_index() == 0:  # the rows this run logs again: one row per (phase, step) in the end
                truncate_metrics(metrics, point.keep_below)
            if point.phase == "rl" and metrics.is_file():  # an evaluation of the resumed step is on record
                done = [r for r in read_metrics(metrics, "eval") if r["step"] == point.step]
                if done:
                    self._last_eval = (point.step, {k: v for k, v in done[-1].items() if k.startswith("eval/")})
        if self._summary.get("status", "finished") == "finished" and "final" in self._summary:
            # a finished run trained further (train.steps raised): its earlier end stays on record
            earlier = {k: self._summary.pop(k) for k in ("final", "eval_final", "steps") if k in self._summary}
            self._summary.setdefault("earlier", []).append(earlier)

    # -- logging -------------------------------------------------------------------------------------
    def logger(self, phase: str, total: int, initial: int = 0) -> RunLogger:
        """The run's one logger (metrics.jsonl, TensorBoard, W&B), (re)started for ``phase``: a bar on a
        terminal, compact lines otherwise."""
        if self._logger is None:
            if self.cfg.logging.wandb and jax.process_index() == 0:
                self._tracker = WandbTracker(self.cfg, self.run_dir, resume=self.resume)
            point = self.run.resume_point if self.run is not None else None
            self._logger = RunLogger(self.run_dir, total_steps=total, initial_step=initial, progress=self.progress,
                                     desc=phase, print_every=self.cfg.logging.print_every, tracker=self._tracker,
                                     purge=point.keep_below if point is not None else None)
        else:
            self._logger.start(phase, total, initial)
        return self._logger

    def say(self, text: str) -> None:
        if self._logger is not None:
            self._logger.message(text)
        elif jax.process_index() == 0:
            print(text, file=sys.stderr, flush=True)

    def _save_summary(self, status: str) -> None:
        self._summary.update(run_dir=str(self.run_dir), status=status, resumes=read_resumes(self.run_dir))
        if jax.process_index() == 0:
            write_summary(self.run_dir, self._summary)

    # -- SFT warm start ------------------------------------------------------------------------------
    def sft(self) -> dict[str, float]:
        """``train.sft_steps`` of supervised warm start on the training prompts' targets, with its own
        checkpoints (``<run_dir>/checkpoints_sft``, every ``train.sft_save_every`` steps and on Ctrl-C);
        a resumed run continues from the last one, and a finished warm start (``<run_dir>/sft_model``)
        is loaded instead of trained again. Returns the last step's metrics."""
        cfg, r = self.cfg, self.run
        steps = cfg.train.sft_steps
        if steps <= 0:
            return {}
        if (self.run_dir / SFT_MODEL).is_dir():  # finished before: the RL phase starts from it
            self._start_rl(load_hf(self.run_dir / SFT_MODEL, mesh=r.mesh, dtype=cfg.model.param_dtype,
                                   **model_overrides(cfg)))
            return self._summary.get("sft") or {}
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
        bs = cfg.train.sft_batch_size
        rng = np.random.default_rng([cfg.seed, 0x5F7])
        ckpt = Checkpointer(self.run_dir / SFT_CHECKPOINTS, keep=cfg.train.keep)
        start = 0
        if self.resume and ckpt.latest_step() is not None:
            sft_state, _ = ckpt.restore(sft_state)
            start = ckpt.latest_step()
            for _ in range(start):  # the data order continues: the draws of the steps already done
                rng.choice(keep, size=bs, replace=len(keep) < bs)
        logger = self.logger("sft", steps, start)
        if start:
            logger.message(f"resuming the SFT warm start at step {start}/{steps}")
        meta = {"phase": "sft", "config": cfg.to_dict(), "model_config": dataclasses.asdict(r.model_config),
                "tokenizer": r.tokenizer_spec}
        last: dict[str, float] = {}
        try:
            with stop_after_step(logger.message) as stop:
                for s in range(start, steps):
                    idx = rng.choice(keep, size=bs, replace=len(keep) < bs)
                    arrays = sft_arrays([enc.ids[i] for i in idx], [targets[i] for i in idx],
                                        prompt_len=cfg.rollout.max_prompt_len, target_len=t_len, pad_id=tok.pad_id)
                    sft_state, m = sft(sft_state, *map(jnp.asarray, arrays))
                    last = metrics_to_floats(m)
                    logger.log(s, last, phase="sft")
                    done = s + 1
                    every = cfg.train.sft_save_every
                    if done < steps and ((every and done % every == 0) or stop.requested):
                        ckpt.save(done, sft_state, meta)
                    if stop.requested and done < steps:
                        ckpt.wait()
                        raise Interrupted(f"interrupted at SFT step {done}/{steps}; its checkpoint is in "
                                          f"{self.run_dir / SFT_CHECKPOINTS}: continue with --resume")
        finally:
            ckpt.close()
        self._start_rl(sft_state.model())
        if not (self.run_dir / SFT_MODEL).exists():
            host = nnx.merge(r.state.graphdef, to_host(r.state.params))  # every process joins the gather
            if jax.process_index() == 0:
                save_hf(host, self.run_dir / SFT_MODEL)
                # the finished warm start is sft_model; its checkpoints (with Adam moments) are not needed
                shutil.rmtree(self.run_dir / SFT_CHECKPOINTS, ignore_errors=True)
        return last

    def _start_rl(self, model: Any) -> None:
        """RL starts from ``model`` (the warm start) with a fresh RL optimizer state; the KL reference is
        the warm-started policy, saved so that a resumed run can rebuild it (ict_jax.train.run)."""
        cfg, r = self.cfg, self.run
        r.model = model
        r.state = init_train_state(cfg, r.model)
        if cfg.rl.loss.kl_coef > 0:
            r.ref_params = reference_params(r.state, r.model.config.resolved_compute_dtype())
    # -- one RL step -----------------------------------------------------------------------------
    def _generate_and_score(self, state: Any, key: Any) -> tuple[Any, Any, np.ndarray]:
        """The next P prompts, G responses each (host arrays) and their rewards. With
        ``rollout.chunks`` > 1 the P prompts are sampled in that many sequential calls (chunk c with
        ``fold_in(key, c)``) and the rows concatenated, prompt-major as from one call."""
        r = self.run
        pb = next(r.iterator)
        chunks = self.cfg.rollout.chunks
        parts = []
        for c, (ids, mask) in enumerate(zip(np.split(pb.ids, chunks), np.split(pb.mask, chunks))):
            if r.mesh.size > 1:
                ids, mask = shard_batch((ids, mask), r.mesh)
            k = key if chunks == 1 else jax.random.fold_in(key, c)  # one call: the key of old
            parts.append(to_host(r.generate(state.params, jnp.asarray(ids), jnp.asarray(mask), k)))
        ro = parts[0] if chunks == 1 else jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)
        return pb, ro, self._score(pb, ro.tokens, ro.valid)

    def _rollout_batch(self, step: int, state: Any) -> tuple[Any, dict[str, float]]:
        """Prompts -> G responses -> rewards -> a :class:`RolloutBatch` placed on the mesh.

        Every process holds the same host data (the same seeded prompt iterator) and builds the same
        batch; each process scores only its share of the rows and the rewards are all-gathered.

        ``rl.adv.drop_zero_std_groups`` (DAPO dynamic sampling): a group whose G responses are all
        correct or all wrong (``rl.adv.filter_on: correct``; ``reward``: whose G rewards are all equal)
        is dropped (:func:`ict_jax.rl.dynamic_sampling.informative_groups`); up to ``rl.adv.max_refill`` further prompt batches are drawn and
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
            group_ok &= informative_groups(rewards, G, cfg.rl.adv.filter_on, cfg.rl.reward.correct)
            ids, mask, rewards = ids.copy(), mask.copy(), rewards.copy()
            while not group_ok.all() and refills < cfg.rl.adv.max_refill:
                refills += 1
                pb2, ro2, rew2 = self._generate_and_score(state, jax.random.fold_in(key, refills))
                donors = list(np.flatnonzero(pb2.valid.astype(bool) & informative_groups(
                    rew2, G, cfg.rl.adv.filter_on, cfg.rl.reward.correct)))
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
        # the valid tokens only (numpy mask): a loop over max_new_tokens per row grew with it (issue 26)
        texts = [r.tokenizer.decode([int(t) for t in np.asarray(tokens[i])[np.asarray(valid[i]) > 0] if int(t) not in eos])
                 for i in mine]
        # rl.reward.fn scores every training response (the datasets' kinds still shape the SFT targets)
        kinds = [CUSTOM_KIND if self.cfg.rl.reward.fn else r.prompts.kinds[int(pb.indices[i // G])] for i in mine]
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
        """RL steps from the state's step to ``train.steps``: log, evaluate every ``train.eval_every``
        steps, checkpoint every ``train.save_every`` steps, at the end and on Ctrl-C."""
        cfg, r = self.cfg, self.run
        start = int(to_host(r.state.step))
        logger = self.logger("rl", cfg.train.steps, start)
        if start:
            logger.message(f"resuming RL at step {start}/{cfg.train.steps}")
        nonfinite_in_a_row = 0
        last: dict[str, float] = {}
        with stop_after_step(logger.message) as stop:
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
                r.checkpointer.check()  # a background save that failed (a full disk) stops the run now
                last = m
                if nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                    raise TrainingDiverged(
                        f"step {step}: {nonfinite_in_a_row} non-finite updates in a row; stopped. The last "
                        f"good checkpoint in {self.run_dir / 'checkpoints'} is intact")
                done = step + 1
                if cfg.train.eval_every and done % cfg.train.eval_every == 0:
                    self.evaluate_and_log(done)
                due = (cfg.train.save_every and done % cfg.train.save_every == 0) or done == cfg.train.steps
                if (due or stop.requested) and nonfinite_in_a_row:  # the last checkpoint stays a good one
                    logger.message(f"step {done}: checkpoint skipped after a non-finite update")
                elif due or stop.requested:
                    self.save(done)
                if stop.requested and done < cfg.train.steps:
                    r.checkpointer.wait()
                    raise Interrupted(f"interrupted at RL step {done}/{cfg.train.steps}; checkpoints are in "
                                      f"{self.run_dir / 'checkpoints'}: continue with --resume")
        return last

    def save(self, step: int) -> None:
        r = self.run
        meta = {"data": r.iterator.state_dict(), "config": self.cfg.to_dict(),
                "model_config": dataclasses.asdict(r.model_config), "tokenizer": r.tokenizer_spec, "step": step}
        r.checkpointer.save(step, r.state, meta)

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@k on ``data.eval`` with the current policy (docs/method.md §6); {} when no eval set is named."""

        return run_eval(self.cfg, self.run, step)

    def evaluate_and_log(self, step: int, label: str | None = None) -> dict[str, float]:
        """:meth:`evaluate` after ``step`` rollout batches, logged as an ``eval`` row at that step (one
        line on the console); an evaluation of the same step in this invocation is reused."""
        if self._last_eval is not None and self._last_eval[0] == step:
            return self._last_eval[1]
        ev = self.evaluate(step)
        if ev:
            self._logger.log(step, ev, phase="eval")
            self._logger.message(f"{label or f'eval @ step {step}'}: {format_eval(ev)}")
        self._last_eval = (step, ev)
        return ev

    def warm_start(self, *, wall_before: float | None = None, t0: float | None = None) -> dict[str, Any]:
        """The SFT warm start (:meth:`sft`) and its evaluation (with ``data.eval``), each recorded in
        ``summary.json`` as it finishes ("status": "sft finished"); returns the summary so far."""
        cfg = self.cfg
        t0 = time.perf_counter() if t0 is None else t0
        wall_before = float(self._summary.get("wall_s", 0.0)) if wall_before is None else wall_before
        self._wall_clock = self._wall_clock or (wall_before, t0)  # close() counts an interrupted invocation
        self._summary["sft"] = self.sft()
        self._summary["model"] = str(self.run_dir / SFT_MODEL)
        self._save_summary("sft finished")
        if cfg.data.eval and "eval_after_sft" not in self._summary:
            if self._logger is None:  # the warm start finished in an earlier invocation
                self.logger("rl", cfg.train.steps)
            self._summary["eval_after_sft"] = self.evaluate_and_log(0, "eval after SFT")
        self._summary["wall_s"] = wall_before + time.perf_counter() - t0
        self._save_summary("sft finished")
        return self._summary

    def train(self) -> dict[str, Any]:
        """SFT warm start (if configured and not finished before), then RL; returns the summary, also
        kept in ``<run_dir>/summary.json`` (written as each part finishes; "status": "finished" at the
        end). A finished run resumed without a raised ``train.steps`` returns its summary unchanged."""
        if self.finished is not None:
            return self.finished
        cfg, r = self.cfg, self.run
        t0 = time.perf_counter()
        wall_before = float(self._summary.get("wall_s", 0.0))
        self._wall_clock = (wall_before, t0)  # close() counts an interrupted invocation's time too
        if self._summary.get("status") in (None, "finished"):  # until it finishes (again), it is not finished
            self._save_summary("running")
        sft_part = f"SFT {cfg.train.sft_steps} steps, then " if cfg.train.sft_steps > 0 else ""
        self.say(f"run {self.run_dir}: {sft_part}{cfg.train.steps} RL steps ({cfg.rl.selector.method})")
        if not r.resumed and cfg.train.sft_steps > 0:
            self.warm_start(wall_before=wall_before, t0=t0)
        self._summary["final"] = self.run_loop()
        r.checkpointer.wait()
        if cfg.data.eval:
            self._summary["eval_final"] = self.evaluate_and_log(cfg.train.steps, "eval at the end")
        self._summary["steps"] = cfg.train.steps
        self._summary["wall_s"] = wall_before + time.perf_counter() - t0
        metrics = self.run_dir / "metrics.jsonl"
        if jax.process_index() == 0 and metrics.exists():
            self._summary["plot"] = str(plot_metrics(metrics, self.run_dir / "metrics.png"))
        self._save_summary("finished")
        self._wall_clock = None
        return self._summary

    def close(self) -> None:
        if self._wall_clock is not None:  # stopped (Ctrl-C, an error) or SFT only: wall_s over every invocation
            before, t0 = self._wall_clock
            self._wall_clock = None
            self._summary["wall_s"] = before + time.perf_counter() - t0
            with contextlib.suppress(OSError):  # a full disk: the error that stopped the run is the one shown
                self._save_summary(self._summary.get("status", "running"))
        if self._logger is not None:
            self._logger.close()
            self._logger = None
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None
        if self.run is not None:
            self.run.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
