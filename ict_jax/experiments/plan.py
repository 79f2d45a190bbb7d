"""The plan of a pre-registered experiment (:mod:`ict_jax.experiments.runner`): a YAML file, committed before
its first result, that fixes the arms, seeds, steps, the reference arms, the outcomes and the stopping
rule. docs/experiments.md documents every field; a minimal plan::

    name: pilot                      # letters, digits, _ . -
    config: ../qwen2p5_coder_0p5b_cpu_grpo.yaml   # the base config, relative to this file
    overrides: {model.lora.enabled: true}         # every arm (dotted keys, typed YAML values)
    arms:                            # name -> a selector method and its own overrides
      ict: {method: ict, overrides: {rl.selector.warmup_steps: 0}}
      grpo: {method: grpo}
    seeds: [0, 1]                    # every arm runs every seed; arms of a seed share data order and keys
    steps: 40                        # RL steps of every run (train.steps)
    chunk_steps: 5                   # runs advance in turn, this many steps at a time
    reference_arms: [grpo]           # paired differences of every other arm against each of these
    primary_outcome: {metric: reward/mean, steps: [21, 40]}   # mean over RL steps 21..40 (1-based)
    stopping_rule: every run trains all 40 steps; no early stopping

Everything is checked when the plan is read (:func:`load_plan`): unknown keys, wrong types, arm overrides
that would take a key the plan owns (``seed``, ``run_dir``, ``train.steps``, ``rl.selector.method``), and
every run's config (built and validated here, before any work). Errors are :class:`PlanError`: one line
naming the plan file and the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ict_jax.config import Config, ConfigError
from ict_jax.config_load import load_config
from ict_jax.train.plugins import check_registered
from ict_jax.train.record import flatten

__all__ = ["PlanError", "Outcome", "Arm", "Branch", "Plan", "RunSpec", "load_plan", "plan_runs", "base_run",
           "OWNED_KEYS", "BRANCH_MAY_DIFFER"]

#: Config keys the plan sets for every run itself: an arm's or the common overrides may not set them.
OWNED_KEYS = ("seed", "run_dir", "train.steps", "rl.selector.method")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS = {"name", "description", "config", "overrides", "arms", "seeds", "steps", "chunk_steps", "reference_arms",
             "primary_outcome", "secondary_outcomes", "evaluation", "stopping_rule", "design", "calibration", "out",
             "record"}
_REQUIRED = ("name", "config", "arms", "seeds", "steps", "reference_arms", "primary_outcome", "stopping_rule")


class PlanError(ConfigError):
    """A plan that cannot be run as written; ``str(err)`` is one line naming the plan and the key."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One outcome of every run. ``metric``: a key of the per-step metrics (``reward/mean``) averaged over
    RL steps ``first..last`` (1-based, inclusive), or a final-evaluation key (``eval/...``, no steps):
    ``eval/<benchmark>/pass@k`` as logged, or ``eval/pass@k`` averaged over the evaluation's benchmarks."""

    metric: str
    first: int | None = None
    last: int | None = None
    label: str | None = None
    at: int | None = None  # an evaluation outcome at RL step ``at`` (train.eval_every) instead of the final one

    @property
    def final_eval(self) -> bool:
        """An evaluation outcome (``eval/...``): the final evaluation's, or the one at step :attr:`at`."""
        return self.metric.startswith("eval/")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.final_eval:
            return f"{self.metric} at step {self.at}" if self.at is not None else f"final {self.metric}"
        return f"{self.metric} steps {self.first}-{self.last}" if self.first != self.last \
            else f"{self.metric} step {self.first}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"metric": self.metric, "name": self.name}
        if not self.final_eval:
            d["steps"] = [self.first, self.last]
        if self.at is not None:
            d["step"] = self.at
        return d


