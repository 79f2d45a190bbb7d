"""LoRA through a whole run: the trainer builds the model with adapters and trains only them,
checkpoints hold the adapters and the base model's identity, a resume is bitwise like an uninterrupted
run and refuses another base, and every command that reads a run (sample, eval, inspect, export) reads
a LoRA run; ``ict-jax compile`` builds the LoRA train state (base frozen, adapters and their moments, no
reference copy). The real Qwen2.5-0.5B version is tests/train/test_lora_real.py (slow)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import ict_jax
from ict_jax.config import ConfigError
from ict_jax.config_load import load_config
from ict_jax.model.identity import arrays_sha256, weights_sha256
from ict_jax.train.lora_base import LoraBase, check_base, describe, file_identity

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
# tests/train/test_trainer.py's tiny run with LoRA: rank 4 on every projection
TINY = ["model.preset=tiny", "rollout.num_samples=4", "train.prompts_per_step=4", "rollout.max_new_tokens=6",
        "rollout.max_prompt_len=16", "train.sft_steps=2", "train.sft_batch_size=8", "rl.selector.warmup_steps=1",
        "data.train=[\"arith?digits=1&size=64\"]", "data.eval=[]", "stats.chunk=8", "rl.reward.workers=1",
        "rl.loss.kl_coef=0.01", "optim.lr=0.01", "optim.lr_warmup_steps=0",
        "train.save_every=2", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
        "mesh.data=-1", "mesh.tensor=2"]  # 4 x 1 x 2 on the 8 test devices (4 prompts split over data = 4)


def _adapters(run: Path) -> dict:
    """{path: array} of the adapters in the run's latest RL checkpoint (its params item)."""
    from ict_jax.model.adapters import split_adapters
    from ict_jax.train.model_source import resolve_model

    model = resolve_model(run, checkpoint=True).load()
    _, adapters, _ = split_adapters(model)
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(adapters)[0]}


# ------------------------------------------------------------------------------------------------
# The base's identity (default suite: no compilation)
# ------------------------------------------------------------------------------------------------
def test_weights_are_identified_by_sha256_of_their_files_or_arrays(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    assert weights_sha256(gguf) == {"m.gguf": hashlib.sha256(gguf.read_bytes()).hexdigest()}  # = sha256sum
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        (hf / name).write_bytes(name.encode())
    (hf / "config.json").write_text("{}")
    got = weights_sha256(hf)
    assert list(got) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert got["model-00001-of-00002.safetensors"] == hashlib.sha256(b"model-00001-of-00002.safetensors").hexdigest()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        weights_sha256(tmp_path / "empty_nonexistent")
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    b = {"w": a["w"].copy(), "b": a["b"].copy()}
    assert arrays_sha256(a) == arrays_sha256(b)
    b["w"][1, 2] = np.nextafter(b["w"][1, 2], np.float32(np.inf))  # one bit of one element
    assert arrays_sha256(a) != arrays_sha256(b)
    assert arrays_sha256(a) != arrays_sha256({"w": a["w"].astype(np.float64), "b": a["b"]})  # the dtype counts


def test_a_checkpoint_on_another_base_is_refused_in_one_line(tmp_path):
    """check_base: the recorded identity must be this run's base (kind, content, a preset's seed);
    LoraBase.check reads it from the checkpoint's metadata."""
    from ict_jax.train.checkpoints import Checkpointer

    (tmp_path / "a.gguf").write_bytes(b"one")
    recorded = file_identity(str(tmp_path / "a.gguf"))
    check_base(recorded, dict(recorded), "the checkpoint of step 2")  # the same base: nothing to say
    (tmp_path / "a.gguf").write_bytes(b"two")  # same path, other weights
    current = file_identity(str(tmp_path / "a.gguf"))
    with pytest.raises(ConfigError) as e:
        check_base(recorded, current, "the checkpoint of step 2")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "holds LoRA adapters trained on" in msg
    assert recorded["sha256"]["a.gguf"][:12] in msg and current["sha256"]["a.gguf"][:12] in msg
    with pytest.raises(ConfigError, match="records no base model"):
        check_base(None, current, "the checkpoint of step 2")
    preset = {"kind": "preset", "source": "tiny", "seed": 0, "sha256": {"arrays": "ab" * 32}}
    assert "preset tiny (seed 0, sha256 abababababab...)" == describe(preset)
    with pytest.raises(ConfigError, match="seed 1"):
        check_base(preset, dict(preset, seed=1), "x")
    # through a checkpoint's metadata (a stand-in state: only the metadata is read)
    import jax.numpy as jnp

    state = ict_jax.TrainState(params={"w": jnp.zeros(2)}, opt_state={}, step=jnp.zeros((), jnp.int32),
                               rng=jax.random.PRNGKey(0))
    with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        ckpt.save(3, state, {"base_model": recorded})
        LoraBase(recorded, tmp_path, warm_start=False).check(ckpt, 3, "rl")
        with pytest.raises(ConfigError, match=r"--resume: the checkpoint of step 3 in .* holds LoRA adapters"):
            LoraBase(current, tmp_path, warm_start=False).check(ckpt, 3, "rl")


def test_the_abstract_lora_state_is_what_init_train_state_builds(tiny_config, tiny_model):
    """abstract_train_state (ict-jax compile, restore templates) of a LoRA config: params = the adapters,
    frozen = the base, AdamW's moments of the adapters only; the same tree, shapes and dtypes as the real
    state of the model with adapters."""
    from ict_jax.model.lora import lora_spec
    from ict_jax.train.checkpoints import abstract_train_state

    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.rank=2", "model.lora.targets=[q_proj,down_proj]"])
    spec = lora_spec(cfg.model.lora, tiny_config.num_layers)
    abstract = abstract_train_state(cfg, tiny_config.replace(lora=spec))
    real = ict_jax.init_train_state(cfg, ict_jax.add_adapters(tiny_model, spec))
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, str(a.dtype)), t)  # noqa: E731
    for part in ("params", "opt_state", "frozen"):
        assert shapes(getattr(abstract, part)) == shapes(getattr(real, part)), part
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
    assert len(names) == 4 and all(any(w in n for n in names) for w in ("wq_lora_a", "wq_lora_b", "w_down_lora_a",
                                                                        "w_down_lora_b")), names
    assert ict_jax.param_count(tiny_model) == sum(a.size for a in jax.tree.leaves(abstract.frozen))


