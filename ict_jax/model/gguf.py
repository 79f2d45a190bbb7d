"""llama.cpp GGUF files -> :class:`ict_jax.Qwen2` and the file's own tokenizer. Torch-free.

Supported architectures (``general.architecture``): ``llama`` (Qwen2 without q/k/v biases: SmolLM2,
Llama 2/3-style models with default RoPE) and ``qwen2`` (Qwen2/Qwen2.5, q/k/v biases). Every tensor type
that ``gguf.quants.dequantize`` knows (F32, F16, BF16, Q8_0, Q4_0/Q4_1, K-quants, ...) is dequantized to
float32 on the host, then cast to the parameter dtype: the model holds dense weights, not quantized ones.

Each GGUF tensor name is translated to its Hugging Face name (:data:`_GLOBAL`, :data:`_PER_LAYER`) and
the HF-named tensors go through the same key map, layout conversion and mesh placement as
:func:`ict_jax.load_hf` (:func:`ict_jax.model.weights.load_from_source`). GGUF stores a ``[out, in]``
weight with its dimensions listed innermost first, so the array read is ``reversed(shape)`` = HF layout.
llama.cpp's converter permutes the rows of ``llama`` q/k projections (interleaved RoPE pairs); that is
undone here (:func:`unpermute_qk`). ``qwen2`` GGUFs are not permuted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ict_jax.model.config import ModelConfig
from ict_jax.model.gguf_reader import open_gguf
from ict_jax.model.qwen2 import Qwen2
from ict_jax.model.tokenizers import load_tokenizer
from ict_jax.model.weights import WeightError, load_from_source

#: ``general.architecture`` -> whether llama.cpp permuted the q/k rows when converting.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": True, "qwen2": False}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when the model has no place for it."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{int(m.group(1))}.{_PER_LAYER[m.group(2)]}"
    return None


def _hf_to_gguf_name(name: str) -> str:
    for g, h in _GLOBAL.items():
        if h == name:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    inv = {h: g for g, h in _PER_LAYER.items()}
    return f"blk.{m.group(1)}.{inv[m.group(2)]}" if m and m.group(2) in inv else name


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``[out, in]`` weight or ``[out]`` bias, HF layout)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _open(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"load_gguf: {str(path)!r} is not a file")
    return open_gguf(path)


def _architecture(reader: Any, where: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return arch


def config_from_gguf(reader: Any, where: str = "GGUF", **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a GGUF's ``{arch}.*`` metadata and tensor list (an open ``GGUFReader``)."""
    arch = _architecture(reader, where)
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        v = _field(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"{where}: GGUF metadata key {arch}.{key!r} is missing")
        if isinstance(v, list):  # per-layer values (some converters write arrays): must all agree
            if len(set(v)) != 1:
                raise ValueError(f"{where}: {arch}.{key} differs between layers ({v[:4]}...); not supported")
            v = v[0]
        return v

    if _field(reader, f"{arch}.expert_count"):
        raise ValueError(f"{where}: mixture-of-experts GGUFs ({arch}.expert_count) are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{where}: RoPE scaling {scaling!r} is not supported (only default RoPE)")
    if "token_embd.weight" not in shapes:
        raise WeightError(f"{where}: tensor 'token_embd.weight' is missing from the GGUF")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = get("attention.key_length", required=False)
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    rope_dim = get("rope.dimension_count", required=False)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{where}: partial RoPE ({arch}.rope.dimension_count={rope_dim}, head dim {head_dim}) "
                         "is not supported")
    fields = dict(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=None if head_dim == hidden // heads else head_dim,
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in shapes,
        qkv_bias="blk.0.attn_q.bias" in shapes,
        max_position_embeddings=int(get("context_length", 32_768)),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def load_gguf(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None, dtype: str | None = None,
              **config_overrides: Any) -> tuple[Qwen2, Any]:
    """Load a llama.cpp GGUF file as ``(Qwen2, Tokenizer)``: the dequantized weights and the file's own
    tokenizer (:func:`ict_jax.load_tokenizer`, with its chat template).

    ``dtype`` sets the parameter dtype (default: float32). With ``mesh`` every parameter is placed
    directly in its sharding from the rule table. ``config_overrides`` go to the :class:`ModelConfig`
    (e.g. ``scan_layers=False``, ``compute_dtype="float32"``). Architectures other than ``llama`` and
    ``qwen2`` raise ``ValueError``; a tensor the model has no place for raises :class:`WeightError`.
    """
    from gguf.quants import dequantize  # gguf: optional, only for .gguf files

    path = Path(path)
    reader = _open(path)
    where = str(path)
    if dtype is not None:
        config_overrides["param_dtype"] = dtype
    cfg = config_from_gguf(reader, where, **config_overrides)
    permuted = SUPPORTED_GGUF_ARCHITECTURES[_architecture(reader, where)]

    tensors, unknown = {}, []
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is None or (hf == "lm_head.weight" and cfg.tie_word_embeddings):
            unknown.append(t.name)
        else:
            tensors[hf] = t
    if unknown:
        raise WeightError(f"{where}: {len(unknown)} GGUF tensor(s) have no place in the model, e.g. "
                          f"{unknown[0]!r} (architecture variants such as rope_freqs are not supported)")

    def get(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise WeightError(f"{where}: tensor {_hf_to_gguf_name(name)!r} ({name}) is missing from the GGUF")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise WeightError(f"{where}: tensor {t.name!r}: {e}") from None
        w = np.asarray(w, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
        return w

    model = load_from_source(cfg, get, mesh=mesh, where=where, shape_origin=" (from the GGUF metadata)")
    return model, load_tokenizer(path)
