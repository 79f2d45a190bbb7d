"""The statistics pass's memory traffic as the TPU compiler builds it (libtpu, one v5p chip; nothing
runs): the group mean Q is never broadcast to every row of its group ([P, G, C, V]) and a block moves
about as many float32 [B, C, V] arrays as its logits need: written once, read by the logsumexp, by Q's
sum and by each row's JS, H1 and H2 (docs/benchmarks.md "The step's bytes by category"; the values are
tests/rl/test_token_stats.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ict_jax.aot import hlo
from ict_jax.aot.cost import cost
from ict_jax.rl.token_stats import stats_from_hidden

pytestmark = pytest.mark.libtpu
P, G, T, C, D, V = 4, 8, 256, 128, 128, 8192


def test_the_statistics_pass_broadcasts_no_group_mean_and_reads_its_logits_a_few_times():
    from ict_jax.aot.compile import get_target, without_persistent_cache

    target = get_target("v5p:1x1x1")
    mesh = jax.sharding.Mesh(np.asarray(target.devices).reshape(1), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    B = P * G
    args = [jax.ShapeDtypeStruct(s, dt, sharding=sh) for s, dt in
            (((B, T, D), jnp.bfloat16), ((D, V), jnp.bfloat16), ((B, T), jnp.int32), ((B, T), jnp.float32))]

    def stats(h, w, tok, val):
        return stats_from_hidden(jax.lax.stop_gradient(h), jax.lax.stop_gradient(w), tok, val, group_size=G,
                                 chunk=C, compute=("logp", "H1", "H2", "js"))

    with without_persistent_cache(True):
        text = jax.jit(stats, out_shardings=sh).lower(*args).compile().as_text()
    module = hlo.parse_hlo(text)
    control = {module.entry} | {c for _, i in module.instructions() for k, c in hlo.callees(module, i)
                                if k in ("body", "condition")}
    spread = [(c, i.name, str(i.arrays[0])) for c in control for i in module.computations[c]
              if i.opcode == "broadcast" and i.arrays and i.arrays[0].elements >= B * C * V]
    assert not spread, spread
    blocks = T // C
    logits = blocks * B * C * V * 4  # one float32 pass over every block's logits
    passes = cost(module).bytes / logits
    assert passes < 7.5, f"{passes:.1f} passes over the logits (10.5 with Q broadcast to every row)"
