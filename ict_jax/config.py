"""The one typed configuration tree, its schema (docs/config.md): the sections' frozen dataclasses, every
default, the allowed range of every number and the checks across fields. Every validation error is a
:class:`ConfigError` whose message is one line naming the dotted key and what is allowed.

Built from plain data by ``ict_jax.config_coerce`` (:func:`from_dict`, :meth:`Config.replace`); loaded
from YAML files and ``key.sub=value`` overrides by ``ict_jax.config_load.load_config``
(``ict_jax.config_overrides.parse_override``). What a registered method (a selector, a loss aggregation)
defaults to lives with its registration, and the method names are checked when a run is built.

Field defaults cite their source: docs/method.md , the ICT paper, or verl's GRPO
defaults where the paper is silent.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ict_jax.config_coerce import build

#: Candidate sets of a top-k selector (docs/method.md §2): a response, a prompt's group, the mini-batch, or
#: (20-Entropy's official code; the selectors registered with ``micro_batch=True``, checked when the run is
#: built) each micro-batch of ``train.micro_batches``.
Scope = Literal["sequence", "group", "batch", "micro_batch"]
#: Which tokens a top-k cut that falls inside an exact tie keeps (docs/method.md §2, ``rl.selector.ties``):
#: exactly k, ties to the lower flat index (``position``), or every token tied at the k-th score (``all``).
Ties = Literal["position", "all"]
#: Where the loss's denominators are counted (``rl.loss.normalize_scope``): over the mini-batch (the default:
#: independent of memory settings) or over each micro-batch, the micro-batch losses then averaged (verl's
#: gradient accumulation, as 20-Entropy's official code runs it).
NormalizeScope = Literal["mini_batch", "micro_batch"]
#: Readings of ICT's score u (docs/method.md §1, ``stats.u_form``): what p[i,t] is compared with.
UForm = Literal["aligned", "loo", "literal", "pooled"]
#: STAPO's two readings of its entropy quantile's candidate set (docs/method.md §2, ``stapo_quantile_over``).
StapoQuantileOver = Literal["valid", "low_prob_positive"]

#: STAPO's default entropy quantile tau_h per reading of its candidate set (docs/method.md §2): 0.75 over
#: the low-probability tokens of correct responses (the v1 TeX source), 0.8 over all valid tokens (v2).
STAPO_TAU_H: dict[str, float] = {"low_prob_positive": 0.75, "valid": 0.8}


class ConfigError(ValueError):
    """A bad configuration key or value. ``str(err)`` is a single line naming the key."""


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------
# --- model.lora: low-rank adapters (docs/lora.md) ------------------------------------------------
#: The projections LoRA can adapt, by their PEFT / Hugging Face module names (Qwen2's attention and MLP).
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters: ``y = x W + (alpha / rank) (x A) B`` on the targeted projections (docs/lora.md)."""

    enabled: bool = False  # off: the whole model trains (and the KL reference is a copy of it)
    rank: int = 16  # r (our choice; PEFT's default is 8)
    alpha: float = 32.0  # the scale is alpha / rank (PEFT; rsLoRA's alpha / sqrt(rank) is not offered)
    dropout: float = 0.0  # only 0: the RL ratio and statistics need a deterministic policy forward
    # which projections, by PEFT name; `target_regex` (PEFT's target_modules as a string) replaces it
    targets: tuple[LoraTarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # a regular expression full-matched against PEFT module names (model.layers.N.self_attn.q_proj); it
    # must select a projection in every layer or in none (adapters are stacked over the layers)
    target_regex: str | None = None
    base_dtype: Literal["float32", "bfloat16"] | None = None  # the frozen base's dtype; null = param_dtype


def _validate_lora(lora: LoraSection) -> None:
    """One-line errors for ``model.lora`` (ranges are checked with the other numeric fields). With LoRA off
    (``enabled: false``) every other key must keep its default: a setting that would do nothing is an
    error naming it, not a run that silently trains every parameter."""
    if lora.dropout != 0:
        raise ConfigError(f"model.lora.dropout: {lora.dropout} is not supported; only 0 (the ratio r = pi / pi_old "
                          "and the token statistics need a deterministic policy forward, and the sampler has none)")
    if not lora.targets and lora.target_regex is None:
        raise ConfigError("model.lora.targets: empty; name at least one of "
                          + ", ".join(get_args(LoraTarget)) + " (or set model.lora.target_regex)")
    if len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(f"model.lora.targets: {list(lora.targets)} names a projection twice")
    if lora.target_regex is not None:
        try:
            re.compile(lora.target_regex)
        except re.error as e:
            raise ConfigError(f"model.lora.target_regex: {lora.target_regex!r} is not a regular expression ({e})") \
                from None
    if not lora.enabled:  # a LoRA setting with LoRA off would do nothing: the whole model would train
        default = LoraSection()
        for f in dataclasses.fields(lora):
            value = getattr(lora, f.name)
            if f.name != "enabled" and value != getattr(default, f.name):
                shown = list(value) if isinstance(value, tuple) else value
                raise ConfigError(f"model.lora.{f.name}: {shown!r} is set but model.lora.enabled is false, so it would "
                                  "do nothing (every parameter would train): set model.lora.enabled=true for "
                                  f"adapters, or leave model.lora.{f.name} out")


@dataclass(frozen=True)
class ModelSection:
    path: str | None = None  # HF directory or .gguf file; None = random init from `preset`
    preset: Literal["tiny", "demo", "qwen2p5_0p5b", "qwen2p5_1p5b", "qwen2p5_7b"] = "tiny"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # "auto": bfloat16 on accelerators, float32 on CPU (docs/architecture.md precision policy)
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    remat: Literal["none", "block", "full"] = "block"
    scan_layers: bool = True
    # the full-sequence forwards' attention (training, scoring, prefill): "dense" (the [B, H, T, T] float32
    # scores of a layer at once), "blocked" (keys in blocks of attention_block, online softmax, recomputed in
    # the backward pass; ict_jax.model.attention), a fused kernel: "xla" / "cudnn" (jax.nn.dot_product_attention)
    # or "splash" (Pallas, TPU; ict_jax.model.fused_attention); "auto": cudnn on a GPU (bfloat16 / float16
    # compute), splash on a TPU, dense elsewhere (docs/architecture.md "Attention")
    attention: Literal["auto", "dense", "blocked", "xla", "cudnn", "splash"] = "auto"
    attention_block: int = 128
    # "char" = the built-in CharTokenizer; a path = an HF tokenizer dir or .gguf; None = from model.path
    tokenizer: str | None = None
    lora: LoraSection = field(default_factory=LoraSection)  # low-rank adapters (docs/lora.md); off by default


#: TPU generations whose topology names ``mesh.target`` accepts, with the number of dimensions of
#: their names in libtpu's notation (``v5e:2x4``, ``v5p:2x2x1``; docs/tpu.md).
TPU_GENERATIONS: dict[str, int] = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """``"v5e:2x4"`` -> ``("v5e", (2, 4))``: a TPU slice named as libtpu names it (generation, then
    the chip grid). Raises :class:`ConfigError` naming the generations and the form."""
    gen, sep, dims = str(name).partition(":")
    n = TPU_GENERATIONS.get(gen)
    parts = dims.split("x") if sep else []
    if n is None or len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts):
        forms = ", ".join(f"{g}:{'x'.join(['A'] * k)}" for g, k in TPU_GENERATIONS.items())
        raise ConfigError(f"{name!r} is not a TPU topology name; expected one of the forms {forms} "
                          "(e.g. v5e:2x4, v5p:2x2x1)")
    return gen, tuple(int(p) for p in parts)