@dataclasses.dataclass(frozen=True)
class Branch:
    """Where a branched arm starts: its parent arm's checkpoint at RL step ``step`` (same seed)."""

    arm: str
    step: int


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    method: str
    overrides: tuple[tuple[str, Any], ...] = ()
    description: str = ""
    branch: Branch | None = None


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the plan: an arm at a seed, in its own run directory."""

    arm: str
    seed: int
    run_dir: Path
    config: Config
    branch: Branch | None = None  # a branched arm: the parent arm and step its run starts from

    @property
    def name(self) -> str:
        return f"{self.arm}_s{self.seed}"

    @property
    def parent(self) -> str | None:
        """The run this one branches from (the parent arm at the same seed), or None."""
        return f"{self.branch.arm}_s{self.seed}" if self.branch is not None else None

    @property
    def first_step(self) -> int:
        """The RL steps the run inherits from its parent (0 for an unbranched run): it trains the rest."""
        return self.branch.step if self.branch is not None else 0


@dataclasses.dataclass(frozen=True)
class Plan:
    path: Path
    text: str  # the plan file as committed: its sha256 is the plan's identity
    name: str
    description: str
    config_path: Path
    overrides: tuple[tuple[str, Any], ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    steps: int
    chunk_steps: int
    reference_arms: tuple[str, ...]
    primary: Outcome
    secondary: tuple[Outcome, ...]
    evaluate_base: bool
    base_seed: int
    stopping_rule: str
    design: Mapping[str, Any]
    calibration: Any
    out: Path
    record: Path

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return (self.primary, *self.secondary)

    def chunk_ends(self) -> list[int]:
        """The steps at which every run pauses in turn: multiples of ``chunk_steps``, and ``steps``."""
        ends = list(range(self.chunk_steps, self.steps, self.chunk_steps))
        return ends + [self.steps] if self.steps > 0 else []

    def to_dict(self) -> dict[str, Any]:
        """The plan as the record stores it (paths as written in the plan, values as parsed)."""
        return {
            "name": self.name, "description": self.description, "config": str(self.config_path),
            "overrides": dict(self.overrides),
            "arms": {a.name: {"method": a.method, "overrides": dict(a.overrides), "description": a.description,
                              **({"branch": {"from": a.branch.arm, "step": a.branch.step}} if a.branch else {})}
                     for a in self.arms},
            "seeds": list(self.seeds), "steps": self.steps, "chunk_steps": self.chunk_steps,
            "reference_arms": list(self.reference_arms), "primary_outcome": self.primary.to_dict(),
            "secondary_outcomes": [o.to_dict() for o in self.secondary],
            "evaluation": {"base": self.evaluate_base, "base_seed": self.base_seed},
            "stopping_rule": self.stopping_rule, "design": dict(self.design), "calibration": self.calibration,
            "out": str(self.out), "record": str(self.record),
        }


# ------------------------------------------------------------------------------------------------
# Reading and checking
# ------------------------------------------------------------------------------------------------
def _err(path: Path, key: str, text: str) -> PlanError:
    return PlanError(f"plan {str(path)!r}: {key}: {text}")


def _mapping(path: Path, key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _err(path, key, f"expected a mapping of dotted config keys to values, got {value!r}")
    return dict(value)


def _int(path: Path, key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _err(path, key, f"expected an integer >= {low}, got {value!r}")
    return value


def _overrides(path: Path, key: str, value: Any) -> tuple[tuple[str, Any], ...]:
    over = _mapping(path, key, value)
    owned = [k for k in over if k in OWNED_KEYS]
    if owned:
        raise _err(path, f"{key}.{owned[0]}", "the plan sets this itself (" + ", ".join(
            f"{k}: {w}" for k, w in zip(OWNED_KEYS, ("seeds", "out", "steps", "the arm's method"))) + ")")
    return tuple(over.items())


def _outcome(path: Path, key: str, value: Any, steps: int) -> Outcome:
    if not isinstance(value, Mapping):
        raise _err(path, key, f"expected a mapping like {{metric: reward/mean, steps: [21, 40]}}, got {value!r}")
    unknown = sorted(set(value) - {"metric", "steps", "step", "label"})
    if unknown:
        raise _err(path, f"{key}.{unknown[0]}", "unknown key (allowed: metric, steps, step, label)")
    metric = value.get("metric")
    if not isinstance(metric, str) or not metric:
        raise _err(path, f"{key}.metric", f"expected a metric name, got {metric!r}")
    label = value.get("label")
    if label is not None and not isinstance(label, str):
        raise _err(path, f"{key}.label", f"expected text, got {label!r}")
    if metric.startswith("eval/"):
        if "steps" in value:
            raise _err(path, f"{key}.steps", "an evaluation outcome (eval/...) has no steps (step: S for the "
                       "evaluation at RL step S, none for the final one)")
        if not metric.rsplit("/", 1)[-1].startswith("pass@"):
            raise _err(path, f"{key}.metric", f"{metric!r}: expected eval/pass@k or eval/<benchmark>/pass@k")
        at = value.get("step")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or not 1 <= at <= steps):
            raise _err(path, f"{key}.step", f"{at!r}: expected an RL step 1..{steps} (an evaluation there: "
                       "train.eval_every)")
        return Outcome(metric, label=label, at=at)
    if "step" in value:
        raise _err(path, f"{key}.step", "a per-step outcome takes steps: [first, last]")
    rng = value.get("steps")
    if (not isinstance(rng, (list, tuple)) or len(rng) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in rng)):
        raise _err(path, f"{key}.steps", f"expected [first, last] RL steps (1-based, inclusive), got {rng!r}")
    first, last = rng
    if not 1 <= first <= last <= steps:
        raise _err(path, f"{key}.steps", f"{list(rng)}: need 1 <= first <= last <= steps ({steps})")
    return Outcome(metric, first, last, label)


def _arms(path: Path, value: Any) -> tuple[Arm, ...]:
    if not isinstance(value, Mapping) or not value:
        raise _err(path, "arms", "expected a mapping of arm names to {method, overrides}, at least one arm")
    arms = []
    for name, spec in value.items():
        key = f"arms.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise _err(path, key, "an arm's name is letters, digits, _ . - (it names its run directories)")
        if not isinstance(spec, Mapping):
            raise _err(path, key, f"expected {{method: ..., overrides: {{...}}}}, got {spec!r}")
        unknown = sorted(set(spec) - {"method", "overrides", "description", "branch"})
        if unknown:
            raise _err(path, f"{key}.{unknown[0]}", "unknown key (allowed: method, overrides, description, branch)")
        method = spec.get("method")
        if not isinstance(method, str) or not method:
            raise _err(path, f"{key}.method", f"expected a selector method (ict, grpo, random, ...), got {method!r}")
        desc = spec.get("description", "")
        if not isinstance(desc, str):
            raise _err(path, f"{key}.description", f"expected text, got {desc!r}")
        arms.append(Arm(name, method, _overrides(path, f"{key}.overrides", spec.get("overrides")), desc,
                        _branch(path, f"{key}.branch", spec.get("branch"), arms)))
    return tuple(arms)


def _branch(path: Path, key: str, value: Any, earlier: Sequence[Arm]) -> Branch | None:
    """An arm's ``branch: {from: ARM, step: S}``: ``from`` an arm listed before it that is not branched itself."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"from", "step"}:
        raise _err(path, key, f"expected {{from: <an earlier arm>, step: <RL step>}}, got {value!r}")
    parents = [a.name for a in earlier if a.branch is None]
    if value["from"] not in parents:
        raise _err(path, f"{key}.from", f"{value['from']!r}: expected an arm listed before this one that is not "
                   f"branched itself ({', '.join(parents) or 'none'})")
    return Branch(value["from"], _int(path, f"{key}.step", value["step"], 1))


