"""train/preflight.py: the memory pre-flight. Hand-made numbers for the arithmetic and the line; the
run's own programs (abstract, nothing compiled) for what a program holds besides its arguments; one tiny
run refused end to end (the CLI: exit 3, one line, nothing written) and ``ict-jax compile --topology local``
reporting the same budget."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ict_jax.config_load import load_config
from ict_jax.memory import BUDGET_ENV, Budget
from ict_jax.train.preflight import (
    DoesNotFit,
    FitCheck,
    MachineBudget,
    ProgramMemory,
    ProgramNeed,
    check_fits,
    cpu_budget,
    programs_to_check,
    resident_bytes,
)

GIB = 1024 ** 3
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# the demo's tiny model, no SFT, one RL step, the KL reference on (the samplers then leave it resident)
TINY = ["train.sft_steps=0", "train.steps=1", "rl.loss.kl_coef=0.01", "rl.reward.workers=1"]


def _machine(total_gib: float, outside_gib: float = 1.0, devices: int = 1, margin: float = 0.05) -> MachineBudget:
    return MachineBudget("cpu", Budget(int(total_gib * GIB), "test budget"), devices, int(outside_gib * GIB), margin)


def test_the_budget_a_device_gets():
    # (20 GiB x 0.95 - 1 GiB) / 1 = 18 GiB; over 8 devices 2.25 GiB each
    assert _machine(20).per_device == 18 * GIB
    assert _machine(20, devices=8).per_device == 18 * GIB // 8
    assert _machine(1, outside_gib=2).per_device == 0  # never negative
    assert "18.00 GiB of cpu memory (test budget: 20.00 GiB, less 1.00 GiB outside the compiled programs and a " \
           "5% margin)" == _machine(20).describe()


def test_a_program_needs_its_compiled_bytes_and_the_runs_other_arrays():
    mem = ProgramMemory("generate", arguments=2 * GIB, temporaries=GIB, outputs=GIB // 2, aliased=GIB // 4, code=0)
    need = ProgramNeed(mem, resident=4 * GIB)
    assert mem.live == 2 * GIB + GIB + GIB // 2 - GIB // 4
    assert need.device_bytes == mem.live + 4 * GIB
    check = FitCheck((ProgramNeed(ProgramMemory("step", 3 * GIB, 5 * GIB, 0, 0, 0), 0), need), _machine(8))
    assert check.worst.name == "step" and not check.fits  # 8 GiB > 8 x 0.95 - 1 = 6.6 GiB
    assert check.line() == ("the train step needs 8.00 GiB (3.00 GiB arguments + 5.00 GiB temporaries), more than "
                            "6.60 GiB of cpu memory (test budget: 8.00 GiB, less 1.00 GiB outside the compiled "
                            "programs and a 5% margin)")
    assert FitCheck(check.needs, _machine(20)).fits and FitCheck(check.needs, None).fits  # no budget: not refused


@pytest.fixture(scope="module")
def tiny_programs(devices8):
    """The demo run's programs built from its abstract state (nothing compiled, nothing loaded)."""
    import jax

    from ict_jax.sharding import make_mesh
    from ict_jax.train.checkpoints import abstract_train_state
    from ict_jax.train.model_source import resolve_model
    from ict_jax.train.programs import build_programs, per_device_bytes

    cfg = load_config(DEMO, TINY)
    source = resolve_model(cfg)
    mc = source.config
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = abstract_train_state(cfg, mc, mesh=mesh)
    return cfg, build_programs(cfg, mesh, mc, state), state, per_device_bytes


def test_the_samplers_leave_the_optimizer_state_and_the_reference_resident(tiny_programs):
    cfg, programs, state, per_device_bytes = tiny_programs
    ref = programs.step.abstract()[2]
    assert ref is not None
    assert resident_bytes(programs, "step") == 0
    others = per_device_bytes((state.opt_state, state.step, state.rng)) + per_device_bytes(ref)  # not the weights
    for name in ("generate", "eval"):
        assert resident_bytes(programs, name) == others > per_device_bytes(ref) > 0