@dataclass(frozen=True)
class MeshSection:
    data: int = -1  # -1 = the rest of the devices
    fsdp: int = 1
    tensor: int = 1
    # the TPU slice the recipe is sized for (a topology name, e.g. "v5e:2x4"); `ict-jax compile` checks
    # it by default; None = no target (compile for the local devices)
    target: str | None = None


@dataclass(frozen=True)
class RolloutSection:
    num_samples: int = 8  # G, rollouts per prompt
    max_prompt_len: int = 512
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # generate's row chunking: the step's P prompts are sampled in this many sequential calls of P/chunks
    # prompts x G rows (a smaller KV cache and decode working set; docs/tpu.md); 1 = one call
    chunks: int = 1
    # response-length buckets (ict_jax.buckets.response_buckets): the update runs at the longest response
    # of the batch rounded up to a power of two from this one up to max_new_tokens, and the decode attends
    # over the filled bucket of its KV cache; null = off (every update and decode step at max_new_tokens)
    min_response_bucket: int | None = 16
    # FSDP meshes: the samplers gather the weights (in the compute dtype) once a call, before the decode
    # loop, instead of all-gathering every layer's shards at every decoded token; costs a whole copy of
    # the weights (over tensor) a device while the sampler runs (docs/sampler.md, docs/tpu.md). auto: on,
    # unless the run's memory pre-flight finds a gathering sampler does not fit (then off, with a warning)
    gather_weights: bool | Literal["auto"] = "auto"


