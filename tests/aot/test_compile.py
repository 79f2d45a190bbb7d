"""``ict-jax compile``. The HLO reader against a hand-written module, topology names and
``mesh.target``, the analytic estimates, compiling a run's programs for the local devices (8 CPU
devices) and, with the tpu extra (libtpu), for a TPU v5e slice: memory, fit, collectives and the
memory-discipline checks; exit codes 0 / 2 / 3 of the command."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from ict_jax.aot import cost, hlo
from ict_jax.aot.compile import PROGRAMS, Target, compile_run, get_target, run_programs
from ict_jax.aot.fit import candidate_settings, estimate_memory, estimate_seconds, search
from ict_jax.config import ConfigError, parse_topology
from ict_jax.config_load import load_config
from ict_jax.model.config import ModelConfig
from ict_jax.train.programs import per_device_bytes

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
RECIPE = str(CONFIGS / "qwen2p5_0p5b_ict.yaml")
# The 0.5B recipe shrunk to the tiny preset: P = 16 prompts of G = 8, 32 + 40 tokens, 2 micro-batches
# (the no-grad statistics pass and gradient accumulation), KL on (the reference parameters), FSDP.
# 40 response positions and chunk 16 keep every dimension of the statistics distinct from the model's.
TINY = ["model.preset=tiny", "train.prompts_per_step=16", "train.mini_batches=1", "train.micro_batches=2",
        "rollout.max_prompt_len=32", "rollout.max_new_tokens=40", "stats.chunk=16", "data.eval_n=4"]

# ------------------------------------------------------------------------------------------------
# The HLO reader, on a hand-written module
# ------------------------------------------------------------------------------------------------
HLO = """HloModule jit_f, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %c3 = s32[] constant(3)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c3), direction=LT
}

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[32,16]{1,0:T(8,128)} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %ar = f32[8,16]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar)
}

%outer_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %c5 = s32[] constant(5)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c5), direction=LT
}

%outer_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[8,16]{1,0}) while(%p), condition=%inner_cond, body=%inner_body
}

%decode_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  ROOT %any = pred[] custom-call(%x), custom_call_target="data_dependent"
}

%decode_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %cp = bf16[8,16]{1,0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %t2 = (s32[], f32[8,16]{1,0}) tuple(%x, %x)
}

ENTRY %main (x: f32[8,16], y: bf16[4,1000]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %y = bf16[4,1000]{1,0} parameter(1)
  %ags = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%x), channel_id=4, dimensions={0}
  %agd = f32[32,16]{1,0} all-gather-done(%ags)
  %rs = f32[2,16]{1,0} reduce-scatter(%x), channel_id=5, dimensions={0}, to_apply=%add
  %ars = (f32[8,16]{1,0}, bf16[4,1000]{1,0}) all-reduce-start(%x, %y), channel_id=6, to_apply=%add
  %ard = (f32[8,16]{1,0}, bf16[4,1000]{1,0}) all-reduce-done(%ars)
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1}}
  %cpd = f32[8,16]{1,0} collective-permute-done(%cps)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,16]{1,0}) tuple(%z, %x)
  %w1 = (s32[], f32[8,16]{1,0}) while(%t), condition=%outer_cond, body=%outer_body
  %w2 = (s32[], f32[8,16]{1,0}) while(%t), condition=%decode_cond, body=%decode_body
  %big = f32[4,7,1000]{2,1,0} broadcast(%y), dimensions={0,2}
  ROOT %r = f32[8,16]{1,0} get-tuple-element(%w1), index=1
}
"""


def test_hlo_reader_counts_loops_collectives_and_parameters():
    m = hlo.parse_hlo(HLO)
    assert m.entry == "main" and len(m.computations) == 8
    mult, unknown = hlo.multiplicity(m)
    # outer loop 5 x inner loop 3; the decode loop's trip count is data-dependent: counted once
    assert (mult["outer_body"], mult["inner_body"], mult["inner_cond"], mult["decode_body"]) == (5, 15, 15, 1)
    assert unknown == 1
    assert mult["add"] == 15 + 1 + 1  # to_apply of the inner all-reduce (15 runs), reduce-scatter, async all-reduce
    s = hlo.summarize_collectives(hlo.collectives(m, mult))
    # all-gather: one in the inner body (15 runs of 32x16 f32 = 2 KiB) + the async start (its result only)
    assert s["all-gather"] == {"count": 2, "runs": 16, "bytes": 16 * 32 * 16 * 4, "largest": 32 * 16 * 4}
    # async all-reduce: its result is the reduced operands (all of them); -done not counted
    assert s["all-reduce"] == {"count": 2, "runs": 16, "bytes": 15 * 8 * 16 * 4 + (8 * 16 * 4 + 4 * 1000 * 2),
                               "largest": 8 * 16 * 4 + 4 * 1000 * 2}
    assert s["reduce-scatter"] == {"count": 1, "runs": 1, "bytes": 2 * 16 * 4, "largest": 2 * 16 * 4}
    # the decode body's bf16 permute + the async one (its result, not its operand or context)
    assert s["collective-permute"] == {"count": 2, "runs": 2, "bytes": 8 * 16 * 2 + 8 * 16 * 4, "largest": 8 * 16 * 4}
    assert s["all-to-all"]["count"] == 0
    assert [str(a) for a in hlo.entry_parameters(m)] == ["f32[8,16]", "bf16[4,1000]"]
    assert sum(a.bytes for a in hlo.entry_parameters(m)) == 8 * 16 * 4 + 4 * 1000 * 2
    hits = hlo.arrays_with_dim(m, 1000)
    assert str(hits[0][0]) == "f32[4,7,1000]" and hits[0][2] == "big"


COST_HLO = """HloModule jit_g

