"""A run's evaluation: pass@k on ``data.eval`` with a policy (docs/method.md §6), sampled by the run's
evaluation program (``programs.eval``: ``data.eval_n`` samples a prompt, ``rollout.kv_cache_dtype``),
written to ``<run_dir>/eval/step_<step>.json`` / ``.jsonl`` and logged as an ``eval`` row.

Every evaluation samples with the same keys (call i of it: ``fold_in(generator_key(seed), i)``), so its
numbers depend on the weights and the seed only: not on how many evaluations ran before in this process
(a resumed run, or compare's RL-only runs, evaluate a checkpoint exactly as one long run does), and the
warm start and the final policy are compared on common random numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ict_jax.data.datasets import load_dataset
from ict_jax.data.templates import template_dataset
from ict_jax.rl.state import TrainState
from ict_jax.sampling.evaluation import evaluate
from ict_jax.sampling.text_generation import TextGenerator, make_text_generator
from ict_jax.train.logs import format_eval
from ict_jax.train.parts import RunParts
from ict_jax.train.programs import gathers, kv_cache_dtype, sampler_prompts

#: docs/method.md §5 metric of an evaluation -> its per-benchmark field in
#: :func:`ict_jax.sampling.evaluation.evaluate`'s results (fractions of the samples)
SHARE_METRICS = {"no_answer_frac": "no_answer", "truncated_frac": "truncated"}


def pass_at_k_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """The docs/method.md §5 metrics of :func:`ict_jax.sampling.evaluation.evaluate`'s results:
    ``{"eval/<benchmark>/pass@k": value}``, with ``eval/<benchmark>/no_answer_frac`` (samples with no
    extractable answer) and ``eval/<benchmark>/truncated_frac`` (samples cut at the length limit) where the
    results hold them."""
    flat: dict[str, float] = {}
    for bench, vals in results.get("benchmarks", results).items():
        if isinstance(vals, dict):
            for k, v in vals.items():
                if k.startswith("pass@") and isinstance(v, (int, float)):
                    flat[f"eval/{bench}/{k}"] = float(v)
            for metric, field in SHARE_METRICS.items():
                v = vals.get(field)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    flat[f"eval/{bench}/{metric}"] = float(v)
    return flat


def eval_results(run_dir: str | Path, step: int) -> Path:
    """Where a run's evaluation after ``step`` rollout batches writes its results,
    ``<run_dir>/eval/step_<step>.json`` (its samples: the same path with ``.jsonl``,
    ``eval_results(...).with_suffix(".jsonl")``)."""
    return Path(run_dir) / "eval" / f"step_{step:06d}.json"


def evaluated_steps(run_dir: str | Path) -> list[int]:
    """The steps after which the run has a finished evaluation (its results file; a samples file alone is
    an evaluation cut short), in order."""
    return sorted(int(p.stem[5:]) for p in (Path(run_dir) / "eval").glob("step_*.json"))


def evaluation_line(done: int, total: int, what: str | None) -> str:
    """``evaluating, 16/128 problems done (chain_sum: sampling problems 25-32 of 128, 4 responses each)``:
    a run's heartbeat while it evaluates."""
    return f"evaluating, {done}/{total} problems done" + (f" ({what})" if what else "")


class Evaluator:
    """Evaluates a run's policies on ``data.eval``. ``last``: an evaluation already on record, ``(step,
    metrics)``, reused instead of evaluating that step again."""

    def __init__(self, parts: RunParts, last: tuple[int, dict[str, float]] | None = None):
        self.parts = parts
        self.last = last
        self._datasets: dict[str, Any] | None = None

    def datasets(self) -> dict[str, Any]:
        """The benchmarks, loaded once per run and templated up front with each one's own instruction
        (multiple choice vs \\boxed{})."""
        if self._datasets is None:
            d, tok, seed = self.parts.config.data, self.parts.tokenizer, self.parts.config.seed
            self._datasets = {name: template_dataset(load_dataset(name, data_dir=d.data_dir, seed=seed), tok,
                                                     d.template) for name in d.eval}
        return self._datasets

    def generator(self, state: TrainState) -> TextGenerator:
        """A text generator over ``state``'s policy (no copy) through the run's evaluation program; its key
        stream starts anew."""
        cfg, parts = self.parts.config, self.parts
        return make_text_generator((state.graphdef, state.model_state()), parts.tokenizer,
                                   max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.data.eval_temperature,
                                   top_p=cfg.data.eval_top_p, template="none", overlong="skip",
                                   max_prompt_len=cfg.rollout.max_prompt_len, batch_size=sampler_prompts("eval", cfg),
                                   seed=cfg.seed, mesh=parts.mesh, kv_cache_dtype=kv_cache_dtype(cfg),
                                   generate_fns={cfg.data.eval_n: parts.programs.eval},
                                   min_response_bucket=cfg.rollout.min_response_bucket,
                                   gather_weights=gathers(cfg))

    def evaluate(self, state: TrainState, step: int) -> dict[str, float]:
        """pass@k of ``state``'s policy after ``step`` rollout batches; {} when no eval set is named."""
        d = self.parts.config.data
        if not d.eval:
            return {}
        results = eval_results(self.parts.run_dir, step)
        results.parent.mkdir(parents=True, exist_ok=True)
        logger = self.parts.logger
        try:
            # with data.eval_batch, each sampler call gets a whole batch of problems (the default hands it 8 a
            # time, as it always has, so that a run's evaluations keep their samples)
            batch = {"batch_size": d.eval_batch} if d.eval_batch else {}
            if self._datasets is None:  # the first evaluation loads the benchmarks (a tfds download: minutes)
                logger.working_on(f"evaluating: loading the benchmarks ({','.join(d.eval)})")
            datasets = self.datasets()
            res = evaluate(self.generator(state), datasets, self.parts.pool, n=d.eval_n, ks=d.eval_k,
                           limit=d.eval_limit, **batch, json_path=results,
                           samples_path=results.with_suffix(".jsonl"), progress=False, print_table=False,
                           listener=lambda done, total, what: logger.working_on(evaluation_line(done, total, what)))
        finally:
            logger.working_on(None)
        return pass_at_k_metrics(res)

    def evaluate_and_log(self, state: TrainState, step: int, label: str | None = None) -> dict[str, float]:
        """:meth:`evaluate`, logged as an ``eval`` row at ``step`` (one line on the console); an
        evaluation of the same step in this invocation (or on record for the resumed step) is reused."""
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        ev = self.evaluate(state, step)
        if ev:
            self.parts.logger.log(step, ev, phase="eval")
            self.parts.logger.message(f"{label or f'eval @ step {step}'}: {format_eval(ev)}")
        self.last = (step, ev)
        return ev