def test_the_sft_step_holds_the_parameters_one_optimizer_state_and_its_batch(tiny_programs):
    """During SFT nothing of RL's exists (its optimizer state and the KL reference are built when SFT ends):
    the SFT step's need is its own arguments, the SFT state (parameters, the SFT optimizer's state, step,
    key) and its batch, with nothing resident beside them."""
    cfg, programs, state, per_device_bytes = tiny_programs
    sft_state, *batch = programs.sft.abstract()
    assert resident_bytes(programs, "sft") == 0
    assert per_device_bytes(sft_state.opt_state) == per_device_bytes(state.opt_state)  # one Adam state: 2 moments
    assert per_device_bytes(programs.sft.abstract()) == per_device_bytes((state, *batch))
    assert [b.shape for b in batch] == [(cfg.train.sft_batch_size, cfg.rollout.max_prompt_len
                                         + cfg.rollout.max_new_tokens)] * 3


class _Compiled:
    """A compiled program's memory analysis, by hand."""

    def __init__(self, temp: int, args: int = 0):
        self.ma = SimpleNamespace(argument_size_in_bytes=args, temp_size_in_bytes=temp, output_size_in_bytes=0,
                                  alias_size_in_bytes=0, generated_code_size_in_bytes=0)

    def memory_analysis(self):
        return self.ma


@pytest.mark.parametrize("mode", ["error", "warn", "off"])
def test_memory_check_error_warn_off(tiny_programs, mode, caplog):
    cfg, programs, _, _ = tiny_programs
    cfg = cfg.replace(**{"train.memory_check": mode})
    small, big = {"step": _Compiled(GIB)}, {"step": _Compiled(30 * GIB)}
    assert check_fits(cfg, programs, small, machine=_machine(20)).fits
    if mode == "error":
        with pytest.raises(DoesNotFit, match=r"^the train step needs 30\.00 GiB \(0 B arguments \+ 30\.00 GiB "
                                             r"temporaries\), more than 18\.00 GiB") as e:
            check_fits(cfg, programs, big, machine=_machine(20))
        assert e.value.config is cfg and e.value.mesh == {"data": 1, "fsdp": 1, "tensor": 1}
    else:
        assert not check_fits(cfg, programs, big, machine=_machine(20)).fits
        assert ("more than 18.00 GiB" in caplog.text) == (mode == "warn")


def test_the_programs_checked_are_the_ones_a_run_executes():
    cfg = load_config(DEMO, TINY)
    assert programs_to_check(cfg) == ("step", "generate", "eval")  # the demo evaluates
    assert programs_to_check(cfg.replace(**{"data.eval": ()})) == ("step", "generate")
    # SFT steps ahead (a new run with train.sft_steps; a resumed one before its warm start finished): the SFT
    # step first; the warm start alone (ict-jax sft) runs it and the evaluation after it
    sft = cfg.replace(**{"train.sft_steps": 5})
    assert programs_to_check(sft) == ("sft", "step", "generate", "eval")
    assert programs_to_check(sft, sft=False) == ("step", "generate", "eval")  # its warm start finished
    assert programs_to_check(sft, rl=False) == ("sft", "eval")


def test_the_cpu_budget_keeps_what_the_process_holds_outside_jax_arrays(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "10GiB")
    m = cpu_budget(2)
    assert m.budget.total == 10 * GIB and m.budget.source == BUDGET_ENV and m.devices == 2
    assert m.outside >= GIB  # the reserve at least (train.preflight.CPU_RESERVE)