@dataclass(frozen=True)
class SelectorSection:
    # a selector registered in ict_jax.rl.selectors (or by a plugin module), checked when the run is built
    # (ict_jax.rl.selectors.check_selector); its defaults live with its registration
    method: str = "ict"
    rho: float | None = None  # None = the method's registered default (docs/method.md §2)
    scope: Scope | None = None  # None = the method's registered default (docs/method.md §2)
    # a top-k cut inside an exact tie: keep exactly k by position, or every tied token (docs/method.md §2)
    ties: Ties = "position"
    warmup_steps: int = 20  # Theta (docs/method.md §2)
    tau_p: float = 0.002  # STAPO probability threshold (the one place the default is written)
    # STAPO entropy quantile; None = the reading's default, STAPO_TAU_H (docs/method.md §2)
    tau_h: float | None = None
    # which tokens STAPO's tau_h quantile of H1 is taken over (docs/method.md §2): the v1 reading
    stapo_quantile_over: StapoQuantileOver = "low_prob_positive"
    # the settings of a selector that registered a params dataclass (ict_jax.rl.selectors.selector_params);
    # the built-ins take none (their settings are the keys above)
    params: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:  # a static argument of the compiled step: params (a mapping) hashed by its content
        return hash(tuple(repr(sorted(v.items())) if isinstance(v, dict) else v
                          for v in (getattr(self, f.name) for f in dataclasses.fields(self))))

    @property
    def resolved_tau_h(self) -> float:
        """``tau_h``, or the default of the ``stapo_quantile_over`` reading (:data:`STAPO_TAU_H`): STAPO's own
        keys (``tau_p``, ``tau_h``, ``stapo_quantile_over``) keep their defaults here, in the schema."""
        return self.tau_h if self.tau_h is not None else STAPO_TAU_H[self.stapo_quantile_over]


@dataclass(frozen=True)
class LossSection:
    eps_low: float = 0.2
    eps_high: float = 0.2  # 0.28 = DAPO clip-higher
    dual_clip_c: float | None = 3.0  # verl's default; None turns dual clip off
    kl_coef: float = 0.001  # verl's GRPO default
    kl_masked: bool = True  # ICT Eq. 11
    # a loss aggregation registered in ict_jax.rl.losses (or by a plugin), checked when the run is built
    loss_agg: str = "seq-mean-token-mean"  # ICT Eq. 11
    normalize_over: Literal["selected", "valid"] = "selected"
    # the loss's denominators over the mini-batch, or over each micro-batch with the micro-batch losses
    # averaged (20-Entropy's official code: verl's gradient accumulation); docs/loss.md
    normalize_scope: NormalizeScope = "mini_batch"
    old_logp: Literal["recompute", "sampler"] = "recompute"
    mask_truncated: bool = False