#: Keys a branched arm's config may set differently from its parent's: how the loss reads the rollouts.
#: Anything else (the model, the optimizer, the data, the sampler) would not continue the parent's run.
BRANCH_MAY_DIFFER = ("rl.", "stats.")


def _check_branches(plan: Plan, specs: Sequence[RunSpec]) -> None:
    """A branch point is a chunk end before the last step, and a branched run's config differs from its
    parent's only in :data:`BRANCH_MAY_DIFFER` (a resume from the parent's checkpoint continues it)."""
    by_name = {s.name: s for s in specs}
    for arm in plan.arms:
        if arm.branch is None:
            continue
        key = f"arms.{arm.name}.branch.step"
        if arm.branch.step >= plan.steps or arm.branch.step not in plan.chunk_ends():
            raise _err(plan.path, key, f"{arm.branch.step}: a branch point is a chunk end before the last step "
                       f"(chunk ends: {', '.join(map(str, plan.chunk_ends()[:-1])) or 'none'})")
        spec = next(s for s in specs if s.arm == arm.name)
        child = flatten(spec.config.to_dict())
        parent = flatten(by_name[spec.parent].config.to_dict())
        bad = sorted(k for k in set(child) | set(parent) if k != "run_dir" and not k.startswith(BRANCH_MAY_DIFFER)
                     and canonical_json(child.get(k)) != canonical_json(parent.get(k)))
        if bad:
            raise _err(plan.path, f"arms.{arm.name}", f"a branched arm continues {arm.branch.arm}'s run, so its "
                       f"config may differ only in {', '.join(k + '*' for k in BRANCH_MAY_DIFFER)}; it differs in "
                       + ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else ""))