def test_an_oversized_run_stops_with_one_line_exit_3_and_writes_nothing(tmp_path, monkeypatch, capsys, devices8):
    """The memory pre-flight on a tiny model with a tiny budget: the refusal comes before the weights load
    and before anything is written (a corrected rerun needs no --resume)."""
    from ict_jax.cli.main import main

    monkeypatch.setenv(BUDGET_ENV, "1200MiB")  # less than the process holds outside JAX arrays + the reserve
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(DEMO), *TINY, f"run_dir={run_dir}", "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ict-jax train: error: the train step needs ")
    assert "of cpu memory (ICT_JAX_MEMORY_BUDGET: 1.17 GiB, less " in err and "estimated to fit" in err
    assert not run_dir.exists()


# the tiny model with a warm start whose batch (256 rows of 8 + 6 tokens) makes the SFT step the largest program by
# far (~4x the train step's bytes a device: 32 rollouts a step)
BIG_SFT = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=8", "rollout.max_new_tokens=6",
           "rollout.max_prompt_len=8", "stats.chunk=6", "train.sft_steps=2", "train.sft_batch_size=256",
           "train.steps=1", "rl.reward.workers=1", "data.eval=[]"]


def test_a_run_whose_sft_step_does_not_fit_is_refused_naming_it_and_writes_nothing(tmp_path, monkeypatch, capsys,
                                                                                   devices8):
    """A budget between the RL programs' needs and the SFT step's: `ict-jax train` and `ict-jax sft` are
    refused by the pre-flight (exit 3, one line naming the SFT step), before the weights load and before
    anything is written; with the SFT warm start finished, the same budget lets the run through the check."""
    from ict_jax.cli.main import main
    from ict_jax.train import preflight
    from ict_jax.train.checkpoints import abstract_train_state
    from ict_jax.train.model_source import resolve_model
    from ict_jax.train.parts import run_mesh_checked
    from ict_jax.train.programs import TokenIds, build_programs

    cfg = load_config(DEMO, BIG_SFT).replace(**{"train.memory_check": "off"})
    mesh, source = run_mesh_checked(cfg), resolve_model(cfg)
    mc, tok = source.config, source.tokenizer()
    programs = build_programs(cfg, mesh, mc, abstract_train_state(cfg, mc, mesh=mesh), TokenIds.of(tok))
    check = preflight.compile_and_check(cfg, programs, sft=True)  # memory_check off: every program, none refused
    need = {n.name: n.device_bytes for n in check.needs}
    assert list(need) == ["sft", "step", "generate"] and check.worst.name == "sft"
    assert need["sft"] > 2 * max(need["step"], need["generate"])
    per_device = (need["sft"] + max(need["step"], need["generate"])) // 2
    devices = len(mesh.devices.flat)
    machine = MachineBudget("cpu", Budget(per_device * devices, "test budget"), devices, 0, 0.0)
    monkeypatch.setattr(preflight, "machine_budget", lambda *args, **kwargs: machine)
    for command in ("train", "sft"):
        run_dir = tmp_path / command
        assert main([command, "--config", str(DEMO), *BIG_SFT, f"run_dir={run_dir}", "--no-progress"]) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"ict-jax {command}: error: the SFT step (sft) needs "), err
        assert "estimated to fit: " in err or "train.sft_batch_size" in err  # what to change
        assert not run_dir.exists()
    # the same run past its warm start (sft_model there, resumed): the SFT step is not checked, the rest fits
    assert preflight.compile_and_check(load_config(DEMO, BIG_SFT), programs, sft=False, machine=machine).fits


def test_compile_for_the_local_machine_reports_the_same_budget(tmp_path, monkeypatch, capsys, devices8):
    from ict_jax.cli.main import main

    monkeypatch.setenv(BUDGET_ENV, "1200MiB")
    assert main(["compile", "--config", str(DEMO), *TINY, "--topology", "local", "--program", "step"]) == 3
    out, err = capsys.readouterr()
    assert "budget: " in out and "(ICT_JAX_MEMORY_BUDGET: 1.17 GiB, less " in out
    last = err.splitlines()[-1]  # after the progress lines
    assert last.startswith("ict-jax compile: step does not fit local: ") and "available a device" in last


