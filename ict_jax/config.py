"""The one typed configuration tree (docs/architecture.md "Config layout").

Frozen dataclasses; YAML files are small overlays over the defaults; ``key.sub=value`` overrides come
from the command line. Every validation error is a :class:`ConfigError` whose message is one line naming
the dotted key and what is allowed.

Field defaults cite their source: docs/method.md , the ICT paper, or verl's GRPO
defaults where the paper is silent.
"""

from __future__ import annotations

import dataclasses
import fractions
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

Method = Literal["dense", "grpo", "ict", "entropy", "stapo", "random"]
Scope = Literal["sequence", "group", "batch"]
LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]

_ICT_DEFAULTS = (0.10, "sequence")
#: Default (rho, scope) per selector, docs/method.md §2's table: the one place these numbers are written
#: (``SelectorSection.resolved_rho`` / ``resolved_scope``, the inspector, the CLI help read them).
#: ``random`` mirrors ``ict`` (same counts).
SELECTOR_DEFAULTS: dict[str, tuple[float | None, str | None]] = {
    "dense": (None, None),
    "ict": _ICT_DEFAULTS,
    "entropy": (0.20, "batch"),
    "stapo": (None, None),
    "random": _ICT_DEFAULTS,
}


class ConfigError(ValueError):
    """A bad configuration key or value. ``str(err)`` is a single line naming the key."""


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSection:
    path: str | None = None  # HF directory or .gguf file; None = random init from `preset`
    preset: Literal["tiny", "demo", "qwen2p5_0p5b", "qwen2p5_1p5b", "qwen2p5_7b"] = "tiny"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # "auto": bfloat16 on accelerators, float32 on CPU (docs/architecture.md precision policy)
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    remat: Literal["none", "block", "full"] = "block"
    scan_layers: bool = True
    # "char" = the built-in CharTokenizer; a path = an HF tokenizer dir or .gguf; None = from model.path
    tokenizer: str | None = None


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


@dataclass(frozen=True)
class SelectorSection:
    method: Method = "ict"
    rho: float | None = None  # None = the method's default (docs/method.md §2)
    scope: Scope | None = None  # None = the method's default (docs/method.md §2)
    warmup_steps: int = 20  # Theta (docs/method.md §2)
    tau_p: float = 0.002  # STAPO probability threshold (the one place the default is written)
    tau_h: float = 0.8  # STAPO entropy quantile (the one place the default is written)

    @property
    def canonical_method(self) -> str:
        """``grpo`` is the user-facing alias of ``dense``."""
        return "dense" if self.method == "grpo" else self.method

    @property
    def resolved_rho(self) -> float | None:
        return self.rho if self.rho is not None else SELECTOR_DEFAULTS.get(self.canonical_method, (None, None))[0]

    @property
    def resolved_scope(self) -> str | None:
        return self.scope if self.scope is not None else SELECTOR_DEFAULTS.get(self.canonical_method, (None, None))[1]


@dataclass(frozen=True)
class LossSection:
    eps_low: float = 0.2
    eps_high: float = 0.2  # 0.28 = DAPO clip-higher
    dual_clip_c: float | None = 3.0  # verl's default; None turns dual clip off
    kl_coef: float = 0.001  # verl's GRPO default
    kl_masked: bool = True  # ICT Eq. 11
    loss_agg: LossAgg = "seq-mean-token-mean"  # ICT Eq. 11
    normalize_over: Literal["selected", "valid"] = "selected"
    old_logp: Literal["recompute", "sampler"] = "recompute"
    mask_truncated: bool = False


@dataclass(frozen=True)
class AdvSection:
    scale_rewards: Literal["group", "batch", "none"] = "group"
    drop_zero_std_groups: bool = False  # DAPO dynamic sampling
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


@dataclass(frozen=True)
class RLSection:
    selector: SelectorSection = field(default_factory=SelectorSection)
    loss: LossSection = field(default_factory=LossSection)
    adv: AdvSection = field(default_factory=AdvSection)
    reward: RewardSection = field(default_factory=RewardSection)


@dataclass(frozen=True)
class StatsSection:
    temperature: float | None = None  # T_s; None = the rollout temperature (docs/method.md notation)
    chunk: int = 64  # largest block of positions in stats_from_hidden (docs/benchmarks.md, issue 3)
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
            _set_dotted(data, key, value)
        return from_dict(data)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------
