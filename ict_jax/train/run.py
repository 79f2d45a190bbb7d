"""Assemble a training run from a :class:`Config`: mesh, model and tokenizer, data, train state, compiled
step and sampler, reward workers, checkpoints (and resume), and the periodic evaluation."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from ict_jax.config import Config, ConfigError
from ict_jax.data.datasets import load_dataset
from ict_jax.data.prompts import EncodedPrompts, PromptIterator, encode_prompts
from ict_jax.data.templates import template_dataset
from ict_jax.model.config import ModelConfig
from ict_jax.model.loading import load_model_and_tokenizer, load_tokenizer_spec
from ict_jax.model.qwen2 import init_model
from ict_jax.model.weights import load_hf
from ict_jax.rewards.checks import CUSTOM_KIND, RewardSpec
from ict_jax.rewards.pool import RewardPool
from ict_jax.rl.state import init_train_state, reference_params
from ict_jax.rl.train_step import check_batch_geometry, make_train_step
from ict_jax.sampling.evaluation import evaluate
from ict_jax.sampling.sampler import make_generate_fn
from ict_jax.sampling.text_generation import make_text_generator
from ict_jax.sharding import check_prompts_divide, make_mesh
from ict_jax.train.checkpoints import Checkpointer
from ict_jax.train.record import check_resume, read_config, read_summary, record_resume
from ict_jax.train.tracking import require_wandb

log = logging.getLogger(__name__)


def maybe_initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None) -> bool:
    """``jax.distributed.initialize`` from explicit flags, or from the environment (Cloud TPU pods and
    SLURM/Open MPI are detected by JAX itself; ``ICT_JAX_COORDINATOR`` / ``ICT_JAX_NUM_PROCESSES`` /
    ``ICT_JAX_PROCESS_ID`` otherwise). Returns True when a multi-process run was set up."""
    coordinator = coordinator or os.environ.get("ICT_JAX_COORDINATOR")
    if num_processes is None and os.environ.get("ICT_JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["ICT_JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("ICT_JAX_PROCESS_ID"):
        process_id = int(os.environ["ICT_JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


@dataclasses.dataclass
class Run:
    cfg: Config
    mesh: Any
    model: Any
    model_config: Any
    tokenizer: Any
    tokenizer_spec: str
    state: Any
    train_step: Any
    ref_params: Any
    generate: Any
    pool: Any
    checkpointer: Any
    iterator: Any
    prompts: Any
    resumed: bool
    resume_point: Any = None
    eval_data: Any = None
    eval_gen: Any = None

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer.close()
        if self.pool is not None:
            self.pool.close()


def model_overrides(cfg: Config) -> dict[str, Any]:
    m = cfg.model
    return dict(compute_dtype=m.compute_dtype, remat=m.remat, scan_layers=m.scan_layers)


@dataclasses.dataclass
class TrainingPrompts:
    """Encoded training prompts of all training datasets, with each prompt's scorer kind."""

    encoded: Any
    kinds: list[str]


def encode_training_data(cfg: Config, tokenizer: Any, datasets: list[Any],
                         max_positions: int | None = None) -> TrainingPrompts:
    """Template and tokenise every training dataset (``data.train``) and concatenate them; each prompt
    keeps its dataset's scorer kind. Prompts that with ``rollout.max_new_tokens`` pass ``max_positions``
    (the model's ``max_position_embeddings``) are dropped and counted, as over-long ones are."""
    parts = [encode_prompts(ds, tokenizer, template=cfg.data.template, max_prompt_len=cfg.rollout.max_prompt_len,
                            max_new_tokens=cfg.rollout.max_new_tokens, max_positions=max_positions)
             for ds in datasets]
    if len(parts) == 1:
        return TrainingPrompts(parts[0], [parts[0].scorer] * len(parts[0]))
    fields = {f.name for f in dataclasses.fields(EncodedPrompts)}
    merged = dict(name="+".join(p.name for p in parts), scorer="mixed",
                  examples=[e for p in parts for e in p.examples], ids=[i for p in parts for i in p.ids],
                  texts=[t for p in parts for t in p.texts], pad_id=parts[0].pad_id,
                  max_prompt_len=cfg.rollout.max_prompt_len, dropped=sum(p.dropped for p in parts),
                  dropped_positions=sum(p.dropped_positions for p in parts),
                  dropped_indices=[])
    return TrainingPrompts(EncodedPrompts(**{k: v for k, v in merged.items() if k in fields}),
                    [p.scorer for p in parts for _ in range(len(p))])