@dataclass(frozen=True)
class AdvSection:
    scale_rewards: Literal["group", "batch", "none"] = "group"
    drop_zero_std_groups: bool = False  # DAPO dynamic sampling
    # what a group must vary in to be kept by dynamic sampling: "correct" (DAPO's definition, 0 < #correct
    # < G) or "reward" (the total reward; keeps all-wrong groups that differ only by a format penalty)
    filter_on: Literal["reward", "correct"] = "correct"
    max_refill: int = 4  # extra prompt batches drawn to replace dropped groups (then they stay dropped)
    eps: float = 1e-6


@dataclass(frozen=True)
class RewardSection:
    correct: float = 1.0  # docs/method.md §3: 1 correct, 0 otherwise
    wrong: float = 0.0
    no_answer: float = 0.0  # < 0 = a format penalty for responses with no extractable answer
    time_limit: float = 5.0  # seconds per response check (the worker is killed past it)
    workers: int = 2  # reward worker processes
    max_response_chars: int = 16384  # only the tail of a response is read for its final answer
    # "package.module:function" scoring every training response inside the reward workers (never in the
    # trainer process); None = each dataset's own reward kind (docs/rewards.md "Custom reward functions")
    fn: str | None = None


@dataclass(frozen=True)
class RLSection:
    selector: SelectorSection = field(default_factory=SelectorSection)
    loss: LossSection = field(default_factory=LossSection)
    adv: AdvSection = field(default_factory=AdvSection)
    reward: RewardSection = field(default_factory=RewardSection)


@dataclass(frozen=True)
class StatsSection:
    temperature: float | None = None  # T_s; None = the rollout temperature (docs/method.md notation)
    chunk: int = 64  # largest block of positions in stats_from_hidden (docs/benchmarks.md)
    # the reading of ICT's score u (docs/method.md §1): aligned (Pbar over the rollouts active at t, itself
    # included), loo (itself excluded), literal (sum over the active rollouts / G), pooled (the group's
    # mean over all its valid positions); docs/results.md has the evidence for the default
    u_form: UForm = "aligned"
    # the JS score for the stats/js_* metrics also when the selector does not use it (ict always
    # computes it): two more vocabulary-wide passes per step
    js_metrics: bool = True


@dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-6  # verl GRPO default
    lr_warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.01  # verl
    grad_clip: float = 1.0  # verl
    b1: float = 0.9
    b2: float = 0.999


@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    prompts_per_step: int = 8  # P
    mini_batches: int = 1  # optimizer updates per rollout batch
    micro_batches: int = 1  # gradient-accumulation chunks per mini-batch
    eval_every: int = 0  # 0 = never
    save_every: int = 50
    keep: int = 3
    sft_steps: int = 0  # SFT warm-start steps before RL (0 = none)
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    sft_save_every: int = 200  # SFT checkpoint every N SFT steps (<run_dir>/checkpoints_sft); 0 = none
    # the memory pre-flight (docs/memory.md): a run whose compiled programs would not fit the machine's
    # memory stops before anything is sampled or written (error, exit 3), only says so (warn), or is not checked
    memory_check: Literal["error", "warn", "off"] = "error"


@dataclass(frozen=True)
class DataSection:
    train: tuple[str, ...] = ("gsm8k",)
    eval: tuple[str, ...] = ()
    data_dir: str | None = None
    template: Literal["qwen_chat", "plain", "none"] = "qwen_chat"
    eval_n: int = 4  # samples per problem for pass@k (docs/method.md §6)
    eval_k: tuple[int, ...] = (1, 4)
    eval_temperature: float = 0.6
    eval_top_p: float = 0.95
    eval_limit: int | None = None  # problems per benchmark (None = all)
    # prompts per call of a run's evaluation sampler (None = train.prompts_per_step): a resource of the
    # machine, not a setting of the evaluation, but the samples' random numbers follow the calls
    eval_batch: int | None = None