%slice_layer (p0: f32[4,8,16], p1: s32[]) -> f32[8,16] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,16}
  ROOT %b = f32[8,16]{1,0} bitcast(%ds)
}

%write_row (q0: f32[64,16], q1: f32[2,16], q2: s32[]) -> f32[64,16] {
  %q0 = f32[64,16]{1,0} parameter(0)
  %q1 = f32[2,16]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z2 = s32[] constant(0)
  ROOT %dus = f32[64,16]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z2)
}

%cond (c: (s32[], f32[4,8,16], f32[2,8], f32[64,16])) -> pred[] {
  %c = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}, f32[64,16]{1,0}) parameter(0)
  %n = s32[] constant(4)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

%body (t: (s32[], f32[4,8,16], f32[2,8], f32[64,16])) -> (s32[], f32[4,8,16], f32[2,8], f32[64,16]) {
  %t = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}, f32[64,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = f32[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %x = f32[2,8]{1,0} get-tuple-element(%t), index=2
  %out = f32[64,16]{1,0} get-tuple-element(%t), index=3
  %layer = f32[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_layer
  %y = f32[2,16]{1,0} dot(%x, %layer), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %out2 = f32[64,16]{1,0} fusion(%out, %y, %i), kind=kLoop, calls=%write_row
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}, f32[64,16]{1,0}) tuple(%i2, %w, %x, %out2)
}

ENTRY %main (w: f32[4,8,16], x: f32[2,8], o: f32[64,16]) -> f32[64,16] {
  %w = f32[4,8,16]{2,1,0} parameter(0)
  %x = f32[2,8]{1,0} parameter(1)
  %o = f32[64,16]{1,0} parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}, f32[64,16]{1,0}) tuple(%z, %w, %x, %o)
  %loop = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}, f32[64,16]{1,0}) while(%init), condition=%cond, body=%body
  %res = f32[64,16]{1,0} get-tuple-element(%loop), index=3
  ROOT %c = f32[64,16]{1,0} copy(%res)
}
"""


def test_cost_multiplies_loop_trips_and_counts_what_slices_and_in_place_updates_touch():
    """FLOPs of the dot x 4 trips; bytes: a fusion that slices one layer of a stacked weight reads that
    layer, not the stack; an in-place dynamic-update-slice reads and writes its update, not the buffer."""
    m = hlo.parse_hlo(COST_HLO)
    c = cost.cost(m)
    assert c.flops == 4 * 2 * (2 * 16) * 8  # 4 trips x 2 x result elements x contracted size
    layer, x, y, row = 8 * 16 * 4, 2 * 8 * 4, 2 * 16 * 4, 2 * 16 * 4
    per_trip = ((layer + 4) + layer  # the slicing fusion: one layer (+ the index) read, one written
                + (x + layer) + y  # the dot
                + (row + 4) + row  # the in-place update: the row (+ the index) read, the row written
                + 3 * 4)  # the counter's add: two operands, one result
    compare = 4 + 4 + 1  # the condition's compare (counted once a trip, as the body)
    whole = 64 * 16 * 4
    assert c.bytes == 4 * (per_trip + compare) + 2 * whole  # + the final copy
    # cost_analysis's error, which the roofline avoids: the loop body counted once
    assert cost.cost(m, {k: int(v > 0) for k, v in hlo.multiplicity(m)[0].items()}).flops == c.flops / 4
    # one iteration from its body: what a decode step costs
    body = cost.cost(m, hlo.multiplicity(m, root="body")[0])
    assert body.flops == c.flops / 4 and body.bytes == per_trip


def test_an_asynchronous_fusion_costs_what_the_same_fusion_costs():
    """XLA GPU starts a fusion that slices one layer of a stacked weight asynchronously (``fusion-start``,
    whose result tuple names the whole stack, then ``fusion-done``): counted like the plain fusion, one
    layer read and written, not the stack."""
    sync = "  %layer = f32[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_layer\n"
    async_ = ("  %ls = ((f32[4,8,16]{2,1,0}, s32[]), f32[8,16]{1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, "
              "calls=%slice_layer\n  %layer = f32[8,16]{1,0} fusion-done(%ls)\n")
    assert sync in COST_HLO
    m = hlo.parse_hlo(COST_HLO.replace(sync, async_))
    assert [i.opcode for i in m.computations["body"] if i.name in ("ls", "layer")] == ["fusion-start", "fusion-done"]
    assert cost.cost(m) == cost.cost(hlo.parse_hlo(COST_HLO))


def test_asynchronous_copies_and_slices_cost_what_their_synchronous_forms_cost():
    """A copy-start's result tuple is (destination, source, context), a slice-start's ((operand), slice,
    context): neither echo is traffic. Each counts as the plain copy (read + write the array) and slice
    (read + write the slice)."""
    def module(copy: str, slice_: str) -> str:
        return f"""HloModule a

