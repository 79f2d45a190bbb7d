"""Rewards: extraction and equivalence table, adversarial inputs against a warm pool, pool life cycle.

The table runs through the session pool in one batch call (math-verify costs ~10-50 ms a check)."""

import os
import pickle
import threading
import time

import numpy as np
import pytest

from ict_jax.rewards.checks import (
    RewardCheck,
    RewardSpec,
    check_text,
    extract_answer,
    extract_choice,
    last_boxed,
    math_equal,
    score_text,
)
from ict_jax.rewards.pool import RewardPool


# Extra kinds for the pool under test. Top-level functions: the workers import this module by name.
def _slow_check(response, gold, meta):
    time.sleep(float(response))
    return 1.0


def _crash_check(response, gold, meta):
    os._exit(3)


def _alloc_check(response, gold, meta):
    return float(len(bytearray(int(response) << 20)) > 0)  # MiB; over the address-space limit -> MemoryError


TIME_LIMIT = 1.0


@pytest.fixture(scope="session")
def pool():
    t0 = time.monotonic()
    p = RewardPool(2, time_limit=TIME_LIMIT, checkers={"slow": _slow_check, "crash": _crash_check,
                                                      "alloc": _alloc_check})
    print(f"\nRewardPool(2) warm in {time.monotonic() - t0:.2f} s")
    yield p
    p.close()


