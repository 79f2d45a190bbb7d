"""Matmuls run on their operands' own dtype (docs/architecture.md "Precision"): in the bfloat16 train step
no dot or convolution reads a float32 operand that is a convert of a bfloat16 value, neither in the
program JAX hands the compiler (any backend) nor in the TPU compiler's output (libtpu, one v5p chip).
XLA's CPU backend converts every bfloat16 dot to float32 itself, so its compiled program is not the
one checked. The float32 parity tests (tests/model/test_qwen2.py) cover the values.

Attention's own einsums (``model/attention.py``) are left to its fused kernel (docs/architecture.md
"Attention"); every other matmul is checked."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import pytest

from ict_jax.aot import hlo
from ict_jax.aot.breakdown import Frame, source_frames
from ict_jax.config_load import load_config

RECIPE = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "qwen2p5_0p5b_ict.yaml")
# micro-batches 2: the no-grad statistics pass and the gradient pass; KL on (the recipe's 0.001)
TINY_BF16 = ["model.preset=tiny", "model.compute_dtype=bfloat16", "train.prompts_per_step=4", "rollout.num_samples=4",
             "train.mini_batches=1", "train.micro_batches=2", "rollout.max_prompt_len=8", "rollout.max_new_tokens=24",
             "stats.chunk=8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]

def _step_job(target):
    from ict_jax.aot.compile import build_programs, run_mesh, target_model_config

    cfg = load_config(RECIPE, TINY_BF16)
    mc, _ = target_model_config(cfg, target.platform)
    assert mc.resolved_compute_dtype() == "bfloat16"
    mesh = run_mesh(cfg, target)
    return build_programs(cfg, mc, mesh, ("step",))[0]


def _outside_attention(module: hlo.HloModule, text: str) -> tuple[list[hlo.Upcast], list[hlo.Upcast]]:
    """(upcasts outside model/attention.py, upcasts inside it), by the matmul's innermost ict_jax frame."""
    frames = source_frames(text)
    outside, inside = [], []
    for u in hlo.upcast_matmuls(module):
        ins = next(i for i in module.computations[u.computation] if i.name == u.matmul)
        m = re.search(r"stack_frame_id=(\d+)", ins.text)
        chain = frames.get(int(m.group(1)), ()) if m else ()
        own = next((f for f in chain if "/ict_jax/" in f.file), Frame("?", "?", 0))
        (inside if own.file.endswith("ict_jax/model/attention.py") else outside).append(u)
    return outside, inside


def test_the_bf16_step_program_reads_no_upcast_matmul_operand(devices8):
    """The program as lowered (before any backend's passes): every projection, MLP and vocabulary-head
    matmul, forward and backward, reads bfloat16 operands."""
    import dataclasses

    from ict_jax.aot.compile import get_target

    target = get_target("local")
    target = dataclasses.replace(target, devices=target.devices[:1])  # a 1 x 1 x 1 mesh
    text = _step_job(target).lower().as_text(dialect="hlo", debug_info=True)
    module = hlo.parse_hlo(text)
    outside, _ = _outside_attention(module, text)
    assert not outside, "\n".join(map(str, outside))
    dots = [ins for _, ins in module.instructions() if ins.opcode == "dot"]
    assert sum(1 for d in dots if d.arrays[0].dtype == "bf16") >= 7 * 3  # 7 projections: forward, dx, dW


@pytest.mark.e2e  # a whole program compiled for a TPU: seconds to half a minute
@pytest.mark.libtpu
def test_the_bf16_step_compiled_for_one_tpu_chip_reads_no_upcast_matmul_operand():
    """The TPU compiler's program for one v5p chip (``v5p:1x1x1``, a topology libtpu takes only with
    its chips-per-host bounds): the same, after fusion."""
    from ict_jax.aot.compile import get_target, without_persistent_cache

    target = get_target("v5p:1x1x1")
    assert target.chips == 1 and target.platform == "tpu"
    with without_persistent_cache(True):
        text = _step_job(target).lower().compile().as_text()
    module = hlo.parse_hlo(text)
    outside, _ = _outside_attention(module, text)
    assert not outside, "\n".join(map(str, outside))


def test_upcast_matmuls_follows_fusion_parameters_and_layout_moves():
    """A hand-written module: a dot inside a fusion reads (through a bitcast and a fusion parameter) a
    convert of a bf16 array, another reads a bf16 array as it is, a third mixes f32 and bf16."""
    text = """HloModule m

%fused (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(f32[4,8]{1,0} %p0, f32[8,2]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4,8], b: f32[8,2], c: bf16[8,2]) -> (f32[4,2], bf16[4,2], f32[4,2]) {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %c = bf16[8,2]{1,0} parameter(2)
  %up = f32[4,8]{1,0} convert(bf16[4,8]{1,0} %a)
  %cast = f32[4,8]{1,0} bitcast(f32[4,8]{1,0} %up)
  %f = f32[4,2]{1,0} fusion(f32[4,8]{1,0} %cast, f32[8,2]{1,0} %b), kind=kOutput, calls=%fused
  %ok = bf16[4,2]{1,0} dot(bf16[4,8]{1,0} %a, bf16[8,2]{1,0} %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %mixed = f32[4,2]{1,0} dot(f32[4,8]{1,0} %cast, bf16[8,2]{1,0} %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[4,2]{1,0}, bf16[4,2]{1,0}, f32[4,2]{1,0}) tuple(%f, %ok, %mixed)
}
"""
    found = hlo.upcast_matmuls(hlo.parse_hlo(text))
    assert sorted(u.matmul for u in found) == ["d", "mixed"]
    d = next(u for u in found if u.matmul == "d")
    assert (str(d.operand), str(d.source)) == ("f32[4,8]", "bf16[4,8]")
    # the unoptimised form prints operands bare: the same finding
    bare = text.replace("%", "")
    bare = bare.replace("f32[4,8]{1,0} cast", "cast").replace("bf16[4,8]{1,0} a", "a")
    assert sorted(u.matmul for u in hlo.upcast_matmuls(hlo.parse_hlo(bare))) == ["d", "mixed"]


def test_projection_matmul_returns_the_compute_dtype():
    """``_mm``'s result is the compute dtype itself (not a float32 result cast back), and float32 stays
    float32."""
    import jax

    from ict_jax.model.qwen2 import _mm  # noqa: PLC2701 - the helper under test

    a, b = jnp.ones((3, 4), jnp.bfloat16), jnp.ones((4, 5), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda a, b: _mm(a, b, jnp.bfloat16))(a, b)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.dtype == jnp.bfloat16
    assert not [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
                and e.invars[0] is dots[0].outvars[0]]  # the result is not cast afterwards
    assert _mm(a.astype(jnp.float32), b, jnp.float32).dtype == jnp.float32
