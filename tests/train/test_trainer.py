"""The trainer end to end on a tiny model with the CharTokenizer and the procedural arith task;
bad input; resume after SIGKILL (slow, subprocess)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from ict_jax.cli.main import main as cli_main
from ict_jax.config_load import load_config
from ict_jax.train.logs import read_metrics

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
TINY = [  # a few seconds per method on 2 cores
    "model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
    "rollout.max_prompt_len=16", "train.sft_steps=2", "train.sft_batch_size=8", "rl.selector.warmup_steps=1",
    "data.train=[\"arith?digits=1&size=64\"]", "data.eval=[]", "stats.chunk=8", "rl.reward.workers=1",
]
SECTION5 = {"reward/mean", "reward/accuracy", "adv/zero_std_group_frac", "response/length_mean",
            "response/truncated_frac", "mask/selected_frac", "mask/selected_prob_mean",
            "mask/high_low_entropy_ratio", "stats/H1_mean", "stats/H2_mean", "stats/H1_selected_mean",
            "stats/H2_selected_mean", "stats/js_mean", "stats/js_p90", "stats/js_selected_mean", "loss/policy",
            "loss/kl", "kl/valid_mean", "clip/frac_selected", "clip/frac_unselected", "grad/norm",
            "rollout/logp_abs_diff_mean", "mask/selected_eos_frac", "mask/selected_after_shortest_frac",
            "mask/selected_truncated_frac", "mask/selected_neg_adv_frac", "optim/update_norm", "time/rollout_s",
            "time/sample_s", "time/rewards_s", "time/update_s", "throughput/tokens_per_s"}


# ict stays in the default suite as the trainer's representative end-to-end run (SFT warm start, RL,
# metrics, checkpoint, TensorBoard, plot, summary); the other methods differ only in the selector, which
# tests/rl/test_train_step.py and tests/rl/test_selectors.py cover as units
@pytest.mark.parametrize("method", ["ict", pytest.param("grpo", marks=pytest.mark.e2e),
                                    pytest.param("entropy", marks=pytest.mark.e2e),
                                    pytest.param("stapo", marks=pytest.mark.e2e),
                                    pytest.param("random", marks=pytest.mark.e2e)])
def test_each_method_trains_logs_every_metric_and_checkpoints(method, tmp_path):
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + [f"rl.selector.method={method}", "train.steps=2", "train.save_every=2",
                                     f"run_dir={tmp_path / 'run'}", "rl.loss.kl_coef=0.01",
                                     "mesh.data=-1", "mesh.tensor=2"])  # 4 x 1 x 2 on the 8 test devices
    # other tests' device buffers (session fixtures), kept alive to the end: a buffer is known by its address,
    # and a freed one's address can be given to a buffer of this run, which would then be left uncounted
    gc.collect()
    keep = jax.live_arrays()
    held = _buffers(keep)
    during_sft = []

    def live_during_sft(info):  # after each SFT step: every device buffer of this run, each counted once
        gc.collect()  # arrays no longer referenced but not yet collected are not the run's memory
        live = sum(n for k, n in _buffers(jax.live_arrays()).items() if k not in held)
        during_sft.append((info.phase, info.step, live, sum(_buffers(jax.tree.leaves(info.state)).values())))

    with Trainer(cfg, progress=False) as t:
        assert t.parts.sft_ahead and t.phase == "sft" and t.ref_params is None
        t.add_hook(live_during_sft, phase="sft")
        summary = t.train()
        compiled = {name: list(p.executables) for name, p in t.parts.programs.by_name().items()}
    # the programs compiled before the first step (the pre-flight point) are the ones the run executed:
    # one shape each (the SFT step's (rows, tokens): train.sft_batch_size 8 x (16 + 6); the largest prompt
    # bucket is the only one of rollout.max_prompt_len 16; the step's (rows, prompt bucket, response width,
    # response bucket): max_new_tokens 6 is its only response bucket, below rollout.min_response_bucket 16),
    # nothing else
    assert compiled == {"sft": [(8, 22)], "step": [(16, 16, 6, 6)], "generate": [(4, 16)], "eval": []}, compiled
    # during SFT the live arrays are the SFT state (parameters, one Adam state, step, key) and at most its
    # batch: no RL optimizer state and no KL reference (kl_coef > 0) beside them (each a multiple of the
    # parameters: 2x and 1x)
    batch = 3 * 8 * 22 * 4  # tokens, attention and loss masks: int32 [sft_batch_size, 16 + 6]
    assert [(p, s) for p, s, _, _ in during_sft] == [("sft", 1), ("sft", 2)]
    for _, step, live, state in during_sft:
        assert state <= live <= state + batch, f"SFT step {step}: {live} bytes of live arrays; the SFT state's {state} + {batch}"
    del keep
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    missing = SECTION5 - set(rows[-1])
    assert not missing, f"metrics without {sorted(missing)}"
    assert all(np.isfinite(rows[-1][k]) for k in SECTION5)
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
    assert (run / "sft_model" / "config.json").is_file()  # the warm start, the KL reference of a resume
    assert (run / "metrics.png").is_file() and (run / "summary.json").is_file()
    assert list((run / "tb" / "rl").glob("events.out.tfevents.*")) and list((run / "tb" / "sft").glob("events.*"))
    assert summary["final"]["reward/mean"] == rows[-1]["reward/mean"]
    # the pre-flight's numbers (docs/memory.md): each program a device, the budget, the predicted and the
    # measured peak of this process
    mem = summary["memory"]
    assert set(mem["programs"]) == {"sft", "step", "generate"} and mem["budget"]["platform"] == "cpu"
    assert mem["programs"]["sft"]["resident"] == 0  # nothing of RL's is alive during SFT
    assert mem["budget"]["devices"] == 8 and 0 < mem["budget"]["per_device"] < mem["budget"]["total"]
    need = max(p["device_bytes"] for p in mem["programs"].values())
    assert mem["predicted_peak"] == mem["budget"]["outside"] + 8 * need and mem["peak_rss"] > 0


def _cli(args: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(args)
    err = capsys.readouterr().err.strip()
    return rc, err


def _buffers(arrays) -> dict[tuple[int, int], int]:
    """The device buffers under ``arrays``: ``(device id, buffer address) -> bytes``, each buffer once. A
    replicated array has one buffer per device; an array and its views are one allocation (a shard's
    ``.data`` is a new ``jax.Array`` on its array's buffer, and ``jax.live_arrays()`` lists it while it lives,
    so counting arrays instead of buffers counts a shard read twice)."""
    out = {}
    for a in arrays:
        if isinstance(a, jax.Array) and not a.is_deleted():
            for shard in a.addressable_shards:
                out[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return out


@pytest.mark.parametrize("override,message", [
    ("rl.selector.methd=ict", "unknown config key 'rl.selector.methd'"),
    ("train.steps=many", "train.steps: expected an integer"),
    ("mesh.data=3", "does not equal the 1 available devices"),
    ("data.train=[\"gsm8k\"]", "gsm8k"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(override, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a: jax.local_devices()[:1])  # a 1-device machine
    run = tmp_path / "run"
    rc, err = _cli(["train", "--config", str(DEMO), f"run_dir={run}", "data.data_dir=" + str(tmp_path / "nodata"),
                    override, "--no-progress"], capsys)
    assert rc == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not run.exists()


def test_malformed_row_names_file_and_line(tmp_path, capsys):
    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True)
    rows = [json.dumps({"question": "1+1?", "answer": "#### 2"}), "{not json", json.dumps({"question": "x"})]
    (d / "gsm8k" / "train.jsonl").write_text("\n".join(rows) + "\n")
    rc, err = _cli(["train", "--config", str(DEMO), f"run_dir={tmp_path / 'run'}", f"data.data_dir={d}",
                    "data.train=[\"gsm8k\"]", "--no-progress"], capsys)
    assert rc == 2 and "train.jsonl:2" in err and len(err.splitlines()) == 1, err


def test_existing_run_dir_is_never_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    rc, err = _cli(["train", "--config", str(DEMO), f"run_dir={run}", "--no-progress"], capsys)
    assert rc == 2 and "already holds a run; pass --resume" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


# ------------------------------------------------------------------------------------------------
# One run per run directory: the Trainer holds it from the start to close()
# ------------------------------------------------------------------------------------------------
#: a first run in its slow start-up: a real Trainer whose build (the model load) takes two minutes
SLOW_FIRST_RUN = """
import sys, time
import ict_jax.train.trainer as trainer_mod
from ict_jax.config_load import load_config

