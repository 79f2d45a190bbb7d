"""``ict-jax compile --breakdown``: a compiled program's bytes by category (:mod:`ict_jax.aot.breakdown`),
the stack-frame tables it reads, and one TPU chip (``v5p:1x1x1``) as a target."""

from __future__ import annotations

import json
import pathlib

import pytest

from ict_jax.aot import hlo
from ict_jax.aot.breakdown import CATEGORIES, breakdown, category, source_frames
from ict_jax.aot.cost import cost

RECIPE = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "qwen2p5_0p5b_ict.yaml")
# a module as XLA prints it: instructions name a stack frame, the tables at the end resolve it
MODULE = """HloModule m

%fused (p0: bf16[4,8]) -> f32[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  ROOT %c = f32[4,8]{1,0} convert(bf16[4,8]{1,0} %p0)
}

ENTRY %main (a: bf16[4,8], w: bf16[8,8]) -> (f32[4,8], bf16[4,8], f32[4,8], f32[4,8]) {
  %a = bf16[4,8]{1,0} parameter(0)
  %w = bf16[8,8]{1,0} parameter(1)
  %up = f32[4,8]{1,0} fusion(bf16[4,8]{1,0} %a), kind=kLoop, calls=%fused, metadata={op_name="x" stack_frame_id=2}
  %d = bf16[4,8]{1,0} dot(bf16[4,8]{1,0} %a, bf16[8,8]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="x" stack_frame_id=2}
  %s = f32[4,8]{1,0} exponential(f32[4,8]{1,0} %up), metadata={op_name="x" stack_frame_id=3}
  %n = f32[4,8]{1,0} multiply(f32[4,8]{1,0} %up, f32[4,8]{1,0} %up), metadata={op_name="x" stack_frame_id=4}
  ROOT %t = (f32[4,8]{1,0}, bf16[4,8]{1,0}, f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%up, %d, %s, %n)
}

FileNames
1 "/somewhere/ict_jax/model/qwen2.py"
2 "/somewhere/ict_jax/rl/token_stats.py"
3 "/site-packages/optax/_src/transform.py"

FunctionNames
1 "decoder_layer"
2 "_mm"
3 "_block_stats"
4 "scale_by_adam"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=2}
3 {file_name_id=2 function_name_id=3 line=30 end_line=30 column=1 end_column=2}
4 {file_name_id=3 function_name_id=4 line=40 end_line=40 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=0}
"""


def test_stack_frames_resolve_to_their_callers():
    frames = source_frames(MODULE)
    assert [(f.function, f.line) for f in frames[2]] == [("_mm", 20), ("decoder_layer", 10)]
    assert [f.function for f in frames[3]] == ["_block_stats", "_mm", "decoder_layer"]
    assert [f.function for f in frames[4]] == ["scale_by_adam"]
    assert source_frames("HloModule m\n") == {}


def test_each_instruction_gets_the_category_of_its_source_and_kind():
    module = hlo.parse_hlo(MODULE)
    frames = source_frames(MODULE)
    by_name = {ins.name: category(module, ins, frames) for ins in module.computations[module.entry]}
    assert by_name["up"] == "converts"  # a fusion that only converts, in the model's code
    assert by_name["d"] == "matmul I/O"
    assert by_name["s"] == "vocabulary head + statistics"  # innermost ict_jax frame: token_stats
    assert by_name["n"] == "optimizer"
    parts = breakdown(module, MODULE)
    assert tuple(parts) == CATEGORIES
    total = cost(module)
    assert sum(c.bytes for c in parts.values()) == total.bytes > 0
    assert sum(c.flops for c in parts.values()) == total.flops == 2 * 4 * 8 * 8
    assert parts["converts"].bytes == 4 * 8 * 2 + 4 * 8 * 4  # reads bf16, writes f32


@pytest.mark.e2e  # a whole program compiled for a TPU: seconds to half a minute
@pytest.mark.libtpu
def test_compile_for_one_tpu_chip_prints_the_breakdown(tmp_path, capsys):
    """``--topology v5p:1x1x1`` (libtpu takes one chip only with its chips-per-host bounds) and
    ``--breakdown``: every category's bytes, summing to the roofline's HLO bytes."""
    from ict_jax.cli.main import main

    out = tmp_path / "r.json"
    rc = main(["compile", "--config", RECIPE, "--topology", "v5p:1x1x1", "--program", "step", "--breakdown",
               "--json", str(out), "model.preset=tiny", "train.prompts_per_step=2", "rollout.num_samples=4",
               "train.mini_batches=1", "train.micro_batches=1", "rollout.max_prompt_len=8",
               "rollout.max_new_tokens=24", "stats.chunk=8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "v5p:1x1x1 (1 x TPU v5" in text and "the HLO bytes by category" in text
    for name in CATEGORIES:
        assert f" {name} " in text
    step = json.loads(out.read_text())["programs"][0]
    parts = step["breakdown"]
    assert list(parts) == list(CATEGORIES)
    assert sum(c["bytes"] for c in parts.values()) == pytest.approx(step["roofline"]["bytes"], rel=1e-9)
    assert sum(c["flops"] for c in parts.values()) == pytest.approx(step["roofline"]["flops"], rel=1e-9)
    for name in ("attention", "matmul I/O", "norms/elementwise", "vocabulary head + statistics", "optimizer"):
        assert parts[name]["bytes"] > 0, name
    # the layers' and the head's matmuls hold nearly all FLOPs
    assert parts["matmul I/O"]["flops"] + parts["vocabulary head + statistics"]["flops"] + \
        parts["attention"]["flops"] == pytest.approx(step["roofline"]["flops"], rel=1e-9)
