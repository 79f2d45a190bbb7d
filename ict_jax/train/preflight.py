"""The memory pre-flight (docs/memory.md): every program of a run compiled, nothing sampled or written yet,
and what they will need compared with what the machine gives the run.

``train.parts.build_parts`` compiles each program at its largest shapes from its abstract arguments
(``train.programs``; the run then executes exactly those executables) and calls :func:`check_fits`
before it writes anything. Per device, a program needs what the compiler counts
(``memory_analysis()``: arguments + outputs - aliased + temporaries + code) plus the run's long-lived
arrays that are not its arguments (:func:`resident_bytes`: while a sampler runs, the optimizer state and
the KL reference stay in memory; during the SFT warm start nothing of RL's exists yet, so the SFT step
holds only its own arguments: the parameters, the SFT optimizer's state and its batch). A run with SFT
steps ahead of it checks the SFT step too (:func:`programs_to_check`). The machine gives
(:func:`machine_budget`):

- CPU: the host's budget (``ict_jax.memory.host_budget``: this process's resident set + MemAvailable,
  bounded by a cgroup or ``ulimit -v``), shared by the mesh's local devices (each holds its shard; a
  replicated array once per device), less what the process holds outside JAX arrays when it checks
  (Python, libraries, the tokenizer, compiled code: resident set - live arrays), less a reserve and a
  margin for what no compiler counts (host copies of rollouts, allocator slack) calibrated on the real
  Qwen2.5-0.5B (:data:`CPU_RESERVE`, :data:`CPU_MARGIN`, docs/memory.md);
- GPU / TPU: the device allocator's ``bytes_limit``.

``train.memory_check``: ``error`` (default) raises :class:`DoesNotFit` (one line; ``ict-jax`` exits 3 and
adds the settings estimated to fit), ``warn`` logs the line and goes on, ``off`` checks nothing.
``ICT_JAX_MEMORY_BUDGET`` replaces the detected budget (``ict_jax.memory``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import jax

from ict_jax.config import Config
from ict_jax.memory import Budget, device_budget, fmt_bytes, host_budget, process_rss
from ict_jax.train.programs import RunPrograms, TokenIds, gathers, per_device_bytes, with_samplers

log = logging.getLogger(__name__)

GIB = 1024 ** 3
#: CPU: bytes kept free beyond what the process holds outside JAX arrays when it checks: the rollouts'
#: host copies, decoded texts, the evaluation's data, the allocator's slack. Calibrated (docs/memory.md).
CPU_RESERVE = int(1.0 * GIB)
#: CPU: host memory of one reward worker process (``rl.reward.workers``; math-verify and reasoning-gym
#: imported: ~340 MB resident each, measured on the project's machine). They start after the pre-flight.
REWARD_WORKER_BYTES = int(0.35 * GIB)
#: CPU: fraction of the host budget kept free (XLA CPU's own allocations around an execution, page-cache
#: pressure). Calibrated on the real Qwen2.5-0.5B (docs/memory.md).
CPU_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program, as the compiler counts them."""

    name: str
    arguments: int
    temporaries: int
    outputs: int
    aliased: int  # outputs that reuse a donated argument's buffer
    code: int

    @property
    def live(self) -> int:
        """Peak bytes the program itself holds: arguments + outputs - aliased + temporaries + code."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def program_memory(name: str, compiled: jax.stages.Compiled) -> ProgramMemory:
    """``compiled.memory_analysis()`` of one program."""
    ma = compiled.memory_analysis()
    return ProgramMemory(name, int(ma.argument_size_in_bytes), int(ma.temp_size_in_bytes),
                         int(ma.output_size_in_bytes), int(ma.alias_size_in_bytes),
                         int(ma.generated_code_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class ProgramNeed:
    """What one program needs on a device at its peak: its own bytes and the run's other arrays."""

    memory: ProgramMemory
    resident: int  # the run's long-lived arrays alive during it that are not its arguments

    @property
    def name(self) -> str:
        return self.memory.name

    @property
    def device_bytes(self) -> int:
        return self.memory.live + self.resident


