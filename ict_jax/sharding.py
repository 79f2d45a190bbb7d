"""The device mesh and the ONE logical-axis rule table (docs/architecture.md "Mesh").

Every parameter carries logical axis names (``nnx.Param(..., logical_axes=(...))``); every activation
constraint uses the same names. :data:`LOGICAL_RULES` maps a logical name to mesh axes. A dimension the
mesh axes do not divide is replicated instead (Qwen2.5-0.5B has 14 query heads and 2 KV heads: on
``tensor=4`` the heads are replicated), and that decision is logged once per (name, size, mesh).

Mesh axes are ``('data', 'fsdp', 'tensor')`` with ``AxisType.Auto``. The batch is split over
``('data', 'fsdp')``; a prompt's G rollouts must stay on one shard, so the number of prompts must be a
multiple of ``data * fsdp`` (:func:`check_prompts_divide`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

#: logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,  # rows of a batch (prompt-major, groups contiguous)
    "vocab": "tensor",  # embedding rows / unembedding columns
    "embed": "fsdp",  # model width of weights (ZeRO-3 style weight sharding)
    "q_heads": "tensor",  # query heads
    "kv_heads": "tensor",  # key/value heads
    "mlp": "tensor",  # FFN width
    "head_dim": None,
    "lora_rank": None,  # the rank axis of LoRA adapters (small: replicated; A and B shard like their weight)
    "layers": None,  # the stacked-layer axis (scan)
    "norm": None,  # RMSNorm scales
    "seq": None,  # sequence positions of activations
    "cache_seq": None,  # KV-cache slots
    "act_embed": None,  # model width of activations
}

_logged: set[tuple[Any, ...]] = set()


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``('data', 'fsdp', 'tensor')`` mesh with ``AxisType.Auto`` axes.

    One size may be -1 ("the rest of the devices"). Raises ``ValueError`` naming the shapes when the
    product does not equal the number of devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v == 0 or v < -1:
            raise ValueError(f"make_mesh: {name}={v!r} must be a positive integer or -1 (the rest)")
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"make_mesh: only one axis may be -1, got {', '.join(rest)} = -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    if rest:
        if n % known:
            raise ValueError(
                f"make_mesh: data={data}, fsdp={fsdp}, tensor={tensor}: the fixed axes' product {known} does not "
                f"divide the {n} devices")
        sizes[rest[0]] = n // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != n:
        raise ValueError(
            f"make_mesh: data x fsdp x tensor = {shape[0]} x {shape[1]} x {shape[2]} = {math.prod(shape)} "
            f"does not equal the {n} available devices")
    return Mesh(np.asarray(devs, dtype=object).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def single_device_mesh() -> Mesh:
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for an array of ``shape`` whose dims have ``logical_axes`` names.

    A dim whose size the mapped mesh axes do not divide, or whose mesh axis an earlier dim already uses,
    is replicated (logged once).
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no rule; known: {', '.join(LOGICAL_RULES)}")
        axes = LOGICAL_RULES[name]
        if axes is None:
            spec.append(None)
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        axes_t = tuple(a for a in axes_t if mesh.shape[a] > 1 and a not in used)
        if not axes_t:
            spec.append(None)
            continue
        n = _axis_size(mesh, axes_t)
        if size % n:
            key = (name, size, tuple(mesh.shape.items()))
            if key not in _logged:
                _logged.add(key)
                log.info("sharding: logical axis %r of size %d is not divisible by mesh axes %s (size %d): "
                         "replicated", name, size, axes_t, n)
            spec.append(None)
            continue
        used.update(axes_t)
        spec.append(axes_t[0] if len(axes_t) == 1 else axes_t)
    return P(*spec)


def logical_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over ('data', 'fsdp'), every other dim replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def place(tree: Any, shardings: Any) -> Any:
    """Every leaf of ``tree`` placed with the sharding at the same place in ``shardings`` (a tree of the
    same structure, or a prefix of it). A device array already placed so is returned as it is (no
    copy). Host (NumPy) leaves become global arrays through ``jax.make_array_from_callback``: in a
    multi-process run every process holds the same host data and each provides its own devices' shards."""
    def one(sh: Any, a: Any) -> jax.Array:
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            if a.is_fully_addressable and not sh.is_fully_addressable:  # a process's own key, the same in each
                return jax.random.wrap_key_data(one(sh, np.asarray(jax.random.key_data(a))),
                                                impl=jax.random.key_impl(a))
            return jax.device_put(a, sh)
        if isinstance(a, jax.Array):
            return jax.device_put(a, sh)
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    return jax.tree.map(one, shardings, tree)


def shard_batch(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf (a [B, ...] array) with its rows split over ('data', 'fsdp') (:func:`place`)."""
    return place(tree, jax.tree.map(lambda a: batch_sharding(mesh, np.ndim(a)), tree))


def to_host(tree: Any) -> Any:
    """NumPy copies of (possibly sharded, possibly multi-process) arrays: all-gathered across processes
    when a process cannot address every shard."""
    def one(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if a.is_fully_replicated:
                return np.asarray(a.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(jax.device_get(a))

    return jax.tree.map(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_prompts_divide(num_prompts: int, mesh: Mesh) -> None:
    """A prompt's G rollouts never straddle a shard: P must be a multiple of data * fsdp."""
    n = _axis_size(mesh, BATCH_AXES)
    if num_prompts % n:
        raise ValueError(
            f"{num_prompts} prompts cannot be split over the mesh's data x fsdp = {mesh.shape['data']} x "
            f"{mesh.shape['fsdp']} = {n} batch shards (groups never straddle a shard): use a multiple of {n}")


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings for an nnx State (abstract or concrete) from each Variable's ``logical_axes``.

    Variables without ``logical_axes`` are replicated.
    """
    def one(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            axes = v.get_metadata().get("logical_axes")
            shape = v.shape if hasattr(v, "shape") else np.shape(v.get_value())
            if axes is None:
                return NamedSharding(mesh, P())
            return logical_sharding(axes, shape, mesh)
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _drop_axis(spec: P, axis: str) -> P:
    """``spec`` without mesh axis ``axis`` (an entry naming only it becomes None: replicated there)."""
    def drop(entry: Any) -> Any:
        if entry is None:
            return None
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(drop(e) for e in spec))


def gather_fsdp(state: Any) -> Any:
    """Inside a program traced under a mesh: ``state`` (an nnx State) with every Variable's FSDP shards
    gathered, each constrained to its logical sharding without the ``fsdp`` mesh axis (tensor parallelism
    kept). A loop that reads the result, like the sampler's decode loop, then finds whole weights on every
    device: they are all-gathered once, before the loop, instead of in every iteration (the decode's
    ``rollout.gather_weights``, docs/sampler.md). Costs the gathered copy's memory per device for as long
    as it is read. Unchanged without a mesh, or on a mesh whose ``fsdp`` axis is 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.shape["fsdp"] == 1:
        return state

    gathered = []

    def one(v: Any) -> Any:
        if not isinstance(v, nnx.Variable):
            return v
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            return v
        spec = _drop_axis(logical_to_spec(axes, v.shape, mesh), "fsdp")
        gathered.append(v)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), v)

    out = jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if not gathered:  # plain arrays carry no logical axes: nothing would be gathered, silently
        raise ValueError("gather_fsdp: the state holds no nnx Variables with logical_axes (a state from "
                         "nnx.split, not plain arrays), so there is nothing to gather")
    return out


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names under the current mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))
