"""``ict-jax compare`` (one warm start, every method x seed as a plan run by the experiment runner, table +
plots, resumable) and the table maths on hand-made metrics rows."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from ict_jax.cli.main import main as cli_main
from ict_jax.config_load import load_config
from ict_jax.experiments.compare import plan_runs, run_config, write_plan
from ict_jax.experiments.compare_report import (
    aggregate_group,
    format_markdown,
    mean_sd,
    pass_at_k,
    run_result,
    steps_to_target,
    tail_mean,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
TINY = [  # the demo config shrunk to seconds per run: 5 SFT steps, 3 RL steps, 8 eval problems
    "model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16", "train.sft_steps=5", "train.sft_batch_size=8", "rl.selector.warmup_steps=1",
    "data.train=[\"arith?digits=1&size=64\"]", "stats.chunk=8", "rl.reward.workers=1",
    "mesh.data=-1", "mesh.tensor=2", "train.steps=3", "train.save_every=3",
    "data.eval=[\"arith?digits=1&size=8&seed=7\"]", "data.eval_n=2", "data.eval_k=[1,2]",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


# --------------------------------------------------------------------------------------------------
# The table maths
# --------------------------------------------------------------------------------------------------
def _rows(rewards, h1=None, h2=None):
    return [{"step": i, "phase": "rl", "reward/mean": r,
             **({"stats/H1_mean": h1[i]} if h1 else {}), **({"stats/H2_mean": h2[i]} if h2 else {})}
            for i, r in enumerate(rewards)]


def test_steps_to_target_uses_a_trailing_moving_average():
    # single steps reach 0.5 early, but the 5-step average only at the 8th step: (.2+.6+.6+.6+.6)/5=0.52
    rewards = [0.0, 0.9, 0.1, 0.2, 0.6, 0.6, 0.6, 0.6, 0.9]
    # partial windows at the start: step 1 -> (0 + .9) / 2 = 0.45 < 0.5
    ma = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
    first = next(i for i, m in enumerate(ma) if m >= 0.5)
    assert steps_to_target(_rows(rewards), 0.5) == first + 1 == 8
    assert steps_to_target(_rows(rewards), 0.95) is None
    assert steps_to_target(_rows([0.7]), 0.5) == 1
    # unsorted rows and non-finite values (logged as strings) are handled
    rows = list(reversed(_rows([0.0, 0.0, 1.0, 1.0]))) + [{"step": 4, "reward/mean": "nan"}]
    assert steps_to_target(rows, 0.5) == 4  # (0 + 0 + 1 + 1) / 4
    assert steps_to_target(rows, 0.5, window=2) == 3  # (0 + 1) / 2


def test_mean_sd_tail_mean_and_pass_at_k():
    s = mean_sd([0.4, 0.5, 0.6])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.5) and s["sd"] == pytest.approx(0.1)  # ddof 1
    assert mean_sd([0.3, None]) == {"mean": 0.3, "sd": None, "n": 1}
    assert mean_sd([None]) == {"mean": None, "sd": None, "n": 0}
    rows = _rows([0.0] * 8, h1=[1, 2, 3, 4, 5, 6, 7, 8], h2=[0] * 8)
    assert tail_mean(rows, "stats/H1_mean") == pytest.approx(6.0)  # last 5: 4..8
    assert tail_mean(rows[:2], "stats/H1_mean") == pytest.approx(1.5)
    assert tail_mean(rows, "stats/js_mean") is None
    evals = {"eval/a/pass@1": 0.2, "eval/a/pass@4": 0.5, "eval/b?x=1&y=2/pass@1": 0.4, "eval/b?x=1&y=2/pass@4": 0.7,
             "eval/a/other": 9.0}
    p = pass_at_k(evals)
    assert list(p) == [1, 4] and p[1] == pytest.approx(0.3) and p[4] == pytest.approx(0.6)


def test_group_aggregate_and_markdown_table():
    target = 0.5
    ict = [run_result(_rows([0.4, 0.6, 0.6, 0.6, 0.6, 0.6], h1=[1.0] * 6, h2=[2.0] * 6),
                      {"eval/x/pass@1": 0.5, "eval/x/pass@4": 0.8}, target, 10.0),
           run_result(_rows([0.6] * 6, h1=[3.0] * 6, h2=[2.0] * 6),
                      {"eval/x/pass@1": 0.7, "eval/x/pass@4": 0.9}, target, 20.0),
           run_result(_rows([0.1] * 6, h1=[2.0] * 6, h2=[2.0] * 6),
                      {"eval/x/pass@1": 0.6, "eval/x/pass@4": 1.0}, target, 30.0)]
    assert [r["steps_to_target"] for r in ict] == [2, 1, None]  # (0.4 + 0.6) / 2 >= 0.5 at step 2
    g = aggregate_group(ict)
    assert g["pass"]["pass@1"]["mean"] == pytest.approx(0.6) and g["pass"]["pass@1"]["sd"] == pytest.approx(0.1)
    assert g["pass"]["pass@4"]["sd"] == pytest.approx(0.1)
    assert g["steps_to_target"] == {"mean": 1.5, "sd": pytest.approx(math.sqrt(0.5)), "n": 2, "n_runs": 3}
    assert g["H1"]["mean"] == pytest.approx(2.0) and g["H1"]["sd"] == pytest.approx(1.0)
    grpo = aggregate_group([run_result(_rows([0.0] * 6), {"eval/x/pass@1": 0.25}, target, 5.0)])
    results = {"target_reward": target, "eval": ["x"], "warmstart": {"eval": {"eval/x/pass@1": 0.125}, "wall_s": 7},
               "groups": [{"group": "ict", "rho": None, "seeds": [0, 1, 2], **g},
                          {"group": "ict_rho0.2", "rho": 0.2, "seeds": [0], **grpo},
                          {"group": "stapo", "rho": None, "seeds": [], **aggregate_group([])}]}
    md = format_markdown(results)
    rows = _table_rows(md)
    assert rows[0][:5] == ["method", "rho", "seeds", "P@1", "P@4"]
    assert rows[1][0] == "warm start (SFT)" and rows[1][3] == "0.125" and rows[1][4] == "n/a"
    assert rows[2][:5] == ["ict", "", "3", "0.600 ± 0.100", "0.900 ± 0.100"]
    assert rows[2][5] == "1.5 ± 0.7 (2/3 reached)"
    assert rows[2][6] == "n/a"  # no step logged mask/selected_frac
    assert rows[2][7] == "2.000 ± 1.000" and rows[2][8] == "2.000 ± 0.000" and rows[2][9] == "20 ± 10"
    assert rows[3][:6] == ["ict_rho0.2", "0.2", "1", "0.250", "n/a", "never"]
    assert rows[4] == ["stapo", "", "0"] + ["n/a"] * 7  # no finished run (e.g. every seed diverged)
    assert "WARNING" not in md
    assert "within one standard deviation" in md and "inconclusive" in md


def test_plan_runs_groups_and_directories(tmp_path):
    specs = plan_runs(["grpo", "ict"], [0, 1], tmp_path, rhos=[0.05, 0.2])
    assert [s.name for s in specs] == ["grpo_s0", "grpo_s1", "ict_rho0.05_s0", "ict_rho0.05_s1",
                                       "ict_rho0.2_s0", "ict_rho0.2_s1"]
    assert specs[2].run_dir == tmp_path / "experiment" / "runs" / "ict_rho0.05_s0" and specs[2].rho == 0.05
    assert specs[0].rho is None and specs[0].method == "grpo"
    assert [s.name for s in plan_runs(["ict"], [0], tmp_path, rhos=[0.1, 0.2])] == ["ict_rho0.1_s0", "ict_rho0.2_s0"]
    from ict_jax.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape("methods: ['ict']: a comparison needs at least two run groups")):
        plan_runs(["ict"], [0, 1], tmp_path)  # one group: the runner's plans compare arms
    with pytest.raises(ConfigError, match="at least two run groups"):
        plan_runs(["ict"], [0], tmp_path, rhos=[0.1])


def test_variant_and_control_methods_plan_their_runs(tmp_path):
    """The controls of docs/method.md §2 run as methods; ict_norm_valid is ict with GRPO's denominators."""
    specs = plan_runs(["frequent", "selectable", "ict_norm_valid"], [0], tmp_path)
    assert [s.name for s in specs] == ["frequent_s0", "selectable_s0", "ict_norm_valid_s0"]
    assert [s.method for s in specs] == ["frequent", "selectable", "ict"]
    cfg = load_config(DEMO)
    runs = [run_config(cfg, s, "m", "char") for s in specs]
    assert [r.rl.selector.method for r in runs] == ["frequent", "selectable", "ict"]
    assert [r.rl.loss.normalize_over for r in runs] == ["selected", "selected", "valid"]
    assert runs[2].run_dir == str(tmp_path / "experiment" / "runs" / "ict_norm_valid_s0")


