"""A run's parts, built once from a :class:`Config` (:func:`build_parts`): the frozen, typed
:class:`RunParts` (mesh, model config, tokenizer, training prompts and their iterator, the compiled
programs, the reward workers, the checkpointer, the logger) beside the state of the phase the run starts
in and the KL reference, which are passed and returned, never kept in the parts. A run with SFT steps
ahead of it (``train.resume.sft_ahead``) starts with its SFT state (the parameters and the SFT
optimizer's state) and no reference: RL's optimizer state and its reference are built when SFT ends
(``train.warm_start.start_rl``), so that the warm start never holds two optimizer states.

Everything that reads user input (the run directory, the resume rules, the batch geometry, the data
sets, the model, a custom reward function) is checked before anything is written."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ict_jax.config import Config, ConfigError
from ict_jax.data.datasets import load_dataset
from ict_jax.data.prompts import PromptIterator
from ict_jax.model.adapters import attach_lora
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.source import ModelSource
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.rewards.checks import CUSTOM_KIND, RewardSpec
from ict_jax.rewards.pool import RewardPool
from ict_jax.rl.state import TrainState, init_train_state, reference_params
from ict_jax.rl.train_step import check_batch_geometry
from ict_jax.sharding import check_prompts_divide, make_mesh
from ict_jax.train.checkpoints import Checkpointer, abstract_train_state, abstract_tree
from ict_jax.train.logs import RunLogger
from ict_jax.train.lora_base import META_KEY as BASE_META_KEY
from ict_jax.train.lora_base import LoraBase, loaded_identity
from ict_jax.train.model_source import resolve_model
from ict_jax.train.plugins import check_registered
from ict_jax.train.preflight import FitCheck, compile_and_check_gathering
from ict_jax.train.programs import (
    Optimizers,
    RunPrograms,
    TokenIds,
    build_programs,
    gathers,
    has_reference,
    reference_dtype,
    same_layout,
)
from ict_jax.train.record import SFT_MODEL, check_resume, read_config, record_resume
from ict_jax.train.resume import (
    SFT_CHECKPOINTS,
    ResumePoint,
    drop_rows_logged_again,
    reference_model,
    resume_point,
    sft_ahead,
)
from ict_jax.train.run_dir import check_run_dir
from ict_jax.train.tracking import WandbTracker, require_wandb
from ict_jax.train.training_data import TrainingPrompts, encode_training_data

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a run is made of, built once by :func:`build_parts`; the train state is not here."""

    config: Config
    run_dir: Path
    mesh: Mesh
    model_config: ModelConfig
    tokenizer: Tokenizer
    tokenizer_spec: str  # how to load the tokenizer again (recorded with each checkpoint)
    prompts: TrainingPrompts
    iterator: PromptIterator  # the training prompts' order; its position is saved with each checkpoint
    programs: RunPrograms
    pool: RewardPool
    checkpointer: Checkpointer  # <run_dir>/checkpoints: the RL checkpoints
    logger: RunLogger
    tracker: WandbTracker | None  # logging.wandb
    resume_point: ResumePoint | None  # where a resumed run continues; None for a new run
    resumed: bool  # an RL checkpoint was restored
    lora_base: LoraBase | None = None  # the base under a LoRA run's adapters (model.lora); None otherwise
    memory: FitCheck | None = None  # the memory pre-flight's numbers (None: not checked)
    sft_ahead: bool = False  # SFT steps are ahead: the run starts in the SFT phase, with its SFT state

    def checkpoint_meta(self, step: int, phase: str = "rl") -> dict[str, Any]:
        """What a checkpoint of ``phase`` ("rl" or "sft") records beside the arrays, for both phases: the
        phase, the step, the run's settings (and a LoRA run's base model, :meth:`base_meta`); an RL
        checkpoint also the data position."""
        meta = {"phase": phase, "config": self.config.to_dict(), "model_config": dataclasses.asdict(self.model_config),
                "tokenizer": self.tokenizer_spec, "step": step, **self.base_meta(phase)}
        if phase == "rl":
            meta["data"] = self.iterator.state_dict()
        return meta

    def base_meta(self, phase: str) -> dict[str, Any]:
        """``{"base_model": identity}`` of a LoRA run's base in ``phase`` ("sft" or "rl"; ``train.lora_base``),
        on the process that writes the metadata; {} otherwise."""
        if self.lora_base is None or jax.process_index() != 0:
            return {}
        return {BASE_META_KEY: self.lora_base.identity(phase)}

    def close(self) -> None:
        """The logger, W&B, the pending checkpoint and the reward workers, in that order."""
        try:
            self.logger.close()
        finally:
            try:
                if self.tracker is not None:
                    self.tracker.close()
            finally:
                try:
                    self.checkpointer.wait()
                    self.checkpointer.close()
                finally:
                    self.pool.close()


