"""Hugging Face safetensors <-> :class:`ict_jax.Qwen2`, through ONE declarative key map.

Each :class:`Entry` names our parameter, the HF tensor (``{i}`` = layer index for stacked layer
weights) and a layout ``kind`` whose two directions are defined once in :data:`_LAYOUTS`.

Loading goes parameter by parameter: the HF tensors of one parameter are read (memory-mapped), put in
our layout on the host once, and placed on the mesh with ``jax.make_array_from_callback`` (each device
receives only its shard; no full copy per device). Weights are read from safetensors only, never pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
from flax import nnx

from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import Qwen2
from ict_jax.sharding import logical_sharding


@dataclass(frozen=True)
class Entry:
    ours: str  # attribute path in the nnx module, e.g. "layers.wq"
    hf: str  # HF tensor name; "{i}" = the layer index
    kind: str  # layout conversion, a key of _LAYOUTS
    stacked: bool = False  # one HF tensor per layer, stacked on our leading layers axis
    when: Callable[[ModelConfig], bool] = lambda c: True


_P = "model.layers.{i}."
KEY_MAP: tuple[Entry, ...] = (
    Entry("embed", "model.embed_tokens.weight", "same"),
    Entry("layers.attn_norm", _P + "input_layernorm.weight", "same", True),
    Entry("layers.wq", _P + "self_attn.q_proj.weight", "heads_in", True),
    Entry("layers.wk", _P + "self_attn.k_proj.weight", "heads_in", True),
    Entry("layers.wv", _P + "self_attn.v_proj.weight", "heads_in", True),
    Entry("layers.bq", _P + "self_attn.q_proj.bias", "heads_bias", True, lambda c: c.qkv_bias),
    Entry("layers.bk", _P + "self_attn.k_proj.bias", "heads_bias", True, lambda c: c.qkv_bias),
    Entry("layers.bv", _P + "self_attn.v_proj.bias", "heads_bias", True, lambda c: c.qkv_bias),
    Entry("layers.wo", _P + "self_attn.o_proj.weight", "heads_out", True),
    Entry("layers.mlp_norm", _P + "post_attention_layernorm.weight", "same", True),
    Entry("layers.w_gate", _P + "mlp.gate_proj.weight", "linear", True),
    Entry("layers.w_up", _P + "mlp.up_proj.weight", "linear", True),
    Entry("layers.w_down", _P + "mlp.down_proj.weight", "linear", True),
    Entry("final_norm", "model.norm.weight", "same"),
    Entry("lm_head", "lm_head.weight", "linear", False, lambda c: not c.tie_word_embeddings),
)

# kind -> (HF tensor -> our layout, our layout -> HF tensor); `s` is our (per-layer) shape.
# HF linear weights are [out, in]; ours are [in, out] with the head axes split out.
_LAYOUTS: dict[str, tuple[Callable[[np.ndarray, tuple], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "same": (lambda w, s: w.reshape(s), lambda w: w),
    "linear": (lambda w, s: w.T.reshape(s), lambda w: w.T),
    "heads_in": (lambda w, s: w.T.reshape(s), lambda w: w.reshape(w.shape[0], -1).T),  # [D,N,hd]
    "heads_bias": (lambda w, s: w.reshape(s), lambda w: w.reshape(-1)),  # [N,hd]
    "heads_out": (lambda w, s: w.T.reshape(s), lambda w: w.reshape(-1, w.shape[-1]).T),  # [N,hd,D]
}


class WeightError(ValueError):
    """A checkpoint that does not fit the model: names the file/tensor and the shapes."""


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
class _Checkpoint:
    """The tensors of a HF checkpoint directory (single or index-sharded safetensors), read lazily."""

    def __init__(self, path: Path):
        # safetensors: imported on the paths that read or write weight files
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
                raise FileNotFoundError(
                    f"{path}: no model.safetensors or model.safetensors.index.json (found: {found}); weights "
                    "are read from safetensors only (convert .bin/.pt checkpoints first)")
            weight_map = None
        self._handles = {}
        for f in files:
            fp = path / f
            if not fp.is_file():
                raise FileNotFoundError(f"{path}: shard {f!r} named in the index is missing")
            try:
                self._handles[f] = safe_open(str(fp), framework="numpy")
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (a Rust error), OSError
                raise WeightError(f"{fp}: not a readable safetensors file ({_first_line(e)}): truncated or "
                                  "corrupted? Copy or export it again") from None
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise WeightError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        f = self.weight_map[name]
        if f not in self._handles:
            raise WeightError(f"{self.path}: tensor {name!r} is mapped to {f!r}, which the index does not list")
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (a Rust error), OSError
            raise WeightError(f"{self.path / f}: cannot read tensor {name!r} ({_first_line(e)}): truncated or "
                              "corrupted? Copy or export it again") from None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _get_variable(model: Any, dotted: str) -> nnx.Variable:
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def expected_tensors(cfg: ModelConfig) -> set[str]:
    """The HF tensor names a model of this config is built from (through :data:`KEY_MAP`)."""
    return {e.hf.format(i=i) for e in KEY_MAP if e.when(cfg) for i in (range(cfg.num_layers) if e.stacked else [0])}


def load_from_source(cfg: ModelConfig, get: Callable[[str], np.ndarray], *, mesh: jax.sharding.Mesh | None,
                     where: str, shape_origin: str = "") -> Qwen2:
    """Build a :class:`Qwen2` of ``cfg`` from a tensor source: ``get(hf_name)`` returns the HF-named tensor
    in HF layout (a missing one raises :class:`WeightError`). Each parameter is put in our layout on the host
    once and placed on ``mesh`` (sharded by the rule table) with ``jax.make_array_from_callback``.
    ``where`` starts error messages; ``shape_origin`` says where the expected shapes came from."""
    abstract = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    model = nnx.merge(graphdef, state)  # abstract leaves, replaced one by one below
    for e in KEY_MAP:
        if not e.when(cfg):
            continue
        var = _get_variable(model, e.ours)
        shape, pdt = tuple(var.shape), var.dtype
        per_shape = shape[1:] if e.stacked else shape
        to_ours = _LAYOUTS[e.kind][0]

        def read(name: str) -> np.ndarray:
            w = get(name)
            want = int(np.prod(per_shape))
            if w.size != want:
                hf_shape = _LAYOUTS[e.kind][1](np.zeros(per_shape, np.int8)).shape
                raise WeightError(f"{where}: tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(hf_shape)}"
                                  f"{shape_origin}")
            out = to_ours(w, per_shape)
            if out.shape != per_shape:
                hf_shape = _LAYOUTS[e.kind][1](np.zeros(per_shape, np.int8)).shape
                raise WeightError(f"{where}: tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(hf_shape)}")
            return out.astype(pdt)

        if e.stacked:
            host = np.stack([read(e.hf.format(i=i)) for i in range(cfg.num_layers)])
        else:
            host = read(e.hf)
        if mesh is None:
            arr = jax.device_put(host, jax.devices()[0])  # committed, like jit outputs
        else:
            sharding = logical_sharding(var.get_metadata()["logical_axes"], host.shape, mesh)
            arr = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
        var.set_value(arr)
        del host
    return model


def load_hf(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None, dtype: str | None = None,
            config: ModelConfig | None = None, **config_overrides: Any) -> Qwen2:
    """Load a Hugging Face Qwen2 checkpoint directory (``config.json`` + safetensors) as a :class:`Qwen2`.

    ``dtype`` sets the parameter dtype (default: float32). With ``mesh`` every parameter is placed
    directly in its sharding from the rule table. ``config_overrides`` go to the :class:`ModelConfig`
    (e.g. ``scan_layers=False``, ``remat="none"``, ``compute_dtype="bfloat16"``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"load_hf: {str(path)!r} is not a directory")
    cfg = config or ModelConfig.from_hf(path)
    if dtype is not None:
        config_overrides["param_dtype"] = dtype
    cfg = cfg.replace(**config_overrides) if config_overrides else cfg
    ckpt = _Checkpoint(path)
    model = load_from_source(cfg, ckpt.get, mesh=mesh, where=str(path), shape_origin=" (from config.json)")
    expected = expected_tensors(cfg)
    # tied checkpoints sometimes still carry lm_head.weight; anything else unknown is reported
    unknown = sorted(k for k in ckpt.weight_map if k not in expected and not k.endswith("rotary_emb.inv_freq")
                     and not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    if unknown:
        raise WeightError(f"{path}: {len(unknown)} checkpoint tensor(s) have no place in the model, e.g. "
                          f"{unknown[0]!r} (is config.json right?)")
    return model


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------
def hf_state_dict(model: Qwen2, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Our parameters as HF-named numpy arrays (through :data:`KEY_MAP`)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for e in KEY_MAP:
        if not e.when(cfg):
            continue
        full = np.asarray(jax.device_get(_get_variable(model, e.ours)[...]))
        if dtype is not None:
            full = full.astype(jax.numpy.dtype(dtype))
        to_hf = _LAYOUTS[e.kind][1]
        if e.stacked:
            for i in range(cfg.num_layers):
                out[e.hf.format(i=i)] = np.ascontiguousarray(to_hf(full[i]))
        else:
            out[e.hf] = np.ascontiguousarray(to_hf(full))
    return out


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(directory: str | os.PathLike) -> None:
    """Give ``directory`` (and the files and folders directly in it) the modes a plain ``mkdir`` and
    ``open(..., "w")`` would: 0777 / 0666 less the user's umask."""
    mask = current_umask()
    directory = Path(directory)
    for p in [directory, *directory.iterdir()]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def written_aside(path: Path, who: str) -> Iterator[Path]:
    """A weight directory written aside and renamed into place: yields a fresh temporary folder beside
    ``path`` to write into; when the block ends without error the folder gets the user's umask
    (:func:`apply_umask`) and replaces ``path`` (which must not exist or be empty: else a FileExistsError
    naming ``who``, before anything is written); on any error, Ctrl-C included, it is removed and ``path`` is
    left as it was. So an interrupted save never leaves a half-written directory at ``path``."""
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{who}: {str(path)!r} exists and is not empty; choose a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{who}_", dir=path.parent))
    try:
        yield tmp
        apply_umask(tmp)  # mkdtemp made it 0700 (and safetensors its files 0600): the user's umask instead
        if path.exists():
            path.rmdir()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf(model: Qwen2, path: str | os.PathLike, *, dtype: str | None = None,
            max_shard_bytes: int = 4 * 1024**3) -> Path:
    """Write ``config.json`` + safetensors (index-sharded above ``max_shard_bytes``) that
    ``transformers.Qwen2ForCausalLM.from_pretrained`` loads. Written to a temporary directory first and
    renamed into place, so an interrupted save never leaves a half-written checkpoint at ``path``."""
    # safetensors: imported on the paths that read or write weight files
    from safetensors.numpy import save_file

    path = Path(path)
    with written_aside(path, "save_hf") as tmp:  # refuses a non-empty path before anything is gathered
        tensors = hf_state_dict(model, dtype)
        cfg_dict = model.config.to_hf()
        if dtype is not None:
            cfg_dict["torch_dtype"] = dtype
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for k, v in tensors.items():
            if size and size + v.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v.nbytes
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for n, shard in enumerate(shards, 1):
                name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=meta)
                weight_map.update({k: name for k in shard})
            total = sum(v.nbytes for v in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    return path