def _need(name: str, gib: float) -> ProgramNeed:
    return ProgramNeed(ProgramMemory(name, 0, int(gib * GIB), 0, 0, 0), 0)


@pytest.mark.parametrize("gather, mode, fsdp, over, decided", [
    ("auto", "error", 8, (), True),                       # it fits: gathered
    ("auto", "error", 8, ("generate",), False),           # only a gathering sampler is over: not gathered
    ("auto", "warn", 8, ("generate", "eval"), False),     # warn: the same decision, no error
    ("auto", "error", 8, ("step", "generate"), "raise"),  # the step is over too: refused as without auto
    ("auto", "error", 1, ("generate",), "raise"),         # no FSDP: gathering changes nothing, nothing to decide
    (True, "error", 8, ("generate",), "raise"),           # asked for: refused, not overridden
])
def test_gather_weights_auto_is_on_unless_only_a_gathering_sampler_does_not_fit(monkeypatch, caplog, gather, mode,
                                                                                 fsdp, over, decided):
    """``rollout.gather_weights: auto`` (hand-made checks in place of compiles): on wherever it fits; off,
    with a warning naming the sampler and its bytes, when only the samplers are over the budget; every
    other refusal stays as it was. Under ``warn`` the same decision without an error."""
    from ict_jax.train import preflight

    machine = _machine(20)  # 18 GiB a device
    rebuilt = []

    def fake_compile_and_check(cfg, programs, *, machine, sft, rl):
        gathered = cfg.rollout.gather_weights is not False
        needs = tuple(_need(n, 30 if n in over and (n == "step" or gathered) else 1) for n in ("step", "generate", "eval"))
        check = FitCheck(needs, machine)
        if not check.fits and cfg.train.memory_check == "error":
            raise DoesNotFit(FitCheck(tuple(n for n in needs if n.device_bytes > machine.per_device)[:1], machine),
                             cfg, {"fsdp": fsdp})
        return check

    monkeypatch.setattr(preflight, "compile_and_check", fake_compile_and_check)
    monkeypatch.setattr(preflight, "with_samplers", lambda cfg, programs, tokens: rebuilt.append(cfg) or "rebuilt")
    cfg = load_config(DEMO, TINY).replace(**{"rollout.gather_weights": gather, "train.memory_check": mode})
    programs = SimpleNamespace(mesh=SimpleNamespace(shape={"data": 1, "fsdp": fsdp, "tensor": 1}))
    if decided == "raise":
        with pytest.raises(DoesNotFit):
            preflight.compile_and_check_gathering(cfg, programs, None, machine=machine)
        assert not rebuilt
        return
    out_cfg, out_programs, check = preflight.compile_and_check_gathering(cfg, programs, None, machine=machine)
    assert out_cfg.rollout.gather_weights is decided and check.fits
    assert out_programs == (programs if decided else "rebuilt")
    assert [c.rollout.gather_weights for c in rebuilt] == ([] if decided else [False])
    warned = "rollout.gather_weights auto: off, since gathering the weights does not fit (the rollout sampler needs " \
             "30.00 GiB"
    assert (warned in caplog.text) is (not decided)


def test_the_samplers_built_again_keep_the_steps_and_their_executables(tiny_programs):
    from ict_jax.train.programs import PLACEHOLDER_IDS, with_samplers

    cfg, programs, _, _ = tiny_programs
    again = with_samplers(cfg.replace(**{"rollout.gather_weights": False}), programs, PLACEHOLDER_IDS)
    assert again.step is programs.step and again.sft is programs.sft and again.mesh is programs.mesh
    assert again.generate is not programs.generate and again.eval is not programs.eval
    assert again.generate.largest == programs.generate.largest and again.eval.largest == programs.eval.largest