def make_reward_pool(cfg: Config) -> RewardPool:
    """The run's reward worker pool (``rl.reward``). A custom reward function (``rl.reward.fn``) is
    named, not imported: the workers import it, never this process."""
    rw = cfg.rl.reward
    return RewardPool(rw.workers, time_limit=rw.time_limit, checkers={CUSTOM_KIND: rw.fn} if rw.fn else None,
                      plugins=cfg.plugins,
                      spec=RewardSpec(correct=rw.correct, wrong=rw.wrong, no_answer=rw.no_answer,
                                      max_response_chars=rw.max_response_chars))


def run_mesh_checked(cfg: Config) -> Mesh:
    """The run's mesh, with the batch geometry checked on it: the sampler splits P prompts (P / chunks a
    call; ``data.eval_batch`` an evaluation's call) over data x fsdp, the step its mini- and micro-batches."""
    m, t = cfg.mesh, cfg.train
    mesh = make_mesh(m.data, m.fsdp, m.tensor)
    try:
        check_prompts_divide(t.prompts_per_step, mesh)
        check_batch_geometry(t.prompts_per_step * cfg.rollout.num_samples, cfg.rollout.num_samples, t.mini_batches,
                             t.micro_batches, mesh)
    except ValueError as e:
        raise ConfigError(f"train.prompts_per_step: {e}") from None
    try:
        check_prompts_divide(t.prompts_per_step // cfg.rollout.chunks, mesh)
    except ValueError as e:
        raise ConfigError(f"rollout.chunks: {cfg.rollout.chunks} chunks of train.prompts_per_step: {e}") from None
    if cfg.data.eval_batch is not None:
        try:
            check_prompts_divide(cfg.data.eval_batch, mesh)
        except ValueError as e:
            raise ConfigError(f"data.eval_batch: {e}") from None
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if t.sft_steps > 0 and t.sft_batch_size % shards:  # the SFT step splits its rows over data x fsdp
        raise ConfigError(f"train.sft_batch_size: {t.sft_batch_size} rows do not split over data x fsdp = {shards} "
                          "shards; use a multiple of it")
    return mesh


def check_resumed_base(lora_base: LoraBase, run_dir: Path) -> None:
    """A LoRA run resumed: ConfigError (one line), before anything is compiled or written, unless the
    checkpoint it continues from (its last RL checkpoint, else the last SFT checkpoint of an unfinished
    warm start) holds adapters trained on this run's base (:meth:`ict_jax.train.lora_base.LoraBase.check`)."""
    for folder, phase in ((run_dir / "checkpoints", "rl"), (run_dir / SFT_CHECKPOINTS, "sft")):
        if phase == "sft" and (run_dir / SFT_MODEL).is_dir():
            return
        if folder.is_dir():
            with Checkpointer(folder, read_only=True) as ckpt:
                step = ckpt.latest_step()
                if step is not None:
                    lora_base.check(ckpt, step, phase)
                    return


def build_parts(cfg: Config, *, resume: bool = False, progress: bool = True, model: Qwen2 | None = None,
                tokenizer: Tokenizer | None = None, preflight: bool = True,
                rl: bool = True, tell: Callable[[str], None] | None = None
                ) -> tuple[RunParts, TrainState, nnx.State | None]:
    """``(parts, state, KL reference parameters or None)`` of a run of ``cfg``: a new run, or with
    ``resume`` the one in ``run_dir`` continued (its last RL checkpoint restored into the state). The
    state is that of the phase the run starts in: with SFT steps ahead (``parts.sft_ahead``) the SFT state
    (the SFT optimizer's state; no reference: both of RL's are built when SFT ends), else the RL train
    state. ``model``/``tokenizer``: use these instead of ``model.path`` / ``model.preset``. ``progress``: a
    bar on a terminal (else compact lines). ``preflight``: compile the programs the run executes (the SFT
    step when SFT is ahead; with ``rl`` the RL programs: ``rl`` False is the warm start alone) and check
    that they fit the machine's memory (``train.preflight``, ``train.memory_check``) before anything is
    written; a run that would not fit raises :class:`~ict_jax.train.preflight.DoesNotFit` with nothing
    written. ``tell(text)``: what runs now, as each part starts (a command's heartbeat names it)."""
    tell = tell or (lambda text: None)
    check_registered(cfg)  # plugins imported, the named methods registered: before anything else
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir, resume)
    ahead = sft_ahead(cfg, run_dir, resume)
    previous = read_config(run_dir) if resume else None
    changes = check_resume(previous, cfg) if previous is not None else {}
    if cfg.logging.wandb:
        require_wandb()
    if jax.process_count() > 1:  # every process has checked before any process writes
        multihost_utils.sync_global_devices("ict_jax: run_dir checked")
    mesh = run_mesh_checked(cfg)
    tell(f"loading the training data ({', '.join(cfg.data.train)})")
    datasets = [load_dataset(name, data_dir=cfg.data.data_dir, seed=cfg.seed) for name in cfg.data.train]
    custom = [ds.name for ds in datasets if ds.scorer == CUSTOM_KIND]
    if custom and cfg.rl.reward.fn is None:
        raise ConfigError(f"data.train: {custom[0]!r} is scored by reward=custom but rl.reward.fn is not set")
    # a LoRA run resumed after its warm start trains adapters on the warm start: load it as the base
    weights = run_dir / SFT_MODEL if resume and cfg.model.lora.enabled and cfg.train.sft_steps > 0 \
        and (run_dir / SFT_MODEL).is_dir() else None
    if weights is not None:
        model = None  # a given model is not the warm start: build from the weights
    source = None
    if model is None:  # the architecture first: the programs compile and are checked before the weights load
        tell(f"resolving the model {cfg.model.path or 'preset:' + cfg.model.preset}")
        source = resolve_model(cfg)
        mc, tokenizer, tok_spec = source.config, source.tokenizer(), source.tokenizer_spec
    else:
        model, tok_spec = attach_lora(model, cfg.model.lora, cfg.seed), "given"
        mc = model.config
    prompts = encode_training_data(cfg, tokenizer, datasets, max_positions=mc.max_position_embeddings)
    iterator = PromptIterator(prompts.encoded, cfg.train.prompts_per_step, seed=cfg.seed)
    optimizers = Optimizers.of(cfg)  # the run's optimizers: built here once, passed to each state and step
    state = start_state(cfg, model, ahead, optimizers) if model is not None \
        else abstract_train_state(cfg, mc, mesh=mesh, tx=optimizers.rl)
    programs = build_programs(cfg, mesh, mc, state, TokenIds.of(tokenizer), optimizers=optimizers)
    # the memory pre-flight: in seconds, before the reward workers start and the weights load (both counted)
    tell("compiling the run's programs (the memory pre-flight)" if preflight else "building the run's programs")
    fit = None
    if preflight:  # rollout.gather_weights auto decided here: cfg then says true or false
        cfg, programs, fit = compile_and_check_gathering(cfg, programs, TokenIds.of(tokenizer), sft=ahead, rl=rl)
    else:  # auto without the pre-flight is on (programs.gathers): the record says what the run does
        cfg = cfg.replace(**{"rollout.gather_weights": gathers(cfg)})
    if previous is not None:  # what the resume changes, against the decided config (auto is not a change)
        changes = check_resume(previous, cfg)
    tell("starting the reward workers")
    pool = make_reward_pool(cfg)  # a custom reward function that cannot load fails here, before any write
    try:
        if model is None:
            tell(f"loading the weights of {source.spec if weights is None else weights}")
            model, state, programs = _load_weights(cfg, mesh, source if weights is None else
                                                   resolve_model(cfg, weights=weights), tokenizer, programs, ahead)
        lora_base = None if model.config.lora is None else LoraBase(
            loaded_identity(cfg, model, weights=weights, given=tok_spec == "given"), run_dir, cfg.train.sft_steps > 0)
        if resume and lora_base is not None:  # before anything is written
            check_resumed_base(lora_base, run_dir)
        tell("starting the run (checkpoints, the KL reference, the logs)")
        parts, state, ref = _start_run(cfg, run_dir, resume, changes, progress, mesh, model, tokenizer, tok_spec,
                                       prompts, iterator, programs, pool, state, lora_base, ahead)
        return dataclasses.replace(parts, memory=fit, sft_ahead=ahead), state, ref
    except BaseException:
        pool.close()
        raise


