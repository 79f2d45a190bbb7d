"""The one builder of a run's compiled programs (docs/architecture.md): :func:`build_programs`.

A run executes four programs (three without an SFT warm start):

- ``sft``: the SFT step of the warm start (:func:`ict_jax.rl.sft.make_sft_step`), ``(SFT state, tokens,
  attention_mask, loss_mask) -> (SFT state, metrics)``, ``train.sft_batch_size`` rows of
  ``rollout.max_prompt_len + rollout.max_new_tokens`` tokens (``train.warm_start.sft_batch``); its state
  holds the SFT optimizer's state (``train.sft_lr``), the only optimizer state alive during SFT: RL's is
  built when SFT ends;
- ``step``: the train step (:func:`ict_jax.rl.train_step.make_train_step`), ``(state, batch, ref_params)
  -> (state, metrics)``, P x G rows; one executable per response bucket (docs/loss.md): the
  batch comes in at ``rollout.max_new_tokens`` response positions and the executable of its bucket
  (:func:`ict_jax.rl.train_step.bucket_of`) cuts them inside the program;
- ``generate``: the rollout sampler (:func:`ict_jax.sampling.sampler.make_generate_fn`), G samples a
  prompt, P / ``rollout.chunks`` prompts a call: :meth:`RunPrograms.rollout` makes the step's P prompts
  in ``rollout.chunks`` sequential calls (chunk c with ``fold_in(key, c)``), rows prompt-major;
- ``eval``: the evaluation sampler, ``data.eval_n`` samples a prompt at the evaluation temperature and
  top-p, ``train.prompts_per_step`` prompts a call (the trainer's evaluation; ``ict_jax.train.evaluation``).

A run's two optimizers (:class:`Optimizers`: RL's and the warm start's) are built once, from the config,
by the run's builder and passed to everything that needs one: the steps, their states, the restore
templates.

Both samplers hold their KV cache in ``rollout.kv_cache_dtype`` (:func:`kv_cache_dtype`), the KL reference
is in the model's compute dtype (:func:`reference_dtype`): written here once for every caller.

Training builds them from its real state (its SFT state when SFT is ahead: the programs read the structure,
shapes and shardings of its parameters, and each takes the state of its own optimizer), ``ict-jax
compile`` (:mod:`ict_jax.aot.compile`) from an abstract one (``jax.ShapeDtypeStruct`` leaves carrying the
run's shardings): the same function, so what compile checks is what training runs
(tests/train/test_programs.py compares the lowered modules).

Each :class:`Program` carries its abstract arguments for every shape it may be called at (a shape key:
the rows and the lengths) and compiles each shape once, ahead of time, from them
(``jit.lower(*abstract).compile()``); calling the program runs that very executable. So the trainer can
compile every program at its largest shapes before anything is sampled, read ``memory_analysis()`` of
exactly what it will execute (the pre-flight, ``ict_jax.train.preflight``), and shapes met later (a
shorter prompt bucket; response-length buckets) are compiled on first use. The largest shape is the
largest of every bucket: the step's key ``(rows, prompt bucket, response width, response bucket)`` is
largest at the uncut width (``max_new_tokens``, the program a bucket of ``max_new_tokens`` runs), the
samplers have one shape, their decode phases (the response buckets of the KV cache) inside the program,
and so has the SFT step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ict_jax.buckets import make_buckets
from ict_jax.config import Config
from ict_jax.model.config import ModelConfig
from ict_jax.model.tokenizers import Tokenizer
from ict_jax.rl.batch import RolloutBatch
from ict_jax.rl.sft import make_sft_optimizer, make_sft_step
from ict_jax.rl.state import TrainState, make_optimizer
from ict_jax.rl.train_step import bucket_of, make_train_step
from ict_jax.sampling.sampler import GenerateFn, Rollout, make_generate_fn
from ict_jax.sampling.text_generation import generator_key
from ict_jax.sharding import BATCH_AXES, batch_sharding, place, replicated, shard_batch, to_host
from ict_jax.train.checkpoints import abstract_opt_state, abstract_tree
from ict_jax.train.plugins import check_registered

#: The programs of a run, in the order a run executes (and compiles) them: the SFT step (a run with
#: ``train.sft_steps``), the train step, the rollout sampler, the evaluation sampler.
PROGRAM_NAMES = ("sft", "step", "generate", "eval")

#: A program's shapes: (rows, lengths...) of its batch arguments (the step's last: its response bucket).
ShapeKey = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The token ids a sampler compiles in: where a response ends (``eos_ids``) and the padding."""

    eos_ids: tuple[int, ...]
    pad_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenIds:
        return cls(tuple(int(i) for i in tokenizer.eos_ids), int(tokenizer.pad_id))