def slow_build(*a, **k):
    print("building", flush=True)
    time.sleep(120)

trainer_mod.build_parts = slow_build
trainer_mod.Trainer(load_config(sys.argv[1], sys.argv[2:]))
"""


class _Built(Exception):
    """Raised by a stand-in build_parts: the Trainer got past its hold of the run directory."""


def _stand_in_build(cfg, *, resume=False, **kwargs):
    from ict_jax.train.run_dir import check_run_dir

    check_run_dir(Path(cfg.run_dir), resume)  # what the real build checks first: the lock file holds no run
    raise _Built


def test_a_second_run_on_a_held_run_dir_is_refused_at_once_naming_the_holder(tmp_path, capsys, monkeypatch):
    import ict_jax.train.trainer as trainer_mod
    from ict_jax.outputs import OutputInUse, hold_output_dir

    run = tmp_path / "run"
    args = [*TINY, "train.steps=2", f"run_dir={run}"]
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu")
    first = subprocess.Popen([sys.executable, "-c", SLOW_FIRST_RUN, str(DEMO), *args], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "building"  # the first run holds run_dir, loading its model
        t0 = time.perf_counter()
        rc, err = _cli(["train", "--config", str(DEMO), *args, "--no-progress"], capsys)
        assert time.perf_counter() - t0 < 10, "refused at once, before anything is built"
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert f"run_dir '{run}' is in use by process {first.pid} on " in err and "(nothing was written)" in err
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
        with pytest.raises(OutputInUse, match=rf"process {first.pid} "):  # --resume too
            trainer_mod.Trainer(load_config(DEMO, args), resume=True)
    finally:
        first.kill()
        first.wait()
    # the killed holder's lock file is no obstacle: neither to the hold nor to "a new run needs an empty run_dir"
    monkeypatch.setattr(trainer_mod, "build_parts", _stand_in_build)
    deadline = time.time() + 10
    while True:
        try:
            with pytest.raises(_Built):
                trainer_mod.Trainer(load_config(DEMO, args))
            break
        except OutputInUse:  # the kernel releases the dead process's flock at once; allow it a moment
            assert time.time() < deadline
            time.sleep(0.1)
    # a Trainer that failed in its start-up released the directory; in-process holders exclude each other too
    with hold_output_dir(run, "run_dir"):
        with pytest.raises(OutputInUse, match=rf"process {os.getpid()} "):
            trainer_mod.Trainer(load_config(DEMO, args))


def test_the_run_dir_is_released_on_every_exit_path(tmp_path, monkeypatch):
    import ict_jax.train.trainer as trainer_mod
    from ict_jax.outputs import OutputInUse, hold_output_dir

    run = tmp_path / "run"
    args = [*TINY, "train.steps=2", f"run_dir={run}"]
    monkeypatch.setattr(trainer_mod, "build_parts", _stand_in_build)
    with pytest.raises(_Built):  # a new run that failed before writing: released, no directory left behind
        trainer_mod.Trainer(load_config(DEMO, args))
    assert not run.exists()
    # a finished run resumed: held while the Trainer is open, released when its block ends
    run.mkdir()
    (run / "config.json").write_text(json.dumps(load_config(DEMO, args).to_dict()))
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2}))
    with trainer_mod.Trainer(load_config(DEMO, args), resume=True) as t:
        assert t.finished is not None
        with pytest.raises(OutputInUse, match=rf"process {os.getpid()} "):
            with hold_output_dir(run, "run_dir"):
                pass
    with hold_output_dir(run, "run_dir"):
        pass
    t = trainer_mod.Trainer(load_config(DEMO, args), resume=True)
    t.close()
    with hold_output_dir(run, "run_dir"):
        pass
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "summary.json"]


# ------------------------------------------------------------------------------------------------
# Resume: bitwise identical to an uninterrupted run (CPU), after a SIGKILL
# ------------------------------------------------------------------------------------------------
def _train_proc(run: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"], JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(DEMO), "--no-progress", *TINY,
            f"train.steps={steps}", "train.save_every=3", "rl.loss.kl_coef=0.01", f"run_dir={run}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final_params(run: Path):
    from flax import nnx

    from ict_jax.train.model_source import resolve_model

    source = resolve_model(run / "checkpoints", checkpoint=True)
    model, meta = source.load(), source.meta
    return meta["step"], jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


# with LoRA: SFT and RL on adapters; a format penalty gives the random model's groups nonzero
# advantages, so that RL moves the adapters (all-zero rewards would leave B = 0 and the check empty)
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "rl.reward.no_answer=-1"]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_after_sigkill_is_bitwise_identical(tmp_path, lora):
    full, cut = tmp_path / "full", tmp_path / "cut"
    extra = LORA if lora else []
    p = _train_proc(full, 6, *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    # the interrupted run: killed as soon as its step-3 checkpoint is final
    p = _train_proc(cut, 6, *extra)
    deadline = time.time() + 900
    while time.time() < deadline and p.poll() is None:
        if any(r["step"] == 3 for r in _rows(cut)) and (cut / "checkpoints" / "3").is_dir():
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    p = _train_proc(cut, 6, "--resume", *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    step_a, params_a = _final_params(full)
    step_b, params_b = _final_params(cut)
    assert step_a == step_b == 6
    chex.assert_trees_all_equal(params_a, params_b)
    if lora:  # the checkpoints hold adapters, and RL trained them
        from ict_jax.train.model_source import resolve_model

        source = resolve_model(full / "checkpoints", checkpoint=True)
        model, meta = source.load(), source.meta
        assert model.config.lora is not None and meta["base_model"]["kind"] == "warm_start"
        b = [np.asarray(x) for k, x in jax.tree_util.tree_flatten_with_path(nnx_lora(model))[0] if "lora_b" in str(k)]
        assert b and all(np.abs(x).max() > 0 for x in b)
    ra, rb = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(6))
    for a, b in zip(ra, rb):
        keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
        assert keep(a) == keep(b), (a["step"], keep(a), keep(b))


def nnx_lora(model):
    from flax import nnx

    return nnx.state(model, nnx.LoRAParam)


def _rows(run: Path) -> list[dict]:
    try:
        return read_metrics(run / "metrics.jsonl")
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_evaluation_depends_on_weights_and_seed_only(tmp_path):
    """Two evaluations of the same weights give the same samples (the generator's key stream restarts),
    so a resumed run or an RL-only run evaluates a checkpoint exactly as one long run does; they sample
    through the run's own evaluation program (train.programs)."""
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.steps=1", "train.sft_steps=0", f"run_dir={tmp_path / 'run'}",
                                     "data.eval=[\"split?digits=1&size=6&seed=5\"]", "data.eval_n=2",
                                     "data.eval_k=[1,2]", "data.eval_temperature=1.0", "mesh.data=-1", "mesh.tensor=2"])
    with Trainer(cfg, progress=False) as t:
        t.evaluate(0)
        first = (tmp_path / "run" / "eval" / "step_000000.jsonl").read_text()
        t.evaluate(0)
        again = (tmp_path / "run" / "eval" / "step_000000.jsonl").read_text()
        compiled = dict(t.parts.programs.eval.executables)
    assert len(compiled) == 1 and first == again  # one executable of the eval program, run twice
    assert len(first.splitlines()) == 12