# ------------------------------------------------------------------------------------------------
# A tiny LoRA run end to end: SFT 2 steps, RL 4 steps; and the same cut after 2 RL steps and resumed
# ------------------------------------------------------------------------------------------------
# the random model answers nothing right, so every group's rewards would be equal and RL would not move the
# adapters (B = 0, the KL check empty): a custom reward that varies with the response gives its groups
# nonzero advantages. The reward workers import the function from the caller's working directory.
REWARD_MODULE = "def score(response, gold, meta):\n    return float(len(set(response)) % 2)\n"


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """(folder to run in, overrides): the file task scored by the custom reward above."""
    folder = tmp_path_factory.mktemp("lora_reward")
    (folder / "lora_t27_reward.py").write_text(REWARD_MODULE)
    rows = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = f"file:{folder / 'tasks.jsonl'}?prompt=q&answer=a&reward=custom"
    return folder, [f"data.train=[\"{task}\"]", "rl.reward.fn=lora_t27_reward:score"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, reward_dir):
    """(full, cut): the same tiny LoRA run, uninterrupted (4 RL steps) and stopped after 2 then resumed."""
    from ict_jax.train.trainer import Trainer

    root = tmp_path_factory.mktemp("lora_runs")
    folder, reward = reward_dir

    def train(run: str, steps: int, resume: bool = False) -> None:
        cfg = load_config(DEMO, TINY + reward + [f"train.steps={steps}", f"run_dir={root / run}"])
        with Trainer(cfg, resume=resume, progress=False) as t:
            t.train()

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        train("full", 4)
        train("cut", 2)
        train("cut", 4, resume=True)
    return root / "full", root / "cut"