ENTRY %main (a: f32[4,8]) -> (f32[1,8], f32[4,8]) {{
  %a = f32[4,8]{{1,0}} parameter(0)
{slice_}
{copy}
  ROOT %t = (f32[1,8]{{1,0}}, f32[4,8]{{1,0}}) tuple(%s, %c)
}}
"""
    sync = module("  %c = f32[4,8]{1,0} copy(%a)", "  %s = f32[1,8]{1,0} slice(%a), slice={[0:1], [0:8]}")
    async_ = module("  %cs = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[]) copy-start(%a)\n"
                    "  %c = f32[4,8]{1,0} copy-done(%cs)",
                    "  %ss = ((f32[4,8]{1,0}), f32[1,8]{1,0}, s32[]) slice-start(%a), slice={[0:1], [0:8]}\n"
                    "  %s = f32[1,8]{1,0} slice-done(%ss)")
    assert cost.cost(hlo.parse_hlo(sync)).bytes == 2 * (4 * 8 * 4) + 2 * (8 * 4)
    assert cost.cost(hlo.parse_hlo(async_)) == cost.cost(hlo.parse_hlo(sync))


def test_convolution_flops_skip_the_holes_of_a_dilated_input():
    """XLA's TPU backend writes batched matmuls as convolutions with strides, padding and lhs dilation:
    only the kernel positions that meet a real input element count (here half of them)."""
    conv = """HloModule c

ENTRY %main (a: f32[1,3,1], k: f32[2,1,1]) -> f32[1,4,1] {
  %a = f32[1,3,1]{2,1,0} parameter(0)
  %k = f32[2,1,1]{2,1,0} parameter(1)
  ROOT %c = f32[1,4,1]{2,1,0} convolution(%a, %k), window={size=2 lhs_dilate=2}, dim_labels=b0f_0io->b0f
}
"""
    # the dilated input is [x0, _, x1, _, x2]: each of the 4 outputs meets one real element of its 2 taps
    assert cost.cost(hlo.parse_hlo(conv)).flops == 2 * 4
    dot = conv.replace("window={size=2 lhs_dilate=2}, dim_labels=b0f_0io->b0f", "dim_labels=bf_io->bf")
    dot = dot.replace("f32[1,3,1]", "f32[2,3]").replace("f32[2,1,1]", "f32[3,4]").replace("f32[1,4,1]", "f32[2,4]")
    dot = dot.replace("{2,1,0}", "{1,0}")
    assert cost.cost(hlo.parse_hlo(dot)).flops == 2 * 2 * 4 * 3  # a plain matmul written as a convolution


STEP_HLO = """HloModule steps

%cond (p: (u32[], f32[4])) -> pred[] {
  %p = (u32[], f32[4]{0}) parameter(0)
  %limit = u32[] constant(8)
  %i = u32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%by_two (p: (u32[], f32[4])) -> (u32[], f32[4]) {
  %p = (u32[], f32[4]{0}) parameter(0)
  %two = u32[] constant(2)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %next = u32[] add(%i, %two)
  ROOT %t = (u32[], f32[4]{0}) tuple(%next, %x)
}

%by_one (p: (u32[], f32[4])) -> (u32[], f32[4]) {
  %p = (u32[], f32[4]{0}) parameter(0)
  %one = u32[] constant(1)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %next = u32[] add(%one, %i)
  ROOT %t = (u32[], f32[4]{0}) tuple(%next, %x)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %zero = u32[] constant(0)
  %five = u32[] constant(5)
  %t0 = (u32[], f32[4]{0}) tuple(%zero, %x)
  %t5 = (u32[], f32[4]{0}) tuple(%five, %x)
  %w2 = (u32[], f32[4]{0}) while(%t0), condition=%cond, body=%by_two
  %w1 = (u32[], f32[4]{0}) while(%t5), condition=%cond, body=%by_one
  ROOT %r = f32[4]{0} get-tuple-element(%w2), index=1
}
"""


def test_trip_counts_read_the_counters_start_and_step():
    """XLA's windowed einsum loops (FSDP's collective matmuls on a TPU) are unrolled by two: their counter
    runs 0, 2, 4, 6 against a limit of 8, four trips, not eight (reading it as eight counted the 0.5B
    recipe's step at ~1.9x its FLOPs); a counter that starts at 5 runs three trips to 8."""
    m = hlo.parse_hlo(STEP_HLO)
    trips = {ins.name: hlo.trip_count(m, ins) for _, ins in m.instructions() if ins.opcode == "while"}
    assert trips == {"w2": 4, "w1": 3}
    mult, unknown = hlo.multiplicity(m)
    assert (mult["by_two"], mult["by_one"], unknown) == (4, 3, 0)


def test_assumed_trip_counts_for_data_dependent_loops():
    m = hlo.parse_hlo(HLO)
    assert [ins.name for ins in hlo.data_dependent_loops(m)] == ["w2"]
    mult, unknown = hlo.multiplicity(m, trips=[7])
    assert mult["decode_body"] == 7 and unknown == 0
    assert hlo.multiplicity(m, trips=[7, 8])[1] == 1  # a count per loop, or none assumed


def test_parse_arrays_reads_tuples_and_ignores_layouts():
    arrays = hlo.parse_arrays("(f32[2,3]{1,0:T(8,128)S(1)}, bf16[]{:T(128)}, pred[7]{0})")
    assert [(a.dtype, a.dims, a.bytes) for a in arrays] == [("f32", (2, 3), 24), ("bf16", (), 2), ("pred", (7,), 7)]


# ------------------------------------------------------------------------------------------------
# Topology names and mesh.target
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [("v5e:2x4", ("v5e", (2, 4))), ("v5p:2x2x1", ("v5p", (2, 2, 1))),
                                            ("v6e:4x8", ("v6e", (4, 8))), ("v4:2x2x2", ("v4", (2, 2, 2)))])