def test_three_non_finite_steps_in_a_row_stop_with_the_last_checkpoint_intact(tmp_path):
    from ict_jax.train.stopping import TrainingDiverged
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.steps=6", "train.save_every=1", "train.sft_steps=0",
                                     f"run_dir={tmp_path / 'run'}", "mesh.data=-1", "mesh.tensor=2"])
    with Trainer(cfg, progress=False) as t:
        real_step = t.parts.programs.step
        calls = {"n": 0}

        class Flaky:  # the run's step program, but steps 2, 3, 4 come back non-finite (update skipped)
            compile = real_step.compile

            def __call__(self, state, batch, ref):
                new, m = real_step(state, batch, ref)
                calls["n"] += 1
                if calls["n"] >= 3:
                    m = dict(m, **{"train/skipped": jax.numpy.ones(())})
                return new, m

        t.parts = dataclasses.replace(t.parts, programs=dataclasses.replace(t.parts.programs, step=Flaky()))
        with pytest.raises(TrainingDiverged, match="3 non-finite updates in a row"):
            t.train()
        t.parts.checkpointer.wait()
        steps = t.parts.checkpointer.all_steps()
    # saved after steps 1 and 2 only; nothing saved once the updates went bad
    assert max(steps) == 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/nonfinite_in_a_row"] for r in rows] == [0, 0, 1, 2, 3]