@pytest.mark.e2e  # three tiny trainer runs (~1 min on 2 cores), shared by the tests below
def test_a_lora_run_resumes_bitwise_like_an_uninterrupted_run(lora_runs):
    from ict_jax.train.logs import read_metrics

    full, cut = lora_runs
    a, b = _adapters(full), _adapters(cut)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}  # noqa: E731
    ra, rb = read_metrics(full / "metrics.jsonl", None), read_metrics(cut / "metrics.jsonl", None)
    assert [(r["phase"], r["step"]) for r in ra] == [(r["phase"], r["step"]) for r in rb]
    assert [keep(r) for r in ra] == [keep(r) for r in rb]
    rl = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rl] == [0, 1, 2, 3] and all(r["kl/valid_mean"] >= 0 for r in rl)
    assert any(r["adv/zero_std_group_frac"] < 1 for r in rl)  # the custom reward gave some group a signal
    assert any(r["kl/valid_mean"] > 0 for r in rl[1:])  # the adapters moved the policy off its reference


@pytest.mark.e2e
def test_checkpoints_hold_the_adapters_and_the_identity_of_their_base(lora_runs):
    """The params item is the adapters alone, the optimizer state their moments alone; the metadata names
    the base: the warm start (its adapters merged into the preset's weights) by its file's sha256. The
    base under RL is exactly that file, untouched by RL; the RL adapters are not fresh any more."""
    from ict_jax.model.adapters import split_adapters
    from ict_jax.train.checkpoints import Checkpointer
    from ict_jax.train.model_source import resolve_model

    full, _ = lora_runs
    with Checkpointer(full / "checkpoints", read_only=True) as ck:
        assert ck.all_steps() == [2, 4]
        saved = ck._mgr.item_metadata(4)
        meta = ck.restore_meta(4)
    params = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved["params"])[0]}
    assert params and all("lora" in p for p in params), sorted(params)[:3]
    opt = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved["opt"])[0]}
    assert not any(w in p for p in opt for w in ("embed", "'wq'", "'w_down'", "final_norm")), sorted(opt)[:5]
    sft = full / "sft_model"
    digest = hashlib.sha256((sft / "model.safetensors").read_bytes()).hexdigest()
    assert meta["base_model"] == {"kind": "warm_start", "source": "sft_model", "sha256": {"model.safetensors": digest}}
    assert meta["model_config"]["lora"]["rank"] == 4
    model = resolve_model(full, checkpoint=True).load()
    _, adapters, base = split_adapters(model)
    want = nnx.state(ict_jax.load_hf(sft), nnx.Param)
    assert jax.tree.structure(jax.tree.map(np.asarray, want)) == jax.tree.structure(jax.tree.map(np.asarray, base))
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    b = [np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(adapters)[0]
         if "lora_b" in jax.tree_util.keystr(k)]
    assert b and all(np.abs(x).max() > 0 for x in b)  # trained: B = 0 only for fresh adapters