#: ids for compiling without a tokenizer (a recipe whose ``model.path`` is not on this machine): they are
#: constants of the program, its memory and collectives do not depend on them
PLACEHOLDER_IDS = TokenIds((1,), 0)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a run, compiled once per shape from abstract arguments.

    ``abstract(shape)`` gives its arguments at ``shape`` as ``jax.ShapeDtypeStruct`` trees with the run's
    shardings; ``lower(shape)`` / ``compile(shape)`` (default: ``largest``, the run's largest shapes, what
    ``ict-jax compile`` and the pre-flight check). Calling the program with real arguments runs the
    executable compiled for their shapes (compiled on first use), the arguments placed as it expects."""

    name: str
    lower_fn: Callable[..., jax.stages.Lowered]  # abstract arguments -> the lowered program
    abstract_for: Callable[[ShapeKey], tuple[Any, ...]]  # shape -> abstract arguments
    shape_of: Callable[[tuple[Any, ...]], ShapeKey]  # call arguments -> their shape
    largest: ShapeKey
    statics: Callable[[ShapeKey], dict[str, Any]] = lambda shape: {}  # shape -> lower_fn's static keywords
    executables: dict[ShapeKey, jax.stages.Compiled] = dataclasses.field(default_factory=dict, compare=False,
                                                                         repr=False)

    def abstract(self, shape: ShapeKey | None = None) -> tuple[Any, ...]:
        return self.abstract_for(self.largest if shape is None else tuple(shape))

    def lower(self, shape: ShapeKey | None = None) -> jax.stages.Lowered:
        shape = self.largest if shape is None else tuple(shape)
        return self.lower_fn(*self.abstract(shape), **self.statics(shape))

    def compile(self, shape: ShapeKey | None = None) -> jax.stages.Compiled:
        """The executable for ``shape`` (default the largest), compiled the first time it is asked for."""
        shape = self.largest if shape is None else tuple(shape)
        if shape not in self.executables:
            self.executables[shape] = self.lower(shape).compile()
        return self.executables[shape]

    def __call__(self, *args: Any) -> Any:
        shape = self.shape_of(args)
        executable = self.compile(shape)
        return executable(*place(args, jax.tree.map(lambda a: a.sharding, self.abstract(shape))))


@dataclasses.dataclass(frozen=True)
class Optimizers:
    """A run's optimizers, built once (:meth:`of`): ``rl``, the train step's (``rl.state.make_optimizer``:
    clipping, AdamW at ``optim.lr``), and ``sft``, the SFT warm start's (``rl.sft.make_sft_optimizer``:
    ``train.sft_lr``). The steps, the states they update and the restore templates take them from here."""

    rl: optax.GradientTransformation
    sft: optax.GradientTransformation

    @classmethod
    def of(cls, config: Config) -> Optimizers:
        return cls(make_optimizer(config), make_sft_optimizer(config))


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """The programs of one run (:func:`build_programs`) and how the loop calls them."""

    step: Program
    generate: Program
    eval: Program
    chunks: int  # rollout.chunks: generate calls a rollout batch takes
    mesh: Mesh
    sft: Program  # the SFT step (train.sft_steps > 0: the warm start's; built for every run, compiled when run)
    optimizers: Optimizers  # the steps' optimizers: a state the step or the SFT step updates holds theirs

    def by_name(self) -> dict[str, Program]:
        return {"sft": self.sft, "step": self.step, "generate": self.generate, "eval": self.eval}

    def compile(self, names: Sequence[str] = PROGRAM_NAMES) -> dict[str, jax.stages.Compiled]:
        """Each named program compiled at its largest shapes (once: a later call of the program runs it)."""
        return {name: self.by_name()[name].compile() for name in names}

    def step_shape(self, response_len: int, prompt_len: int | None = None) -> ShapeKey:
        """The train step's shape key at response bucket ``response_len`` (and ``prompt_len``, default the
        largest prompt bucket) for a batch of ``rollout.max_new_tokens`` response positions."""
        rows, lp, width, _ = self.step.largest
        return rows, lp if prompt_len is None else prompt_len, width, response_len

    def step_for(self, response_len: int, prompt_len: int | None = None) -> jax.stages.Compiled:
        """The train step's executable for response bucket ``response_len`` (:meth:`step_shape`), compiled
        on first use."""
        return self.step.compile(self.step_shape(response_len, prompt_len))

    def rollout(self, params: Any, ids: np.ndarray, mask: np.ndarray, key: jax.Array) -> Rollout:
        """G responses to each of the P prompts ``ids``/``mask`` ``[P, Lp]`` as host arrays, sampled in
        ``rollout.chunks`` sequential calls of P / chunks prompts (chunk c with ``fold_in(key, c)``; one
        call: ``key`` itself), rows concatenated prompt-major as from one call. ``key``: a raw key like the
        train state's root (a typed key is taken as its raw data)."""
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        parts = []
        for c, (i, m) in enumerate(zip(np.split(ids, self.chunks), np.split(mask, self.chunks))):
            i, m = shard_batch((i, m), self.mesh)
            k = key if self.chunks == 1 else jax.random.fold_in(key, c)
            parts.append(to_host(self.generate(params, i, m, k)))
        return parts[0] if self.chunks == 1 else jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)


