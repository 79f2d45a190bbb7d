"""The decode loop reads each weight once a token: the bytes one compiled decode step accesses (its loop
body walked through the HLO, loop trip counts multiplied in: ``aot.roofline.decode_step_cost``) against
the least a step must read, the weights in the compute dtype and the KV cache's slots. Compiled, not run,
for the path each platform takes: the CPU's unrolled layers (float32), and (with libtpu) a TPU's layer
scan, the path accelerators run, with float32 parameters and bfloat16 compute as a training run's
policy: a decode that re-read the float32 weights, or cast them again at every step, reads up to ~2x; one
that copies the KV cache at every step (a layer scan over the cache as xs/ys), ~1.5x. Under FSDP, a decode
that all-gathers the weights' shards at every step reads several times more (``rollout.gather_weights``
gathers them once a call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ict_jax.aot import hlo
from ict_jax.aot.roofline import decode_step_cost, decode_step_multiplicity
from ict_jax.model.config import ModelConfig
from ict_jax.model.qwen2 import Qwen2
from ict_jax.sampling.sampler import make_generate_fn
from ict_jax.sharding import state_shardings

# Qwen2.5-0.5B's proportions (grouped KV heads, MLP ~5.5x the width, attention ~15% of a layer's
# weights) at width 256: ~5.2 MB of weights in bfloat16, a KV cache of ~2 MB over 16 rows
CONFIG = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=1408, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=64, param_dtype="float32", compute_dtype="bfloat16")
P, G, LP, N = 4, 4, 64, 64
LIMIT = 1.3

def least_bytes(c: ModelConfig) -> tuple[int, int]:
    """(weights a decode step reads in the compute dtype: the tied head, not the embedding table's rows;
    the KV cache it attends over: every slot of the last phase, k and v, in the compute dtype)."""
    size = jnp.dtype(c.compute_dtype).itemsize
    weights = c.num_params() * size
    kv = 2 * c.num_layers * P * G * c.num_kv_heads * (LP + N - 1) * c.resolved_head_dim * size
    return weights, kv


def compiled_decode(config: ModelConfig, devices, unroll: bool, *, fsdp: int = 1,
                    gather_weights: bool = False) -> hlo.HloModule:
    """The compiled generate program's HLO on ``fsdp`` of ``devices`` (the weights sharded as a run shards
    them: ``sharding.state_shardings``; the prompts' rows over fsdp)."""
    mesh = Mesh(np.asarray(devices[:fsdp]).reshape(1, fsdp, 1), ("data", "fsdp", "tensor"))
    rep = NamedSharding(mesh, PartitionSpec())
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda v, sh: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), v),
                         state, state_shardings(state, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
    key = jax.eval_shape(lambda: jax.random.key(0))
    ids = jax.ShapeDtypeStruct((P, LP), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))
    fn = make_generate_fn(graphdef, num_samples=G, max_new_tokens=N, unroll_layers=unroll, min_response_bucket=None,
                          gather_weights=gather_weights)
    with jax.set_mesh(mesh):
        lowered = fn.jitted.lower(state, ids, ids, jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep))
    if devices[0].platform == "tpu":
        from ict_jax.aot.compile import without_persistent_cache

        with without_persistent_cache(True):
            compiled = lowered.compile()
    else:
        compiled = lowered.compile()
    module = hlo.parse_hlo(compiled.as_text())
    assert len(hlo.data_dependent_loops(module)) == 1  # one decode phase
    return module


def compiled_decode_bytes(config: ModelConfig, devices, unroll: bool) -> float:
    return decode_step_cost(compiled_decode(config, devices, unroll)).bytes


def decode_step_gathers(module: hlo.HloModule) -> int:
    """All-gathers in one step of the decode loop (its body and what the body calls)."""
    return hlo.summarize_collectives(hlo.collectives(module, decode_step_multiplicity(module)))["all-gather"]["runs"]


def ratio(config: ModelConfig, step_bytes: float, fsdp: int = 1) -> float:
    """A decode step's bytes over the least it must read a device: every weight (FSDP gathers them all)
    and the device's rows' share of the KV cache."""
    weights, kv = least_bytes(config)
    assert 0.2 < kv / (weights + kv) < 0.5  # both parts matter
    return step_bytes / (weights + kv / fsdp)


def check(config: ModelConfig, step_bytes: float) -> None:
    r = ratio(config, step_bytes)
    assert 1.0 <= r < LIMIT, f"a decode step reads {step_bytes:,.0f} B = {r:.2f}x weights + KV"


def test_cpu_decode_reads_each_weight_once_a_token():
    """CPU: float32 compute (the CPU's setting: XLA CPU emulates bfloat16 by converting whole arrays to
    float32, the KV cache included, at every step) and the unrolled layers, the CPU's default."""
    config = CONFIG.replace(compute_dtype="float32")
    check(config, compiled_decode_bytes(config, jax.devices("cpu"), unroll=True))


@pytest.mark.libtpu
def test_tpu_decode_reads_each_weight_once_a_token():
    from ict_jax.aot.compile import get_target

    check(CONFIG, compiled_decode_bytes(CONFIG, get_target("v5e:2x2").devices, unroll=False))


@pytest.mark.libtpu
def test_tpu_fsdp_decode_gathers_the_weights_once_with_gather_weights():
    """FSDP 4 on a TPU: with ``rollout.gather_weights`` the weights are gathered once, before the loop, and a
    decode step reads them as on one device (1.16x). Without it every step all-gathers every layer's shards
    again: 7.75x with 21 all-gathers a step (docs/sampler.md; not compiled here, for the suite's time)."""
    from ict_jax.aot.compile import get_target

    once = compiled_decode(CONFIG, get_target("v5e:2x2").devices, False, fsdp=4, gather_weights=True)
    assert decode_step_gathers(once) == 0
    r = ratio(CONFIG, decode_step_cost(once).bytes, fsdp=4)
    assert 1.0 <= r < LIMIT, f"a decode step reads {r:.2f}x weights + the device's KV"