#: The settings of an evaluation (``ict-jax eval``, the trainer's periodic evaluation) and the config key
#: each is read from: the one place their defaults live (the config tree's fields). ``ict-jax eval`` of a
#: run directory takes them from the run's recorded config, its flags override them, and its help texts
#: and ``EVAL_DEFAULTS`` / ``make_text_generator`` read the defaults through :func:`eval_settings`.
EVAL_KEYS: dict[str, str] = {
    "benchmarks": "data.eval", "data_dir": "data.data_dir", "template": "data.template",
    "n": "data.eval_n", "k": "data.eval_k", "temperature": "data.eval_temperature", "top_p": "data.eval_top_p",
    "limit": "data.eval_limit", "max_new_tokens": "rollout.max_new_tokens",
    "max_prompt_len": "rollout.max_prompt_len", "batch_size": "train.prompts_per_step", "seed": "seed",
    "workers": "rl.reward.workers", "time_limit": "rl.reward.time_limit",
}


@dataclass(frozen=True)
class LoggingSection:
    # a compact line every N steps when no progress bar is shown (not a terminal, --no-progress);
    # None = about ten lines per phase
    print_every: int | None = None
    wandb: bool = False  # also log to Weights & Biases (the optional `wandb` extra), same metric names
    wandb_project: str = "ict_jax"
    wandb_name: str | None = None  # None = the run directory's name


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    rl: RLSection = field(default_factory=RLSection)
    stats: StatsSection = field(default_factory=StatsSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    # Python modules imported when a run is built, before its methods are checked: a plugin registers more
    # selectors, loss aggregations or reward kinds (docs/plugins.md); searched in the working directory first
    plugins: tuple[str, ...] = ()
    seed: int = 0
    run_dir: str = "runs/default"

    @property
    def stats_temperature(self) -> float:
        return self.stats.temperature if self.stats.temperature is not None else self.rollout.temperature

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def replace(self, **dotted: Any) -> "Config":
        """Return a copy with dotted-key overrides, validated: ``cfg.replace(**{"rl.loss.kl_coef": 0})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            set_dotted(data, key, value)
        return from_dict(data)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """The allowed values of a numeric field: ``lo``/``hi`` bounds (None = unbounded), each closed
    (``<=``) or open (``<``)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def text(self, name: str) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        left = "" if self.lo is None else f"{num(self.lo)} {'<' if self.lo_open else '<='} "
        right = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {num(self.hi)}"
        return f"{left}{name}{right}" if (left or right) else f"any finite {name}"


_POS, _NONNEG, _ANY = Range(0, lo_open=True), Range(0), Range()
_UNIT_OPEN_CLOSED = Range(0, 1, lo_open=True)  # (0, 1]: a fraction that may not be 0
_BETA = Range(0, 1, hi_open=True)
#: The allowed range of every numeric field, by dotted key (a test checks that every int and float field
#: of the tree is listed). Every float must also be finite. ``None`` (where a field allows it) is not checked.
RANGES: dict[str, Range] = {
    "mesh.data": Range(-1), "mesh.fsdp": Range(-1), "mesh.tensor": Range(-1),  # -1 = the rest; 0 below
    "rollout.chunks": Range(1), "rollout.min_response_bucket": Range(1),
    "rollout.num_samples": Range(1), "rollout.max_prompt_len": Range(1), "rollout.max_new_tokens": Range(1),
    "rollout.temperature": _POS, "rollout.top_p": _UNIT_OPEN_CLOSED, "rollout.top_k": _NONNEG,
    "rl.selector.rho": _UNIT_OPEN_CLOSED, "rl.selector.warmup_steps": _NONNEG,
    "rl.selector.tau_p": Range(0, 1, lo_open=True, hi_open=True), "rl.selector.tau_h": Range(0, 1),
    "rl.loss.eps_low": _BETA, "rl.loss.eps_high": _NONNEG, "rl.loss.dual_clip_c": Range(1, lo_open=True),
    "rl.loss.kl_coef": _NONNEG,
    "rl.adv.max_refill": _NONNEG, "rl.adv.eps": _POS,
    "rl.reward.correct": _ANY, "rl.reward.wrong": _ANY, "rl.reward.no_answer": _ANY,
    "rl.reward.time_limit": _POS, "rl.reward.workers": Range(1), "rl.reward.max_response_chars": Range(1),
    "stats.temperature": _POS, "stats.chunk": Range(1),
    "optim.lr": _NONNEG, "optim.lr_warmup_steps": _NONNEG, "optim.weight_decay": _NONNEG,
    "optim.grad_clip": _POS, "optim.b1": _BETA, "optim.b2": _BETA,
    "train.steps": _NONNEG, "train.prompts_per_step": Range(1), "train.mini_batches": Range(1),
    "train.micro_batches": Range(1), "train.eval_every": _NONNEG, "train.save_every": _NONNEG,
    "model.attention_block": Range(1),
    "train.keep": Range(1), "train.sft_steps": _NONNEG, "train.sft_lr": _POS, "train.sft_batch_size": Range(1),
    "train.sft_save_every": _NONNEG,
    "data.eval_n": Range(1), "data.eval_k": Range(1), "data.eval_temperature": _POS,
    "data.eval_top_p": _UNIT_OPEN_CLOSED, "data.eval_limit": Range(1), "data.eval_batch": Range(1),
    "logging.print_every": Range(1),
    "seed": Range(0, 2**32, hi_open=True),  # jax.random.key(seed) wraps at 2**32: two seeds would be one run
}
RANGES.update({"model.lora.rank": Range(1), "model.lora.alpha": _POS,  # model.lora (docs/lora.md)
               "model.lora.dropout": Range(0, 1, hi_open=True)})


def _range_text(key: str) -> str:
    """The allowed values of the numeric field ``key`` in words (``0 < temperature``; :data:`RANGES`)."""
    r = RANGES.get(key)
    return r.text(key.rsplit(".", 1)[-1]) if r is not None else "a finite number"


def _leaves(obj: Any, prefix: str = "") -> typing.Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, key)
        else:
            yield key, value