def resident_bytes(programs: RunPrograms, name: str) -> int:
    """Per-device bytes of the run's long-lived arrays (the train state and the KL reference: the step's
    arguments but its batch) that program ``name`` does not take as arguments: 0 for the step; the
    optimizer state and the reference for a sampler (which takes the model's weights only); 0 for the SFT
    step, whose state is the only one alive during the warm start (RL's is built when it ends)."""
    if name in ("step", "sft"):
        return 0
    state, _, ref = programs.step.abstract()
    run = per_device_bytes((state, ref))
    return max(0, run - per_device_bytes(programs.by_name()[name].abstract()[0]))


def program_needs(programs: RunPrograms, compiled: Mapping[str, jax.stages.Compiled]) -> list[ProgramNeed]:
    return [ProgramNeed(program_memory(name, c), resident_bytes(programs, name)) for name, c in compiled.items()]


def live_array_bytes() -> int:
    """Bytes of every JAX array this process holds now, each device's shard counted (on CPU all of them
    are host memory)."""
    total = 0
    for a in jax.live_arrays():
        try:
            total += sum(s.data.nbytes for s in a.addressable_shards)
        except Exception:  # noqa: BLE001 - an array deleted (donated) while we count
            continue
    return total


@dataclasses.dataclass(frozen=True)
class MachineBudget:
    """What the programs of a run may use on each device: ``(budget.total x (1 - margin) - outside) /
    devices``."""

    platform: str
    budget: Budget
    devices: int  # devices sharing the budget (CPU: the mesh's local devices; else 1)
    outside: int  # bytes the budget must keep for things outside the compiled programs
    margin: float

    @property
    def per_device(self) -> int:
        return max(0, int((self.budget.total * (1 - self.margin) - self.outside) // self.devices))

    def describe(self) -> str:
        """``16.01 GiB of cpu memory (MemAvailable + ..., 17.35 GiB, less 1.09 GiB outside the compiled
        programs and a 5 % margin)``"""
        parts = []
        if self.outside:
            parts.append(f"{fmt_bytes(self.outside)} outside the compiled programs")
        if self.margin:
            parts.append(f"a {self.margin:.0%} margin")
        less = f", less {' and '.join(parts)}" if parts else ""
        shared = f", shared by {self.devices} devices" if self.devices > 1 else ""
        each = " a device" if self.devices > 1 else ""
        return (f"{fmt_bytes(self.per_device)}{each} of {self.platform} memory ({self.budget.source}: "
                f"{fmt_bytes(self.budget.total)}{less}{shared})")


def cpu_budget(devices: int, *, outside: int | None = None, budget: Budget | None = None,
               reward_workers: int = 0) -> MachineBudget:
    """The host's budget for ``devices`` CPU devices. ``outside``: bytes held outside the programs; default
    what this process holds outside JAX arrays now (resident set - live arrays) + :data:`CPU_RESERVE` +
    ``reward_workers`` x :data:`REWARD_WORKER_BYTES` (worker processes still to start)."""
    if outside is None:
        outside = (max(0, process_rss() - live_array_bytes()) + CPU_RESERVE
                   + max(0, int(reward_workers)) * REWARD_WORKER_BYTES)
    return MachineBudget("cpu", budget or host_budget(), max(1, devices), outside, CPU_MARGIN)


def machine_budget(devices: Sequence[jax.Device], *, reward_workers: int = 0) -> MachineBudget | None:
    """The budget of this process's ``devices`` (a mesh's: ``mesh.devices.flat``); None where the devices
    report none. ``reward_workers``: worker processes that will share a CPU host's memory."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    platform = local[0].platform
    if platform == "cpu":
        return cpu_budget(len(local), reward_workers=reward_workers)
    found = device_budget(local[0])
    return None if found is None else MachineBudget(platform, found, 1, 0, 0.0)


_TITLES = {"sft": "the SFT step (sft)", "step": "the train step", "generate": "the rollout sampler",
           "eval": "the evaluation sampler"}


@dataclasses.dataclass(frozen=True)
class FitCheck:
    """The pre-flight's result: each program's need and the machine's budget."""

    needs: tuple[ProgramNeed, ...]
    machine: MachineBudget | None

    @property
    def worst(self) -> ProgramNeed:
        return max(self.needs, key=lambda n: n.device_bytes)

    @property
    def fits(self) -> bool:
        return self.machine is None or all(n.device_bytes <= self.machine.per_device for n in self.needs)

    def record(self) -> dict:
        """What ``summary.json`` keeps (``memory``): each program's bytes a device, the budget, and on a CPU
        the predicted peak of this process (bytes outside the programs + the largest program on every
        device) to set beside the measured one (docs/memory.md, calibration)."""
        out: dict = {"programs": {n.name: {"device_bytes": n.device_bytes, "compiled_live": n.memory.live,
                                           "resident": n.resident} for n in self.needs}}
        m = self.machine
        if m is not None:
            out["budget"] = {"platform": m.platform, "total": m.budget.total, "source": m.budget.source,
                             "devices": m.devices, "outside": m.outside, "margin": m.margin,
                             "per_device": m.per_device, "held_at_check": m.budget.held}
            if m.platform == "cpu":
                out["predicted_peak"] = m.outside + self.worst.device_bytes * m.devices
        return out

    def line(self) -> str:
        """One line: the program that does not fit (the largest), its bytes, the budget."""
        w, m = self.worst, self.machine
        mem = w.memory
        what = (f"{fmt_bytes(mem.arguments)} arguments + {fmt_bytes(mem.temporaries)} temporaries"
                + (f" + {fmt_bytes(mem.outputs - mem.aliased)} outputs" if mem.outputs > mem.aliased else "")
                + (f" + {fmt_bytes(w.resident)} of the run's other arrays" if w.resident else ""))
        verdict = "fits in" if self.fits else "more than"
        budget = m.describe() if m is not None else "an unknown budget"
        return f"{_TITLES.get(w.name, w.name)} needs {fmt_bytes(w.device_bytes)} ({what}), {verdict} {budget}"


class DoesNotFit(RuntimeError):
    """A run whose programs would not fit the machine's memory (``train.memory_check: error``): one line;
    ``check`` holds the numbers, ``config`` and ``mesh`` (its resolved shape) the run's settings.
    ``ict-jax`` exits 3 and adds the settings estimated to fit."""

    def __init__(self, check: FitCheck, config: Config, mesh: Mapping[str, int]):
        super().__init__(check.line())
        self.check, self.config, self.mesh = check, config, dict(mesh)


def check_fits(config: Config, programs: RunPrograms, compiled: Mapping[str, jax.stages.Compiled], *,
               machine: MachineBudget | None = None) -> FitCheck:
    """The pre-flight of ``compiled`` (program name -> executable) against ``machine`` (default: this
    machine's budget for the run's mesh). Logs every program's numbers; by ``train.memory_check`` raises
    :class:`DoesNotFit`, warns, or (``off``) only reports."""
    mode = config.train.memory_check
    if machine is None and mode != "off":
        machine = machine_budget(list(programs.mesh.devices.flat), reward_workers=config.rl.reward.workers)
    check = FitCheck(tuple(program_needs(programs, compiled)), machine)
    for n in check.needs:
        m = n.memory
        log.info("%s: %d bytes a device (arguments %d, temporaries %d, outputs %d, aliased %d, code %d, other "
                 "arrays %d)", n.name, n.device_bytes, m.arguments, m.temporaries, m.outputs, m.aliased, m.code,
                 n.resident)
    if mode == "off" or check.fits:
        return check
    if mode == "warn":
        log.warning("train.memory_check=warn: %s", check.line())
        return check
    raise DoesNotFit(check, config, programs.mesh.shape)


def programs_to_check(config: Config, *, sft: bool | None = None, rl: bool = True) -> Sequence[str]:
    """The programs a run executes, in the order it runs them: the SFT step when SFT steps are ahead of it
    (``sft``; default: ``train.sft_steps > 0``, a new run's), then with ``rl`` the train step and the
    rollout sampler, and the evaluation sampler with ``data.eval`` (which evaluates after SFT too: ``rl``
    False is the warm start alone, ``ict-jax sft``)."""
    sft = config.train.sft_steps > 0 if sft is None else sft
    names = (("sft",) if sft else ()) + (("step", "generate") if rl else ())
    return names + (("eval",) if config.data.eval else ())


def compile_and_check(config: Config, programs: RunPrograms, *, machine: MachineBudget | None = None,
                      sft: bool | None = None, rl: bool = True) -> FitCheck | None:
    """Compile the run's programs (:func:`programs_to_check` of ``sft`` and ``rl``) at their largest
    shapes, one at a time in the order the run executes them, each checked as it compiles
    (:func:`check_fits`): a program that does not fit stops the run before the next one compiles. The
    budget is read before the first compile (the compiler's own working memory is freed for the
    programs). Returns the last check (None without programs)."""
    if machine is None and config.train.memory_check != "off":
        machine = machine_budget(list(programs.mesh.devices.flat), reward_workers=config.rl.reward.workers)
    compiled: dict[str, jax.stages.Compiled] = {}
    check = None
    for name in programs_to_check(config, sft=sft, rl=rl):
        compiled[name] = programs.by_name()[name].compile()
        check = check_fits(config, programs, {name: compiled[name]}, machine=machine)
    if check is not None and len(compiled) > 1:
        check = FitCheck(tuple(program_needs(programs, compiled)), machine)
    return check


SAMPLERS = ("generate", "eval")


def compile_and_check_gathering(config: Config, programs: RunPrograms, tokens: TokenIds, *,
                                sft: bool | None = None, rl: bool = True, machine: MachineBudget | None = None
                                ) -> tuple[Config, RunPrograms, FitCheck | None]:
    """:func:`compile_and_check`, deciding ``rollout.gather_weights: auto``: the samplers gather the FSDP
    weights once a call unless that does not fit. When only the samplers are over the budget (an error
    under ``train.memory_check: error``, a failed check under ``warn``) with ``auto`` on an FSDP mesh, the
    samplers are built again without gathering and checked again (the steps keep their executables), and a
    warning says so. Returns the config the run then follows (``gather_weights`` true or false), its
    programs and the last check."""
    auto = config.rollout.gather_weights == "auto"
    resolved = config.replace(**{"rollout.gather_weights": gathers(config)})
    if not auto or programs.mesh.shape.get("fsdp", 1) == 1 or config.train.memory_check == "off":
        return resolved, programs, compile_and_check(config, programs, machine=machine, sft=sft, rl=rl)
    try:
        check = compile_and_check(config, programs, machine=machine, sft=sft, rl=rl)
    except DoesNotFit as e:
        check = e.check
        if not _only_samplers_over(check):
            raise
    else:
        if check is None or not _only_samplers_over(check):
            return resolved, programs, check
    line = check.line()
    off = config.replace(**{"rollout.gather_weights": False})
    log.warning("rollout.gather_weights auto: off, since gathering the weights does not fit (%s); the samplers "
                "all-gather each layer's shards at every decoded token instead (slower; docs/sampler.md)", line)
    programs = with_samplers(off, programs, tokens)
    return off, programs, compile_and_check(off, programs, machine=machine, sft=sft, rl=rl)


def _only_samplers_over(check: FitCheck) -> bool:
    """Whether some program of ``check`` is over its budget and every such program is a sampler."""
    m = check.machine
    over = {n.name for n in check.needs if m is not None and n.device_bytes > m.per_device}
    return bool(over) and over <= set(SAMPLERS)