def test_markdown_has_a_column_per_eval_benchmark():
    target = 0.5
    runs = [run_result(_rows([0.1] * 3), {"eval/a/pass@1": p, "eval/b?force_x=true/pass@1": q}, target, 1.0)
            for p, q in ((0.2, 0.6), (0.4, 0.8))]
    g = aggregate_group(runs)
    assert g["pass_by_bench"]["a"]["pass@1"]["mean"] == pytest.approx(0.3)
    results = {"target_reward": target, "eval": ["a", "b?force_x=true"],
               "warmstart": {"eval": {"eval/a/pass@1": 0.1, "eval/b?force_x=true/pass@1": 0.5}, "wall_s": 7},
               "groups": [{"group": "ict", "rho": None, "seeds": [0, 1], **g}]}
    md = format_markdown(results)
    rows = _table_rows(md)
    assert rows[0][:6] == ["method", "rho", "seeds", "P@1", "P@1 b1", "P@1 b2"]
    assert rows[1][3:6] == ["0.300", "0.100", "0.500"]
    assert rows[2][3:6] == ["0.500 ± 0.141", "0.300 ± 0.141", "0.700 ± 0.141"]
    assert "b1 = a; b2 = b?force_x=true" in md


def _sel_rows(fracs):
    return [{"step": i, "phase": "rl", "reward/mean": 0.5, "mask/selected_frac": f} for i, f in enumerate(fracs)]