def build_model_and_tokenizer(cfg: Config, mesh: Any) -> tuple[Any, Any, str]:
    """(model, tokenizer, tokenizer spec). ``model.path``: an HF directory or a ``.gguf`` file (or
    ``pkg:<package>/<file>``); otherwise a randomly initialised ``model.preset`` whose vocabulary is
    sized to the tokenizer (``model.tokenizer``: ``char`` = the built-in CharTokenizer)."""

    m = cfg.model
    if m.path:
        model, tok = load_model_and_tokenizer(m.path, mesh=mesh, dtype=m.param_dtype, tokenizer=m.tokenizer,
                                              **model_overrides(cfg))
        return model, tok, m.tokenizer or m.path
    spec = m.tokenizer or "char"
    tok = load_tokenizer_spec(spec)
    kw = dict(param_dtype=m.param_dtype, **model_overrides(cfg))
    if m.preset in ("tiny", "demo"):
        kw["vocab_size"] = tok.vocab_size
    mc = ModelConfig.preset(m.preset, **kw)
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"model.preset: {m.preset} has {mc.vocab_size} token ids but the tokenizer needs "
                          f"{tok.vocab_size}")
    return init_model(mc, seed=cfg.seed, mesh=mesh), tok, spec


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A new run never writes over an existing one; ``--resume`` continues one that exists."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir: {str(run_dir)!r} exists and is not a directory")
    if resume and not run_dir.is_dir():
        raise ConfigError(f"--resume: run_dir {str(run_dir)!r} does not exist, so there is nothing to resume "
                          "(drop --resume to start a new run there)")
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run_dir: {str(run_dir)!r} already holds a run; pass --resume to continue it or "
                          "choose another run_dir (nothing was written)")


SFT_CHECKPOINTS = "checkpoints_sft"  # <run_dir>/checkpoints_sft/<sft step>/: an unfinished SFT warm start
SFT_MODEL = "sft_model"  # <run_dir>/sft_model: the finished SFT warm start (a Hugging Face directory)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run directory stands: ``phase`` "start" (nothing to continue), "sft" (an SFT checkpoint
    at ``step`` SFT steps), or "rl" (``step`` rollout batches done; 0 = the SFT warm start finished and
    RL has not saved a checkpoint yet). ``keep_below``: per phase, the first step a resumed run logs
    again (the rows from there on are dropped from metrics.jsonl and hidden in TensorBoard)."""

    phase: str
    step: int
    keep_below: dict[str, int]


def finished_sft_steps(directory: Path) -> int | None:
    """The latest finished SFT checkpoint's step in ``directory`` (None when there is none)."""
    if not directory.is_dir():
        return None
    with Checkpointer(directory, read_only=True) as ck:
        return ck.latest_step()


def resume_point(cfg: Config, run_dir: Path, rl_step: int | None) -> ResumePoint:
    """The :class:`ResumePoint` of ``run_dir`` given its latest RL checkpoint step."""
    if rl_step is not None:
        return ResumePoint("rl", rl_step, {"rl": rl_step, "eval": rl_step + 1})
    if cfg.train.sft_steps > 0 and (run_dir / SFT_MODEL).is_dir():
        summary = read_summary(run_dir) or {}
        return ResumePoint("rl", 0, {"rl": 0, "eval": 1 if "eval_after_sft" in summary else 0})
    sft_step = finished_sft_steps(run_dir / SFT_CHECKPOINTS) if cfg.train.sft_steps > 0 else None
    if sft_step is not None:
        return ResumePoint("sft", sft_step, {"sft": sft_step, "rl": 0, "eval": 0})
    return ResumePoint("start", 0, {"sft": 0, "rl": 0, "eval": 0})


