"""pass@k against brute-force enumeration; the evaluate loop with a fake generate_fn."""

import itertools
import json
import math
from fractions import Fraction

import pytest

from ict_jax.data.datasets import Dataset
from ict_jax.data.example import Example
from ict_jax.rewards.pool import RewardPool
from ict_jax.sampling.evaluation import EVAL_DEFAULTS, aggregate, evaluate, format_table, pass_at_k


def brute_pass_at_k(n, c, k):
    """Fraction of all k-subsets of n samples (c correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # P@1 = mean accuracy


def test_pass_at_k_large_n_stable():
    for n, c, k in [(200, 1, 100), (1000, 3, 10), (500, 250, 64), (300, 0, 50)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    for bad in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_aggregate_and_table():
    res = aggregate({"a": [[True, False, False, False], [False] * 4], "b": [[True] * 4]}, ks=(1, 4))
    # se: sample sd (ddof 1) of the per-problem pass@k over sqrt(problems): a's pass@1 values 0.25 and 0,
    # sd 0.25 / sqrt(2), se 0.125; pass@4 values 1 and 0, se 0.5; b has one problem, so no se, nor the average
    assert res["benchmarks"]["a"] == {"problems": 2, "samples": 8, "pass@1": 0.125, "pass@4": 0.5,
                                      "se": {"pass@1": pytest.approx(0.125), "pass@4": pytest.approx(0.5)}}
    assert res["benchmarks"]["b"]["pass@1"] == 1.0 and res["benchmarks"]["b"]["se"] == {"pass@1": None, "pass@4": None}
    assert res["average"] == {"pass@1": pytest.approx(0.5625), "pass@4": 0.75, "se": {"pass@1": None, "pass@4": None}}
    table = format_table(res)
    # fractions with three decimals, the one convention of every table (was percent), ± the standard error
    assert table.splitlines()[1].split() == ["a", "2", "0.125", "±", "0.125", "0.500", "±", "0.500"]
    assert table.splitlines()[2].split() == ["b", "1", "1.000", "1.000"]
    assert table.splitlines()[-1].split() == ["average", "3", "0.562", "0.750"]
    # the average's se: sqrt(sum of the benchmarks' se^2) / benchmarks
    two = aggregate({"a": [[True, False], [False, False]], "c": [[True, True], [True, False], [False, False]]},
                    ks=(1,))
    se_a, se_c = 0.25, 0.5 / math.sqrt(3)  # values (0.5, 0): sd 0.5 / sqrt(2); (1, 0.5, 0): sd 0.5
    assert two["benchmarks"]["a"]["se"]["pass@1"] == pytest.approx(se_a)
    assert two["benchmarks"]["c"]["se"]["pass@1"] == pytest.approx(se_c)
    assert two["average"]["se"]["pass@1"] == pytest.approx(math.sqrt(se_a ** 2 + se_c ** 2) / 2)
    assert format_table(two).splitlines()[-1].split()[2:] == ["0.375", "±", f"{math.hypot(se_a, se_c) / 2:.3f}"]
    with pytest.raises(ValueError, match="samples < k"):
        aggregate({"a": [[True, False]]}, ks=(4,))


@pytest.fixture(scope="module")
def pool():
    with RewardPool(1, time_limit=5.0) as p:
        yield p


def test_evaluate_writes_table_json_jsonl(pool, tmp_path, capsys):
    n = 4
    gsm = Dataset("gsm_fake", [Example(f"q{i}", str(i), {"source": "fake", "index": i}) for i in range(7)], "gsm8k")
    mc = [Example(f"mc{i}", "ABCD"[i % 4], {"choices": ["1", "2", "3", "4"]}) for i in range(3)]
    calls = []

    def generate_fn(prompts, n_):
        calls.append(len(prompts))
        out = []
        for p in prompts:
            i = int(p.lstrip("mcq"))
            if p.startswith("q"):  # problem i: i % 5 correct samples, then a wrong one, then no answer
                good = i % (n_ + 1)
                out.append(([f"so\n#### {i}"] * good + ["#### -1"] + ["no idea"] * n_)[:n_])
            else:  # multiple choice: problem i right only in its first sample
                out.append([f"The answer is ({'ABCD'[i % 4]})"] + ["The answer is (Z)"] * (n_ - 1))
        return out

    res = evaluate(generate_fn, {"gsm_fake": gsm, "mc_fake": ("mc", mc)}, pool, n=n, ks=(1, 4), batch_size=3,
                   json_path=tmp_path / "out" / "eval.json", samples_path=tmp_path / "out" / "samples.jsonl",
                   settings={"temperature": 0.6}, progress=False)
    assert calls == [3, 3, 1, 3] and max(calls) <= 3
    counts = [i % (n + 1) for i in range(7)]
    g = res["benchmarks"]["gsm_fake"]
    assert g["problems"] == 7 and g["samples"] == 28
    assert g["pass@1"] == pytest.approx(sum(counts) / 28)
    assert g["pass@4"] == pytest.approx(sum(c > 0 for c in counts) / 7)
    assert g["no_answer"] == pytest.approx(sum(max(0, n - c - 1) for c in counts) / 28)
    m = res["benchmarks"]["mc_fake"]
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@4"] == 1.0
    assert res["average"]["pass@1"] == pytest.approx((g["pass@1"] + 0.25) / 2)
    assert res["n"] == 4 and res["ks"] == [1, 4] and res["settings"] == {"temperature": 0.6}

    printed = capsys.readouterr().out
    assert "gsm_fake" in printed and "mc_fake" in printed and "average" in printed
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved == json.loads(json.dumps(res))
    # the saved standard error of P@1 over gsm_fake's 7 problems, by hand: per-problem c / 4
    p1 = [c / n for c in counts]
    mean = sum(p1) / 7
    assert saved["benchmarks"]["gsm_fake"]["se"]["pass@1"] == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in p1) / 6) / math.sqrt(7))
    assert saved["benchmarks"]["mc_fake"]["se"] == {"pass@1": 0.0, "pass@4": 0.0}  # every problem 1 of 4 right
    assert f"± {saved['benchmarks']['gsm_fake']['se']['pass@1']:.3f}" in printed
    lines = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == (7 + 3) * n
    first = lines[0]
    assert set(first) == {"benchmark", "index", "sample", "prompt", "response", "answer", "gold", "correct",
                          "reward", "status", "truncated"}
    assert all(x["truncated"] is None for x in lines)  # plain strings do not say whether they were cut
    assert g["truncated"] is None and m["truncated"] is None
    q1 = [x for x in lines if x["benchmark"] == "gsm_fake" and x["index"] == 1]
    assert [x["correct"] for x in q1] == [True, False, False, False]
    assert q1[0]["answer"] == "1" and q1[0]["gold"] == "1" and q1[2]["status"] == "no_answer"
    assert sum(x["correct"] for x in lines) == sum(counts) + 3


def test_evaluate_counts_truncated_and_no_answer(pool, tmp_path):
    """``truncated``: the share of samples whose Response says it hit the length limit; ``no_answer``: the
    share with no extractable answer (3 problems x 4 samples, counted by hand)."""
    from ict_jax.sampling.text_generation import Response

    ds = Dataset("d", [Example(f"q{i}", "1") for i in range(3)], "gsm8k")
    # per problem: (text, truncated) of its 4 samples; "#### 1" right, "#### 2" wrong, "..." no answer
    samples = {"q0": [("#### 1", False), ("...", True), ("...", True), ("#### 2", False)],
               "q1": [("#### 1", True), ("#### 1", False), ("...", False), ("#### 1", False)],
               "q2": [("...", True), ("#### 2", False), ("#### 1", False), ("#### 1", False)]}
    seen = []

    def generate_fn(prompts, n):
        out = [[Response(t, c) for t, c in samples[p]] for p in prompts]
        seen.extend(type(r) for rs in out for r in rs)
        return out

    res = evaluate(generate_fn, [ds], pool, n=4, ks=(1,), batch_size=2, samples_path=tmp_path / "s.jsonl",
                   progress=False, print_table=False)
    b = res["benchmarks"]["d"]
    assert seen == [Response] * 12
    assert b["truncated"] == 4 / 12 and b["no_answer"] == 4 / 12 and b["pass@1"] == pytest.approx(6 / 12)
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [x["truncated"] for x in lines] == [c for p in ("q0", "q1", "q2") for _, c in samples[p]]
    assert [x["response"] for x in lines] == [t for p in ("q0", "q1", "q2") for t, _ in samples[p]]
    # a truncated response with an answer is scored like any other
    assert [x["correct"] for x in lines if x["index"] == 1] == [True, True, False, True]


def test_evaluate_limit_and_errors(pool):
    ds = Dataset("d", [Example(f"q{i}", "1") for i in range(5)], "gsm8k")
    res = evaluate(lambda ps, n: [[r"\boxed{1}"] * n for _ in ps], [ds], pool, n=2, ks=(1, 2), limit=2,
                   progress=False, print_table=False)
    assert res["benchmarks"]["d"]["problems"] == 2 and res["average"]["pass@2"] == 1.0
    with pytest.raises(ValueError, match="expected 2 each"):
        evaluate(lambda ps, n: [["x"] for _ in ps], [ds], pool, n=2, ks=(1,), progress=False, print_table=False)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        evaluate(lambda ps, n: [], [ds], pool, n=2, ks=(4,))
    assert EVAL_DEFAULTS == {"n": 4, "ks": (1, 4), "temperature": 0.6, "top_p": 0.95}


def test_public_names():
    import ict_jax
    import ict_jax.sampling.evaluation as ev

    assert ict_jax.evaluate_benchmarks is ev.evaluate and ict_jax.pass_at_k is pass_at_k
    assert ict_jax.RewardPool is RewardPool and ict_jax.sampling.evaluation.aggregate is aggregate


def test_progress_is_lines_not_carriage_return_frames_when_redirected():
    """eval's tqdm bar wrote \\r frames into redirected logs. Off a terminal, a line
    about every fifth of the problems (the trainer's compact lines are the model)."""
    import io

    from ict_jax.sampling.evaluation import Progress

    out = io.StringIO()  # not a terminal
    p = Progress(23, stream=out)
    for _ in range(23):
        p.update(1)
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split()[1] for ln in lines] == ["5/23", "10/23", "15/23", "20/23", "23/23"]
    assert all(ln.startswith("eval ") for ln in lines) and "ETA" in lines[0] and "ETA" not in lines[-1]
    quiet = io.StringIO()
    Progress(10, enabled=False, stream=quiet).update(10)
    assert quiet.getvalue() == ""