# ------------------------------------------------------------------------------------------------
# Shapes, dtypes and abstract arguments: written once
# ------------------------------------------------------------------------------------------------
def prompt_len(config: Config) -> int:
    """The largest prompt bucket: prompts are left-padded to a bucket of ``rollout.max_prompt_len``."""
    return max(make_buckets(config.rollout.max_prompt_len))


def kv_cache_dtype(config: Config) -> str | None:
    """The samplers' KV-cache dtype: ``rollout.kv_cache_dtype``, None (``auto``) = the compute dtype."""
    kv = config.rollout.kv_cache_dtype
    return None if kv == "auto" else kv


def reference_dtype(model_config: ModelConfig) -> str:
    """The KL reference parameters' dtype: the model's compute dtype (``rl.state.reference_params``)."""
    return model_config.resolved_compute_dtype()


def abstract_batch(config: Config, mesh: Mesh, prompt_len_: int | None = None, response_len: int | None = None,
                   rows: int | None = None) -> RolloutBatch:
    """The rollout batch of one step (P x G rows over ('data', 'fsdp')), abstract; default lengths: the
    largest prompt bucket and ``rollout.max_new_tokens``."""
    B = config.train.prompts_per_step * config.rollout.num_samples if rows is None else rows
    Lr = config.rollout.max_new_tokens if response_len is None else response_len
    L = (prompt_len(config) if prompt_len_ is None else prompt_len_) + Lr

    def s(shape: tuple[int, ...], dt: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt, sharding=batch_sharding(mesh, len(shape)))

    i32, f32 = jnp.int32, jnp.float32
    return RolloutBatch(tokens=s((B, L), i32), attention_mask=s((B, L), i32), response_valid=s((B, Lr), f32),
                        rewards=s((B,), f32), advantages=s((B,), f32), sampler_logp=s((B, Lr), f32),
                        truncated=s((B,), f32), row_valid=s((B,), f32), correct=s((B,), f32))


def sft_len(config: Config) -> int:
    """Tokens of an SFT row: the prompt left-padded to ``rollout.max_prompt_len`` (not a bucket: the SFT
    batch has one shape), the target right-padded to ``rollout.max_new_tokens``."""
    return config.rollout.max_prompt_len + config.rollout.max_new_tokens


