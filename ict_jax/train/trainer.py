"""The run: the SFT warm start, then RL (draw prompts -> generate G responses each -> score -> advantages ->
train step), each a phase of the one loop (``train.phase.run_phase``), with hooks.

The only module that knows every other one (docs/architecture.md). :class:`Trainer` builds a run's parts
once (``train.parts.build_parts``: mesh, model, data, the compiled programs, reward workers,
checkpoints, logger), compiles every program before anything is sampled (the pre-flight point,
``train.preflight``), runs the SFT warm start as a phase (``train.warm_start.sft_phase``: one call of the
``sft`` program a step, its checkpoints and hooks), builds RL's state when it ends, then runs the RL
phase (:meth:`Trainer.rl_phase`), per RL step s:

1. a rollout batch (``train.rollout.collect_rollout``: the next P prompts, G responses each from the
   current policy with key ``fold_in(fold_in(root, SAMPLER_STREAM), s)``, scored by the reward workers);
2. one call of the compiled train step (docs/method.md §4), its metrics (§5) logged;
3. the hooks (``train.hooks``): evaluation every ``train.eval_every`` steps, a checkpoint every
   ``train.save_every`` steps and at the end, the profiler, the non-finite guard; at the end the final
   evaluation and the summary.

A non-finite loss or gradient skips that update inside the step (``train/skipped``); three such steps in
a row stop the run with :class:`TrainingDiverged`, leaving the last good checkpoint intact. Every random
stream is ``fold_in(root, STREAM)`` then ``fold_in(step)`` (``ict_jax.rng``) and the data position is
saved with the checkpoint, so ``--resume`` continues exactly. The state is passed to each part and
returned; the trainer holds the current one (:attr:`Trainer.state`: the SFT state during the warm start,
then the RL train state), replaced after each phase and step.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

from ict_jax.config import Config
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.rl.state import TrainState
from ict_jax.sharding import to_host
from ict_jax.train.evaluation import Evaluator
from ict_jax.train.hooks import (
    Hook,
    Hooks,
    ProfileHook,
    StepInfo,
    checkpoint_health,
    count_nonfinite,
    evaluate_every,
    final_evaluation,
    finish_summary,
    nonfinite_guard,
    save_checkpoint,
)
from ict_jax.train.logs import RunLogger, last_logged_step, metrics_to_floats
from ict_jax.train.parts import build_parts
from ict_jax.train.phase import Phase, PhaseEnd, run_phase
from ict_jax.train.preflight import programs_to_check
from ict_jax.train.record import SFT_MODEL
from ict_jax.train.resume import eval_on_record, finished_run
from ict_jax.train.rollout import collect_rollout
from ict_jax.train.run_dir import hold_run_dir
from ict_jax.train.summary import RunSummary
from ict_jax.train.warm_start import load_warm_start, run_warm_start, save_warm_start, sft_state, start_rl

PHASES = ("sft", "rl")


class Trainer:
    """Build everything a run needs from a :class:`Config`, then :meth:`train` it.

    ``resume``: continue the run in ``run_dir`` (docs/checkpoints.md "Resume"): from its last RL
    checkpoint, else its finished SFT warm start, else its last SFT checkpoint. A finished run whose
    ``train.steps`` was not raised is not built at all: :attr:`finished` holds its summary and
    :meth:`train` returns it unchanged. ``profile_steps``: ``(first, stop)`` RL steps traced.
    ``preflight``: compile the programs the run executes (the SFT step when SFT is ahead, the RL programs
    unless ``rl`` is False: the warm start alone, ``ict-jax sft``) and check their memory before anything
    is written (``train.preflight``; :class:`~ict_jax.train.preflight.DoesNotFit` when they would not fit).
    :attr:`state`: the SFT state (the only optimizer state alive) until the warm start ends, then RL's.

    The run directory is held from the start (``train.run_dir.hold_run_dir``, before the model loads) until
    :meth:`close` / the ``with`` block's end: a second Trainer, in this process or another, is refused at
    once with :class:`~ict_jax.outputs.OutputInUse` naming the holder; with ``held``, the caller holds it
    (``ict-jax train`` does from its first second). ``tell(text)``: what the build is doing (a heartbeat)."""

    def __init__(self, config: Config, *, resume: bool = False, progress: bool = True, model: Qwen2 | None = None,
                 profile_steps: tuple[int, int] | None = None, tokenizer: Tokenizer | None = None, rl: bool = True,
                 preflight: bool = True, held: bool = False, tell: Callable[[str], None] | None = None):
        self.cfg, self.resume, self.run_dir, self.rl = config, resume, Path(config.run_dir), rl
        self.parts, self.summary, self.hooks, self.sft_hooks = None, None, Hooks(), Hooks()
        self.state = self.ref_params = None
        self.phase = "rl"  # the phase self.state belongs to: "sft" (an SFT state) or "rl"
        self.paused: int | None = None  # the step a paused run stopped at (run_loop's pause)
        self._hold = contextlib.ExitStack()  # the run directory, held until close() (before anything slow)
        self._hold.enter_context(hold_run_dir(self.run_dir, resume, primary=False if held else None))
        try:
            self.finished = finished_run(config, self.run_dir) if resume else None
            if self.finished is not None:
                return
            self.parts, self.state, self.ref_params = build_parts(config, resume=resume, progress=progress,
                                                                  model=model, tokenizer=tokenizer, preflight=preflight,
                                                                  rl=rl, tell=tell)
            self.phase = "sft" if self.parts.sft_ahead else "rl"
            self.summary = RunSummary(self.run_dir, resume=resume)
            self.evaluator = Evaluator(self.parts, eval_on_record(self.run_dir, self.parts.resume_point))
            self.add_default_hooks(profile_steps)
        except BaseException:
            self.close()
            raise

    def add_hook(self, fn: Hook, every: int = 1, phase: str = "rl") -> None:
        """``fn(StepInfo)`` after every ``every``-th step of ``phase`` ("rl", or "sft": the warm start's
        steps, ``StepInfo.state`` its SFT state), after the hooks registered before it."""
        if phase not in PHASES:
            raise ValueError(f"add_hook: phase {phase!r}; the phases are {', '.join(PHASES)}")
        (self.hooks if phase == "rl" else self.sft_hooks).add(fn, every)

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
        self.parts.programs.compile(programs_to_check(self.cfg, sft=self.parts.sft_ahead, rl=self.rl))

    def run_phase(self, phase: Phase, state: TrainState, start: int,
                  pause: Callable[[int], bool] | None = None) -> PhaseEnd:
        """The run's one loop, ``train.phase.run_phase``, over ``phase`` from ``start``; :attr:`state` follows it."""
        self.state = state
        return run_phase(phase, state, start, self.logger, run_dir=self.run_dir, pause=pause,
                         on_state=lambda new: setattr(self, "state", new))

    def sft(self) -> dict[str, float]:
        """The SFT warm start as a phase of the run's loop (``train.warm_start.run_warm_start``), or a finished
        one loaded (``<run_dir>/sft_model``); then RL's state and reference, built once the SFT state is
        dropped (``start_rl``). Returns the last SFT step's metrics ({} without ``train.sft_steps``)."""
        if self.cfg.train.sft_steps <= 0:
            return {}
        if (self.run_dir / SFT_MODEL).is_dir():  # finished before: the RL phase starts from it
            self.state = self.ref_params = None
            self.state, self.ref_params, self.phase = *load_warm_start(self.parts), "rl"
            return self.summary.get("sft") or {}
        state = self.state if self.phase == "sft" else sft_state(self.parts, self.state)
        self.state, self.ref_params, self.phase = None, None, "sft"  # nothing of RL's is alive during SFT
        model, last = run_warm_start(self.parts, state, self.run_phase, resume=self.resume,
                                     hooks=self.sft_hooks.step_hooks)
        self.state = state = None  # the SFT optimizer state goes before RL's is built
        self.state, self.ref_params, self.phase = *start_rl(self.parts, model), "rl"
        save_warm_start(self.parts, self.state)
        return last

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
        """One RL step from :attr:`state` (replaced by the new one): a rollout batch, one update; returns
        the step's metrics."""
        batch, times = collect_rollout(self.parts, self.state, step)
        t0 = time.perf_counter()
        self.state, metrics = self.parts.programs.step(self.state, batch, self.ref_params)
        m = metrics_to_floats(metrics)
        times["time/update_s"] = time.perf_counter() - t0
        n_tokens = times.pop("_tokens")
        times["throughput/tokens_per_s"] = n_tokens / max(1e-9, times["time/rollout_s"] + times["time/update_s"])
        return {**m, **times}

    def rl_phase(self) -> Phase:
        """RL as a phase of the run's loop: ``train.steps`` steps of :meth:`rl_step` (with the non-finite
        updates in a row, ``train.hooks.count_nonfinite``), the RL checkpoints and :attr:`hooks`."""
        def step(state: TrainState, s: int) -> tuple[TrainState, dict[str, float]]:
            self.state = state
            metrics = self.rl_step(s)
            return self.state, metrics

        return Phase("rl", "RL", self.cfg.train.steps, count_nonfinite(step), self.parts.checkpointer, self.hooks)

    def run_loop(self, pause: Callable[[int], bool] | None = None) -> dict[str, float]:
        """RL steps from the state's step to ``train.steps`` (:meth:`rl_phase` in :meth:`run_phase`); Ctrl-C
        stops after the step in progress (its checkpoint saved). ``pause(done)``: True ends the loop there
        with a checkpoint of that step (:attr:`paused`), continued by a resumed run exactly as if it had not
        stopped. Returns the last step's metrics."""
        self.paused = None
        end = self.run_phase(self.rl_phase(), self.state, int(to_host(self.state.step)), pause)
        self.paused = end.paused
        return end.last

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
        self.summary["final"] = last or last_logged_step(self.run_dir)  # resumed after its last step: on record
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