def test_selected_fraction_after_the_warm_up_by_hand():
    """mask/selected_frac averaged over the steps after the warm-up; a run that selected every token there, or
    never left the warm-up, is flagged (it trained as dense GRPO)."""
    from ict_jax.experiments.compare_report import dense_steps, selected_everything, selection

    assert dense_steps("ict", 2) == 2 and dense_steps("random", 2) == 2 and dense_steps("selectable", 2) == 2
    assert dense_steps("stapo", 2) == 0 and dense_steps("entropy", 2) == 0 and dense_steps("grpo", 2) == 0
    s = selection(_sel_rows([1.0, 1.0, 0.1, 0.2, "nan"]), dense=2)  # steps 2, 3 count; "nan" is left out
    assert s == {"selected_frac": pytest.approx(0.15), "sparse_steps": 2, "dense_steps": 2, "steps": 4,
                 "all_selected": False}
    stapo = selection(_sel_rows([1.0, 1.0, 1.0]))  # STAPO silenced no token
    assert stapo == {"selected_frac": 1.0, "sparse_steps": 3, "dense_steps": 0, "steps": 3, "all_selected": True}
    warm = selection(_sel_rows([1.0, 1.0, 1.0]), dense=20)  # every step inside a 20-step warm-up
    assert warm == {"selected_frac": None, "sparse_steps": 0, "dense_steps": 20, "steps": 3, "all_selected": True}
    assert selection([{"step": 0, "reward/mean": 0.5}])["all_selected"] is None  # nothing logged: nothing to say
    assert selected_everything("stapo", stapo) and selected_everything("ict", warm)
    assert not selected_everything("grpo", stapo) and not selected_everything("dense", stapo)
    assert not selected_everything("ict", s) and not selected_everything("ict", None)


def test_a_sparse_method_that_selected_everything_is_a_column_and_a_warning():
    """The hand case of a short comparison: STAPO silenced no token (its row equals GRPO's), ICT's runs never
    left the warm-up on one seed; the table shows the selected fraction, the warnings name them."""
    target = 0.5
    r = lambda fracs, dense=0: run_result(_sel_rows(fracs), {"eval/x/pass@1": 0.5}, target, 1.0,  # noqa: E731
                                          dense=dense)
    groups = [
        {"group": "ict", "method": "ict", "rho": None, "seeds": [0, 1],
         "runs": {"0": r([1.0, 0.1, 0.12], dense=1), "1": r([1.0, 1.0, 1.0], dense=3)}},
        {"group": "grpo", "method": "grpo", "rho": None, "seeds": [0, 1],
         "runs": {"0": r([1.0, 1.0, 1.0]), "1": r([1.0, 1.0, 1.0])}},
        {"group": "stapo", "method": "stapo", "rho": None, "seeds": [0, 1],
         "runs": {"0": r([1.0, 1.0, 1.0]), "1": r([1.0, 1.0, 1.0])}},
        {"group": "entropy", "method": "entropy", "rho": None, "seeds": [0],
         "runs": {"0": r([0.2, 0.2, 0.2])}},
    ]
    groups = [{**g, **aggregate_group(list(g["runs"].values()))} for g in groups]
    assert groups[0]["selected_frac"] == {"mean": pytest.approx(0.11), "sd": None, "n": 1}  # seed 1: no sparse step
    md = format_markdown({"target_reward": target, "eval": ["x"], "warmstart": {}, "groups": groups})
    rows = _table_rows(md)
    col = rows[0].index("selected (after warm-up)")
    assert [row[col] for row in rows[1:]] == ["0.110 (all: seed 1)", "1.000 ± 0.000",
                                              "1.000 ± 0.000 (all: seed 0, 1)", "0.200"]
    warnings = [line for line in md.splitlines() if "WARNING" in line]
    assert len(warnings) == 2
    assert warnings[0] == ("**WARNING: ict (ict) selected every valid token in 1 of 2 run(s) (seed 1: every RL step "
                           "inside the dense warm-up (rl.selector.warmup_steps 3)): it trained as dense GRPO, so its "
                           "numbers repeat GRPO's and its curves hide GRPO's; it is no evidence about the method.**")
    assert warnings[1].startswith("**WARNING: stapo (stapo) selected every valid token in 2 of 2 run(s) (seed 0, 1: "
                                  "selected fraction 1.000 on every one of its 6 sparse step(s))")


