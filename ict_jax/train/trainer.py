"""The RL loop: draw prompts -> generate G responses each -> score -> advantages -> train step, with hooks.

The only module that knows every other one (docs/architecture.md). :class:`Trainer` builds a run's parts
once (``train.parts.build_parts``: mesh, model, data, the compiled programs, reward workers,
checkpoints, logger), compiles every program before anything is sampled (the pre-flight point,
``train.preflight``), runs the SFT warm start (``train.warm_start``), then per RL step s:

1. a rollout batch (``train.rollout.collect_rollout``: the next P prompts, G responses each from the
   current policy with key ``fold_in(fold_in(root, SAMPLER_STREAM), s)``, scored by the reward workers);
2. one call of the compiled train step (docs/method.md §4), its metrics (§5) logged;
3. the hooks (``train.hooks``): evaluation every ``train.eval_every`` steps, a checkpoint every
   ``train.save_every`` steps and at the end, the profiler, the non-finite guard; at the end the final
   evaluation and the summary.

A non-finite loss or gradient skips that update inside the step (``train/skipped``); three such steps in
a row stop the run with :class:`TrainingDiverged`, leaving the last good checkpoint intact. Every random
stream is ``fold_in(root, STREAM)`` then ``fold_in(step)`` (``ict_jax.rng``) and the data position is
saved with the checkpoint, so ``--resume`` continues exactly. The train state is passed to each part and
returned; the trainer holds the current one (:attr:`Trainer.state`), replaced after each phase and step.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

from ict_jax.config import Config
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.rng import SAMPLER_STREAM  # noqa: F401 - its former home (docs/sampler.md)
from ict_jax.sharding import to_host
from ict_jax.train.evaluation import Evaluator
from ict_jax.train.hooks import (MAX_NONFINITE_IN_A_ROW, Hook, Hooks, ProfileHook, StepInfo,  # noqa: F401
                                 checkpoint_health, evaluate_every, final_evaluation, finish_summary,
                                 nonfinite_guard, save_checkpoint)
from ict_jax.train.logs import RunLogger, metrics_to_floats
from ict_jax.train.parts import build_parts
from ict_jax.train.preflight import programs_to_check
from ict_jax.train.resume import SFT_MODEL, eval_on_record, finished_run, hold_run_dir
from ict_jax.train.rollout import collect_rollout
from ict_jax.train.stopping import Interrupted, TrainingDiverged, stop_after_step  # noqa: F401 - public here
from ict_jax.train.summary import RunSummary
from ict_jax.train.warm_start import warm_start as run_warm_start


class Trainer:
    """Build everything a run needs from a :class:`Config`, then :meth:`train` it.

    ``resume``: continue the run in ``run_dir`` (docs/checkpoints.md "Resume"): from its last RL
    checkpoint, else its finished SFT warm start, else its last SFT checkpoint. A finished run whose
    ``train.steps`` was not raised is not built at all: :attr:`finished` holds its summary and
    :meth:`train` returns it unchanged. ``profile_steps``: ``(first, stop)`` RL steps traced.
    ``preflight``: compile the RL programs and check their memory before anything is written
    (``train.preflight``; :class:`~ict_jax.train.preflight.DoesNotFit` when they would not fit).

    The run directory is held from the start (``train.resume.hold_run_dir``, before the model loads) until
    :meth:`close` / the ``with`` block's end: a second Trainer on it, in this process or another, is
    refused at once with :class:`~ict_jax.outputs.OutputInUse` naming the holder."""

    def __init__(self, config: Config, *, resume: bool = False, progress: bool = True,
                 profile_steps: tuple[int, int] | None = None, model: Qwen2 | None = None,
                 tokenizer: Tokenizer | None = None, preflight: bool = True):
        self.cfg, self.resume, self.run_dir = config, resume, Path(config.run_dir)
        self.parts, self.summary, self.hooks = None, None, Hooks()
        self.state = self.ref_params = None
        self.paused: int | None = None  # the step a paused run stopped at (run_loop's pause)
        self._hold = contextlib.ExitStack()  # the run directory, held until close() (before anything slow)
        self._hold.enter_context(hold_run_dir(self.run_dir, resume))
        try:
            self.finished = finished_run(config, self.run_dir) if resume else None
            if self.finished is not None:
                return
            self.parts, self.state, self.ref_params = build_parts(config, resume=resume, progress=progress,
                                                                  model=model, tokenizer=tokenizer, preflight=preflight)
            self.summary = RunSummary(self.run_dir, resume=resume)
            self.evaluator = Evaluator(self.parts, eval_on_record(self.run_dir, self.parts.resume_point))
            self.add_default_hooks(profile_steps)
        except BaseException:
            self.close()
            raise

    def add_hook(self, fn: Hook, every: int = 1) -> None:
        """``fn(StepInfo)`` after every ``every``-th RL step, after the hooks registered before it."""
        self.hooks.add(fn, every)

    def add_default_hooks(self, profile_steps: tuple[int, int] | None = None) -> None:
        parts, cfg = self.parts, self.cfg
        if profile_steps:
            self.add_hook(ProfileHook(self.run_dir / "profile", *profile_steps))
        self.add_hook(checkpoint_health(parts.checkpointer))
        self.add_hook(nonfinite_guard(self.run_dir))
        if cfg.train.eval_every:
            self.add_hook(evaluate_every(self.evaluator), every=cfg.train.eval_every)
        self.add_hook(save_checkpoint(parts))
        self.hooks.add_end(final_evaluation(self.evaluator, self.summary))
        self.hooks.add_end(finish_summary(parts, self.summary))

    def logger(self, phase: str, total: int, initial: int = 0) -> RunLogger:
        """The run's logger (metrics.jsonl, TensorBoard, W&B) started for ``phase``: a bar on a terminal,
        compact lines otherwise."""
        self.parts.logger.start(phase, total, initial)
        return self.parts.logger

    def say(self, text: str) -> None:
        self.parts.logger.message(text)

    def compile(self) -> None:
        """Every program of the run compiled at its largest shapes before anything is sampled (the memory
        pre-flight in ``build_parts`` compiled and checked them already: then this reuses them)."""
        self.parts.programs.compile(programs_to_check(self.cfg))

    def sft(self) -> dict[str, float]:
        """The SFT warm start (``train.warm_start``), or a finished one loaded; RL then starts from it.
        Returns the last SFT step's metrics ({} without ``train.sft_steps``)."""
        if self.cfg.train.sft_steps <= 0:
            return {}
        self.state, self.ref_params, last = run_warm_start(self.parts, self.state, self.logger, resume=self.resume)
        return self.summary.get("sft") or {} if last is None else last

    def warm_start(self) -> dict[str, Any]:
        """:meth:`sft` and its evaluation (with ``data.eval``), each recorded in ``summary.json`` as it
        finishes ("status": "sft finished"); returns the summary so far."""
        self.summary.start_clock()  # close() counts an interrupted invocation
        self.summary["sft"] = self.sft()
        self.summary["model"] = str(self.run_dir / SFT_MODEL)
        self.summary.save("sft finished")
        if self.cfg.data.eval and "eval_after_sft" not in self.summary:
            self.summary["eval_after_sft"] = self.evaluate_and_log(0, "eval after SFT")
        self.summary.stamp_wall()
        self.summary.save("sft finished")
        return self.summary.data

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@k on ``data.eval`` with the current policy (docs/method.md §6); {} when no eval set is named."""
        return self.evaluator.evaluate(self.state, step)

    def evaluate_and_log(self, step: int, label: str | None = None) -> dict[str, float]:
        return self.evaluator.evaluate_and_log(self.state, step, label)

    def rl_step(self, step: int) -> dict[str, float]:
        """One RL step from :attr:`state`: a rollout batch, one update; returns the step's metrics."""
        batch, times = collect_rollout(self.parts, self.state, step)
        t0 = time.perf_counter()
        self.state, metrics = self.parts.programs.step(self.state, batch, self.ref_params)
        m = metrics_to_floats(metrics)
        times["time/update_s"] = time.perf_counter() - t0
        n_tokens = times.pop("_tokens")
        times["throughput/tokens_per_s"] = n_tokens / max(1e-9, times["time/rollout_s"] + times["time/update_s"])
        return {**m, **times}

    def run_loop(self, pause: Callable[[int], bool] | None = None) -> dict[str, float]:
        """RL steps from the state's step to ``train.steps``, each followed by the hooks; Ctrl-C stops after
        the step in progress (its checkpoint saved). ``pause(done)``, asked after each step's hooks: True
        ends the loop there with a checkpoint of that step (:attr:`paused`), to be continued by a resumed
        run exactly as if it had not stopped. Returns the last step's metrics."""
        steps = self.cfg.train.steps
        start = int(to_host(self.state.step))
        logger = self.logger("rl", steps, start)
        if start:
            logger.message(f"resuming RL at step {start}/{steps}")
        self.hooks.begin(start)
        streak, last = 0, {}
        self.paused = None
        with stop_after_step(logger.message) as stop:
            for step in range(start, steps):
                last = self.rl_step(step)
                streak = streak + 1 if last.get("train/skipped", 0) > 0 else 0
                last["train/nonfinite_in_a_row"] = float(streak)
                logger.log(step, last)
                done = step + 1
                pausing = done < steps and pause is not None and bool(pause(done))
                self.hooks.run(StepInfo(done, self.state, last, final=done == steps,
                                        stopping=stop.requested or pausing))
                if stop.requested and done < steps:
                    self.parts.checkpointer.wait()
                    raise Interrupted(f"interrupted at RL step {done}/{steps}; checkpoints are in "
                                      f"{self.run_dir / 'checkpoints'}: continue with --resume run_dir={self.run_dir}")
                if pausing:
                    self.parts.checkpointer.wait()
                    self.paused = done
                    break
        return last

    def train(self, pause: Callable[[int], bool] | None = None) -> dict[str, Any]:
        """SFT warm start (if configured and not finished before), then RL; returns the summary, also
        kept in ``<run_dir>/summary.json`` (written as each part finishes; "status": "finished" at the
        end). A finished run resumed without a raised ``train.steps`` returns its summary unchanged.
        ``pause``: see :meth:`run_loop`; a paused run saves its checkpoint, records "status": "paused" and
        ``steps_done``, skips the end hooks (final evaluation, summary) and is continued with ``resume``."""
        if self.finished is not None:
            return self.finished
        cfg = self.cfg
        self.summary.start_clock()  # close() counts an interrupted invocation's time too
        if self.parts.memory is not None:  # the pre-flight's numbers, kept also by a run that dies (memory.md)
            self.summary["memory"] = self.parts.memory.record()
        self.summary.save("running")  # until it finishes (again), it is not finished
        sft_part = f"SFT {cfg.train.sft_steps} steps, then " if cfg.train.sft_steps > 0 else ""
        self.say(f"run {self.run_dir}: {sft_part}{cfg.train.steps} RL steps ({cfg.rl.selector.method})")
        self.compile()
        if not self.parts.resumed and cfg.train.sft_steps > 0:
            self.warm_start()
        last = self.run_loop(pause)
        if self.paused is not None:
            self.summary["steps_done"] = self.paused
            self.summary.stamp_wall()
            self.summary.save("paused")
            return self.summary.data
        self.summary["final"] = last
        self.summary.data.pop("steps_done", None)  # a paused invocation's; "steps" says it at the end
        self.hooks.run_end(StepInfo(cfg.train.steps, self.state, self.summary["final"], final=True))
        return self.summary.data

    def close(self) -> None:
        """Stop the run's workers and writers, then release the run directory (every exit path ends here)."""
        try:
            if self.summary is not None:
                self.summary.close()
        finally:
            try:
                if self.parts is not None:
                    self.parts.close()
            finally:
                self._hold.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