def check_ranges(cfg: Config) -> None:
    """Every numeric field (:data:`RANGES`) within its range; the message names the key and the range."""
    for key, value in _leaves(cfg):
        r = RANGES.get(key)
        if r is None or value is None:
            continue
        for v in (value if isinstance(value, tuple) else (value,)):
            if not r.contains(v):
                raise ConfigError(f"{key}: {v!r} is out of range; allowed: {_range_text(key)}")


def _check_fraction(key: str, rho: float) -> None:
    if not (0.0 < rho <= 1.0):
        raise ConfigError(f"{key}: {rho} is out of range; allowed: 0 < rho <= 1")
    if round(rho, 4) != rho:
        raise ConfigError(f"{key}: {rho} has more than 4 decimals (docs/method.md §2 stores rho as a fraction)")


_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_FN_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


def validate(cfg: Config) -> Config:
    """Ranges of every numeric field, then cross-field checks; returns ``cfg``. Raises :class:`ConfigError`."""
    check_ranges(cfg)
    _validate_lora(cfg.model.lora)
    for name in ("data", "fsdp", "tensor"):
        v = getattr(cfg.mesh, name)
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{name}: {v} is not allowed; use a positive size or -1 (the rest)")
    if sum(getattr(cfg.mesh, n) == -1 for n in ("data", "fsdp", "tensor")) > 1:
        raise ConfigError("mesh: at most one of data, fsdp, tensor may be -1")
    if cfg.mesh.target is not None:
        try:
            parse_topology(cfg.mesh.target)
        except ConfigError as e:
            raise ConfigError(f"mesh.target: {e}") from None
    s = cfg.rl.selector
    if s.rho is not None:
        _check_fraction("rl.selector.rho", s.rho)
    rw = cfg.rl.reward
    if not rw.correct > rw.wrong:
        raise ConfigError(f"rl.reward.correct: {rw.correct} must be greater than rl.reward.wrong={rw.wrong}")
    if rw.fn is not None and not _FN_RE.fullmatch(rw.fn):
        raise ConfigError(f"rl.reward.fn: {rw.fn!r} is not of the form package.module:function")
    for module in cfg.plugins:
        if not _MODULE_RE.fullmatch(module):
            raise ConfigError(f"plugins: {module!r} is not a module name (package.module)")
    t = cfg.train
    if t.prompts_per_step % cfg.rollout.chunks:
        raise ConfigError(f"rollout.chunks: {cfg.rollout.chunks} does not divide train.prompts_per_step="
                          f"{t.prompts_per_step} (each generate call samples P / chunks whole prompts)")
    if t.prompts_per_step % t.mini_batches:
        raise ConfigError(
            f"train.mini_batches: {t.mini_batches} does not divide train.prompts_per_step={t.prompts_per_step} "
            "(groups never split across mini-batches)")
    rows = t.prompts_per_step // t.mini_batches * cfg.rollout.num_samples
    if rows % t.micro_batches:
        raise ConfigError(
            f"train.micro_batches: {t.micro_batches} does not divide the {rows} rows "
            f"({t.prompts_per_step // t.mini_batches} prompts x {cfg.rollout.num_samples} samples) of a mini-batch")
    for k in cfg.data.eval_k:
        if k < 1 or k > cfg.data.eval_n:
            raise ConfigError(f"data.eval_k: {k} must be between 1 and data.eval_n={cfg.data.eval_n}")
    return cfg