def test_dapo_dynamic_sampling_refills_dropped_groups(tmp_path):
    """train.rollout.collect_rollout, without a trainer loop: a stand-in scorer makes groups
    uninformative, and further prompt batches refill them in order."""
    from ict_jax.train.rollout import collect_rollout
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.steps=1", "train.sft_steps=0", f"run_dir={tmp_path / 'run'}",
                                     "rl.adv.drop_zero_std_groups=true", "rl.adv.max_refill=2",
                                     "mesh.data=-1", "mesh.tensor=2"])
    G, P = cfg.rollout.num_samples, cfg.train.prompts_per_step
    with Trainer(cfg, progress=False) as t:
        batches = []
        real = t.parts.iterator

        class Spy:
            def __next__(self):
                pb = next(real)
                batches.append(pb)
                return pb

        parts = dataclasses.replace(t.parts, iterator=Spy())

        def fake_score(parts, pb, tokens, valid):
            r = np.zeros(P * G, np.float32)
            if len(batches) == 1:
                r[G:G + 1] = 1.0  # only group 1 of the first batch is informative
            else:
                r[::2] = 1.0  # every group of a refill batch is informative
            return r

        batch, info = collect_rollout(parts, t.state, 0, score=fake_score)
        first_batches = list(batches)

        # With a format penalty, group 0 is all wrong and differs only by format.
        # filter_on=correct (the default) drops and refills it; filter_on=reward keeps it.
        def format_only(parts, pb, tokens, valid):
            r = np.zeros(P * G, np.float32)
            r[::G] = 1.0  # one right answer in every group ...
            r[:G] = [-0.2, 0.0] * (G // 2)  # ... but group 0: all wrong, half without an answer
            return r

        kept = {}
        for filter_on in ("correct", "reward"):
            other = dataclasses.replace(parts, config=cfg.replace(**{"rl.reward.no_answer": -0.2,
                                                                     "rl.adv.filter_on": filter_on}))
            batches.clear()
            fb, finfo = collect_rollout(other, t.state, 0, score=format_only)
            kept[filter_on] = (finfo["rollout/refills"], np.asarray(fb.rewards)[:G].astype(np.float32).tolist())
    assert kept["correct"][0] >= 1 and max(kept["correct"][1]) == 1.0  # refilled with an informative group
    assert kept["reward"] == (0, np.float32([-0.2, 0.0] * (G // 2)).tolist())  # kept: its rewards differ
    assert info["rollout/refills"] == 1 and info["rollout/kept_row_frac"] == 1.0
    # the rollout's time splits into sampling and rewards (the two scorer calls: the batch and its refill)
    assert info["time/rewards_s"] > 0 and info["time/sample_s"] > 0
    assert info["time/sample_s"] + info["time/rewards_s"] == pytest.approx(info["time/rollout_s"])
    first, refill = first_batches
    Lr = cfg.rollout.max_new_tokens
    prompts = np.asarray(batch.tokens)[::G, :-Lr]
    width = prompts.shape[1]
    pad = lambda a: np.pad(a, ((0, 0), (width - a.shape[1], 0)))  # noqa: E731  (CharTokenizer pad id 0)
    np.testing.assert_array_equal(prompts[1], pad(first.ids)[1])  # the informative group stays
    for hole, donor in zip([0, 2, 3], [0, 1, 2]):  # the others are refilled in order from the new batch
        np.testing.assert_array_equal(prompts[hole], pad(refill.ids)[donor])
    rewards = np.asarray(batch.rewards).reshape(P, G)
    assert (rewards.max(1) > rewards.min(1)).all()


@pytest.mark.e2e  # a profiled trainer run (~20 s)
def test_profile_steps_write_a_trace(tmp_path, capsys):
    run = tmp_path / "run"
    rc, err = _cli(["train", "--config", str(DEMO), *TINY, "train.steps=2", "train.sft_steps=0",
                    "mesh.data=-1", "mesh.tensor=2", f"run_dir={run}", "--profile-steps", "0:1", "--no-progress"],
                   capsys)
    assert rc == 0, err
    assert list((run / "profile").rglob("*.xplane.pb")), "no jax.profiler trace written"
    rc, err = _cli(["train", "--config", str(DEMO), f"run_dir={tmp_path / 'r2'}", "--profile-steps", "3:1"], capsys)
    assert rc == 2 and "--profile-steps '3:1'" in err


def test_rollout_chunks_sample_the_prompts_in_sequential_calls(tmp_path):
    """rollout.chunks = 2 (generate's row chunking, docs/tpu.md): the run's rollout makes two calls of its
    generate program of P / 2 prompts, the second with its own key, concatenated prompt-major into the
    step's P x G rows."""
    from ict_jax.train.rollout import collect_rollout, generate_and_score
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.steps=1", "train.sft_steps=0", f"run_dir={tmp_path / 'run'}",
                                     "train.prompts_per_step=8", "rollout.chunks=2", "mesh.data=-1",
                                     "mesh.tensor=2"])
    G, P = cfg.rollout.num_samples, cfg.train.prompts_per_step
    with Trainer(cfg, progress=False) as t:
        calls, real = [], t.parts.programs.generate

        def spy(params, ids, mask, key):
            ro = real(params, ids, mask, key)
            calls.append((np.asarray(ids), np.asarray(key), jax.tree.map(np.asarray, ro)))
            return ro

        parts = dataclasses.replace(t.parts, programs=dataclasses.replace(t.parts.programs, generate=spy))
        pb, ro, _ = generate_and_score(parts, t.state, jax.random.PRNGKey(7))
        batch, _ = collect_rollout(parts, t.state, 0)
    (ids0, key0, ro0), (ids1, key1, ro1) = calls[:2]
    assert ids0.shape[0] == ids1.shape[0] == P // 2
    np.testing.assert_array_equal(np.concatenate([ids0, ids1]), pb.ids)
    assert not np.array_equal(key0, key1)  # each chunk samples with its own key
    np.testing.assert_array_equal(ro.tokens, np.concatenate([ro0.tokens, ro1.tokens]))
    np.testing.assert_array_equal(ro.logp, np.concatenate([ro0.logp, ro1.logp]))
    assert ro.tokens.shape[0] == P * G and np.asarray(batch.tokens).shape[0] == P * G


@pytest.mark.e2e
def test_the_step_runs_each_batch_at_its_response_bucket(tmp_path):
    """Response buckets through the run's step program: buckets (2, 4, 6) of max_new_tokens 6. The
    pre-flight compiles the largest (the uncut step, bucket 6); each step runs at the bucket of its
    batch's longest response (``train/response_len``), the others compiled on first use, one executable
    per bucket met and nothing else. The spy ends every response after 1, 3, then 6 tokens (its validity
    cut; an untrained model rarely stops by itself), so the three steps meet the buckets 2, 4 and 6."""
    from ict_jax.train.trainer import Trainer

    cfg = load_config(DEMO, TINY + ["train.steps=3", "train.sft_steps=0", f"run_dir={tmp_path / 'run'}",
                                     "rollout.min_response_bucket=2", "mesh.data=-1", "mesh.tensor=2"])
    with Trainer(cfg, progress=False) as t:
        real, ends = t.parts.programs.step, iter([1, 3, 6])

        class Spy:  # the run's step program, on the batch with its responses ended early
            compile = real.compile

            def __call__(self, state, batch, ref):
                valid = np.asarray(batch.response_valid)
                valid = np.where(np.arange(valid.shape[1])[None, :] < next(ends), valid, 0).astype(valid.dtype)
                return real(state, batch.replace(response_valid=valid), ref)

        t.parts = dataclasses.replace(t.parts, programs=dataclasses.replace(t.parts.programs, step=Spy()))
        t.train()
        compiled = sorted(real.executables)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/response_len"] for r in rows] == [2, 4, 6]
    assert compiled == [(16, 16, 6, 2), (16, 16, 6, 4), (16, 16, 6, 6)]


def test_timed_scorer_adds_the_seconds_of_every_call_and_returns_the_rewards():
    """train.rollout.TimedScorer: what splits a step's rollout time into sampling and rewards."""
    import time

    from ict_jax.train.rollout import TimedScorer

    def slow(parts, pb, tokens, valid):
        time.sleep(0.02)
        return np.asarray(tokens, np.float32)[:, 0]

    timed = TimedScorer(slow)
    out = [timed(None, None, np.full((3, 2), k), None) for k in (1, 2)]
    np.testing.assert_array_equal(out[1], [2.0, 2.0, 2.0])
    assert 0.04 <= timed.seconds < 1.0

    def broken(parts, pb, tokens, valid):
        time.sleep(0.02)
        raise RuntimeError("reward worker died")

    timed = TimedScorer(broken)
    with pytest.raises(RuntimeError, match="reward worker died"):
        timed(None, None, None, None)
    assert timed.seconds >= 0.02  # counted even when the scorer fails