# (kind, response, gold, expected correct)
M, G, C = "math", "gsm8k", "mc"
TABLE = [
    # fractions vs decimals
    (M, r"So the answer is \boxed{\frac{1}{2}}.", "0.5", True),
    (M, r"\boxed{0.5}", r"\frac{1}{2}", True),
    (M, r"\boxed{\dfrac{3}{4}}", "0.75", True),
    (M, r"\boxed{\tfrac34}", r"\frac{3}{4}", True),
    (M, r"\boxed{0.333}", r"\frac{1}{3}", False),
    (M, r"\boxed{\frac{1}{3}}", r"\frac14", False),
    (M, r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", True),  # nested braces
    # thousands separators
    (M, r"\boxed{1,000}", "1000", True),
    (M, r"\boxed{1{,}000}", "1000", True),
    (M, r"\boxed{1,234,567}", "1234567", True),
    (M, r"\boxed{12,345}", "12.345", False),
    # negatives
    (M, r"\boxed{-3}", "-3", True),
    (M, r"\boxed{3}", "-3", False),
    (M, r"\boxed{-\frac{1}{2}}", "-0.5", True),
    (M, r"\boxed{\frac{-1}{2}}", r"-\frac12", True),
    # \left( \right), tuples, sets, intervals
    (M, r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", True),
    (M, r"\boxed{\left( 3, \frac{\pi}{3} \right)}", r"(3,\frac{\pi}{2})", False),
    (M, r"\boxed{\{1,2\}}", r"\{2,1\}", True),
    (M, r"\boxed{(-\infty, 2]}", r"(-\infty,2]", True),
    (M, r"\boxed{(-\infty, 2)}", r"(-\infty,2]", False),
    (M, r"\boxed{[1, 5)}", r"[1,5)", True),
    # percentages (math-verify is lenient: 50\% equals 50 and 0.5)
    (M, r"\boxed{50\%}", "50", True),
    (M, r"\boxed{50\%}", "0.5", True),
    (M, r"\boxed{40\%}", "50", False),
    # units and currency
    (M, r"\boxed{5 \text{ cm}}", "5", True),
    (M, r"\boxed{18 \text{ dollars}}", "18", True),
    (M, r"\boxed{\$18}", "18", True),
    (M, r"\boxed{17 \text{ dollars}}", "18", False),
    # x = 5 vs 5
    (M, r"\boxed{x = 5}", "5", True),
    (M, r"\boxed{x=6}", "5", False),
    (M, r"\boxed{y = 2x + 1}", "2x+1", True),
    # numeric forms and close misses
    (M, r"\boxed{18.00}", "18", True),
    (M, r"\boxed{3}", "3.0", True),
    (M, r"\boxed{4.9}", "5", False),
    (M, r"\boxed{\pi}", "3.14159", False),
    (M, r"\boxed{2^{10}}", "1024", True),
    (M, r"\boxed{10^{6}}", "1000000", True),
    (M, r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (M, r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),
    (M, r"\boxed{\infty}", r"\infty", True),
    (M, r"\boxed{x^2+2x+1}", r"(x+1)^2", True),
    (M, r"\boxed{x^2+2x}", r"(x+1)^2", False),
    # several boxed: the last counts; \fbox; \boxed 7
    (M, r"First \boxed{1}, then corrected: \boxed{2}", "2", True),
    (M, r"First \boxed{1}, then corrected: \boxed{2}", "1", False),
    (M, r"\fbox{12}", "12", True),
    (M, r"\boxed 7", "7", True),
    # "The answer is ..."
    (M, "Adding up, the answer is 42.", "42", True),
    (M, r"The final answer is $\frac{7}{2}$.", "3.5", True),
    (M, r"The answer is \(\sqrt{2}\)", r"\sqrt2", True),
    (M, "The answer is 41.", "42", False),
    (M, "I computed 42 but gave no final answer line", "42", False),
    (M, r"\boxed{}", "0", False),
    # GSM8K
    (G, "She sold 48 + 24 = 72 clips.\n#### 72", "72", True),
    (G, "#### 1,080", "1080", True),
    (G, "#### 72", "#### 72", True),
    (G, "#### 73", "72", False),
    (G, "#### $1,080.00", "1080", True),
    (G, r"So she earns \boxed{\$10} per hour.", "10", True),
    (G, "The answer is 18 dollars.", "18", True),
    # multiple choice
    (C, "The answer is (B)", "B", True),
    (C, "The answer is (B)", "C", False),
    (C, "Answer: D", "D", True),
    (C, r"so the letter is $\boxed{C}$", "C", True),
    (C, r"\boxed{\text{(A)}}", "A", True),
    (C, r"\boxed{B) 3.5}", "B", True),
    (C, "Option A is wrong. **B**", "B", True),
    (C, "The correct option is C.", "C", True),
    (C, "I doubt A. The answer is **C**", "C", True),
    (C, "Answer: (A) ... on reflection, Answer: (D)", "D", True),
    (C, "B", "B", True),
    (C, "(A)", "B", False),
    (C, "the answer is a tricky one", "A", False),
    (C, "The answer is C", 2, True),  # gold as a 0-based index
    # exact (arithmetic drills)
    ("exact", " 357\n", "357", True),
    ("exact", "358", "357", False),
    # sum (the "split" task: any two positive integers adding up to the gold)
    ("sum", "007+88", "95", True),
    ("sum", " 47+48\n", "95", True),
    ("sum", "94+1", "95", True),
    ("sum", "0+95", "95", False),       # positive parts only
    ("sum", "95+0", "95", False),
    ("sum", "40+56", "95", False),
    ("sum", "95", "95", False),         # not "x+y": no answer
    ("sum", "40 + 55", "95", False),
    ("sum", "40+55+0", "95", False),
    ("sum", "-5+100", "95", False),
    ("sum", "40+55.0", "95", False),
    ("sum", "1" * 19 + "+1", "95", False),  # over 18 digits: no answer, never converted
    ("sum", "40+55", "ninety-five", False),  # a gold that is not an integer matches nothing
]


@pytest.fixture(scope="session")
def table_checks():
    """The table through a pool with the runs' own time limit (rl.reward.time_limit's default): the table
    checks answers, not speed, and the 1 s of the time-limit tests' pool was missed by a first math-verify
    parse on a loaded machine (a timeout there is a false failure of the table)."""
    from ict_jax.config import RewardSection

    t0 = time.monotonic()
    kinds, responses, golds, _ = zip(*TABLE)
    with RewardPool(2, time_limit=RewardSection().time_limit) as p:
        checks = p.check(list(kinds), list(responses), list(golds))
    print(f"\n{len(TABLE)} table checks in {time.monotonic() - t0:.2f} s")
    return checks


def test_table_size():
    assert len(TABLE) >= 60


@pytest.mark.parametrize("i", range(len(TABLE)), ids=[f"{k}:{r[:30]}|{g}" for k, r, g, _ in TABLE])
def test_table(table_checks, i):
    kind, response, gold, expected = TABLE[i]
    c = table_checks[i]
    assert c.status in ("ok", "no_answer"), c
    assert c.correct is expected, (response, gold, c)
    assert c.reward == (1.0 if expected else 0.0)


def test_in_process_matches_pool(table_checks):
    for i in range(0, len(TABLE), 7):
        kind, response, gold, _ = TABLE[i]
        assert check_text(kind, response, gold) == table_checks[i]


def test_extraction_rules():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{1} and \boxed{2") == "1"  # an unclosed last box falls back
    assert last_boxed(r"\boxed{\{1\}}") == r"\{1\}"  # escaped braces do not count
    assert last_boxed("no box") is None
    assert extract_answer("steps\n#### 1,000\n") == "1,000"
    assert extract_answer("The answer is **$12$**.") == "12"
    assert extract_answer(r"The answer is 3 but \boxed{4}") == "4"  # boxed first
    assert extract_answer(r"\boxed{" + "1" * 2000 + "}") is None  # over MAX_ANSWER_CHARS
    assert extract_answer("x" * 20_000 + "#### 5") == "5"
    assert extract_answer(r"\boxed{5}" + "x" * 20_000) is None  # only the tail is read
    assert extract_choice("The answer is 42", choices=["12", "42", "7", "1"]) == "B"
    assert extract_choice("Final Answer: C") == "C"
    assert extract_choice("The answer is: (D)") == "D" and extract_choice("answer is option B.") == "B"
    assert extract_choice("The answer I got is unclear") is None  # "I" after "answer" is a pronoun
    assert math_equal("1/2", "0.5") and not math_equal(None, "1") and not math_equal("   ", "1")


def test_format_reward_in_process():
    spec = RewardSpec(correct=1.0, wrong=0.0, no_answer=-0.5)
    assert score_text("math", "I don't know", "3", spec=spec) == -0.5
    assert score_text("math", r"\boxed{4}", "3", spec=spec) == 0.0
    assert score_text("math", r"\boxed{3}", "3", spec=spec) == 1.0
    assert score_text("mc", "no idea", "A", spec=spec) == -0.5
    with pytest.raises(ValueError, match="unknown reward kind"):
        score_text("nope", "x", "y")


ADVERSARIAL = {
    "1 MB of text": "lorem ipsum " * 90_000,
    "1 MB inside boxed": r"\boxed{" + "9" * 1_000_000 + "}",
    "power tower": r"The answer is \boxed{10^{10^{10^{10}}}}",
    "10,000 nested braces": r"\boxed{" + "{" * 10_000 + "5" + "}" * 10_000 + "}",
    "10,000 open braces": r"\boxed{" + "{" * 10_000 + "5",
    "unbalanced LaTeX": r"\boxed{\frac{1}{\left(2} \right] \begin{pmatrix} 1 & 2 \\ \sqrt{",
    "python in boxed": r"\boxed{__import__('os').system('touch /tmp/ict_jax_pwned')}",
    "lambda in boxed": r"\boxed{(lambda: [x for x in range(10**10)])()}",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_false_within_2s(pool, name):
    t0 = time.monotonic()
    (c,) = pool.check("math", [ADVERSARIAL[name]], ["5"])
    elapsed = time.monotonic() - t0
    assert c.correct is False and c.reward == 0.0, c
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s"
    assert not os.path.exists("/tmp/ict_jax_pwned")
    # the pool keeps working afterwards
    assert pool.score("math", [r"\boxed{5}", r"\boxed{6}"], ["5", "5"]).tolist() == [1.0, 0.0]


def test_sum_scorer_statuses_and_long_outputs():
    assert check_text("sum", "12+3", "15").status == "ok"
    for bad in ("15", "12 + 3", "", "+" * 10_000, "9" * 100_000 + "+1", "1+" * 5_000 + "1"):
        c = check_text("sum", bad, "15")
        assert (c.correct, c.answer, c.status) == (False, None, "no_answer"), bad[:20]


def test_adversarial_batch_one_call(pool):
    names = list(ADVERSARIAL)
    t0 = time.monotonic()
    r = pool.score("math", [ADVERSARIAL[n] for n in names] + [r"\boxed{5}"], ["5"] * (len(names) + 1))
    assert r.dtype == np.float32 and r.tolist() == [0.0] * len(names) + [1.0]
    assert time.monotonic() - t0 < 2.0 * len(names)


def test_hung_worker_killed_and_replaced(pool):
    pids, restarts = pool.worker_pids(), pool.restarts
    t0 = time.monotonic()
    checks = pool.check("slow", ["30", "0"], [None, None])
    assert time.monotonic() - t0 < TIME_LIMIT + 1.5
    assert checks[0] == RewardCheck(0.0, False, None, "timeout") and checks[1].reward == 1.0
    assert pool.restarts == restarts + 1
    new = pool.worker_pids()
    assert len(set(new) - set(pids)) == 1
    dead = (set(pids) - set(new)).pop()
    deadline = time.monotonic() + 5  # killed and reaped: no zombie left in the process table
    while os.path.exists(f"/proc/{dead}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{dead}")
    assert pool.score("math", [r"\boxed{2}"] * 4, ["2"] * 4).tolist() == [1.0] * 4


def test_crash_and_memory_limit(pool):
    restarts = pool.restarts
    c = pool.check("crash", ["x"], [None])[0]
    assert c.status == "error: worker died" and c.reward == 0.0 and pool.restarts == restarts + 1
    c = pool.check("alloc", ["8192"], [None])[0]  # 8 GiB > the 2 GiB address-space limit
    assert c.status == "error: MemoryError" and c.reward == 0.0
    assert pool.check("alloc", ["1"], [None])[0].reward == 1.0


def test_async_and_threads(pool):
    futs = [pool.score_async("gsm8k", [f"#### {i}", "#### 0"], [str(i), "1"]) for i in range(5)]
    out = {}

    def worker(j):
        out[j] = pool.score("mc", ["The answer is (A)"] * 3, ["A", "B", "A"])

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futs:
        assert f.result(timeout=30).tolist() == [1.0, 0.0]
    assert all(v.tolist() == [1.0, 0.0, 1.0] for v in out.values())
    assert pool.score("math", [], []).shape == (0,)
    with pytest.raises(ValueError, match="golds"):
        pool.score("math", ["a"], [])
    with pytest.raises(ValueError, match="unknown reward kind"):
        pool.score("nope", ["a"], ["b"])


def test_reasoning_gym_gold_scores_one(pool):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    metas, golds, responses = [], [], []
    for name in ("basic_arithmetic", "chain_sum", "simple_equations", "fraction_simplification"):
        ds = reasoning_gym.create_dataset(name, size=2, seed=3)
        for i in range(len(ds)):
            entry = ds[i]
            metas.append({"gym_entry": entry, "gym_dataset": name})
            golds.append(entry["answer"])
            responses.append(f"Reasoning...\n<answer>{entry['answer']}</answer>")
    r = pool.score("gym", responses + [rf"so \boxed{{{golds[0]}}}", "<answer>nonsense</answer>", "nothing"],
                   golds + golds[:3], metas + metas[:3])
    assert r.tolist() == [1.0] * len(golds) + [1.0, 0.0, 0.0]
    assert check_text("gym", "nothing", golds[0], metas[0]).status == "no_answer"


def test_pool_life_cycle():
    with pytest.raises(ValueError, match="never fork"):
        RewardPool(1, context="fork")
    t0 = time.monotonic()
    with RewardPool(1, time_limit=5.0, spec=RewardSpec(no_answer=-1.0)) as p:
        print(f"\nsecond RewardPool(1) warm in {time.monotonic() - t0:.2f} s")
        assert p.score("math", ["nothing", r"\boxed{1}"], ["1", "1"]).tolist() == [-1.0, 1.0]
        pids = p.worker_pids()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.score("math", ["x"], ["1"])
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_spawn_context():
    t0 = time.monotonic()
    with RewardPool(1, context="spawn", time_limit=5.0) as p:
        print(f"\nspawn RewardPool(1) warm in {time.monotonic() - t0:.2f} s")
        assert p.score("mc", ["Answer: C", r"\boxed{A}"], ["C", "B"]).tolist() == [1.0, 0.0]


def test_unpicklable_meta_fails_the_caller_only(pool):
    # what pickle raises for an unpicklable object (a local lambda: AttributeError), in this process
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.score("gym", ["<answer>1</answer>"], ["1"], [{"gym_entry": lambda: 0}])
    assert pool.score("math", [r"\boxed{1}"], ["1"]).tolist() == [1.0]


# ------------------------------------------------------------------------------------------------
# "The answer is X" counts only as a final statement (docs/rewards.md, rule 3)
# ------------------------------------------------------------------------------------------------
FINAL_STATEMENT = [  # (response, extracted answer or None): the table of docs/rewards.md
    ("Check if the answer is indeed 10...", None),  # a check, not a statement
    ("Let me verify whether the answer is 4.", None),
    ("If the answer is 5, then y = 3.", None),  # a conditional
    ("If x is 5, the answer is 10.", None),  # a conditional lead-in
    ("So the answer is 10?", None),  # a question
    ("Is the answer 10? Yes.", None),
    ("The answer is not 10.", None),  # a negation
    ("The answer is probably 10.", None),  # hedged
    ("I think the answer is 10.", None),  # not the opening of a sentence
    ("So the answer is 10.", "10"),
    ("Therefore, the final answer is: 18 dollars.", "18"),
    ("Adding up, the answer is 42.", "42"),
    ("So, in total, the answer is 60.", "60"),
    ("We find x. The answer is 12. Let me double-check: 3 * 4 = 12.", "12"),
    ("First compute.\nThe answer is 7", "7"),
    ("**The answer is 9**", "9"),
    ("- The answer is 3.5.", "3.5"),
]


@pytest.mark.parametrize("response,expected", FINAL_STATEMENT)
def test_answer_is_only_as_a_final_statement(response, expected):
    assert extract_answer(response) == expected
    gold = expected or "10"
    assert check_text("gsm8k", response, gold).correct is (expected is not None)


def test_rewards_doc_lists_the_final_statement_table():
    """docs/rewards.md shows every case of the table above, with the same outcome."""
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    for response, expected in FINAL_STATEMENT:
        shown = response.replace("\n", "\\n")
        row = next((line for line in doc.splitlines() if f"`{shown}`" in line), None)
        assert row is not None, f"docs/rewards.md lacks the case {shown!r}"
        assert (f"`{expected}`" in row) if expected else ("no answer" in row), row


# ------------------------------------------------------------------------------------------------
# The reverse of extraction: sft_target / answer_text, for every kind
# ------------------------------------------------------------------------------------------------
def test_sft_target_is_read_back_correct_by_every_kind():
    import reasoning_gym

    from ict_jax.data.example import Example
    from ict_jax.rewards.checks import KINDS, answer_text, sft_target

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    cases = {  # kind -> (gold, meta)
        "math": (r"\frac{3}{4}", {}), "gsm8k": ("1080", {}), "mc": ("C", {}), "exact": ("57+38", {}),
        "sum": ("95", {}), "gym": (str(entry["answer"]), {"gym_entry": entry, "gym_dataset": "basic_arithmetic"}),
    }
    assert set(cases) == set(KINDS)
    for kind, (gold, meta) in cases.items():
        ex = Example("q", gold, {"source": "t", "index": 0, **meta})
        target = sft_target(ex, kind)
        check = check_text(kind, target, gold, meta)
        assert check.correct and check.status == "ok", (kind, target, check)
    assert check_text("mc", answer_text("mc", 2), 2).correct  # a 0-based index gold: the letter C
    assert answer_text("mc", 2) == "The answer is (C)."
    assert sft_target(Example("95=", "95", {"solution": "07+88"}), "sum") == "07+88"  # a solution wins
    with pytest.raises(ValueError, match="unknown reward kind"):
        answer_text("nope", "1")


# ------------------------------------------------------------------------------------------------
# A custom reward function, run in the killable workers with the same time limit
# ------------------------------------------------------------------------------------------------
CUSTOM_MODULE = '''
import os, time
def exact_or_half(response, gold, meta):
    """1 for the gold, 0.5 when meta says partial credit applies, else 0; records its process id."""
    open(os.path.join(meta["out"], f"pid_{os.getpid()}"), "w").close()
    if response.strip() == str(gold):
        return 1.0
    return 0.5 if meta.get("partial") else 0.0
def hangs(response, gold, meta):
    while True:
        time.sleep(1)
def raises(response, gold, meta):
    raise RuntimeError("a bug in the user's function")
def not_a_number(response, gold, meta):
    return "yes"
'''


def test_custom_reward_function_runs_in_the_workers_with_the_time_limit(tmp_path, monkeypatch):
    import sys

    from ict_jax.rewards.checks import CUSTOM_KIND

    (tmp_path / "my_rewards_t17.py").write_text(CUSTOM_MODULE)
    monkeypatch.chdir(tmp_path)  # the workers import from the caller's working directory
    meta = {"out": str(tmp_path)}
    with RewardPool(2, time_limit=1.0, checkers={CUSTOM_KIND: "my_rewards_t17:exact_or_half",
                                                 "hang": "my_rewards_t17:hangs", "raise": "my_rewards_t17:raises",
                                                 "nan": "my_rewards_t17:not_a_number"}) as p:
        t0 = time.monotonic()
        checks = p.check([CUSTOM_KIND, CUSTOM_KIND, CUSTOM_KIND, "hang", "raise", "nan"],
                         ["42", "41", "41", "x", "x", "x"], ["42"] * 6,
                         [meta, meta, {**meta, "partial": True}, meta, meta, meta])
        elapsed = time.monotonic() - t0
        workers = set(p.worker_pids())
        assert p.restarts == 1  # the hanging check's worker was killed and replaced
    assert [c.reward for c in checks] == [1.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    assert [c.correct for c in checks] == [True, False, False, False, False, False]
    assert checks[3].status == "timeout" and elapsed < 1.0 + 2.0
    assert checks[4].status == "error: RuntimeError"
    assert checks[5].status.startswith("error: returned str")
    ran_in = {int(f.name[4:]) for f in tmp_path.glob("pid_*")}
    assert ran_in and os.getpid() not in ran_in  # never in this process
    assert "my_rewards_t17" not in sys.modules
    del workers


def test_custom_reward_function_that_cannot_load_is_a_one_line_error(tmp_path, monkeypatch):
    from ict_jax.rewards.pool import RewardFunctionError

    (tmp_path / "my_rewards_t17b.py").write_text("def f(r, g, m):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    for spec, message in [("no_such_module_t17:f", "cannot import 'no_such_module_t17'"),
                          ("my_rewards_t17b:missing", "has no function 'missing'")]:
        with pytest.raises(RewardFunctionError, match=message) as e:
            RewardPool(1, checkers={"custom": spec})
        assert len(str(e.value).splitlines()) == 1


def test_reward_pool_time_limit_default_is_the_configs():
    """One default: `RewardPool`'s time limit is `rl.reward.time_limit`'s (rewards imports nothing of
    ict_jax, so the number is pinned here rather than imported)."""
    import inspect

    from ict_jax.config import RewardSection

    assert inspect.signature(RewardPool).parameters["time_limit"].default == RewardSection().time_limit


# docs/rewards.md's RewardPool example in a plain script (no `if __name__ == "__main__":`)
# failed with "reward worker ... died during start-up": each worker re-runs the script (forkserver/spawn)
# and reaches RewardPool(...) again. The worker now stops there and the parent says so.
@pytest.mark.e2e  # two Python processes with their worker pools: ~10-20 s on 2 cores
def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    import subprocess
    import sys

    body = ('from ict_jax import RewardPool\n\nprint("top level ran")\n'
            '{guard}with RewardPool(num_workers=2, time_limit=3.0) as pool:\n'
            '{indent}    print("scores", pool.score("exact", ["1"], ["1"]).tolist())\n')
    for name, guard, indent in (("plain.py", "", ""), ("guarded.py", 'if __name__ == "__main__":\n    ', "    ")):
        (tmp_path / name).write_text(body.format(guard=guard, indent=indent))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    plain = subprocess.run([sys.executable, "plain.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=env)
    assert plain.returncode == 1
    last = plain.stderr.strip().splitlines()[-1]
    assert last.startswith("ict_jax.rewards.pool.UnguardedScriptError: reward worker ")
    assert f"re-ran {tmp_path / 'plain.py'} while starting" in last and 'if __name__ == "__main__":' in last
    assert "died during start-up" not in plain.stderr
    guarded = subprocess.run([sys.executable, "guarded.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env=env)
    assert guarded.returncode == 0 and "scores [1.0]" in guarded.stdout, guarded.stderr
