"""Datasets (fixture files in each public format), malformed rows, templates, prompt encoding, length
buckets, deterministic shuffling and resumable iteration, reasoning-gym, tfds."""

import csv
import json
import pathlib
import sys

import numpy as np
import pytest

from ict_jax import CharTokenizer, Dataset, Example, load_dataset
from ict_jax.buckets import bucket_for, make_buckets
from ict_jax.data.datasets import PAPER_BENCHMARKS, parse_spec
from ict_jax.data.example import DataError
from ict_jax.data.prompts import PromptIterator, encode_prompts, pad_left
from ict_jax.data.templates import format_prompt
from ict_jax.rewards.checks import gym_answer_score, last_boxed


def write_jsonl(path: pathlib.Path, rows) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: pathlib.Path, rows) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: pathlib.Path, header, rows) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


GSM = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24.\nTotal 48+24 = <<48+24=72>>72.\n#### 72"},
       {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"},
       {"question": "What is 10 - 15?", "answer": "10-15=-5\n#### -5"}]


# -- file formats -------------------------------------------------------------------------------------
def test_gsm8k_jsonl_and_hf_parquet_layout(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM)
    write_parquet(tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet", GSM[:2])  # HF repo layout
    train = load_dataset("gsm8k", data_dir=str(tmp_path))
    assert (train.name, train.split, train.scorer, len(train)) == ("gsm8k", "train", "gsm8k", 3)
    assert [ex.answer for ex in train] == ["72", "2400", "-5"]
    assert train[0].prompt == GSM[0]["question"] and train[0].meta["solution"] == GSM[0]["answer"]
    assert train[2].meta["index"] == 2 and train[2].meta["source"] == "gsm8k"
    test = load_dataset("gsm8k_test", data_dir=str(tmp_path))
    assert test.split == "test" and [ex.answer for ex in test] == ["72", "2400"]
    assert load_dataset("gsm8k", data_dir=str(tmp_path), split="test")[1] == test[1]
    assert len(load_dataset("gsm8k", data_dir=str(tmp_path), limit=2)) == 2


def test_math_and_math500(tmp_path):
    write_jsonl(tmp_path / "math" / "train.jsonl", [
        {"problem": "Compute $\\frac{2}{4}$.", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
         "type": "Algebra"},
        {"problem": "p", "solution": "First \\boxed{3}, then \\boxed{\\{1,2\\} \\cup {x}}", "level": "Level 5",
         "type": "Counting & Probability"}])
    ds = load_dataset("math", data_dir=str(tmp_path))
    assert ds.scorer == "math" and [ex.answer for ex in ds] == ["\\frac{1}{2}", "\\{1,2\\} \\cup {x}"]
    assert ds[0].meta["level"] == "Level 1" and ds[0].meta["type"] == "Algebra"
    write_parquet(tmp_path / "math500" / "test.parquet", [
        {"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "answer": "2", "subject": "Prealgebra",
         "level": 1, "unique_id": "test/prealgebra/1.json"}])
    m5 = load_dataset("math500", data_dir=str(tmp_path))
    assert (m5[0].answer, m5[0].meta["level"], m5[0].meta["unique_id"]) == ("2", 1, "test/prealgebra/1.json")


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None


def test_mmlu_stem(tmp_path):
    rows = [{"question": "What is 2+2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "6"],
             "answer": 1},
            {"question": "Who wrote Hamlet?", "subject": "high_school_european_history",
             "choices": ["a", "b", "c", "d"], "answer": 0},
            {"question": "Bone count?", "subject": "anatomy", "choices": ["1", "2", "3", "4"], "answer": 3},
            {"question": "Unit of force?", "subject": "high_school_physics", "choices": ["N", "J", "W", "Pa"],
             "answer": 0}]
    write_parquet(tmp_path / "mmlu" / "all" / "test-00000-of-00001.parquet", rows)
    ds = load_dataset("mmlu_stem", data_dir=str(tmp_path))
    assert ds.scorer == "mc" and len(ds) == 2  # history and anatomy are not STEM
    assert ds[0].prompt == "What is 2+2?\n\nA. 3\nB. 4\nC. 5\nD. 6" and ds[0].answer == "B"
    assert ds[1].answer == "A" and ds[1].meta["subject"] == "high_school_physics"
    assert len(load_dataset("mmlu_stem", data_dir=str(tmp_path), stem_only=False)) == 4


def test_gpqa_shuffle_is_deterministic_and_records_gold(tmp_path):
    header = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3",
              "Subdomain"]
    rows = [[f"Question {i}?", f"right{i}", f"w1_{i}", f"w2_{i}", f"w3_{i}", "Physics"] for i in range(12)]
    write_csv(tmp_path / "gpqa_diamond" / "gpqa_diamond.csv", header, rows)  # the file as the HF repo has it
    a = load_dataset("gpqa_diamond", data_dir=str(tmp_path), seed=0)
    b = load_dataset("gpqa_diamond", data_dir=str(tmp_path), seed=0)
    c = load_dataset("gpqa_diamond", data_dir=str(tmp_path), seed=1)
    assert [ex.prompt for ex in a] == [ex.prompt for ex in b]
    assert [ex.prompt for ex in a] != [ex.prompt for ex in c]
    for i, ex in enumerate(a):
        k = "ABCD".index(ex.answer)
        assert ex.meta["choices"][k] == f"right{i}" and f"{ex.answer}. right{i}" in ex.prompt
        assert sorted(ex.meta["choices"]) == sorted([f"right{i}", f"w1_{i}", f"w2_{i}", f"w3_{i}"])
    assert len({ex.answer for ex in a}) > 1  # the gold letter is not always A