def _seeds(path: Path, seeds: Any) -> list[int]:
    if (not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                         for s in seeds) or len(set(seeds)) != len(seeds)):
        raise _err(path, "seeds", f"{seeds!r}: expected distinct non-negative integers, at least one")
    return seeds


def _evaluation(path: Path, ev: Any, seeds: Sequence[int]) -> tuple[bool, int]:
    ev = ev or {}
    if not isinstance(ev, Mapping) or set(ev) - {"base", "base_seed"}:
        raise _err(path, "evaluation", f"expected {{base: true|false, base_seed: N}}, got {ev!r}")
    evaluate_base = ev.get("base", False)
    if not isinstance(evaluate_base, bool):
        raise _err(path, "evaluation.base", f"expected true or false, got {evaluate_base!r}")
    return evaluate_base, _int(path, "evaluation.base_seed", ev.get("base_seed", seeds[0]), 0)


def _design(path: Path, design: Any) -> dict[str, Any]:
    design = design or {}
    if not isinstance(design, Mapping):
        raise _err(path, "design", f"expected a mapping (assumed_sd, alpha, power, note), got {design!r}")
    unknown = sorted(set(design) - {"assumed_sd", "alpha", "power", "note"})
    if unknown:
        raise _err(path, f"design.{unknown[0]}", "unknown key (allowed: assumed_sd, alpha, power, note)")
    for key, lo, hi in (("assumed_sd", 0.0, float("inf")), ("alpha", 0.0, 1.0), ("power", 0.0, 1.0)):
        v = design.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v < hi):
            raise _err(path, f"design.{key}", f"{v!r}: expected a number in ({lo:g}, {hi:g})")
    if not isinstance(design.get("note", ""), str):
        raise _err(path, "design.note", f"expected text, got {design['note']!r}")
    return dict(design)