def test_a_slow_sampler_call_gets_heartbeat_lines_when_redirected(pool, monkeypatch, capsys):
    """One sampler call of a real model on a CPU takes minutes: off a terminal, a line at least every
    $ICT_JAX_HEARTBEAT_S seconds with the problems done, the time and the batch being sampled."""
    import time

    monkeypatch.setenv("ICT_JAX_HEARTBEAT_S", "0.1")
    ds = Dataset("slow", [Example(f"q{i}", "1") for i in range(6)], scorer="gsm8k")

    def slow(prompts, n):
        time.sleep(0.6)
        return [["\\boxed{1}"] * n for _ in prompts]

    evaluate(slow, {"slow": ds}, pool, n=2, ks=(1,), batch_size=2, print_table=False)
    lines = capsys.readouterr().err.splitlines()
    beats = [ln for ln in lines if "elapsed" in ln]
    assert any(ln.startswith("eval 0/6 problems  elapsed ") and ln.endswith(
        "(slow: sampling problems 1-2 of 6, 2 responses each)") for ln in beats), lines
    # batch b is scored while batch b + 1 is sampled: 2 problems are done while the third batch samples
    assert any(ln.startswith("eval 2/6 problems  elapsed ") and "ETA " in ln and "sampling problems 5-6 of 6" in ln
               for ln in beats), lines


def test_a_listener_hears_the_problems_done_and_the_batch_without_progress_lines(pool, capsys):
    """A training run evaluates with progress=False and shows the evaluation in its own heartbeat: the
    listener hears every phase and count, in order, and nothing is printed."""
    ds = Dataset("three", [Example(f"q{i}", "1") for i in range(3)], scorer="gsm8k")
    heard = []
    evaluate(lambda prompts, n: [["\\boxed{1}"] * n for _ in prompts], {"three": ds}, pool, n=2, ks=(1,),
             batch_size=2, progress=False, print_table=False, listener=lambda *a: heard.append(a))
    assert heard == [(0, 3, "three: sampling problems 1-2 of 3, 2 responses each"), (0, 3, None),
                     (0, 3, "three: sampling problems 3-3 of 3, 2 responses each"), (0, 3, None),
                     (0, 3, "three: scoring problems 1-2 of 3"), (0, 3, None), (2, 3, None),
                     (2, 3, "three: scoring problems 3-3 of 3"), (2, 3, None), (3, 3, None)]
    assert capsys.readouterr().err == ""