def test_aime_years(tmp_path):
    write_parquet(tmp_path / "aime2024" / "train-00000-of-00001.parquet".replace("train", "test"),
                  [{"ID": "2024-I-1", "Problem": "Find x.", "Solution": "...", "Answer": 33}])
    ds = load_dataset("aime2024", data_dir=str(tmp_path))
    assert (ds.scorer, ds[0].prompt, ds[0].answer, ds[0].meta["year"]) == ("math", "Find x.", "33", 2024)
    write_jsonl(tmp_path / "aime" / "test.jsonl", [  # a combined file: rows carry their year in the url
        {"problem": "p23", "answer": "033", "url": "https://x/wiki/index.php/2023_AIME_I_Problems/Problem_1"},
        {"problem": "p22", "answer": "1", "url": "https://x/wiki/index.php/2022_AIME_II_Problems/Problem_1"},
        {"problem": "p25", "answer": "7", "year": 2025}])
    a23 = load_dataset("aime2023", data_dir=str(tmp_path))
    assert [(ex.prompt, ex.answer) for ex in a23] == [("p23", "33")]
    assert [ex.prompt for ex in load_dataset("aime2025", data_dir=str(tmp_path))] == ["p25"]
    assert set(PAPER_BENCHMARKS) >= {"aime2023", "aime2024", "aime2025", "math500", "gsm8k_test"}