def _read(path: Path) -> tuple[str, Mapping[str, Any]]:
    """The plan's text and its parsed mapping, with its top-level keys checked."""
    import yaml  # only where text is parsed

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"plan {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"plan {str(path)!r}: cannot be read ({e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PlanError(f"plan {str(path)!r}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, Mapping):
        raise PlanError(f"plan {str(path)!r}: expected a mapping of plan keys (name, config, arms, ...)")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _err(path, unknown[0], f"unknown key (allowed: {', '.join(sorted(_TOP_KEYS))})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise _err(path, missing[0], "required")
    return text, data


def _header(path: Path, data: Mapping[str, Any]) -> tuple[str, Path]:
    """The plan's name and its config's path, with the text fields checked."""
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise _err(path, "name", f"{name!r}: letters, digits, _ . - (it names the output folders)")
    for key in ("description", "stopping_rule"):
        if not isinstance(data.get(key, ""), str):
            raise _err(path, key, f"expected text, got {data[key]!r}")
    if not data["stopping_rule"].strip():
        raise _err(path, "stopping_rule", "state the rule (e.g. every run trains all its steps; no early stop)")
    if not isinstance(data["config"], str):
        raise _err(path, "config", f"expected a path to a config YAML, got {data['config']!r}")
    config_path = (path.parent / data["config"]) if not Path(data["config"]).is_absolute() else Path(data["config"])
    if not config_path.is_file():
        raise _err(path, "config", f"{data['config']!r}: no such file (relative to the plan's folder)")
    return name, config_path


def load_plan(path: str | Path) -> Plan:
    """Read and check the plan at ``path`` (module docstring); every run's config is built and validated."""
    path = Path(path)
    text, data = _read(path)
    name, config_path = _header(path, data)
    steps = _int(path, "steps", data["steps"], 1)
    chunk = _int(path, "chunk_steps", data.get("chunk_steps", steps), 1)
    seeds = _seeds(path, data["seeds"])
    arms = _arms(path, data["arms"])
    names = [a.name for a in arms]
    refs = data["reference_arms"]
    if not isinstance(refs, list) or not refs or any(r not in names for r in refs) or len(set(refs)) != len(refs):
        raise _err(path, "reference_arms", f"{refs!r}: expected a list of distinct arm names ({', '.join(names)})")
    if len(arms) < 2:
        raise _err(path, "arms", "a comparison needs at least two arms")
    primary = _outcome(path, "primary_outcome", data["primary_outcome"], steps)
    sec = data.get("secondary_outcomes") or []
    if not isinstance(sec, list):
        raise _err(path, "secondary_outcomes", f"expected a list of outcomes, got {sec!r}")
    secondary = tuple(_outcome(path, f"secondary_outcomes[{i}]", o, steps) for i, o in enumerate(sec))
    names_o = [o.name for o in (primary, *secondary)]
    if len(set(names_o)) != len(names_o):
        raise _err(path, "secondary_outcomes", "two outcomes share a name: give one a label")
    evaluate_base, base_seed = _evaluation(path, data.get("evaluation"), seeds)
    design = _design(path, data.get("design"))
    out = Path(data.get("out") or f"runs/experiments/{name}")
    record = Path(data.get("record") or out)
    plan = Plan(path=path, text=text, name=name, description=data.get("description", ""), config_path=config_path,
                overrides=_overrides(path, "overrides", data.get("overrides")), arms=arms, seeds=tuple(seeds),
                steps=steps, chunk_steps=chunk, reference_arms=tuple(refs), primary=primary, secondary=secondary,
                evaluate_base=evaluate_base, base_seed=base_seed, stopping_rule=data["stopping_rule"],
                design=dict(design), calibration=data.get("calibration"), out=out, record=record)
    _check_branches(plan, plan_runs(plan))  # every run's config is valid, before any work
    if evaluate_base:
        base_run(plan)
    return plan


# ------------------------------------------------------------------------------------------------
# The runs
# ------------------------------------------------------------------------------------------------
def common_config(plan: Plan) -> Config:
    """The base config with the plan's common overrides (no arm's yet)."""
    try:
        cfg = load_config(plan.config_path)
        return cfg.replace(**dict(plan.overrides))
    except ConfigError as e:
        raise PlanError(f"plan {str(plan.path)!r}: overrides: {e}") from None


def _run_config(plan: Plan, common: Config, arm: Arm, seed: int, run_dir: Path) -> Config:
    over = {**dict(arm.overrides), "seed": seed, "run_dir": str(run_dir), "train.steps": plan.steps,
            "rl.selector.method": arm.method}
    try:
        cfg = common.replace(**over)
        check_registered(cfg)  # its plugins imported, its method registered: before any work
        return cfg
    except ConfigError as e:
        raise PlanError(f"plan {str(plan.path)!r}: arms.{arm.name}: {e}") from None


def plan_runs(plan: Plan) -> list[RunSpec]:
    """Every arm x seed, arm-major in the plan's order; run directory ``<out>/runs/<arm>_s<seed>``, one per
    run (arm names are distinct, so no two arms share one)."""
    common = common_config(plan)
    specs = []
    for arm in plan.arms:
        for seed in plan.seeds:
            run_dir = plan.out / "runs" / f"{arm.name}_s{seed}"
            specs.append(RunSpec(arm.name, seed, run_dir, _run_config(plan, common, arm, seed, run_dir), arm.branch))
    return specs


def base_run(plan: Plan) -> RunSpec:
    """The evaluation of the starting model (``evaluation.base``): the common config, 0 RL steps, seed
    ``evaluation.base_seed``, in ``<out>/runs/base``. A LoRA run's fresh adapters leave the model's
    outputs unchanged (B = 0), so this is the base model's evaluation under the runs' settings."""
    common = common_config(plan)
    run_dir = plan.out / "runs" / "base"
    try:
        cfg = common.replace(**{"seed": plan.base_seed, "run_dir": str(run_dir), "train.steps": 0,
                                "rl.selector.method": "dense"})
    except ConfigError as e:
        raise PlanError(f"plan {str(plan.path)!r}: evaluation: {e}") from None
    if not cfg.data.eval:
        raise PlanError(f"plan {str(plan.path)!r}: evaluation.base: the config names no data.eval to evaluate on")
    return RunSpec("base", plan.base_seed, run_dir, cfg)


def canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys and no spaces (what a hash or a comparison reads)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def differing_keys(specs: Sequence[RunSpec]) -> dict[str, dict[str, Any]]:
    """The config keys (dotted) whose values differ between the arms at the first seed, besides the run
    directory: ``{key: {arm: value}}``, what the arms' runs do not share."""
    by_arm: dict[str, dict[str, Any]] = {}
    for s in specs:
        if s.seed == specs[0].seed:
            flat = flatten(s.config.to_dict())
            flat.pop("run_dir", None)
            by_arm[s.arm] = flat
    keys = sorted({k for f in by_arm.values() for k in f})
    return {k: {arm: f.get(k) for arm, f in by_arm.items()} for k in keys
            if len({canonical_json(f.get(k)) for f in by_arm.values()}) > 1}