def abstract_sft_batch(config: Config, mesh: Mesh, shape: tuple[int, int] | None = None
                       ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(tokens, attention_mask, loss_mask) of one SFT step, abstract: int32 ``shape`` each (default
    ``[train.sft_batch_size, sft_len]``), rows over ('data', 'fsdp')."""
    shape = (config.train.sft_batch_size, sft_len(config)) if shape is None else tuple(shape)
    return tuple(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh, 2)) for _ in range(3))


def with_optimizer(state: TrainState, tx: Any) -> TrainState:
    """``state`` (abstract) with ``tx``'s optimizer state, abstract and placed as ``init_opt_state`` places
    it, in place of its own: what a program of that optimizer takes."""
    return state.replace(opt_state=abstract_opt_state(tx, state.params))


def abstract_reference(params: Any, dtype: str) -> Any:
    """The KL reference parameters (``rl.state.reference_params``: the policy's in the compute dtype,
    the same shardings), abstract."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype), sharding=a.sharding), params)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` s or arrays (its shard of each
    leaf)."""
    total = 0
    for a in jax.tree.leaves(tree):
        sh = getattr(a, "sharding", None)
        shape = sh.shard_shape(a.shape) if sh is not None else a.shape
        total += int(np.prod(shape, dtype=np.int64)) * _itemsize(a.dtype)
    return total


def _itemsize(dtype: Any) -> int:
    """Bytes of one element; a typed PRNG key's are those of its key data (threefry: 2 x uint32)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return int(np.prod(data.shape, dtype=np.int64)) * jnp.dtype(data.dtype).itemsize
    return jnp.dtype(dtype).itemsize


