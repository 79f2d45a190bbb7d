"""Architecture hyperparameters of a Qwen2-family decoder (Qwen2.5, and bias-free Llama-style models)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax

from ict_jax.config import ModelSection

Dtype = Literal["float32", "bfloat16", "float16"]
_SECTION = ModelSection()  # the config tree's defaults (one source per default)
#: The ModelConfig fields a run's ``model`` section sets (same names there) that do not change the weights.
RUN_SETTINGS = ("remat", "scan_layers", "attention", "attention_block")


def run_settings(source: Any) -> dict[str, Any]:
    """:data:`RUN_SETTINGS` read from ``source`` (a :class:`ModelConfig` or the config tree's ``model`` section)."""
    return {name: getattr(source, name) for name in RUN_SETTINGS}

#: HF ``architectures`` values whose weights this model can hold (same tensors, maybe without q/k/v bias).
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")

#: The projections LoRA can adapt: PEFT / Hugging Face module name -> (our stacked weight in
#: ``DecoderStack``, the HF submodule it sits in: ``model.layers.{i}.<submodule>.<name>``).
LORA_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("wq", "self_attn"), "k_proj": ("wk", "self_attn"), "v_proj": ("wv", "self_attn"),
    "o_proj": ("wo", "self_attn"), "gate_proj": ("w_gate", "mlp"), "up_proj": ("w_up", "mlp"),
    "down_proj": ("w_down", "mlp"),
}


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters of a :class:`ModelConfig` (docs/lora.md): ``y = x W + (alpha / rank) (x A) B`` on
    each projection of ``targets`` (PEFT module names, kept in :data:`LORA_MODULES` order), in every layer.
    ``base_dtype``: the frozen base weights' dtype (None = the model's ``param_dtype``, which the adapters
    always use). Built from the config's ``model.lora`` by :func:`ict_jax.model.lora.lora_spec`."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(LORA_MODULES)
    base_dtype: Dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ValueError(f"LoraSpec.rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"LoraSpec.alpha must be a positive number, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in LORA_MODULES]
        if unknown or not self.targets:
            raise ValueError(f"LoraSpec.targets {list(self.targets)}: name one or more of {', '.join(LORA_MODULES)}")
        # canonical order and a tuple (a JSON round trip gives a list): equal specs hash equal
        object.__setattr__(self, "targets", tuple(t for t in LORA_MODULES if t in self.targets))
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        """alpha / rank (PEFT's scaling without rsLoRA)."""
        return self.alpha / self.rank


def resolve_compute_dtype(setting: str, platform: str | None = None) -> str:
    """The dtype the compute-dtype ``setting`` means on ``platform`` (``cpu``, ``gpu``, ``tpu``; default: JAX's
    default backend): ``auto`` is bfloat16 on accelerators and float32 on a CPU (docs/architecture.md,
    precision), any other setting itself. The one place ``auto`` is resolved: the model at trace time
    (:meth:`ModelConfig.resolved_compute_dtype`), the model source for a target platform (``ict-jax
    compile``, :func:`ict_jax.train.model_source.resolve_model`)."""
    if setting != "auto":
        return setting
    platform = jax.default_backend() if platform is None else platform
    return "float32" if platform == "cpu" else "bfloat16"


#: ``model.attention`` values: ``auto``, the two plain-JAX forms, the fused kernels
ATTENTIONS = ("auto", "dense", "blocked", "xla", "cudnn", "splash")