def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, get_args(tp)))}")
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not {_type_name(tp)}")
    if origin is tuple:
        if isinstance(value, str):  # "1,4" from the command line: each element parsed as YAML
            import yaml  # yaml only where text is parsed (the CLI parser imports this module)

            value = [yaml.safe_load(v) for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return tuple(_coerce(v, get_args(tp)[0], key) for v in value)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # programming error, not user input


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def _check_fraction(key: str, rho: float) -> None:
    if not (0.0 < rho <= 1.0):
        raise ConfigError(f"{key}: {rho} is out of range; allowed: 0 < rho <= 1")
    if round(rho, 4) != rho:
        raise ConfigError(f"{key}: {rho} has more than 4 decimals (docs/method.md §2 stores rho as a fraction)")


def validate(cfg: Config) -> Config:
    """Cross-field checks; returns ``cfg``. Raises :class:`ConfigError`."""
    def positive(key: str, v: float, allow_zero: bool = False) -> None:
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{key}: {v} must be {'>= 0' if allow_zero else '> 0'}")

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
    r = cfg.rollout
    positive("rollout.num_samples", r.num_samples)
    positive("rollout.max_prompt_len", r.max_prompt_len)
    positive("rollout.max_new_tokens", r.max_new_tokens)
    positive("rollout.temperature", r.temperature)
    if not (0.0 < r.top_p <= 1.0):
        raise ConfigError(f"rollout.top_p: {r.top_p} is out of range; allowed: 0 < top_p <= 1")
    positive("rollout.top_k", r.top_k, allow_zero=True)
    s = cfg.rl.selector
    if s.rho is not None:
        _check_fraction("rl.selector.rho", s.rho)
    positive("rl.selector.warmup_steps", s.warmup_steps, allow_zero=True)
    if not (0.0 < s.tau_p < 1.0):
        raise ConfigError(f"rl.selector.tau_p: {s.tau_p} is out of range; allowed: 0 < tau_p < 1")
    if not (0.0 <= s.tau_h <= 1.0):
        raise ConfigError(f"rl.selector.tau_h: {s.tau_h} is out of range; allowed: 0 <= tau_h <= 1")
    lo = cfg.rl.loss
    positive("rl.loss.eps_low", lo.eps_low, allow_zero=True)
    positive("rl.loss.eps_high", lo.eps_high, allow_zero=True)
    if lo.eps_low >= 1:
        raise ConfigError(f"rl.loss.eps_low: {lo.eps_low} must be < 1")
    if lo.dual_clip_c is not None and lo.dual_clip_c <= 1:
        raise ConfigError(f"rl.loss.dual_clip_c: {lo.dual_clip_c} must be > 1 or null")
    positive("rl.loss.kl_coef", lo.kl_coef, allow_zero=True)
    positive("rl.adv.eps", cfg.rl.adv.eps)
    positive("rl.adv.max_refill", cfg.rl.adv.max_refill, allow_zero=True)
    positive("rl.reward.time_limit", cfg.rl.reward.time_limit)
    positive("rl.reward.workers", cfg.rl.reward.workers)
    positive("rl.reward.max_response_chars", cfg.rl.reward.max_response_chars)
    if cfg.stats.temperature is not None:
        positive("stats.temperature", cfg.stats.temperature)
    positive("stats.chunk", cfg.stats.chunk)
    o = cfg.optim
    positive("optim.lr", o.lr, allow_zero=True)
    positive("optim.lr_warmup_steps", o.lr_warmup_steps, allow_zero=True)
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    positive("optim.grad_clip", o.grad_clip)
    t = cfg.train
    positive("train.steps", t.steps, allow_zero=True)
    positive("train.prompts_per_step", t.prompts_per_step)
    positive("train.mini_batches", t.mini_batches)
    positive("train.micro_batches", t.micro_batches)
    if t.prompts_per_step % t.mini_batches:
        raise ConfigError(
            f"train.mini_batches: {t.mini_batches} does not divide train.prompts_per_step={t.prompts_per_step} "
            "(groups never split across mini-batches)")
    rows = t.prompts_per_step // t.mini_batches * cfg.rollout.num_samples
    if rows % t.micro_batches:
        raise ConfigError(
            f"train.micro_batches: {t.micro_batches} does not divide the {rows} rows "
            f"({t.prompts_per_step // t.mini_batches} prompts x {cfg.rollout.num_samples} samples) of a mini-batch")
    positive("train.eval_every", t.eval_every, allow_zero=True)
    positive("train.save_every", t.save_every, allow_zero=True)
    positive("train.keep", t.keep)
    for k in cfg.data.eval_k:
        if k < 1 or k > cfg.data.eval_n:
            raise ConfigError(f"data.eval_k: {k} must be between 1 and data.eval_n={cfg.data.eval_n}")
    return cfg


def rho_fraction(rho: float) -> tuple[int, int]:
    """rho (at most 4 decimals) as an exact integer fraction (a, b) (docs/method.md §2)."""
    _check_fraction("rho", rho)
    f = fractions.Fraction(round(rho * 10_000), 10_000)
    return f.numerator, f.denominator


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def from_dict(data: dict[str, Any]) -> Config:
    return validate(_build(Config, data, ""))


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
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


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"rl.loss.kl_coef=0"`` -> ``("rl.loss.kl_coef", 0)``; the value is parsed as YAML."""
    import yaml  # yaml only where text is parsed (the CLI parser imports this module)

    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load defaults <- YAML file <- ``key=value`` overrides, validated.

    A YAML may name a ``base:`` file (relative to itself) that it overlays.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _load_yaml(Path(path), seen=())
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return from_dict(data)


def _load_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    import yaml  # yaml only where text is parsed (the CLI parser imports this module)

    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file {str(path)!r} includes itself through 'base'")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        parent = _load_yaml((path.parent / base), seen + (path.resolve(),))
        data = _deep_merge(parent, data)
    return data