def start_state(cfg: Config, model: Qwen2, sft: bool, optimizers: Optimizers) -> TrainState:
    """The state a run starts with from ``model``: with SFT ahead (``sft``) the SFT state (the parameters
    and the SFT optimizer's fresh state, ``optimizers.sft``), else the RL train state (``optimizers.rl``)."""
    return init_train_state(cfg, model, tx=optimizers.sft if sft else optimizers.rl)


def _load_weights(cfg: Config, mesh: Mesh, source: ModelSource, tokenizer: Tokenizer, programs: RunPrograms,
                  sft: bool = False) -> tuple[Qwen2, TrainState, RunPrograms]:
    """The model's weights (``source``: the run's model, or a resumed LoRA run's warm start, its base) and the
    start state (:func:`start_state`), for programs built (and maybe compiled) from the abstract state;
    programs built again from the real state if its structure, shapes or shardings differ (never expected: a
    warning says so)."""
    model = source.load(mesh=mesh)
    state = start_state(cfg, model, sft, programs.optimizers)
    if not same_layout(abstract_tree(state), (programs.sft if sft else programs.step).abstract()[0]):
        log.warning("the loaded model's train state differs from the one compiled before loading; compiling again")
        programs = build_programs(cfg, mesh, model.config, state, TokenIds.of(tokenizer),
                                  optimizers=programs.optimizers)
    return model, state, programs