@pytest.mark.parametrize("args,message", [
    (["--methods", "ict,ppo"], "--methods: 'ppo' is not a selector method"),
    (["--methods", "grpo", "--rho", "0.1"], "--rho: the sparsity ablation is for ICT only"),
    (["--seeds", "0"], "--seeds '0'"),
    (["--rho", "0.1,1.5"], "rl.selector.rho: 1.5 is out of range"),
    (["train.sft_steps=0"], "compare needs a shared starting point"),
    (["--methods", "ict"], "--methods: ['ict']: a comparison needs at least two run groups"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = cli_main(["compare", "--config", str(DEMO), "--out", str(out), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"methods": ["ict", "ppo"]}, "methods: 'ppo' is not a selector method"),
    ({"methods": []}, "methods: empty"),
    ({"methods": ["grpo"], "rhos": [0.1]}, "rhos: the sparsity ablation is for ICT only"),
    ({"seeds": [0, 0]}, "seeds: [0, 0]: expected distinct non-negative integers"),
    ({"seeds": []}, "seeds: []"),
    ({"target_reward": float("nan")}, "target_reward: nan"),
    ({"methods": "ict,grpo"}, "methods: 'ict,grpo': expected a sequence of method names"),
    ({"seeds": 3}, "seeds: 3: expected a sequence of integers"),
    ({"rhos": "0.05,0.1"}, "rhos: '0.05,0.1': expected a sequence of fractions"),
])
def test_run_comparison_takes_typed_values_and_names_its_parameters(kwargs, message, tmp_path):
    """The library takes sequences and names its parameters (the CLI translates them into flags, above)."""
    from ict_jax.config import ConfigError
    from ict_jax.experiments.compare import run_comparison

    with pytest.raises(ConfigError, match=re.escape(message)):
        run_comparison(DEMO, out=tmp_path / "cmp", progress=False, **kwargs)
    assert not (tmp_path / "cmp").exists()


# --------------------------------------------------------------------------------------------------
# The orchestration without training: a stand-in Trainer writes what a real run writes
# --------------------------------------------------------------------------------------------------
class _FakeTrainer:
    """Stands in for ict_jax.train.trainer.Trainer in `run_comparison`'s warm start (sft + evaluate) and in
    the experiment runner (a run: train), writing the files the real one writes: sft_model/, metrics.jsonl,
    a checkpoint folder and summary.json. Records (run_dir, resume) per construction."""

    calls: list = []
    configs: dict = {}  # run folder name -> the Config the run was given
    diverge: set = set()  # methods whose train() raises TrainingDiverged
    select_all: set = set()  # methods that log mask/selected_frac 1.0 on every step (STAPO silencing nothing)

    def __init__(self, cfg, resume=False, progress=True):
        self.cfg, self.run, self.paused = cfg, Path(cfg.run_dir), None
        _FakeTrainer.calls.append((self.run.name, resume))
        _FakeTrainer.configs[self.run.name] = cfg

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def sft(self):
        (self.run / "sft_model").mkdir(parents=True)
        (self.run / "sft_model" / "config.json").write_text("{}")
        return {"sft/loss": 1.0}

    def evaluate(self, step):
        return {"eval/arith/pass@1": 0.125, "eval/arith/pass@2": 0.25}

    def train(self, pause=None):
        from ict_jax.train.logs import RunLogger
        from ict_jax.train.stopping import TrainingDiverged

        method, steps = self.cfg.rl.selector.method, self.cfg.train.steps
        if method in _FakeTrainer.diverge:
            raise TrainingDiverged("3 non-finite updates in a row")
        if not (self.run / "metrics.jsonl").is_file():
            log = RunLogger(self.run, total_steps=steps, progress=False, tensorboard=False)
            warm = self.cfg.rl.selector.warmup_steps if method in ("ict", "random") else 0
            for s in range(steps):
                sel = 1.0 if s < warm or method in ("grpo", "dense") or method in _FakeTrainer.select_all else 0.1
                log.log(s, {"reward/mean": 0.25 * (s + 1), "stats/H1_mean": 2.0 - 0.1 * s, "stats/H2_mean": 1.0,
                            "mask/selected_frac": sel})
            log.close()
            (self.run / "checkpoints" / str(steps)).mkdir(parents=True)
        p1 = 0.5 if method == "ict" else 0.375
        summary = {"eval_final": {"eval/arith/pass@1": p1, "eval/arith/pass@2": p1 + 0.25}, "wall_s": 2.0,
                   "status": "finished", "steps": steps}
        (self.run / "summary.json").write_text(json.dumps(summary))
        return summary


def res_selection(out: Path, group: str, seed: str = "0") -> dict:
    groups = json.loads((out / "results.json").read_text())["groups"]
    return next(g for g in groups if g["group"] == group)["runs"][seed]["selection"]


def _fake_trainers(monkeypatch):
    import ict_jax.experiments.compare
    import ict_jax.experiments.runner

    monkeypatch.setattr(ict_jax.experiments.compare, "Trainer", _FakeTrainer)  # the warm start
    monkeypatch.setattr(ict_jax.experiments.runner, "Trainer", _FakeTrainer)  # the RL runs


def test_the_generated_plan_gives_every_run_the_config_compare_built(tmp_path):
    """The plan compare writes, read by the runner's own reader, gives every run exactly the config compare
    builds for it (run_config: the comparison's config from the warm start, RL only, the run's method, rho,
    variant overrides, seed and run directory): the runner trains the runs compare defines."""
    from ict_jax.experiments.plan import load_plan
    from ict_jax.experiments.plan import plan_runs as runner_runs

    cfg = load_config(DEMO, TINY)
    out = tmp_path / "cmp"
    specs = plan_runs(["grpo", "ict", "ict_norm_valid"], [0, 3], out, rhos=[0.05, 0.2])
    plan = load_plan(write_plan(cfg, specs, out, "/models/sft", "char"))
    assert plan.arm_names == ["grpo", "ict_rho0.05", "ict_rho0.2", "ict_norm_valid"] and plan.seeds == (0, 3)
    assert plan.steps == cfg.train.steps and plan.reference_arms == ("grpo",)
    assert plan.out == plan.record == out.absolute() / "experiment" and plan.config_path == out / "rl_config.yaml"
    assert (plan.primary.metric, plan.primary.first, plan.primary.last) == ("reward/mean", 1, cfg.train.steps)
    runs = runner_runs(plan)
    assert [r.name for r in runs] == [s.name for s in specs]
    for r, s in zip(runs, specs):
        assert r.run_dir == s.run_dir
        assert r.config == run_config(cfg, s, "/models/sft", "char"), s.name
    assert runs[0].config.train.sft_steps == 0 and runs[0].config.model.path == "/models/sft"
    assert runs[2].config.rl.selector.rho == 0.05 and runs[6].config.rl.loss.normalize_over == "valid"
    text = (out / "plan.yaml").read_text()
    write_plan(cfg, specs, out, "/models/sft", "char")  # the same comparison: the same plan, byte for byte
    assert (out / "plan.yaml").read_text() == text


def test_compare_orchestration_with_a_stand_in_trainer(tmp_path, capsys, monkeypatch):
    """What `ict-jax compare` does around the training runs (the e2e test below trains for real): one
    warm start shared by every run, each run's config, the table, the plots, skip / resume / diverged on
    a second invocation, and the refusal of another config in the same folder."""
    _fake_trainers(monkeypatch)
    monkeypatch.setattr(_FakeTrainer, "calls", [])
    monkeypatch.setattr(_FakeTrainer, "configs", {})
    monkeypatch.setattr(_FakeTrainer, "diverge", {"stapo"})
    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(DEMO), "--methods", "ict,grpo,stapo", "--seeds", "1", "--out", str(out),
            "--target-reward", "0.5", "--no-progress", *TINY]
    assert cli_main(argv) == 0
    cap = capsys.readouterr()
    assert _FakeTrainer.calls == [("warmstart", False), ("ict_s0", False), ("grpo_s0", False), ("stapo_s0", False)]
    warm = out / "warmstart" / "sft_model"
    assert json.loads((out / "warmstart" / "warmstart.json").read_text())["eval"] == {
        "eval/arith/pass@1": 0.125, "eval/arith/pass@2": 0.25}
    assert _FakeTrainer.configs["warmstart"].train.sft_steps == 5
    cfgs = {m: _FakeTrainer.configs[f"{m}_s0"].to_dict() for m in ("ict", "grpo", "stapo")}
    for m, c in cfgs.items():
        assert c["model"]["path"] == str(warm.absolute()) and c["model"]["tokenizer"] == "char"
        assert c["train"]["sft_steps"] == 0 and c["seed"] == 0 and c["rl"]["selector"]["method"] == m
        assert c["run_dir"] == str(out.absolute() / "experiment" / "runs" / f"{m}_s0")
    strip = lambda c: {**c, "rl": {**c["rl"], "selector": None}, "run_dir": None}  # noqa: E731
    assert strip(cfgs["ict"]) == strip(cfgs["grpo"]) == strip(cfgs["stapo"])
    assert "stapo s0: after step 0 of 3 diverged" in cap.err  # the runner's line
    exp = out / "experiment"
    assert json.loads((exp / "runs" / "stapo_s0" / "experiment_status.json").read_text())["status"] == "diverged"
    record = json.loads((exp / "experiment.json").read_text())  # the runner's record and report, beside the runs
    assert {n: r["status"] for n, r in record["runs"].items()} == {"ict_s0": "finished", "grpo_s0": "finished",
                                                                   "stapo_s0": "diverged"}
    assert record["plan"]["reference_arms"] == ["grpo"] and (exp / "report.md").is_file()

    md = (out / "results.md").read_text()
    assert md in cap.out
    rows = _table_rows(md)
    assert rows[0][:5] == ["method", "rho", "seeds", "P@1", "P@2"]
    assert rows[1][:5] == ["warm start (SFT)", "", "", "0.125", "0.250"]
    # reward 0.25, 0.5, 0.75: the 5-step moving average reaches 0.5 at step 3 ((.25 + .5 + .75) / 3)
    assert rows[2][:6] == ["ict", "", "1", "0.500", "0.750", "3.0"]
    assert rows[3][:6] == ["grpo", "", "1", "0.375", "0.625", "3.0"]
    assert rows[4] == ["stapo", "", "0"] + ["n/a"] * 7  # diverged: left out of the table
    # selected after the warm-up (TINY: rl.selector.warmup_steps=1, ICT only): ict steps 1-2, grpo steps 0-2
    assert rows[0][6] == "selected (after warm-up)" and rows[2][6] == "0.100" and rows[3][6] == "1.000"
    assert res_selection(out, "ict") == {"selected_frac": pytest.approx(0.1), "sparse_steps": 2, "dense_steps": 1,
                                         "steps": 3, "all_selected": False}
    assert res_selection(out, "grpo")["dense_steps"] == 0 and res_selection(out, "grpo")["all_selected"] is True
    assert "WARNING" not in md and "WARNING" not in cap.err  # dense GRPO selecting everything is its method
    res = json.loads((out / "results.json").read_text())
    assert res["runs"] == {"ict_s0": "started", "grpo_s0": "started", "stapo_s0": "diverged"}
    assert res["groups"][0]["runs"]["0"]["H1"] == pytest.approx(1.9)  # tail mean of 2.0, 1.9, 1.8
    for png in ("reward.png", "H1.png", "H2.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png

    # again: the warm start is reused, finished and diverged runs are skipped, nothing trains
    _FakeTrainer.calls.clear()
    assert cli_main(argv) == 0
    assert "warm start: reusing" in capsys.readouterr().err
    assert _FakeTrainer.calls == [] and _table_rows((out / "results.md").read_text()) == rows
    assert set(json.loads((out / "results.json").read_text())["runs"].values()) == {"skipped"}

    # a run with a checkpoint but no summary is resumed, not restarted
    (exp / "runs" / "grpo_s0" / "summary.json").unlink()
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert _FakeTrainer.calls == [("grpo_s0", True)]
    assert json.loads((out / "results.json").read_text())["runs"]["grpo_s0"] == "resumed"

    # another seed (a new plan under the same config) trains only the new runs
    _FakeTrainer.calls.clear()
    assert cli_main([*argv[:6], "0,1", *argv[7:]]) == 0
    capsys.readouterr()
    assert _FakeTrainer.calls == [("ict_s1", False), ("grpo_s1", False), ("stapo_s1", False)]
    assert json.loads((out / "results.json").read_text())["runs"] == {
        "ict_s0": "skipped", "ict_s1": "started", "grpo_s0": "skipped", "grpo_s1": "started", "stapo_s0": "skipped",
        "stapo_s1": "diverged"}
    assert json.loads((exp / "experiment.json").read_text())["plan"]["seeds"] == [0, 1]

    # another config in the same folder is refused before anything runs
    _FakeTrainer.calls.clear()
    assert cli_main(argv + ["train.steps=4"]) == 2
    assert "holds a comparison made with another config (differs in train.steps)" in capsys.readouterr().err
    assert _FakeTrainer.calls == []


def test_compare_warns_when_a_sparse_method_selected_every_token(tmp_path, capsys, monkeypatch):
    """`ict-jax compare --config`: STAPO silenced no token, so its row equals GRPO's. The table shows the
    selected fraction and a warning, and the command prints the warning."""
    _fake_trainers(monkeypatch)
    monkeypatch.setattr(_FakeTrainer, "calls", [])
    monkeypatch.setattr(_FakeTrainer, "configs", {})
    monkeypatch.setattr(_FakeTrainer, "diverge", set())
    monkeypatch.setattr(_FakeTrainer, "select_all", {"stapo"})
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--config", str(DEMO), "--methods", "grpo,stapo", "--seeds", "1", "--out", str(out),
                     "--no-progress", *TINY]) == 0
    cap = capsys.readouterr()
    md = (out / "results.md").read_text()
    rows = _table_rows(md)
    col = rows[0].index("selected (after warm-up)")
    assert [r[0] for r in rows[2:]] == ["grpo", "stapo"]
    assert rows[2][col] == "1.000" and rows[3][col] == "1.000 (all: seed 0)"
    assert rows[2][3:col] == rows[3][3:col]  # the same numbers as GRPO's
    warning = ("WARNING: stapo (stapo) selected every valid token in 1 of 1 run(s) (seed 0: selected fraction 1.000 "
               "on every one of its 3 sparse step(s)): it trained as dense GRPO")
    assert warning in md and f"[compare] {warning}" in cap.err and md in cap.out
    assert cap.err.count(warning) == 1  # the runner prints it, once
    assert "grpo (grpo) selected" not in md