@pytest.mark.e2e
@pytest.mark.torch
def test_commands_read_a_lora_run_and_its_peft_export_loads_in_peft(lora_runs, tmp_path, capsys):
    """sample / inspect / eval / export take the run directory; the PEFT adapter (base: the run's warm
    start, a transformers directory) loads with PeftModel onto transformers' Qwen2 with our logits and
    greedy tokens; the merged export gives the same logits."""
    import torch
    import transformers
    from peft import PeftModel

    from ict_jax.cli.main import main
    from ict_jax.train.model_source import resolve_model

    full, _ = lora_runs
    source = resolve_model(full)
    model, tok, where = source.load(), source.tokenizer(), source.where
    assert model.config.lora is not None and "checkpoint of step 4" in where
    assert main(["export", "--checkpoint", str(full), "--out", str(tmp_path / "peft"), "--format", "peft"]) == 0
    assert main(["export", "--checkpoint", str(full), "--out", str(tmp_path / "merged")]) == 0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((full / "sft_model").absolute()) and cfg["r"] == 4
    ids = np.asarray([tok.encode("3+4=") + [5, 7], tok.encode("9-2=") + [3, 3]], np.int32)
    ours = np.asarray(model(ids, np.ones_like(ids)))
    hf = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"]),
                                   tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(ids)).logits.numpy(), ours, atol=1e-4, rtol=0)
        np.testing.assert_allclose(merged(torch.tensor(ids)).logits.numpy(), ours, atol=1e-4, rtol=0)
        greedy = hf.generate(input_ids=torch.tensor(ids[:1]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                             max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 6:].numpy()
    mine = ict_jax.generate(model, ids[:1], None, jax.random.key(0), max_new_tokens=6, greedy=True)
    np.testing.assert_array_equal(np.asarray(mine.tokens[0]), greedy)
    capsys.readouterr()
    assert main(["sample", "--model", str(full), "--prompt", "3+4=", "-n", "2", "--max-new-tokens", "4"]) == 0
    assert "=== prompt 0" in capsys.readouterr().out
    assert main(["inspect", "--checkpoint", str(full), "--prompt", "3+4=", "-n", "4", "--max-new-tokens", "4",
                 "--out", str(tmp_path / "page.html")]) == 0
    assert (tmp_path / "page.html").is_file()
    assert main(["eval", "--model", str(full), "--benchmarks", "arith?digits=1&size=4", "--n", "2", "--k", "1",
                 "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())


@pytest.mark.e2e
def test_a_changed_base_is_refused_on_resume_and_on_load(lora_runs, reward_dir, tmp_path, capsys, monkeypatch):
    """The run's warm start rewritten with other weights: --resume stops with one line (exit 2) before
    anything is written; loading the checkpoint (sample, export, ...) is refused with one line too."""
    from ict_jax.cli.main import main
    from ict_jax.train.model_source import resolve_model

    full, _ = lora_runs
    run = tmp_path / "run"
    shutil.copytree(full, run)
    other = ict_jax.save_hf(ict_jax.init_model(ict_jax.ModelConfig.tiny(vocab_size=100), seed=7), tmp_path / "other")
    shutil.copy(other / "model.safetensors", run / "sft_model" / "model.safetensors")
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    monkeypatch.chdir(reward_dir[0])
    rc = main(["train", "--config", str(DEMO), *TINY, *reward_dir[1], "train.steps=6", f"run_dir={run}", "--resume",
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "holds LoRA adapters trained on the run's SFT warm start sft_model" in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_text() == before and not (run / "resumes.jsonl").exists()
    with pytest.raises(ValueError, match="holds LoRA adapters trained on .* but that base is now") as e:
        resolve_model(run).load()  # the metadata reads; the base is checked as it loads
    assert len(str(e.value).splitlines()) == 1
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "x"), "--format", "peft"]) == 2


@pytest.mark.e2e  # lowers the four programs twice and compiles the step (~20 s)
def test_compile_builds_the_lora_run_training_builds(tmp_path, devices8):
    """ict-jax compile (abstract state from the config) and training (real state) lower the same LoRA
    programs on a 4 x 1 x 2 mesh; the compiled step's arguments are the base once, the adapters and their
    two moments, and the batch: no reference copy although rl.loss.kl_coef > 0."""
    from ict_jax.aot.compile import build_programs, get_target, run_mesh, target_model_config
    from ict_jax.train.parts import build_parts
    from ict_jax.train.programs import per_device_bytes

    cfg = load_config(DEMO, TINY + ["train.sft_steps=0", "train.steps=1",
                                    f"run_dir={tmp_path / 'run'}"])
    parts, state, ref = build_parts(cfg, progress=False)
    try:
        assert ref is None and state.frozen is not None
        target = get_target("local")
        mc, source = target_model_config(cfg, target.platform)
        # compile resolves compute_dtype and attention "auto" for the target (float32 and dense attention on
        # CPU); training resolves them at use
        assert mc == parts.model_config.replace(compute_dtype="float32", attention="dense") and "LoRA rank 4" in source
        jobs = build_programs(cfg, mc, run_mesh(cfg, target))
        assert [job.name for job in jobs] == ["sft", "step", "generate", "eval"]  # the SFT step on adapters too
        for job in jobs:
            assert job.lower().as_text() == parts.programs.by_name()[job.name].lower().as_text(), job.name
        step = jobs[1]
        args = parts.programs.step.abstract()
        assert args[2] is None  # the step takes no reference parameters
        want = per_device_bytes(state.frozen) + 3 * per_device_bytes(state.params) + per_device_bytes(args[1])
        ma = parts.programs.step.compile().memory_analysis()
        assert want < ma.argument_size_in_bytes <= want + 64  # + the step counter, the key and Adam's counts
        assert step.expected_args == per_device_bytes(args)
    finally:
        parts.close()