def resolve_attention(setting: str, platform: str | None = None, compute_dtype: str = "bfloat16") -> str:
    """The attention the ``model.attention`` ``setting`` means on ``platform`` (``cpu``, ``gpu``, ``tpu``;
    default: JAX's default backend) at ``compute_dtype`` (resolved): ``auto`` is ``cudnn`` on a GPU computing
    in bfloat16 or float16 (cuDNN's flash attention takes no float32), ``splash`` on a TPU and ``dense``
    otherwise (XLA's CPU backend has no fused kernel: ``xla`` computes the dense form's scores too); any
    other setting itself. Resolved at trace time (:meth:`ModelConfig.resolved_attention`) or for a target
    platform (``ict-jax compile``, :func:`ict_jax.train.model_source.resolve_model`)."""
    if setting != "auto":
        return setting
    platform = jax.default_backend() if platform is None else platform
    if platform in ("gpu", "cuda", "rocm") and compute_dtype in ("bfloat16", "float16"):
        return "cudnn"
    return "splash" if platform == "tpu" else "dense"


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of :class:`ict_jax.Qwen2`.

    ``compute_dtype="auto"`` resolves to bfloat16 on accelerators and float32 on CPU (docs/architecture.md
    precision policy). ``remat``: ``none`` keeps every activation; ``block`` rematerialises each decoder
    block but keeps its matmul outputs (``dots_with_no_batch_dims_saveable``); ``full`` keeps only the
    block inputs (``nothing_saveable``). ``scan_layers`` runs the stacked layers with ``lax.scan`` (one
    compiled layer body; compile time independent of depth) instead of an unrolled Python loop; the
    parameter layout is the same either way. ``attention`` (the full-sequence forwards: training,
    scoring, prefill): ``dense`` scores every query against every key at once (a ``[B, H, T, T]`` float32
    matrix a layer); ``blocked`` walks the keys in blocks of ``attention_block`` with an online softmax and
    recomputes them in the backward pass, the same result without that matrix
    (:mod:`ict_jax.model.attention`); ``xla``, ``cudnn`` and ``splash`` are fused kernels
    (:mod:`ict_jax.model.fused_attention`); ``auto`` picks the backend's (:func:`resolve_attention`). The
    decode step is dense (one query).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None = hidden_size // num_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True
    max_position_embeddings: int = 32_768
    param_dtype: Dtype = "float32"
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    remat: Literal["none", "block", "full"] = _SECTION.remat
    scan_layers: bool = _SECTION.scan_layers
    attention: Literal["auto", "dense", "blocked", "xla", "cudnn", "splash"] = _SECTION.attention
    attention_block: int = _SECTION.attention_block  # key positions a block of the blocked attention
    lora: LoraSpec | None = None  # low-rank adapters on the projections (docs/lora.md); None = none

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # read back from a checkpoint's JSON metadata
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "set head_dim explicitly")
        if self.resolved_head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.resolved_head_dim} must be even (RoPE)")
        if self.remat not in ("none", "block", "full"):
            raise ValueError(f"ModelConfig.remat must be one of none, block, full; got {self.remat!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"ModelConfig.attention must be one of {', '.join(ATTENTIONS)}; got {self.attention!r}")
        if not isinstance(self.attention_block, int) or self.attention_block < 1:
            raise ValueError(f"ModelConfig.attention_block must be a positive integer, got {self.attention_block!r}")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def base_param_dtype(self) -> str:
        """The dtype of the weights other than LoRA adapters: ``lora.base_dtype`` when set, else ``param_dtype``."""
        return self.lora.base_dtype if self.lora is not None and self.lora.base_dtype else self.param_dtype

    def resolved_compute_dtype(self, platform: str | None = None) -> str:
        """The compute dtype on ``platform`` (default: JAX's default backend), :func:`resolve_compute_dtype`."""
        return resolve_compute_dtype(self.compute_dtype, platform)

    def resolved_attention(self, platform: str | None = None) -> str:
        """The full-sequence attention on ``platform`` (default: JAX's default backend), :func:`resolve_attention`."""
        return resolve_attention(self.attention, platform, self.resolved_compute_dtype(platform))

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Exact parameter count (embedding, layers, final norm and an untied head)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.resolved_head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def num_adapter_params(self) -> int:
        """Exact LoRA adapter parameter count: rank x (in + out) per targeted projection and layer (0 without
        LoRA). Not included in :meth:`num_params`, which counts the base model."""
        if self.lora is None:
            return 0
        d, f, hd = self.hidden_size, self.intermediate_size, self.resolved_head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        sizes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
                 "up_proj": (d, f), "down_proj": (f, d)}
        return self.num_layers * self.lora.rank * sum(sum(sizes[t]) for t in self.lora.targets)

    # -- presets ---------------------------------------------------------------------------------
    @classmethod
    def qwen2p5_0p5b(cls, **kw: Any) -> "ModelConfig":
        """Qwen2.5-0.5B(-Instruct): 494,032,768 parameters."""
        return cls(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_layers=24, num_heads=14,
                   num_kv_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **kw)

    @classmethod
    def qwen2p5_1p5b(cls, **kw: Any) -> "ModelConfig":
        """Qwen2.5-1.5B(-Instruct): 1,543,714,304 parameters."""
        return cls(vocab_size=151_936, hidden_size=1_536, intermediate_size=8_960, num_layers=28, num_heads=12,
                   num_kv_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **kw)

    @classmethod
    def qwen2p5_7b(cls, **kw: Any) -> "ModelConfig":
        """Qwen2.5-7B(-Instruct): 7,615,616,512 parameters (vocabulary 152,064, untied head)."""
        return cls(vocab_size=152_064, hidden_size=3_584, intermediate_size=18_944, num_layers=28, num_heads=28,
                   num_kv_heads=4, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)

    @classmethod
    def tiny(cls, **kw: Any) -> "ModelConfig":
        """A 2-layer random model for tests (vocab 256, hidden 64, 4 heads / 2 KV heads)."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    max_position_embeddings=2_048)
        base.update(kw)
        return cls(**base)

    @classmethod
    def demo(cls, **kw: Any) -> "ModelConfig":
        """The embedded demo's small model (4 layers, width 128), sized for the CharTokenizer's 100 ids."""
        base = dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                    num_kv_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    max_position_embeddings=1_024)
        base.update(kw)
        return cls(**base)

    @classmethod
    def presets(cls) -> dict[str, Any]:
        """The preset registry: name -> the constructor (``ModelConfig.preset(name)``); ``ict-jax info``
        lists it and ``model.preset`` accepts exactly these names."""
        return {"tiny": cls.tiny, "demo": cls.demo, "qwen2p5_0p5b": cls.qwen2p5_0p5b,
                "qwen2p5_1p5b": cls.qwen2p5_1p5b, "qwen2p5_7b": cls.qwen2p5_7b}

    @classmethod
    def preset(cls, name: str, **kw: Any) -> "ModelConfig":
        presets = cls.presets()
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(presets)}")
        return presets[name](**kw)

    # -- Hugging Face ----------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any], **kw: Any) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (a directory, the file, or its parsed dict).

        ``rope_theta`` is accepted at the top level (real Qwen2.5 files) and inside ``rope_parameters``
        (transformers v5). Llama-style architectures have no q/k/v bias unless ``attention_bias`` says so.
        """
        if isinstance(path_or_dict, dict):
            d, where = dict(path_or_dict), "config dict"
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise FileNotFoundError(f"no Hugging Face config.json at {str(p)!r}")
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e})") from None
            where = str(p)
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"{where}: unsupported architecture {archs}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if not archs and model_type not in (None, "qwen2", "llama", "mistral"):
            raise ValueError(f"{where}: unsupported model_type {model_type!r}; supported: qwen2, llama, mistral")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope_theta is None:
            rope_theta = rp.get("rope_theta", 10_000.0)
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only default RoPE)")
        is_qwen = model_type == "qwen2" or "Qwen2ForCausalLM" in archs
        qkv_bias = bool(d.get("attention_bias", is_qwen))
        try:
            fields = dict(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=int(d["num_attention_heads"]),
                num_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                head_dim=d.get("head_dim"),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                max_position_embeddings=int(d.get("max_position_embeddings", 32_768)),
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing required key {e.args[0]!r}") from None
        if fields["head_dim"] is not None and fields["head_dim"] == fields["hidden_size"] // fields["num_heads"]:
            fields["head_dim"] = None
        fields.update(kw)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.Qwen2ForCausalLM`` (or Llama when bias-free) loads."""
        common = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu", torch_dtype=self.param_dtype, head_dim=self.resolved_head_dim,
        )
        if self.qkv_bias:
            common.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
        else:
            common.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                          mlp_bias=False)
        return common