# --------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_compare_two_methods_writes_table_and_plots_and_resumes(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(DEMO), "--methods", "ict,grpo", "--seeds", "1", "--out", str(out),
            "--target-reward", "0.0", "--no-progress", *TINY]
    assert cli_main(argv) == 0
    cap = capsys.readouterr()
    warm = out / "warmstart" / "sft_model"
    assert (warm / "config.json").is_file()
    # every run starts from the shared warm start, RL only, its own method, the same seed and data
    runs = out / "experiment" / "runs"  # the runner's run directories
    cfgs = {m: json.loads((runs / f"{m}_s0" / "config.json").read_text()) for m in ("ict", "grpo")}
    for m, c in cfgs.items():
        assert c["model"]["path"] == str(warm.absolute()) and c["model"]["tokenizer"] == "char"
        assert c["train"]["sft_steps"] == 0 and c["seed"] == 0 and c["rl"]["selector"]["method"] == m
    strip = lambda c: {**c, "rl": {**c["rl"], "selector": None}, "run_dir": None}  # noqa: E731
    assert strip(cfgs["ict"]) == strip(cfgs["grpo"])

    md = (out / "results.md").read_text()
    assert md in cap.out  # the table is printed too
    rows = _table_rows(md)
    assert rows[0][:5] == ["method", "rho", "seeds", "P@1", "P@2"]
    assert [r[0] for r in rows[1:]] == ["warm start (SFT)", "ict", "grpo"]
    res = json.loads((out / "results.json").read_text())
    for g, row in zip(res["groups"], rows[2:]):
        assert g["seeds"] == [0]
        run = g["runs"]["0"]
        summary = json.loads((runs / f"{g['group']}_s0" / "summary.json").read_text())
        p = pass_at_k(summary["eval_final"])
        assert set(p) == {1, 2} and run["pass"] == {"pass@1": p[1], "pass@2": p[2]}
        assert row[3] == f"{p[1]:.3f}" and row[4] == f"{p[2]:.3f}"  # one seed: no sd
        assert run["steps"] == 3 and run["steps_to_target"] == 1 and row[5] == "1.0"  # target 0: step 1
        assert math.isfinite(run["H1"]) and run["H1"] > 0 and row[7] == f"{run['H1']:.3f}"
        sel = run["selection"]  # TINY's 1-step warm-up applies to ict, not grpo
        assert sel["dense_steps"] == (1 if g["group"] == "ict" else 0) and sel["sparse_steps"] == 3 - sel["dense_steps"]
        assert row[6] == f"{sel['selected_frac']:.3f}" and (sel["selected_frac"] < 0.5) == (g["group"] == "ict")
    assert "inconclusive" in md
    for png in ("reward.png", "H1.png", "H2.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png

    # a second invocation trains nothing: the warm start is reused and both runs are skipped
    metrics = {m: (runs / f"{m}_s0" / "metrics.jsonl").read_text() for m in ("ict", "grpo")}
    assert cli_main(argv) == 0
    assert "warm start: reusing" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["runs"] == {"ict_s0": "skipped", "grpo_s0": "skipped"}
    assert {m: (runs / f"{m}_s0" / "metrics.jsonl").read_text() for m in ("ict", "grpo")} == metrics
    assert _table_rows((out / "results.md").read_text()) == rows

    # a run with a checkpoint but no summary is resumed, not restarted: no RL step is repeated
    (runs / "grpo_s0" / "summary.json").unlink()
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert json.loads((out / "results.json").read_text())["runs"] == {"ict_s0": "skipped", "grpo_s0": "resumed"}
    assert (runs / "grpo_s0" / "metrics.jsonl").read_text() == metrics["grpo"]
    assert (runs / "grpo_s0" / "summary.json").is_file()
    assert _table_rows((out / "results.md").read_text())[3][:4] == rows[3][:4]

    # reusing the folder with another config would mix results: refused before anything runs
    assert cli_main(argv + ["train.steps=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a comparison made with another config (differs in train.steps)" in err, err


@pytest.mark.e2e
def test_a_compare_run_equals_the_same_run_trained_directly(tmp_path, monkeypatch):
    """A run of the comparison (trained by the experiment runner from the generated plan) logs, step by step
    and bitwise, the metrics of the same run trained directly by the Trainer with the config compare builds
    for it (run_config: the config from the shared warm start, RL only, the run's method and seed)."""
    from ict_jax.experiments.compare import run_comparison
    from ict_jax.train.logs import read_metrics
    from ict_jax.train.trainer import Trainer

    # a reward by the response's length gives the tiny model's groups different rewards: nonzero updates
    (tmp_path / "compare_reward_t52.py").write_text(
        "def by_length(response, gold, meta):\n    return float(len(response.strip()) % 3) / 2.0\n")
    monkeypatch.chdir(tmp_path)  # the reward workers import rl.reward.fn from the working directory
    over = [*TINY, "train.steps=2", "train.save_every=2", "data.eval=[]", "rl.reward.fn=compare_reward_t52:by_length"]
    out = tmp_path / "cmp"
    run_comparison(DEMO, methods=["ict", "grpo"], seeds=[1], out=out, progress=False, overrides=over)
    cfg = load_config(DEMO, over)
    spec = plan_runs(["ict", "grpo"], [1], out.absolute())[0]
    direct = run_config(cfg, spec, str((out / "warmstart" / "sft_model").absolute()), "char").replace(
        run_dir=str(tmp_path / "direct"))
    with Trainer(direct, progress=False) as trainer:
        trainer.train()
    timing = ("time/", "throughput/")  # the machine's clock, not the run
    rows = [[{k: v for k, v in r.items() if not k.startswith(timing)} for r in read_metrics(d / "metrics.jsonl", "rl")]
            for d in (spec.run_dir, tmp_path / "direct")]
    assert [r["step"] for r in rows[0]] == [0, 1] and all(r["grad/norm"] > 0 for r in rows[0]), rows[0]
    assert rows[0] == rows[1]


@pytest.mark.slow
def test_rho_ablation_selects_fewer_tokens_at_smaller_rho(tmp_path):
    from ict_jax.experiments.compare import run_comparison
    from ict_jax.train.logs import read_metrics

    out = tmp_path / "cmp"
    res = run_comparison(DEMO, methods=["ict"], seeds=[0, 1], rhos=[0.05, 0.3], out=out, progress=False,
                         overrides=TINY + ["train.steps=4", "train.save_every=2"])
    assert [g["group"] for g in res["groups"]] == ["ict_rho0.05", "ict_rho0.3"]
    assert all(g["seeds"] == [0, 1] and g["pass"]["pass@1"]["sd"] is not None for g in res["groups"])
    sel = {}
    for g in ("ict_rho0.05", "ict_rho0.3"):
        rows = [r for s in (0, 1) for r in read_metrics(out / "experiment" / "runs" / f"{g}_s{s}" / "metrics.jsonl")
                if r["step"] >= 1]
        sel[g] = sum(r["mask/selected_frac"] for r in rows) / len(rows)  # after the 1-step warm-up
    assert 0 < sel["ict_rho0.05"] < sel["ict_rho0.3"] < 1, sel
    rows = _table_rows((out / "results.md").read_text())
    assert [r[:3] for r in rows[2:]] == [["ict_rho0.05", "0.05", "2"], ["ict_rho0.3", "0.3", "2"]]


def test_a_comparison_that_failed_at_start_up_does_not_block_the_corrected_rerun(tmp_path, capsys, monkeypatch):
    """A compare that failed at start-up (here: the warm start's data file does not
    exist) left compare_config.json, and the corrected rerun was refused as "another config". The record
    guards results: while the folder holds none, a rerun with another config replaces it; once a run has
    produced something, another config is still refused."""
    import ict_jax.experiments.compare

    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(DEMO), "--methods", "ict,grpo", "--seeds", "1", "--out", str(out),
            "--no-progress", *TINY]
    bad = [*argv, 'data.train=["file:no_such_file.jsonl"]']
    assert cli_main(bad) == 2  # the real Trainer: fails while reading its inputs, before writing anything
    assert "no_such_file.jsonl" in capsys.readouterr().err
    assert (out / "compare_config.json").is_file() and not ict_jax.experiments.compare.has_results(out)
    _fake_trainers(monkeypatch)
    monkeypatch.setattr(_FakeTrainer, "calls", [])
    monkeypatch.setattr(_FakeTrainer, "configs", {})
    monkeypatch.setattr(_FakeTrainer, "diverge", set())
    assert cli_main(argv) == 0, capsys.readouterr().err  # the corrected config: accepted
    recorded = json.loads((out / "compare_config.json").read_text())
    assert recorded["data"]["train"] == ["arith?digits=1&size=64"]  # the record is the run's config now
    capsys.readouterr()
    assert cli_main([*argv, "train.steps=4"]) == 2  # results exist: another config is refused
    assert "holds a comparison made with another config" in capsys.readouterr().err