def build_run(cfg: Config, *, resume: bool = False, model: Any = None, tokenizer: Any = None) -> Run:

    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir, resume)
    previous = read_config(run_dir) if resume else None
    changes = check_resume(previous, cfg) if previous is not None else {}
    if cfg.logging.wandb:
        require_wandb()
    if jax.process_count() > 1:  # every process has checked before any process writes

        multihost_utils.sync_global_devices("ict_jax: run_dir checked")
    m = cfg.mesh
    mesh = make_mesh(m.data, m.fsdp, m.tensor)

    t = cfg.train
    try:  # the sampler splits P prompts over data x fsdp; the step its mini- and micro-batches
        check_prompts_divide(t.prompts_per_step, mesh)
        check_batch_geometry(t.prompts_per_step * cfg.rollout.num_samples, cfg.rollout.num_samples, t.mini_batches,
                             t.micro_batches, mesh)
    except ValueError as e:
        raise ConfigError(f"train.prompts_per_step: {e}") from None
    try:  # each of generate's rollout.chunks calls splits its P / chunks prompts over data x fsdp too
        check_prompts_divide(t.prompts_per_step // cfg.rollout.chunks, mesh)
    except ValueError as e:
        raise ConfigError(f"rollout.chunks: {cfg.rollout.chunks} chunks of train.prompts_per_step: {e}") from None
    # everything that reads user input comes before anything is written
    datasets = [load_dataset(name, data_dir=cfg.data.data_dir, seed=cfg.seed) for name in cfg.data.train]
    custom = [ds.name for ds in datasets if ds.scorer == CUSTOM_KIND]
    if custom and cfg.rl.reward.fn is None:
        raise ConfigError(f"data.train: {custom[0]!r} is scored by reward=custom but rl.reward.fn is not set")
    if model is None:
        model, tokenizer, tok_spec = build_model_and_tokenizer(cfg, mesh)
    else:
        tok_spec = "given"
    prompts = encode_training_data(cfg, tokenizer, datasets, max_positions=model.config.max_position_embeddings)
    P = cfg.train.prompts_per_step
    iterator = PromptIterator(prompts.encoded, P, seed=cfg.seed)
    state = init_train_state(cfg, model)
    train_step = make_train_step(cfg, mesh)
    r = cfg.rollout
    kv = None if r.kv_cache_dtype == "auto" else r.kv_cache_dtype
    generate = make_generate_fn(state.graphdef, num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, eos_ids=tokenizer.eos_ids,
                                kv_cache_dtype=kv, pad_id=tokenizer.pad_id, mesh=mesh if mesh.size > 1 else None,
                                min_response_bucket=r.min_response_bucket)  # decode over the filled cache (issue 26)
    pool = make_reward_pool(cfg)  # a custom reward function that cannot load fails here, before any write
    try:
        return _start_run(cfg, run_dir, resume, changes, mesh, model, tokenizer, tok_spec, state, train_step,
                          generate, pool, iterator, prompts)
    except BaseException:
        pool.close()
        raise


def make_reward_pool(cfg: Config) -> RewardPool:
    """The run's reward worker pool (``rl.reward``). A custom reward function (``rl.reward.fn``) is
    named, not imported: the workers import it, never this process."""
    rw = cfg.rl.reward
    return RewardPool(rw.workers, time_limit=rw.time_limit, checkers={CUSTOM_KIND: rw.fn} if rw.fn else None,
                      spec=RewardSpec(correct=rw.correct, wrong=rw.wrong, no_answer=rw.no_answer,
                                      max_response_chars=rw.max_response_chars))


def _start_run(cfg: Config, run_dir: Path, resume: bool, changes: dict, mesh: Any, model: Any, tokenizer: Any,
               tok_spec: str, state: Any, train_step: Any, generate: Any, pool: Any, iterator: Any,
               prompts: Any) -> Run:
    """The writing half of :func:`build_run`: the run directory, checkpoints, resume, the record."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep)
    resumed = False
    rl_step = checkpointer.latest_step() if resume else None
    if rl_step is not None:
        state, meta = checkpointer.restore(state)
        iterator.load_state_dict(meta["data"])
        resumed = True
        log.info("resumed from step %d", int(jax.device_get(state.step)))
    point = resume_point(cfg, run_dir, rl_step) if resume else None
    ref_params = None
    if cfg.rl.loss.kl_coef > 0:
        ref_source = _reference_source(cfg, run_dir, model, resumed, mesh)
        ref_params = reference_params(ref_source, model.config.resolved_compute_dtype())
    if jax.process_index() == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if point is not None and point.phase != "start":
            record_resume(run_dir, changes, phase=point.phase, step=point.step)
    return Run(cfg=cfg, mesh=mesh, model=model, model_config=model.config, tokenizer=tokenizer,
               tokenizer_spec=tok_spec, state=state, train_step=train_step, ref_params=ref_params,
               generate=generate, pool=pool, checkpointer=checkpointer, iterator=iterator, prompts=prompts,
               resumed=resumed, resume_point=point)


def _reference_source(cfg: Config, run_dir: Path, model: Any, resumed: bool, mesh: Any) -> Any:
    """The KL reference is the policy at the start of RL. A resumed run rebuilds it: the SFT result
    saved at ``<run_dir>/sft_model`` if there is one (placed on the run's mesh, like the policy), else
    the initial model (reloaded / re-initialised deterministically, which is what ``model`` is before
    any checkpoint is restored into the state)."""

    sft_dir = run_dir / SFT_MODEL
    if resumed and sft_dir.is_dir():
        return nnx.state(load_hf(sft_dir, mesh=mesh, dtype=cfg.model.param_dtype, **model_overrides(cfg)), nnx.Param)
    return nnx.state(model, nnx.Param)


def run_eval(cfg: Config, run: Run, step: int) -> dict[str, float]:
    """pass@k on ``data.eval`` with the current policy; metric names ``eval/<benchmark>/pass@k``."""
    if not cfg.data.eval:
        return {}

    d = cfg.data
    if run.eval_data is None:  # built once per run: the same problems, and one compiled sampler
        # templated up front with each benchmark's own instruction (multiple choice vs \boxed{})
        run.eval_data = {name: template_dataset(load_dataset(name, data_dir=d.data_dir, seed=cfg.seed),
                                                run.tokenizer, d.template) for name in d.eval}
        run.eval_gen = make_text_generator((run.state.graphdef, run.state.params), run.tokenizer,
                                           max_new_tokens=cfg.rollout.max_new_tokens, temperature=d.eval_temperature,
                                           top_p=d.eval_top_p, template="none", overlong="skip",
                                           max_prompt_len=cfg.rollout.max_prompt_len,
                                           batch_size=max(1, cfg.train.prompts_per_step), seed=cfg.seed,
                                           mesh=run.mesh if run.mesh.size > 1 else None,
                                           min_response_bucket=cfg.rollout.min_response_bucket)  # issue 26
    datasets, gen = run.eval_data, run.eval_gen
    gen.state = run.state.params  # the current policy weights, no copy
    # Every evaluation samples with the same keys (run i of it: fold_in(key(seed), i)), so its numbers
    # depend on the weights and the seed only: not on how many evaluations ran before in this process
    # (a resumed run, or compare's RL-only runs, evaluate a checkpoint exactly as one long run does), and
    # the warm start and the final policy are compared on common random numbers.
    gen.calls = 0
    out_dir = Path(cfg.run_dir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    res = evaluate(gen, datasets, run.pool, n=d.eval_n, ks=d.eval_k, limit=d.eval_limit,
                   json_path=out_dir / f"step_{step:06d}.json", samples_path=out_dir / f"step_{step:06d}.jsonl",
                   progress=False, print_table=False)
    flat: dict[str, float] = {}
    for bench, vals in res.get("benchmarks", res).items():
        if isinstance(vals, dict):
            for k, v in vals.items():
                if k.startswith("pass@") and isinstance(v, (int, float)):
                    flat[f"eval/{bench}/{k}"] = float(v)
    return flat