def _start_run(cfg: Config, run_dir: Path, resume: bool, changes: dict, progress: bool, mesh: Mesh, model: Qwen2,
               tokenizer: Tokenizer, tok_spec: str, prompts: TrainingPrompts, iterator: PromptIterator,
               programs: RunPrograms, pool: RewardPool, state: TrainState, lora_base: LoraBase | None,
               sft: bool = False) -> tuple[RunParts, TrainState, nnx.State | None]:
    """The writing half of :func:`build_parts`: the run directory, checkpoints and resume, the record,
    the logger. With SFT ahead (``sft``) the state is the SFT state and there is no reference yet."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep)
    rl_step = checkpointer.latest_step() if resume else None
    if rl_step is not None:
        state, meta = checkpointer.restore(state)
        iterator.load_state_dict(meta["data"])
        log.info("resumed from step %d", int(jax.device_get(state.step)))
    point = resume_point(cfg, run_dir, rl_step) if resume else None
    ref = None
    if has_reference(cfg, state) and not sft:
        ref = reference_params(reference_model(cfg, run_dir, model, rl_step is not None, mesh),
                               reference_dtype(model.config))
    if jax.process_index() == 0:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if point is not None and point.phase != "start":
            record_resume(run_dir, changes, phase=point.phase, step=point.step)
    if point is not None:
        drop_rows_logged_again(run_dir, point)
    tracker = WandbTracker(cfg, run_dir, resume=resume) if cfg.logging.wandb and jax.process_index() == 0 else None
    logger = RunLogger(run_dir, total_steps=cfg.train.steps, progress=progress, desc="rl",
                       print_every=cfg.logging.print_every, tracker=tracker,
                       purge=point.keep_below if point is not None else None)
    parts = RunParts(config=cfg, run_dir=run_dir, mesh=mesh, model_config=model.config, tokenizer=tokenizer,
                     tokenizer_spec=tok_spec, prompts=prompts, iterator=iterator, programs=programs, pool=pool,
                     checkpointer=checkpointer, logger=logger, tracker=tracker, resume_point=point,
                     resumed=rl_step is not None, lora_base=lora_base)
    return parts, state, ref