# -- malformed rows and missing files ------------------------------------------------------------------
def test_malformed_jsonl_names_file_and_line(tmp_path):
    good = json.dumps(GSM[0])
    p = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [good, "", "{not json"])
    with pytest.raises(DataError, match=rf"{p}:3: invalid JSON"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    write_jsonl(p, [good, {"question": "q"}])
    with pytest.raises(DataError, match=rf"{p}:2: missing field 'answer'"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    write_jsonl(p, [{"question": 5, "answer": "#### 1"}])
    with pytest.raises(DataError, match=rf"{p}:1: field 'question' should be str, got int"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    write_jsonl(p, [{"question": "q", "answer": "no final line"}])
    with pytest.raises(DataError, match=rf"{p}:1: GSM8K"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    write_jsonl(p, ["[1, 2]"])
    with pytest.raises(DataError, match=rf"{p}:1: expected a JSON object"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    assert issubclass(DataError, ValueError)


def test_malformed_parquet_and_csv_rows(tmp_path):
    p = write_parquet(tmp_path / "math500" / "test.parquet", [
        {"problem": "ok", "answer": "1"}, {"problem": "no box", "answer": None, "solution": "none"}])
    with pytest.raises(DataError, match=rf"{p}: row 1: no 'answer' field"):
        load_dataset("math500", data_dir=str(tmp_path))
    p = write_parquet(tmp_path / "mmlu" / "test.parquet", [
        {"question": "q", "subject": "college_physics", "choices": ["a", "b"], "answer": 7}])
    with pytest.raises(DataError, match=rf"{p}: row 0: 'answer' 7"):
        load_dataset("mmlu_stem", data_dir=str(tmp_path))
    p = tmp_path / "gpqa_diamond" / "train.csv"
    p.parent.mkdir()
    p.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
                 "q,a,b,c,d\nq2,a2\n")
    with pytest.raises(DataError, match=rf"{p}:3: wrong number of CSV fields"):
        load_dataset("gpqa_diamond", data_dir=str(tmp_path))
    (tmp_path / "math500" / "test.parquet").unlink()
    (tmp_path / "math500" / "test.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(DataError, match="cannot read Parquet"):
        load_dataset("math500", data_dir=str(tmp_path))


def test_missing_files_and_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        load_dataset("gsm8k", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="needs data.data_dir"):
        load_dataset("math")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("nope", data_dir=str(tmp_path))


# -- procedural ---------------------------------------------------------------------------------------
def test_arith_is_seeded_and_correct():
    a = load_dataset("arith?size=50&digits=4", seed=3)
    assert a.scorer == "exact" and len(a) == 50
    assert [ex.prompt for ex in a] == [ex.prompt for ex in load_dataset("arith", size=50, digits=4, seed=3)]
    assert [ex.prompt for ex in a] != [ex.prompt for ex in load_dataset("arith", size=50, digits=4, seed=4)]
    for ex in a:
        lhs = ex.prompt.rstrip("=")
        op = "+" if "+" in lhs else "-"
        x, y = (int(t) for t in lhs.split(op))
        assert int(ex.answer) == (x + y if op == "+" else x - y) and int(ex.answer) >= 0
        assert max(x, y) < 10**4
    tok = CharTokenizer()
    assert all(tok.decode(tok.encode(ex.prompt)) == ex.prompt for ex in a)


def test_arith_scratchpad_works_each_column_then_the_sum():
    from ict_jax.data.tasks import addition_scratchpad

    # by hand: carries in, a missing digit as 0, a carry out of the last column
    assert addition_scratchpad(57, 38) == "7+8=15,5+3+1=9,95"
    assert addition_scratchpad(57, 8) == "7+8=15,5+0+1=6,65"
    assert addition_scratchpad(3, 4) == "3+4=7,7"
    assert addition_scratchpad(63, 56) == "3+6=9,6+5=11,119"
    assert addition_scratchpad(999, 1) == "9+1=10,9+0+1=10,9+0+1=10,1000"
    ds = load_dataset("arith?digits=3&ops=+&scratchpad=true&size=200", seed=1)
    plain = load_dataset("arith?digits=3&ops=+&size=200", seed=1)
    assert [e.prompt for e in ds] == [e.prompt for e in plain]  # the same problems
    tok = CharTokenizer()
    for ex, p in zip(ds, plain):
        x, y = (int(t) for t in ex.prompt.rstrip("=").split("+"))
        assert ex.answer.rsplit(",", 1)[1] == p.answer == str(x + y)
        assert tok.decode(tok.encode(ex.answer)) == ex.answer
    with pytest.raises(ValueError, match="scratchpad=True needs ops='\\+'"):
        load_dataset("arith?ops=+-&scratchpad=true&size=3")


def test_split_is_seeded_and_its_solutions_score_one():
    from ict_jax.rewards.checks import check_text, sft_target

    ds = load_dataset("split?digits=3&size=300", seed=2)
    assert ds.scorer == "sum" and len(ds) == 300
    assert [e.meta["solution"] for e in ds] == [e.meta["solution"] for e in load_dataset("split", size=300, seed=2)]
    assert [e.prompt for e in ds] != [e.prompt for e in load_dataset("split", size=300, seed=3)]
    tok = CharTokenizer()
    xs = []
    for ex in ds:
        n = int(ex.prompt.rstrip("="))
        assert ex.answer == str(n) and 2 <= n <= 999
        sol = sft_target(ex, ds.scorer)
        x, y = sol.split("+")
        assert sol == ex.meta["solution"] and len(x) == 3 and y == str(n - int(x)) and 1 <= int(x) < n
        assert check_text("sum", sol, ex.answer).correct
        assert tok.decode(tok.encode(sol)) == sol
        xs.append(int(x) / n)
    assert 0.4 < float(np.mean(xs)) < 0.6  # x is spread over 1..N-1, not a fixed choice
    with pytest.raises(ValueError, match="digits >= 1"):
        load_dataset("split?digits=0&size=3")


def test_split_force_x_teacher_forces_the_sft_x_and_scores_only_y():
    """The x-forced evaluation: the same N and x as the plain set's SFT solutions, x in the prompt,
    gold y = N - x, exact scorer (hand-checked: seed 12345, digits 2 starts with 63 = 09 + 54)."""
    from ict_jax.rewards.checks import check_text

    plain = load_dataset("split?digits=2&size=50&seed=12345")
    forced = load_dataset("split?digits=2&size=50&seed=12345&force_x=true")
    assert forced.scorer == "exact" and forced[0].prompt == "63=09+" and forced[0].answer == "54"
    for a, b in zip(plain, forced):
        x, y = a.meta["solution"].split("+")
        assert b.prompt == f"{a.answer}={x}+" and b.answer == y
        assert check_text("exact", y, b.answer).correct and not check_text("exact", f"{x}+{y}", b.answer).correct
    with pytest.raises(ValueError, match="force_x"):
        load_dataset("split?force_x=yes&size=3")


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_reasoning_gym_scores_its_own_gold(name):
    ds = load_dataset(f"gym:{name}", size=4, seed=7)
    again = load_dataset(f"gym:{name}?size=4&seed=7")
    assert ds.scorer == "gym" and len(ds) == 4 and [ex.prompt for ex in ds] == [ex.prompt for ex in again]
    for ex in ds:
        assert ex.meta["gym_dataset"] == name and ex.meta["gym_entry"]["answer"] == ex.answer
        assert gym_answer_score(ex.answer, ex.meta) == 1.0
        assert gym_answer_score("definitely wrong", ex.meta) == 0.0


def test_parse_spec():
    assert parse_spec("gym:chain_sum?size=20&seed=3&x=a&f=0.5&b=true") == (
        "gym:chain_sum", {"size": 20, "seed": 3, "x": "a", "f": 0.5, "b": True})
    with pytest.raises(ValueError):
        parse_spec("arith?digits")


# -- templates, encoding, buckets, iteration ------------------------------------------------------------
def test_templates():
    q = "What is 1+1?"
    chat = format_prompt(q, "qwen_chat")
    assert chat == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within "
                    "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert format_prompt(q, "plain") == ("Question: What is 1+1?\nPlease reason step by step, and put your final "
                                         "answer within \\boxed{}.\nAnswer:")
    assert format_prompt(q, "none") == q
    assert format_prompt(q, "qwen_chat", CharTokenizer()).startswith("<bos><user>What is 1+1?\n")
    with pytest.raises(ValueError, match="template"):
        format_prompt(q, "fancy")


def _dataset(n: int, scorer: str = "exact") -> Dataset:
    return Dataset("toy", [Example("1" * (1 + i % 13) + "=", str(i), {"index": i}) for i in range(n)], scorer)


def test_over_long_prompts_are_dropped_and_counted(caplog):
    ds = _dataset(26)  # prompt lengths 2..14 characters
    tok = CharTokenizer()
    enc = encode_prompts(ds, tok, template="none", max_prompt_len=8)
    too_long = [i for i, ex in enumerate(ds) if len(ex.prompt) > 8]
    assert enc.dropped == len(too_long) > 0 and enc.dropped_indices == too_long
    assert len(enc) == 26 - enc.dropped and all(len(ids) <= 8 for ids in enc.ids)
    assert [ex.answer for ex in enc.examples] == [ex.answer for i, ex in enumerate(ds) if i not in too_long]
    assert "dropped" in caplog.text
    chat = encode_prompts(ds, tok, template="qwen_chat", max_prompt_len=512)
    assert chat.dropped == 0 and "\\boxed{}" in chat.texts[0]
    mc = encode_prompts(_dataset(2, "mc"), tok, template="plain", max_prompt_len=512)
    assert "letter" in mc.texts[0]


def test_buckets_and_left_padding():
    assert make_buckets(512) == (32, 64, 128, 256, 512) and make_buckets(100, 16) == (16, 32, 64, 100)
    assert bucket_for(33, (32, 64)) == 64 and bucket_for(1, (32, 64)) == 32
    with pytest.raises(ValueError):
        bucket_for(65, (32, 64))
    ids, mask = pad_left([np.array([5, 6, 7]), np.array([9])], 4, pad_id=0)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    # widening an already left-padded batch: its padding stays padding (even a pad id that is a real token)
    ids, mask = pad_left(np.array([[9, 5, 6, 7], [9, 0, 0, 9]]), 6, pad_id=9, masks=np.array([[0, 1, 1, 1], [0, 1, 1, 1]]))
    np.testing.assert_array_equal(ids, [[9, 9, 9, 5, 6, 7], [9, 9, 9, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="does not fit"):
        pad_left(np.zeros((1, 5)), 4, pad_id=0)

    tok = CharTokenizer()
    enc = encode_prompts(_dataset(40), tok, template="none", max_prompt_len=16)
    it = PromptIterator(enc, 4, seed=0, buckets=(4, 8, 16))
    for _ in range(25):
        b = next(it)
        assert b.ids.shape == b.mask.shape == (4, b.length) and b.length in (4, 8, 16)
        assert b.valid.all() and b.length == bucket_for(int(b.mask.sum(1).max()), (4, 8, 16))
        for row, ex, m in zip(b.ids, b.examples, b.mask):
            assert tok.decode(row[m.astype(bool)]) == ex.prompt
            assert (row[~m.astype(bool)] == tok.pad_id).all() and m[-1] == 1  # left padding


def test_shuffling_is_deterministic_per_seed_and_epoch():
    enc = encode_prompts(_dataset(12), CharTokenizer(), template="none", max_prompt_len=16)

    def order(seed, batches=9):
        it = PromptIterator(enc, 4, seed=seed)
        return [tuple(next(it).indices) for _ in range(batches)]

    a = order(0)
    assert a == order(0) and a != order(1)
    epochs = [sorted(sum(a[e * 3:(e + 1) * 3], ())) for e in range(3)]
    assert all(e == list(range(12)) for e in epochs)  # every epoch a permutation
    assert sum(a[0:3], ()) != sum(a[3:6], ())  # reshuffled each epoch
    plain = PromptIterator(enc, 4, shuffle=False)
    assert list(next(plain).indices) == [0, 1, 2, 3]


def test_iterator_state_resumes_exactly():
    enc = encode_prompts(_dataset(10), CharTokenizer(), template="none", max_prompt_len=16)
    it = PromptIterator(enc, 3, seed=5)  # 10 % 3: each epoch's tail of 1 is skipped
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # survives a JSON checkpoint
    expected = [tuple(next(it).indices) for _ in range(5)]
    resumed = PromptIterator(enc, 3, seed=5)
    resumed.load_state_dict(state)
    assert [tuple(next(resumed).indices) for _ in range(5)] == expected
    with pytest.raises(ValueError, match="different"):
        PromptIterator(enc, 3, seed=6).load_state_dict(state)


def test_single_pass_for_evaluation():
    enc = encode_prompts(_dataset(10), CharTokenizer(), template="none", max_prompt_len=16)
    batches = list(PromptIterator(enc, 4, shuffle=False, epochs=1, drop_last=False))
    assert [b.ids.shape[0] for b in batches] == [4, 4, 4]
    assert [int(b.valid.sum()) for b in batches] == [4, 4, 2]
    seen = [int(i) for b in batches for i, v in zip(b.indices, b.valid) if v]
    assert seen == list(range(10))
    assert batches[-1].examples[3] is batches[-1].examples[1]  # filler rows copy the last real row
    with pytest.raises(ValueError, match="cannot fill"):
        PromptIterator(enc, 11)


# -- tensorflow-datasets ------------------------------------------------------------------------------
def test_tfds_prepared_locally(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("array_record")

    class TinyGsm8k(tfds.core.GeneratorBasedBuilder):
        """A two-split GSM8K-shaped builder prepared from memory (no download)."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(GSM), "test": self._generate_examples(GSM[:1])}

        def _generate_examples(self, rows):
            for i, row in enumerate(rows):
                yield i, row

    TinyGsm8k(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    ds = load_dataset("tfds:tiny_gsm8k", data_dir=str(tmp_path), split="train")
    assert ds.scorer == "gsm8k" and sorted(ex.answer for ex in ds) == ["-5", "2400", "72"]
    assert len(load_dataset("tfds:tiny_gsm8k", data_dir=str(tmp_path), split="test")) == 1
    with pytest.raises(DataError, match="no split"):
        load_dataset("tfds:tiny_gsm8k", data_dir=str(tmp_path), split="validation")
    with pytest.raises(FileNotFoundError, match="download_and_prepare"):  # never downloads
        load_dataset("tfds:gsm8k", data_dir=str(tmp_path / "empty"))


def test_chat_template_falls_back_to_qwen2p5():
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    from ict_jax.model.tokenizers import HFTokenizer

    tok = HFTokenizer(Backend(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), eos_ids=[0], pad_id=0)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "q"}])
    assert format_prompt("q", "qwen_chat", tok) == format_prompt("q", "qwen_chat")
    assert format_prompt("q", "qwen_chat", tok).startswith("<|im_start|>system\nYou are Qwen")


def test_tfds_missing_is_one_line_naming_the_extra(monkeypatch):
    """tensorflow-datasets is an optional extra: without it a tfds: source says how to get it."""
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes `import tensorflow_datasets` fail
    with pytest.raises(ImportError, match=r"^tensorflow-datasets \(the tfds extra\) is not installed: pip install -e "
                                          r"'\.\[tfds\]' in the ict_jax checkout \(needed only for tfds: sources"):
        load_dataset("tfds:gsm8k", data_dir="/nonexistent", split="train")


# ------------------------------------------------------------------------------------------------
# A generic task from a JSONL / Parquet file (docs/data.md "Your own task file")
# ------------------------------------------------------------------------------------------------
def test_file_task_from_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ict_jax.rewards.checks import check_text

    rows = [{"question": "2+2?", "solution": 4, "level": 1}, {"question": "Half of 7?", "solution": "3.5", "level": 2}]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist([{**r, "solution": str(r["solution"])} for r in rows]),
                   tmp_path / "tasks.parquet")  # a Parquet column has one type
    for name in ("tasks.jsonl", "tasks.parquet"):
        ds = load_dataset(f"file:{name}?prompt=question&answer=solution&reward=math", data_dir=str(tmp_path))
        assert ds.scorer == "math" and len(ds) == 2
        assert [(e.prompt, e.answer) for e in ds] == [("2+2?", "4"), ("Half of 7?", "3.5")]
        assert ds[1].meta["level"] == 2 and ds[1].meta["index"] == 1  # the other fields go to meta
        assert check_text(ds.scorer, r"so \boxed{\frac72}", ds[1].answer).correct
    # absolute path, defaults (prompt, answer, math), and the custom kind
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    ds = load_dataset(f"file:{tmp_path / 'plain.jsonl'}?reward=custom")
    assert ds.scorer == "custom" and ds[0].answer == "a"
    # multiple choice: a list-of-options field, a 0-based index answer
    (tmp_path / "mc.jsonl").write_text(json.dumps({"q": "Pick", "opts": ["x", "y", "z"], "a": 2}) + "\n")
    ds = load_dataset("file:mc.jsonl?prompt=q&answer=a&choices=opts&reward=mc", data_dir=str(tmp_path))
    assert ds[0].answer == "C" and ds[0].prompt.endswith("C. z") and ds[0].meta["choices"] == ["x", "y", "z"]


@pytest.mark.parametrize("name,rows,error,message", [
    ("bad.jsonl", ['{"question": "1?", "solution": "1"}', '{"question": "2?"}'], "DataError",
     "bad.jsonl:2: missing field 'solution'"),
    ("bad.jsonl", ['{"question": "1?", "solution": "1"}', '{not json'], "DataError", "bad.jsonl:2: invalid JSON"),
    ("bad.jsonl", ['{"question": ["a"], "solution": "1"}'], "DataError", "bad.jsonl:1: field 'question' should be str"),
    ("ok.jsonl", ['{"question": "1?", "solution": "1"}'], "ValueError", "reward='nope' is not a reward kind"),
    ("ok.txt", ['x'], "ValueError", "expected a .jsonl, .parquet, .csv file"),
    ("missing.jsonl", None, "FileNotFoundError", "file:missing.jsonl: no such file"),
    # a null field is null (not missing); the column of invalid JSON is the line's own
    # (json counted the trailing newline as a second line: "column 1"); a non-UTF-8 file names its line
    ("bad.jsonl", ['{"question": "1?", "solution": "1"}', '{"question": null, "solution": "2"}'], "DataError",
     "bad.jsonl:2: field 'question' is null; expected str"),
    ("bad.jsonl", ['{"question": "1?", "solution": "1"'], "DataError",
     "bad.jsonl:1: invalid JSON (Expecting ',' delimiter at the end of the line)"),
    ("bad.jsonl", ['{"question": "1?" "solution": "1"}'], "DataError",
     "bad.jsonl:1: invalid JSON (Expecting ',' delimiter at column 19)"),
    ("bad.jsonl", ['{"question": "1?", "solution": "1"}', b'{"question": "caf\xe9?", "solution": "2"}'], "DataError",
     "bad.jsonl:2: not UTF-8 text (byte 0xe9 at column 18): save the file as UTF-8"),
    ("bad.csv", ['question,solution', '1?,1', b'caf\xe9?,2'], "DataError", "bad.csv:3: not UTF-8 text (byte 0xe9 at "
                                                                           "column 4)"),
])
def test_file_task_errors_name_the_file_and_line(tmp_path, name, rows, error, message):
    if rows is not None:
        (tmp_path / name).write_bytes(b"\n".join(r if isinstance(r, bytes) else r.encode() for r in rows) + b"\n")
    reward = "nope" if "reward=" in message else "math"
    with pytest.raises(Exception) as e:
        load_dataset(f"file:{name}?prompt=question&answer=solution&reward={reward}", data_dir=str(tmp_path))
    assert type(e.value).__name__ == error and message in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="unknown option"):
        load_dataset("file:x.jsonl?promt=question")


def test_jsonl_lines_split_on_newlines_only_and_a_bom_is_dropped(tmp_path):
    """U+2028 inside a JSON string is not a line break (str.splitlines would split there); a UTF-8
    byte-order mark at the start of the file is not part of the first row."""
    rows = [{"prompt": "a\u2028b", "answer": "1"}, {"prompt": "c", "answer": "2"}]
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    (tmp_path / "t.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    ds = load_dataset(f"file:{tmp_path / 't.jsonl'}?reward=exact")
    assert [e.prompt for e in ds] == ["a\u2028b", "c"]