def get_dotted(tree: Any, key: str, default: Any = None) -> Any:
    """``tree``'s value at a dotted ``key`` (a :class:`Config` or the plain dict of one, e.g. a run's
    ``config.json``); ``default`` where the key is missing."""
    node = tree
    for part in key.split("."):
        if isinstance(node, dict):
            if part not in node:
                return default
            node = node[part]
        elif dataclasses.is_dataclass(node) and hasattr(node, part):
            node = getattr(node, part)
        else:
            return default
    return node


def eval_settings(tree: Any = None) -> dict[str, Any]:
    """{setting: value} of :data:`EVAL_KEYS` from ``tree`` (a :class:`Config` or the plain dict a run
    recorded; keys it lacks take the defaults; None = the defaults). Lists come back as tuples."""
    defaults = Config()
    out = {}
    for name, key in EVAL_KEYS.items():
        value = get_dotted(defaults, key) if tree is None else get_dotted(tree, key, get_dotted(defaults, key))
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


# --------------------------------------------------------------------------------------------------
# The plain form (nested dicts and lists: YAML, config.json) both ways
# --------------------------------------------------------------------------------------------------
def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def build_section(cls: type, data: Any, prefix: str) -> Any:
    """The frozen dataclass ``cls`` from the plain mapping ``data``, every value checked as the config tree's
    are (``ict_jax.config_coerce.build``); :class:`ConfigError` (one line) naming ``prefix.<key>`` for an
    unknown key or a wrong type. A registry member's own settings are built with it (``rl.selector.params``)."""
    return build(cls, data, prefix, error=ConfigError, allowed=_range_text)


def from_dict(data: dict[str, Any]) -> Config:
    """The validated :class:`Config` of a plain tree (the inverse of :meth:`Config.to_dict`; a run's
    ``config.json``): each value coerced to its field's type, then :func:`validate`."""
    return validate(build(Config, data, "", error=ConfigError, allowed=_range_text))


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` of the plain tree ``data`` to ``value``, making the sections on the way;
    :class:`ConfigError` where a part of the key is a value, not a section."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])} is a value, not a section; cannot set {key!r}")
        node = child
    node[parts[-1]] = value