def test_parse_topology(name, expected):
    assert parse_topology(name) == expected


@pytest.mark.parametrize("name", ["v5e:2x2x1", "v5p:2x2", "v9:2x2", "v5e-8", "v5e:0x4", "v5e:2xa", "local", ""])
def test_bad_topology_names(name):
    with pytest.raises(ConfigError, match="not a TPU topology name"):
        parse_topology(name)


@pytest.mark.parametrize("gen, chips, name", [("v5e", 8, "v5litepod-8"), ("v6e", 8, "v6e-8"), ("v5p", 4, "v5p-8"),
                                              ("v4", 4, "v4-8")])
def test_accelerator_type_names_the_slice_as_cloud_tpu_does(gen, chips, name):
    from ict_jax.platform import accelerator_type

    assert accelerator_type(gen, chips) == name


def test_mesh_target_is_validated():
    assert load_config(RECIPE).mesh.target == "v5e:2x4"
    assert load_config(RECIPE, ["mesh.target=null"]).mesh.target is None
    with pytest.raises(ConfigError, match=r"^mesh.target: 'v5e-8' is not a TPU topology name") as e:
        load_config(RECIPE, ["mesh.target=v5e-8"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("size", ["0p5b", "1p5b", "7b"])
def test_every_qwen_recipe_names_its_slice(size):
    paths = sorted(CONFIGS.glob(f"qwen2p5_{size}_*.yaml"))
    assert paths, f"no qwen2p5_{size}_*.yaml recipe in {CONFIGS}"  # an empty glob must not pass
    for path in paths:
        gen, dims = parse_topology(load_config(path).mesh.target)
        assert gen in ("v5e", "v5p", "v6e", "v4") and np.prod(dims) >= 4, path.name


# ------------------------------------------------------------------------------------------------
# Analytic estimates and candidate settings (no compilation)
# ------------------------------------------------------------------------------------------------
def _ov(data=1, fsdp=8, tensor=1, micro=4, remat="block", chunk=128):
    return {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "train.micro_batches": micro,
            "model.remat": remat, "stats.chunk": chunk}


def test_memory_estimate_moves_the_right_way():
    cfg = load_config(RECIPE)
    mc = ModelConfig.qwen2p5_0p5b(compute_dtype="bfloat16")
    step = lambda **kw: estimate_memory(cfg.replace(**{"stats.chunk": kw.get("chunk", 128)}), mc, _ov(**kw))["step"]  # noqa: E731
    assert step(micro=8) < step(micro=4) < step(micro=2)
    assert step(remat="full") < step(remat="block") < step(remat="none")
    assert step(chunk=32) < step(chunk=64) < step(chunk=128)
    assert step(data=1, fsdp=8) < step(data=8, fsdp=1)  # sharded state
    # blocked attention holds a block of keys' scores, not the layer's whole T x T matrix (model.attention)
    blocked = estimate_memory(cfg, mc.replace(attention="blocked", attention_block=128), _ov())["step"]
    assert blocked < step() and blocked < estimate_memory(cfg, mc.replace(attention="blocked", attention_block=512),
                                                          _ov())["step"]


def test_the_sft_step_estimate_holds_one_optimizer_state_and_grows_with_its_batch():
    """The SFT step's estimate: its batch (train.sft_batch_size) and remat move it; micro-batches, the
    rollout's chunks and the KL reference do not (none of them exists during the warm start); with it
    among the programs, the knobs left to change name its batch."""
    from ict_jax.aot.fit import no_fit_hint

    cfg = load_config(RECIPE, ["train.sft_steps=10"])
    mc = ModelConfig.qwen2p5_0p5b(compute_dtype="bfloat16")

    def sft(bs=32, kl=0.001, **kw):
        return estimate_memory(cfg.replace(**{"train.sft_batch_size": bs, "rl.loss.kl_coef": kl}), mc, _ov(**kw))["sft"]

    assert sft(bs=16) < sft(bs=32) < sft(bs=64)
    assert sft(remat="full") < sft(remat="block") < sft(remat="none")
    assert sft(micro=2) == sft(micro=8) and sft(kl=0.0) == sft(kl=0.1)
    assert sft(bs=8) < estimate_memory(cfg, mc, _ov())["step"]  # the train step's state adds the reference
    assert "lower train.sft_batch_size, train.prompts_per_step" in no_fit_hint(False, sft=True)
    assert "sft_batch_size" not in no_fit_hint(False)


def test_rollout_chunks_trade_generate_memory_for_decode_time():
    """generate's row chunking: the sampler's estimate falls with rollout.chunks, the step's does not
    move, and the estimated time grows (more decode loops), so --fit takes it only when needed."""
    cfg = load_config(RECIPE)
    mc = ModelConfig.qwen2p5_0p5b(compute_dtype="bfloat16")
    target = Target("v5e:2x4", "tpu", tuple(range(8)), "TPU v5 lite", 16 * 1024 ** 3, "v5e")
    mem = {c: estimate_memory(cfg, mc, {**_ov(), "rollout.chunks": c}) for c in (1, 2, 4)}
    assert mem[4]["generate"] < mem[2]["generate"] < mem[1]["generate"]
    assert mem[1]["step"] == mem[4]["step"] and mem[1]["eval"] == mem[4]["eval"]
    secs = [estimate_seconds(cfg, mc, {**_ov(), "rollout.chunks": c}, target) for c in (1, 2, 4)]
    assert secs[0] < secs[1] < secs[2]


def test_candidate_settings_follow_the_train_steps_geometry(devices8):
    """Every candidate passes the train step's own check (whole groups per shard in a mini-batch, as
    many rows on every shard in a micro-batch), and micro-batches of part of a group are among them."""
    from ict_jax.rl.train_step import check_batch_geometry
    from ict_jax.sharding import make_mesh

    cfg = load_config(RECIPE)
    mc = ModelConfig.qwen2p5_0p5b()
    settings = candidate_settings(cfg, mc, 8)
    assert settings
    t, G = cfg.train, cfg.rollout.num_samples
    for s in settings:
        assert s["mesh.data"] * s["mesh.fsdp"] * s["mesh.tensor"] == 8
        assert mc.num_kv_heads % s["mesh.tensor"] == 0
        mesh = make_mesh(s["mesh.data"], s["mesh.fsdp"], s["mesh.tensor"], devices=devices8)
        check_batch_geometry(t.prompts_per_step * G, G, t.mini_batches, s["train.micro_batches"], mesh)
    shards = {(s["mesh.data"] * s["mesh.fsdp"], s["train.micro_batches"]) for s in settings}
    assert (8, 16) in shards  # 256 rows / 16 = 16 rows a micro-batch: 2 rows of a group of 8 a shard
    assert {s["model.remat"] for s in settings} == {"none", "block", "full"}
    assert {(s["mesh.data"], s["mesh.fsdp"]) for s in settings if s["mesh.tensor"] == 1} >= {(8, 1), (1, 8), (2, 4)}
    for s in settings:  # every generate call of P / rollout.chunks prompts holds whole prompts on every shard
        assert (t.prompts_per_step // s["rollout.chunks"]) % (s["mesh.data"] * s["mesh.fsdp"]) == 0
    assert {s["rollout.chunks"] for s in settings} == {1, 2, 4, 8}


# ------------------------------------------------------------------------------------------------
# Compiling for the local devices (8 CPU devices): the machinery and the checks, in seconds
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def local_reports(devices8):
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4"])
    return compile_run(cfg, get_target("local"))  # the programs the run executes: no SFT in the recipe


def test_local_generate_with_rollout_chunks_holds_a_smaller_cache(local_reports, devices8):
    """rollout.chunks = 2: the compiled sampler takes P / 2 prompts and its KV cache holds half the rows
    (the kv cache check finds the smaller cache at its expected shape)."""
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4", "rollout.chunks=2"])
    (gen2,), _ = compile_run(cfg, get_target("local"), ("generate",))
    gen1 = local_reports[0][1]
    kv1, kv2 = (next(c for c in r.checks if c.name == "kv cache") for r in (gen1, gen2))
    assert kv1.ok and kv2.ok
    rows1, rows2 = (int(c.detail.split("[")[1].split(",")[1]) for c in (kv1, kv2))  # [layers, rows, ...]
    assert rows1 == 2 * rows2 == 16 * 8 // 8  # P x G rows over 8 shards, then half of them
    assert gen2.temporaries < gen1.temporaries


@pytest.mark.parametrize("gather", ["auto", True])
def test_a_gathering_sampler_that_does_not_fit_is_compiled_without_gathering_under_auto(monkeypatch, devices8,
                                                                                       gather):
    """``rollout.gather_weights: auto`` on an FSDP mesh: a sampler whose gathered program does not fit is
    built again without gathering and compiled, and its report says why, as the run's pre-flight decides
    (tests/train/test_preflight.py); asked for explicitly (true) it is reported as not fitting. Hand-made
    reports in place of the compiles: only the decision is under test."""
    from ict_jax.aot import compile as aot_compile

    built, calls = [], []
    real_build = aot_compile.build_programs

    def build(cfg, mc, mesh, names, response_len=None):
        built.append((tuple(names), cfg.rollout.gather_weights))
        return real_build(cfg, mc, mesh, names, response_len)

    def fake_compile(program, target, mesh, **kwargs):
        calls.append(program.name)
        fits = program.name != "generate" or calls.count("generate") > 1
        return aot_compile.ProgramReport(program=program.name, target=target.name, mesh=dict(mesh.shape),
                                         compiled=True, fits=fits, hbm=1 << 20, arguments=2 << 20 if not fits else 0,
                                         temporaries=0, outputs=0, aliased=0, code=0)

    monkeypatch.setattr(aot_compile, "build_programs", build)
    monkeypatch.setattr(aot_compile, "compile_program", fake_compile)
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4"]).replace(**{"rollout.gather_weights": gather})
    reports, _ = compile_run(cfg, get_target("local"), ("step", "generate"))
    by = {r.program: r for r in reports}
    if gather == "auto":
        assert calls == ["step", "generate", "generate"] and built[-1] == (("generate",), False)
        assert by["generate"].fits and by["generate"].note == ("rollout.gather_weights auto: off, since gathering "
                                                               "the weights does not fit (2.0 MiB live a device > "
                                                               "1.0 MiB)")
    else:
        assert calls == ["step", "generate"] and len(built) == 1
        assert not by["generate"].fits and by["generate"].note is None
    assert by["step"].note is None


def test_local_compile_reports_every_program(local_reports):
    reports, source = local_reports
    assert source.startswith("preset tiny")
    assert [r.program for r in reports] == ["step", "generate", "eval"] == list(PROGRAMS[1:])
    budget = get_target("local").budget  # the pre-flight's budget (docs/memory.md; the tests fix it: conftest)
    assert budget is not None and budget.devices == 8
    for r in reports:  # CPU: each device's share of the host's memory (read live: it moves between reads)
        assert r.compiled and r.fits and 0 < r.hbm <= budget.budget.total // 8
        assert r.temporaries > 0 and r.arguments > 0 and r.compile_s > 0
        assert r.live == r.arguments + r.outputs - r.aliased + r.temporaries + r.code + r.resident
        assert r.mesh == {"data": 2, "fsdp": 4, "tensor": 1}
        failed = [c for c in r.checks if not c.ok]
        assert not failed, f"{r.program}: {failed}"
    step, gen, ev = reports
    assert step.aliased > 0  # the donated state
    assert step.resident == 0 and gen.resident == ev.resident > 0  # optimizer state + reference stay on device
    assert {c.name for c in step.checks} == {"arguments", "no [rows, T, V]", "layer-wise gathers"}
    assert {c.name for c in gen.checks} == {"arguments", "no [rows, T, V]", "kv cache"}
    assert step.collectives["all-gather"]["count"] > 0  # FSDP gathers the weights


def test_roofline_counts_the_steps_flops_as_the_analytic_model_does(local_reports):
    """The step's matmul FLOPs counted from its compiled HLO (loop trip counts multiplied in, 8 devices)
    against ``aot.fit.step_flops``, the analytic count of what the step computes: 2 x matmul parameters x
    tokens a forward pass, attention's full T x T scores, the vocabulary head over the response
    positions; the reference, old-policy and statistics passes (two micro-batches: not fused) are three
    forwards, the gradient pass three more, plus remat block's recomputation. So the HLO count is ~2x the
    textbook 6 N tokens (which counts one forward and one backward: 3 forwards), the ratio the analytic
    model predicts; counting the layer scan's body once would give about half."""
    from ict_jax.aot.compile import target_model_config
    from ict_jax.aot.fit import current_overrides, step_flops

    reports, _ = local_reports
    step, gen, ev = reports
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4"])
    mc = target_model_config(cfg, "cpu")[0]
    analytic = step_flops(cfg, mc, current_overrides(cfg, step.mesh))
    counted = step.roofline.flops * 8  # per device -> all 8
    assert 0.95 < counted / analytic < 1.1, (counted, analytic)
    six_nd = 6 * mc.num_params() * 16 * 8 * (32 + 40)
    assert step.roofline.model_flops * 8 == pytest.approx(six_nd)
    assert counted / six_nd == pytest.approx(analytic / six_nd, rel=0.1) and 1.8 < analytic / six_nd < 2.6
    assert step.roofline.chip is None and step.roofline.bound_s is None  # a CPU: counts, no chip figures
    # the samplers: every row to max_new_tokens, the decode phases at their lengths (16, 32, 40 windows)
    assert gen.roofline.decode_steps == (15, 16, 8) and gen.roofline.unknown_loops == 0
    assert gen.roofline.model_flops * 8 == pytest.approx(2 * mc.num_params() * 16 * 8 * 40)
    assert 0.9 < gen.roofline.flops / gen.roofline.model_flops < 1.6  # + attention over the cache, the prefill
    assert gen.roofline.decode_ratio > 1.0
    assert ev.roofline.decode_steps == gen.roofline.decode_steps


def test_a_run_with_sft_steps_compiles_the_sft_step_first_and_it_keeps_the_discipline(devices8):
    """With train.sft_steps the run executes the SFT step before anything else: compile's default programs
    start with it; compiled (FSDP over 4 of the 8 devices) it takes the parameters, the SFT optimizer's
    state and its batch, nothing of RL's stays resident beside it, and it keeps the step's memory
    discipline (no dense [rows, T, V] logits, layer-wise gathers)."""
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4", "train.sft_steps=10", "train.sft_batch_size=16"])
    assert run_programs(cfg) == PROGRAMS == ("sft", "step", "generate", "eval")
    (sft,), _ = compile_run(cfg, get_target("local"), ("sft",))
    assert sft.program == "sft" and sft.compiled and sft.fits and sft.resident == 0 and sft.aliased > 0
    assert sft.positions == 32 + 40 - 1  # the log-probs of every position after the first
    assert {c.name for c in sft.checks} == {"arguments", "no [rows, T, V]", "layer-wise gathers"}
    failed = [c for c in sft.checks if not c.ok]
    assert not failed, failed
    assert sft.collectives["all-gather"]["count"] > 0  # FSDP gathers the weights


@pytest.mark.e2e
def test_step_at_a_smaller_response_bucket(local_reports):
    """The step is built at the largest response bucket by default (max_new_tokens = 40: the
    run's memory); ``response_len`` builds another, which needs less."""
    full = local_reports[0][0]
    assert full.positions == 40
    cfg = load_config(RECIPE, TINY + ["mesh.data=2", "mesh.fsdp=4"])
    (small,), _ = compile_run(cfg, get_target("local"), ("step",), response_len=16)
    assert small.positions == 16 and small.compiled and all(c.ok for c in small.checks)
    assert small.temporaries < full.temporaries
    with pytest.raises(ValueError, match="response_len 41: the step's response bucket is 1..rollout.max_new_tokens=40"):
        compile_run(cfg, get_target("local"), ("step",), response_len=41)


# ------------------------------------------------------------------------------------------------
# --fit on the local devices with an artificial memory limit
# ------------------------------------------------------------------------------------------------
def test_fit_returns_the_cheapest_setting_that_fits(local_reports):
    """Local CPU compiles are seconds: the limit is set between the memory of the cheapest candidate
    and that of a frugal one, so the search must skip or reject the cheap ones and confirm a frugal
    one by compiling."""
    cfg = load_config(RECIPE, TINY)
    local = get_target("local")
    step = local_reports[0][0]
    limit = int(step.live * 0.9)  # below the (data 2, fsdp 4, micro 2, block) setting compiled above
    target = dataclasses.replace(local, hbm_bytes=limit)
    result = search(cfg, target, programs=("step",), max_compiles=6)
    assert result.best is not None, result.tried
    assert result.reports[0].live <= limit
    assert result.tried[-1]["fits"] and all(not t["fits"] for t in result.tried[:-1])
    seconds = [t["estimated_seconds"] for t in result.tried]
    assert seconds == sorted(seconds)  # tried cheapest first


def test_fit_says_what_to_change_when_no_setting_is_estimated_to_fit():
    """A budget below every candidate's estimate: nothing is compiled, and the answer names the knobs --fit
    does not vary (and LoRA, unless the run has it) instead of "none of the 0 settings compiled fits"."""
    from ict_jax.aot.fit import format_fit

    target = dataclasses.replace(get_target("local"), hbm_bytes=1024 ** 2)  # 1 MiB
    for lora in (False, True):
        cfg = load_config(RECIPE, TINY + [f"model.lora.enabled={str(lora).lower()}"])
        result = search(cfg, target, programs=("step",), max_compiles=2)
        assert result.best is None and result.tried == [] and result.lora is lora
        line = format_fit(result)
        assert "\n" not in line and line.startswith(f"--fit: none of the {result.candidates} settings of ")
        assert "is estimated to fit local with 5% headroom, so none was compiled; lower train.prompts_per_step" in line
        assert ("model.lora.enabled=true" in line) is not lora


# ------------------------------------------------------------------------------------------------
# The command line: exit codes and one-line errors
# ------------------------------------------------------------------------------------------------
def _cli(argv, capsys):
    from ict_jax.cli.main import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, message", [
    (["--topology", "v9:2x2"], "'v9:2x2' is not a TPU topology name"),
    (["mesh.data=-1", "mesh.fsdp=3"], "does not divide the 8 devices"),
    (["--program", "step", "train.micro_batches=3"], "train.micro_batches: 3 does not divide"),
    (["--response-len", "41"], "--response-len 41: the step's response bucket is 1..rollout.max_new_tokens=40"),
    (["--response-len", "16", "--fit"], "--response-len and --fit"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    rc, _, err = _cli(["compile", "--config", RECIPE, "--topology", "local"] + TINY + argv, capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("ict-jax compile: error:") and message in err


def test_missing_libtpu_names_the_extra(monkeypatch, capsys):
    import ict_jax.aot.compile as tc

    monkeypatch.setattr(tc.importlib.util, "find_spec", lambda name: None)
    rc, _, err = _cli(["compile", "--config", RECIPE, "--topology", "v5e:2x2"] + TINY, capsys)
    assert rc == 2 and "pip install -e '.[tpu]' in the ict_jax checkout" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# The real TPU compiler (libtpu): the tiny preset on v5e:2x2, and a config made not to fit
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tpu_reports():
    # dense attention: the roofline counts the HLO's matmuls, and a Pallas kernel's (splash, what auto picks
    # on a TPU) sit inside one custom call it cannot see; the splash step's own compile and discipline:
    # tests/model/test_fused_attention.py
    cfg = load_config(RECIPE, TINY + ["mesh.data=1", "mesh.fsdp=-1", "model.attention=dense"])
    target = get_target("v5e:2x2")
    return cfg, target, compile_run(cfg, target)[0]


@pytest.mark.e2e  # a whole program compiled for a TPU: seconds to half a minute
@pytest.mark.libtpu
def test_tiny_preset_compiles_for_v5e_and_keeps_memory_discipline(tpu_reports):
    cfg, target, reports = tpu_reports
    assert target.platform == "tpu" and target.chips == 4 and target.device_kind == "TPU v5 lite"
    assert target.hbm_bytes == int(15.75 * 1024 ** 3)  # what the compiler reports for a v5e chip
    for r in reports:
        assert r.compiled and r.fits and r.live < target.hbm_bytes
        failed = [c for c in r.checks if not c.ok]
        assert not failed, f"{r.program}: {failed}"
    step = reports[0]
    # the roofline's FLOPs from the TPU program (its matmuls are convolutions) as the analytic count
    from ict_jax.aot.fit import current_overrides, step_flops

    analytic = step_flops(cfg, ModelConfig.tiny(compute_dtype="bfloat16", remat=cfg.model.remat),
                          current_overrides(cfg, step.mesh))
    assert 0.95 < step.roofline.flops * 4 / analytic < 1.1
    assert step.roofline.chip == "v5e" and step.roofline.bound_s > 0 and 0 < step.roofline.mfu_ceiling < 1
    # FSDP over 4 chips: the weights are gathered (in the layer scan) and the batch rows are split
    assert step.collectives["all-gather"]["count"] > 0 and step.collectives["all-gather"]["runs"] > 0
    # per-chip arguments scale as 1/fsdp: the compiled program takes exactly the state's shards
    from ict_jax.aot.compile import run_mesh
    from ict_jax.train.checkpoints import abstract_train_state
    from ict_jax.train.programs import abstract_batch

    mc = ModelConfig.tiny(compute_dtype="bfloat16")
    sharded = abstract_train_state(cfg, mc, mesh=run_mesh(cfg, target))
    whole = abstract_train_state(cfg, mc, mesh=run_mesh(cfg.replace(**{"mesh.data": 4, "mesh.fsdp": 1}), target))
    ratio = per_device_bytes((sharded.params, sharded.opt_state)) / per_device_bytes((whole.params, whole.opt_state))
    assert 0.25 <= ratio < 0.27  # 1/4, plus the replicated norms and biases
    assert abstract_batch(cfg, run_mesh(cfg, target)).tokens.sharding.shard_shape((128, 72)) == (32, 72)


@pytest.mark.e2e  # a whole program compiled for a TPU: seconds to half a minute
@pytest.mark.libtpu
def test_a_config_that_does_not_fit_exits_3_with_one_line(tmp_path, capsys):
    """The real 0.5B model, data-parallel on 4 v5e chips, the paper's geometry in one micro-batch:
    the compiler refuses the step (RESOURCE_EXHAUSTED) within seconds."""
    out = tmp_path / "r.json"
    rc, text, err = _cli(["compile", "--config", RECIPE, "--topology", "v5e:2x2", "--program", "step",
                          "mesh.data=4", "mesh.fsdp=1", "train.micro_batches=1", "--json", str(out)], capsys)
    assert rc == 3
    # a progress line as each program starts and ends (compile printed nothing for
    # minutes), then the one line of exit code 3
    lines = err.splitlines()
    assert lines[0] == "[compile] step: compiling for v5e:2x2 ..."
    assert lines[1].startswith("[compile] step: compiled in ") and "does not fit (" in lines[1]
    assert len(lines) == 3 and lines[2].startswith("ict-jax compile: step does not fit v5e:2x2:")
    assert "GiB of temporaries > 15.75 GiB HBM" in lines[2]
    data = json.loads(out.read_text())
    assert data["programs"][0]["fits"] is False and data["programs"][0]["temporaries"] > 16 * 1024 ** 3
    assert "NO" in text


@pytest.mark.libtpu
def test_hbm_of_each_generation_comes_from_the_compiler():
    from ict_jax.aot.compile import hbm_bytes

    gib = {name: hbm_bytes(get_target(name).devices) / 1024 ** 3 for name in ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")}
    assert gib == {"v5e:2x2": 15.75, "v6e:2x2": 31.25, "v5p:2x2x1": pytest.approx(95.74, abs=0.01)}