def same_layout(a: Any, b: Any) -> bool:
    """Two trees of arrays / ShapeDtypeStructs with the same structure (static fields included) and, leaf
    by leaf, the same shape, dtype and sharding: a program compiled for one runs the other."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype
               and getattr(x, "sharding", None) == getattr(y, "sharding", None)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def has_reference(config: Config, state: TrainState) -> bool:
    """Whether the step takes KL reference parameters: ``rl.loss.kl_coef > 0`` and not a LoRA state (whose
    reference is its own base with the adapters off)."""
    return config.rl.loss.kl_coef > 0 and state.frozen is None


# ------------------------------------------------------------------------------------------------
# The builder
# ------------------------------------------------------------------------------------------------
def build_programs(config: Config, mesh: Mesh, model_config: ModelConfig, state: TrainState,
                   tokens: TokenIds = PLACEHOLDER_IDS, *, optimizers: Optimizers | None = None) -> RunPrograms:
    """The programs of a run of ``config`` on ``mesh``. ``state``: the run's train state or SFT state, real
    (training) or abstract (``ict-jax compile``: ``train.checkpoints.abstract_train_state``); only the
    structure, shapes, shardings and graph of its parameters, step and key are read: the train step takes
    the RL optimizer's state, the SFT step the SFT optimizer's, each built abstract here. ``optimizers``: the
    run's (:class:`Optimizers`, the ones its states were made with; default ``Optimizers.of(config)``).
    ``model_config`` gives the compute dtype of the KL reference; ``tokens``: the tokenizer's EOS and pad
    ids. Nothing is compiled here. The config's plugins are imported and its methods checked first
    (:func:`ict_jax.train.plugins.check_registered`)."""
    check_registered(config)
    optimizers = optimizers or Optimizers.of(config)
    abstract_state = with_optimizer(abstract_tree(state), optimizers.rl)
    ref = abstract_reference(abstract_state.params, reference_dtype(model_config)) \
        if has_reference(config, state) else None
    platform = mesh.devices.flat[0].platform
    return RunPrograms(step=_step_program(config, mesh, abstract_state, ref, optimizers.rl),
                       generate=_sampler_program("generate", config, mesh, abstract_state, tokens, platform),
                       eval=_sampler_program("eval", config, mesh, abstract_state, tokens, platform),
                       chunks=config.rollout.chunks, mesh=mesh,
                       sft=_sft_program(config, mesh, abstract_state, optimizers.sft), optimizers=optimizers)


def _sft_program(config: Config, mesh: Mesh, state: TrainState, tx: optax.GradientTransformation) -> Program:
    """The SFT step (:func:`ict_jax.rl.sft.make_sft_step`'s jitted update, its state donated): shape key
    (rows, tokens), one shape, ``(train.sft_batch_size, sft_len)``."""
    sft = make_sft_step(config, mesh, tx=tx)
    sft_state = with_optimizer(state, tx)

    def lower(*args: Any) -> jax.stages.Lowered:
        with jax.set_mesh(mesh):
            return sft.jitted.lower(*args)

    return Program("sft", lower, lambda k: (sft_state, *abstract_sft_batch(config, mesh, k)),
                   lambda args: tuple(args[1].shape), (config.train.sft_batch_size, sft_len(config)))


def _step_program(config: Config, mesh: Mesh, state: TrainState, ref: Any, tx: optax.GradientTransformation
                  ) -> Program:
    """The train step: shape key (rows, prompt bucket, response width, response bucket); a batch's bucket
    is read from its valid tokens on the host (:func:`ict_jax.rl.train_step.bucket_of`, the same on every
    process) and passed to ``step.lower`` as ``response_len``."""
    step = make_train_step(config, mesh, tx=tx)
    rows, N = config.train.prompts_per_step * config.rollout.num_samples, config.rollout.max_new_tokens

    def shape_of(args: tuple[Any, ...]) -> ShapeKey:
        batch = args[1]
        n, lr = batch.tokens.shape[0], batch.response_valid.shape[1]
        return (n, batch.tokens.shape[1] - lr, lr, bucket_of(step.plan, batch))

    return Program("step", step.lower, lambda k: (state, abstract_batch(config, mesh, k[1], k[2], rows=k[0]), ref),
                   shape_of, (rows, prompt_len(config), N, N), statics=lambda k: {"response_len": k[3]})


def sampler_fn(name: str, config: Config, graphdef: Any, mesh: Mesh, tokens: TokenIds, platform: str) -> GenerateFn:
    """The rollout (``generate``) or evaluation (``eval``) sampler's jitted function. On a CPU the decode
    unrolls the layer loop of a shallow model; compiled for an accelerator it keeps the layer scan."""
    ev, r, d = name == "eval", config.rollout, config.data
    return make_generate_fn(graphdef, num_samples=d.eval_n if ev else r.num_samples, max_new_tokens=r.max_new_tokens,
                            temperature=d.eval_temperature if ev else r.temperature,
                            top_p=d.eval_top_p if ev else r.top_p, top_k=0 if ev else r.top_k,
                            eos_ids=tokens.eos_ids, pad_id=tokens.pad_id, kv_cache_dtype=kv_cache_dtype(config),
                            unroll_layers=None if platform == "cpu" else False, mesh=mesh,
                            min_response_bucket=r.min_response_bucket, gather_weights=gathers(config))


def gathers(config: Config) -> bool:
    """Whether the run's samplers gather FSDP weights once a call (``rollout.gather_weights``): ``auto`` is on;
    the run's pre-flight turns it off where a gathering sampler does not fit
    (:func:`ict_jax.train.preflight.compile_and_check`)."""
    return config.rollout.gather_weights is not False


def with_samplers(config: Config, programs: RunPrograms, tokens: TokenIds) -> RunPrograms:
    """``programs`` with its two samplers built again for ``config`` (the train and SFT steps kept, with the
    executables already compiled)."""
    state = programs.step.abstract()[0]
    platform = programs.mesh.devices.flat[0].platform
    return dataclasses.replace(programs, generate=_sampler_program("generate", config, programs.mesh, state, tokens,
                                                                   platform),
                               eval=_sampler_program("eval", config, programs.mesh, state, tokens, platform))


def sampler_prompts(name: str, config: Config) -> int:
    """Prompts a call of the sampler takes: P / ``rollout.chunks`` (generate), ``data.eval_batch`` or P (eval)."""
    P = config.train.prompts_per_step
    if name == "eval":
        return config.data.eval_batch or max(1, P)
    return P // config.rollout.chunks


def _sampler_program(name: str, config: Config, mesh: Mesh, state: TrainState, tokens: TokenIds,
                     platform: str) -> Program:
    fn = sampler_fn(name, config, state.graphdef, mesh, tokens, platform)
    params = state.model_state()
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    key = jax.eval_shape(lambda: generator_key(0) if name == "eval" else jax.random.PRNGKey(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated(mesh))

    def abstract_for(k: ShapeKey) -> tuple[Any, ...]:
        ids = jax.ShapeDtypeStruct(k, jnp.int32, sharding=rows)
        return params, ids, ids, key

    def lower(*args: Any) -> jax.stages.Lowered:
        with jax.set_mesh(mesh):
            return fn.jitted.lower(*args)

    return Program(name, lower, abstract_for, lambda args: tuple(args[1].shape),
                   (sampler_prompts(name, config), prompt_len(config)))
