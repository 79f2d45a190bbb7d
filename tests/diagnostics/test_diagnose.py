"""ict-jax diagnose (ict_jax.diagnostics.diagnose): forking tokens, the sorted-u elbow measures and the selected
tokens' diagnostics against hand-computed values; one tiny end-to-end run (tiny random model, the char
tokenizer, the built-in split task) that writes the JSON, the Markdown with the paper's column and the
plots; and the CLI's one-line errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import ict_jax
from ict_jax.cli.main import main
from ict_jax.data.datasets import load_dataset
from ict_jax.diagnostics.diagnose import (
    LOWEST_P,
    PAPER,
    Setting,
    lowest_p_mask,
    reanalyse,
    run_diagnose,
    selector_specs,
)
from ict_jax.diagnostics.diagnose_measures import GRID, diagnostics, fork_positions, sorted_u_curve
from ict_jax.diagnostics.diagnose_report import format_markdown
from ict_jax.model.tokenizers import CharTokenizer
from ict_jax.rl.selectors import resolved_rho, resolved_scope
from ict_jax.rl.token_stats import U_FORMS


def test_fork_positions_hand_computed():
    # one group of 4: r0 and r1 share "1 2", r2 and r3 share "6 2 3"
    tokens = np.array([[1, 2, 3, 4], [1, 2, 5, 4], [6, 2, 3, 4], [6, 2, 3, 9], [1, 1, 1, 1], [1, 1, 1, 1]])
    valid = np.ones(tokens.shape, bool)
    valid[3, 3] = True
    group = np.array([0, 0, 0, 0, 1, 1])  # group 1: two identical responses never fork
    f = fork_positions(tokens, valid, group)
    want = np.zeros(tokens.shape, bool)
    want[0:4, 0] = True  # t = 0: {r0, r1} take 1, {r2, r3} take 6
    want[0:2, 2] = True  # r0 and r1 part at t = 2
    want[2:4, 3] = True  # r2 and r3 part at t = 3
    np.testing.assert_array_equal(f, want)
    # a sibling that has ended (valid 0) is no peer
    valid2 = valid.copy()
    valid2[1, 2:] = False
    f2 = fork_positions(tokens, valid2, group)
    assert not f2[0, 2] and not f2[1, 2]


def test_sorted_u_curve_elbow_measures():
    n = 101
    linear = np.linspace(1.0, 0.0, n)[None]  # u falls linearly with rank: no elbow
    s = sorted_u_curve(np.random.default_rng(0).permutation(linear[0])[None], np.ones((1, n), bool))
    np.testing.assert_allclose(s["curve"], 1.0 - GRID, atol=1e-12)
    assert abs(s["E"] - 1.0) < 1e-9 and s["responses"] == 1 and s["knee"] is None  # the curve is its chord
    step = np.where(np.arange(n) < 10, 1.0, 0.05)[None]  # top 10 % high, the rest flat: a sharp elbow
    s = sorted_u_curve(step, np.ones((1, n), bool))
    # the slopes of the interpolated curve: a drop before rank 0.10, flat after it
    c = np.interp(GRID, np.linspace(0, 1, n), step[0])
    top = (np.interp(0.02, GRID, c) - np.interp(0.10, GRID, c)) / 0.08
    mid = (np.interp(0.10, GRID, c) - np.interp(0.30, GRID, c)) / 0.2
    assert mid == 0.0 and math.isinf(s["E"])  # nothing falls after 10 %: infinitely sharp
    assert top > 0 and abs(s["knee"] - 0.1) <= 0.01
    # responses too short for a curve, and all-zero u, are counted apart
    s = sorted_u_curve(np.zeros((2, 30)), np.ones((2, 30), bool))
    assert s["curve"] is None and s["flat_share"] == 1.0 and s["responses"] == 2
    s = sorted_u_curve(step[:, :10], np.ones((1, 10), bool))
    assert s["responses"] == 0


def _synthetic(tok):
    """One group of G = 2, N = 4, every token valid; hand-set p, H1, H2 and masks."""
    tokens = np.array([[tok.encode("a")[0], tok.encode("b")[0], tok.encode("c")[0], tok.encode("a")[0]],
                       [tok.encode("a")[0], tok.encode("d")[0], tok.encode("c")[0], tok.encode("c")[0]]])
    p = np.array([[0.9, 0.2, 0.5, 0.1], [0.9, 0.4, 0.6, 0.3]])
    H1 = np.array([[0.1, 2.0, 1.0, 3.0], [0.1, 1.5, 0.8, 2.5]])  # sorted: .1 .1 .8 1 1.5 2 2.5 3; lower median 1.0
    H2 = -np.log(np.array([[0.8, 0.1, 0.3, 0.05], [0.8, 0.2, 0.4, 0.1]]))
    u = np.array([[0.0, 0.3, 0.1, 0.2], [0.0, 0.4, 0.05, 0.25]])
    sel = np.array([[0, 1, 0, 1], [0, 1, 0, 0]], bool)  # p 0.2, 0.1, 0.4; H1 2.0, 3.0, 1.5: all above the median
    masks = {name: sel if name.startswith("ict[") else np.ones((2, 4), bool) for name in selector_specs(["aligned"])}
    return {"tokens": tokens, "valid": np.ones((2, 4), bool), "logp": np.log(p), "H1": H1, "H2": H2,
            "pmax": np.full((2, 4), 0.9), "truncated": np.zeros(2), "js": {"aligned": u},
            "pbar_tok": {"aligned": np.full((2, 4), 0.25)}, "masks": masks, "reward": np.array([1.0, 0.0]),
            "correct": np.array([True, False]), "advantage": np.array([0.7071, -0.7071]), "group": np.array([0, 0]),
            "texts": ["abca", "adcc"], "timing": {"sample_s": 0.0, "stats_s": 0.0, "score_s": 0.0},
            "u_forms": ("aligned",), "group_size": 2,
            "selector_forms": {k: f for k, (_, f) in selector_specs(["aligned"]).items()}}


def test_diagnostics_hand_computed():
    tok = CharTokenizer()
    d = diagnostics(_synthetic(tok), tok)
    s = d["selectors"]["ict[aligned]"]
    assert s["selected"] == 3 and abs(s["selected_frac"] - 3 / 8) < 1e-12
    np.testing.assert_allclose([s["p"]["mean"], s["p"]["median"], s["p"]["sd"]],
                               [0.7 / 3, 0.2, np.std([0.2, 0.1, 0.4], ddof=1)], rtol=1e-12)
    np.testing.assert_allclose(s["beta"]["mean"], (0.1 + 0.05 + 0.2) / 3, rtol=1e-12)
    np.testing.assert_allclose(s["qtok"]["mean"], 0.25)
    assert d["H1_median"] == 1.0 and s["h_counts_median"] == [3, 0] and s["h_ratio_median"] is None
    # top-20 % threshold: the 0.8 quantile of the 8 H1 values (linear) = 2.0 + 0.6 * (2.5 - 2.0) = 2.3
    assert abs(d["H1_q80"] - 2.3) < 1e-12 and s["h_counts_top20"] == [1, 2]
    # the forks: r0 and r1 share "a", part at t = 1 ("b" vs "d") and are alone after it
    assert s["forks"] == 2 and s["forks_selected"] == 2
    assert s["top_selected"][0][:2] in (["b", 1], ["d", 1], ["a", 1])
    assert {t for t, _, _ in s["top_unselected"]} == {"a", "c"}
    r = d["readings"]["aligned"]
    # mean u per response: 0.6 / 4 and 0.7 / 4; two responses: a correlation needs 3
    assert r["adv_corr"]["pearson"] is None and r["adv_corr"]["n"] == 2
    np.testing.assert_allclose([r["adv_corr"]["mean_u_pos"], r["adv_corr"]["mean_u_neg"]], [0.15, 0.175])
    assert r["u"]["zero_share"] == 0.25 and d["accuracy"] == 0.5 and d["groups_with_signal"] == 1
    # aligned ceiling at n = 2: 1/2 [ln(4/3) + ln(2/3)/2] + ln(2)/4 = 0.2158; u >= 0.205 for 0.3, 0.4, 0.25
    assert r["u"]["u_at_ceiling"] == 3 / 8
    assert s["tie_share"] is None  # no tie record: n/a
    data = _synthetic(tok)
    data["ties"] = {"ict[aligned]": np.array([[0, 1, 0, 0], [0, 0, 0, 0]], bool)}
    assert diagnostics(data, tok)["selectors"]["ict[aligned]"]["tie_share"] == 1 / 3
    md = format_markdown({"title": "t", "dataset": "x", "prompts": 1, "max_new_tokens": 4, "u_forms": ["aligned"],
                          "rho": 0.1, "seed": 0, "template": "none", "paper": PAPER,
                          "settings": {"G2_T1": d | {"setting": {"group_size": 2, "temperature": 1.0}}}})
    assert "0.18 ± 0.09" in md and "1.03 / 0.99" in md and "ICT, u aligned" in md


def test_what_each_selector_reaches_hand_computed():
    """diagnose's coverage shares are the train step's (ict_jax.rl.coverage) on the setting's arrays: one
    group of G = 2, N = 4; response 0 truncated (4 tokens, no EOS), response 1 ended with EOS after 2 tokens
    (the group's shortest); A = +0.71 / -0.71. ICT's mask selects t 1, 3 of response 0 and t 1 of response 1
    (its EOS; t 3 of response 1 is padding)."""
    tok = CharTokenizer()
    data = _synthetic(tok)
    data["valid"] = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    data["truncated"] = np.array([True, False])
    data["masks"]["ict[aligned]"] = np.array([[0, 1, 0, 1], [0, 1, 0, 1]], bool)
    d = diagnostics(data, tok)
    # 3 selected: EOS row 1 t 1; after the shortest (t >= 2): row 0 t 3; truncated: row 0's two; A < 0: row 1's one
    assert d["selectors"]["ict[aligned]"]["reach"] == {
        "selected_eos_frac": float(np.float32(1) / np.float32(3)),
        "selected_after_shortest_frac": float(np.float32(1) / np.float32(3)),
        "selected_truncated_frac": float(np.float32(2) / np.float32(3)),
        "selected_neg_adv_frac": float(np.float32(1) / np.float32(3))}
    # one bin of 16 positions: 3 of its 6 valid tokens selected
    assert d["selectors"]["ict[aligned]"]["selected_by_position"] == [0.5]
    # every valid token (all): 1 EOS of 6, 2 tokens after the shortest, 4 truncated, 2 with A < 0
    assert d["selectors"]["all"]["reach"] == {k: float(np.float32(c) / np.float32(6)) for k, c in (
        ("selected_eos_frac", 1), ("selected_after_shortest_frac", 2), ("selected_truncated_frac", 4),
        ("selected_neg_adv_frac", 2))}
    results = {"title": "t", "dataset": "x", "prompts": 1, "max_new_tokens": 4, "u_forms": ["aligned"], "rho": 0.1,
               "seed": 0, "template": "none", "paper": PAPER,
               "settings": {"G2_T1": d | {"setting": {"group_size": 2, "temperature": 1.0}}}}
    md = format_markdown(results)
    assert "### What each selector reaches" in md
    assert "| ict[aligned] | 3 (50.0 %) | 0.33 | 0.33 | 0.67 | 0.33 | 0.50 |" in md
    assert "| all | 6 (100.0 %) | 0.17 | 0.33 | 0.67 | 0.33 | 1.00 |" in md
    for s in d["selectors"].values():  # a diagnose.json from before: n/a and how to add it
        del s["reach"]
    assert "Not in this diagnose.json: `ict-jax diagnose --reanalyse" in format_markdown(results)


def test_selected_share_by_bin_leaves_bins_without_valid_tokens_empty():
    tok = CharTokenizer()
    data = _synthetic(tok)
    N = 40  # bins [0, 16), [16, 32), [32, 40); no valid token past t 19
    for k in ("tokens", "logp", "H1", "H2", "pmax"):
        data[k] = np.concatenate([data[k]] * 10, axis=1)
    for k in ("js", "pbar_tok"):
        data[k] = {f: np.concatenate([v] * 10, axis=1) for f, v in data[k].items()}
    data["valid"] = np.zeros((2, N), bool)
    data["valid"][0, :20] = True
    data["valid"][1, :10] = True
    sel = np.zeros((2, N), bool)
    sel[0, [0, 17, 30]] = True  # t 30 is padding
    sel[1, [3, 9]] = True
    data["masks"] = {name: sel for name in data["masks"]}
    s = diagnostics(data, tok)["selectors"]["ict[aligned]"]
    assert s["selected_by_position"] == [float(np.float32(3) / np.float32(26)), 0.25, None]


def test_lowest_p_and_entropy_per_response_at_icts_count():
    """lowest_p keeps each response's k = max(1, ceil(rho n)) least likely tokens (ties to the earlier one);
    entropy[sequence] is 20-Entropy at ICT's rho per response."""
    logp = np.log(np.array([[0.9, 0.2, 0.5, 0.1, 0.3], [0.6, 0.6, 0.9, 0.9, 0.9]], np.float32))
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)  # n = 5 and 3
    assert np.asarray(lowest_p_mask(logp, valid, 0.1)).tolist() == [[0, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert np.asarray(lowest_p_mask(logp, valid, 0.5)).tolist() == [[0, 1, 0, 1, 1], [1, 1, 0, 0, 0]]
    specs = selector_specs(["aligned", "pooled"], rho=0.1)
    lp, ent = specs[LOWEST_P][0], specs["entropy[sequence]"][0]
    assert (resolved_rho(lp), resolved_scope(lp)) == (0.1, "sequence")
    assert (ent.method, resolved_rho(ent), resolved_scope(ent)) == ("entropy", 0.1, "sequence")
    assert {"ict[aligned]", "ict[pooled]", "random", LOWEST_P, "entropy[sequence]"} <= set(specs)
    assert resolved_rho(selector_specs(["aligned"])["entropy[sequence]"][0]) == 0.1  # ICT's default rho


def test_ict_under_both_tie_rules_in_the_report():
    """ICT's rows come under both tie rules (rl.selector.ties): ``ict[r]`` (position, exactly k) and
    ``ict[r,ties=all]`` (every token tied at the cut); the report gives each its selected count and tie share."""
    tok = CharTokenizer()
    specs = selector_specs(["aligned"], rho=0.3)
    assert specs["ict[aligned]"][0].ties == "position" and specs["ict[aligned,ties=all]"][0].ties == "all"
    assert resolved_rho(specs["ict[aligned,ties=all]"][0]) == 0.3 and specs["ict[aligned,ties=all]"][1] == "aligned"
    assert all(cfg.ties == "position" for name, (cfg, _) in specs.items() if "ties=all" not in name)
    data = _synthetic(tok)
    data["masks"]["ict[aligned,ties=all]"] = np.array([[0, 1, 1, 1], [0, 1, 0, 0]], bool)
    data["ties"] = {"ict[aligned]": np.array([[0, 1, 0, 0], [0, 0, 0, 0]], bool),
                    "ict[aligned,ties=all]": np.array([[0, 0, 1, 1], [0, 0, 0, 0]], bool)}
    d = diagnostics(data, tok)
    s = d["selectors"]["ict[aligned,ties=all]"]
    assert s["selected"] == 4 and s["selected_frac"] == 0.5 and s["tie_share"] == 0.5
    assert d["selectors"]["ict[aligned]"]["tie_share"] == 1 / 3
    results = {"title": "t", "dataset": "x", "prompts": 1, "max_new_tokens": 4, "u_forms": ["aligned"], "rho": 0.1,
               "seed": 0, "template": "none", "paper": PAPER,
               "settings": {"G2_T1": d | {"setting": {"group_size": 2, "temperature": 1.0}}}}
    md = format_markdown(results)
    assert "| ties = position (exactly k): selected tokens decided by the tie rule (share) | not given | 0.33 |" in md
    assert "| ties = all (every token tied at the cut kept)" in md and "| 4 (50.0 %) · 0.50 |" in md
    assert "tie share (position / all)" in md and "· 0.33 / 0.50 |" in md
    del d["selectors"]["ict[aligned,ties=all]"]  # a diagnose.json from before: n/a and how to add it
    assert "n/a (not in this diagnose.json: --reanalyse adds it)" in format_markdown(results)


@pytest.mark.e2e  # a whole diagnose run (12 s)
def test_run_diagnose_tiny_end_to_end(tmp_path, tiny_hf_dir, capsys, monkeypatch):
    """A tiny random model on the split task: every reading and selector is reported, the counts follow
    docs/method.md §2, and the JSON, Markdown and plot are written; progress lines as each setting and
    batch starts and ends."""
    tok = CharTokenizer()
    model = ict_jax.init_model(ict_jax.ModelConfig.tiny(vocab_size=tok.vocab_size, num_layers=1), seed=0)
    ds = load_dataset("split?digits=2&size=3&seed=3")
    said = []
    res = run_diagnose(model, tok, ds, settings=[Setting(2, 1.0)], max_new_tokens=12, batch_rows=4,
                       template="none", out=tmp_path, title="tiny", say=said.append,
                       heartbeat_s=3600.0)  # the progress lines alone (a loaded machine's compile can pass 30 s)
    assert said[0] == "G2_T1: setting 1 of 1 (G = 2, T = 1.0)"
    assert said[1] == "G2_T1: sampling prompts 1-2 of 3 (2 responses each, up to 12 tokens, compiling first) ..."
    assert said[2].startswith("G2_T1: prompts 1-2 of 3 sampled in ") and "statistics and masks in " in said[2]
    assert said[3] == "G2_T1: sampling prompts 3-3 of 3 (2 responses each, up to 12 tokens) ..."
    assert said[-1].startswith("G2_T1: done in ")
    assert res["instruction"] is None  # template none: the prompts as given
    d = res["settings"]["G2_T1"]
    assert set(d["readings"]) == set(U_FORMS)
    assert set(d["selectors"]) == set(selector_specs(U_FORMS))
    n_valid = d["valid_tokens"]
    assert d["selectors"]["all"]["selected"] == n_valid
    for form in U_FORMS:  # ICT and its complement partition the valid tokens
        assert d["selectors"][f"ict[{form}]"]["selected"] + d["selectors"][f"frequent[{form}]"]["selected"] == n_valid
    assert d["selectors"]["random"]["selected"] == d["selectors"]["ict[aligned]"]["selected"]
    for form in U_FORMS:  # the saturation measures (rl.saturation) of every reading and top-k selector
        assert 0.0 <= d["readings"][form]["u"]["u_at_ceiling"] <= 1.0
        assert 0.0 <= d["selectors"][f"ict[{form}]"]["tie_share"] <= 1.0
    assert 0.0 <= d["selectors"]["entropy"]["tie_share"] <= 1.0 and d["selectors"]["random"]["tie_share"] is None
    for form in U_FORMS:  # ties: all keeps position's tokens and every token tied at the cut
        pos, every = d["selectors"][f"ict[{form}]"], d["selectors"][f"ict[{form},ties=all]"]
        assert every["selected"] >= pos["selected"] and 0.0 <= every["tie_share"] <= 1.0
    saved = json.loads((tmp_path / "diagnose.json").read_text())
    assert saved["settings"]["G2_T1"]["valid_tokens"] == n_valid
    md = (tmp_path / "diagnose.md").read_text()
    assert "paper (Qwen2.5, GSM8K / MATH)" in md and "## G2_T1" in md
    assert (tmp_path / "G2_T1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for form in U_FORMS:  # the advantage diagnostic, plain and length controlled, per reading
        for key in ("adv_corr", "adv_corr_within", "adv_corr_finished", "adv_corr_partial_length"):
            c = d["readings"][form][key]
            assert (c["pearson"] is None) == (c["why"] is not None), (form, key)
    assert "### The advantage diagnostic" in md and "| p(o_t) | Q(o_t) |" in md
    # the saved arrays are the ones reanalyse has always read: a .npz saved before the length-controlled
    # correlations existed is the same file, and a diagnose.json without them gains them
    z = np.load(tmp_path / "G2_T1.npz")
    specs = selector_specs(U_FORMS)
    assert set(z.files) == ({"tokens", "valid", "logp", "H1", "H2", "pmax", "truncated", "reward", "correct",
                             "advantage", "group"} | {f"{k}.{f}" for k in ("js", "pbar_tok") for f in U_FORMS}
                            | {f"masks.{n}" for n in specs}
                            | {f"ties.{n}" for n in specs if n.startswith(("ict[", "entropy"))})
    old = json.loads((tmp_path / "diagnose.json").read_text())
    for r in old["settings"]["G2_T1"]["readings"].values():
        for key in ("adv_corr_within", "adv_corr_finished", "adv_corr_partial_length"):
            del r[key]
        del r["adv_corr"]["why"]
    (tmp_path / "diagnose.json").write_text(json.dumps(old))
    assert "Not in this diagnose.json" in format_markdown(old)
    # arrays saved before ICT's ties: all selection, entropy[sequence] and lowest_p existed: reanalyse recomputes
    # them (and their tie records) from u, H1 and logp
    arrays = dict(np.load(tmp_path / "G2_T1.npz"))
    later = ("ties=all", "entropy[sequence]", LOWEST_P)
    np.savez_compressed(tmp_path / "G2_T1.npz", **{k: v for k, v in arrays.items() if not any(n in k for n in later)})
    # the report rebuilt from the saved arrays, without sampling, gives the same diagnostics
    again = reanalyse(tmp_path, tok)["settings"]["G2_T1"]
    assert set(np.load(tmp_path / "G2_T1.npz").files) == set(arrays)
    for key in ("valid_tokens", "accuracy", "readings", "selectors"):
        assert json.dumps(again[key], sort_keys=True) == json.dumps(d[key], sort_keys=True), key
    assert "Not in this diagnose.json" not in (tmp_path / "diagnose.md").read_text()

    # `ict-jax diagnose --reanalyse` loads the tokenizer only (it loaded the whole model: 30 s and 4.6 GB
    # for the 1.5B) and needs no --prompts
    import ict_jax.model.source as source

    def no_weights(*a, **k):
        raise AssertionError("--reanalyse loaded the weights")

    monkeypatch.setattr(source, "load_hf", no_weights)
    monkeypatch.setattr(source, "load_gguf", no_weights)
    capsys.readouterr()
    assert main(["diagnose", "--reanalyse", "--model", str(tiny_hf_dir), "--tokenizer", "char",
                 "--out", str(tmp_path)]) == 0
    assert "[diagnose] G2_T1: reanalysed" in capsys.readouterr().out
    assert main(["diagnose", "--model", str(tiny_hf_dir), "--out", str(tmp_path / "x")]) == 2
    assert "--prompts SRC is required (except with --reanalyse)" in capsys.readouterr().err


@pytest.mark.e2e  # a diagnose run of a tiny model (~11 s: its programs compile)
def test_diagnose_says_what_runs_at_least_every_heartbeat(monkeypatch):
    """Inside a setting a phase of a real model takes minutes (a sampler call, the statistics): a heartbeat
    line names the phase that runs whenever the interval passes without a line (here 0.05 s, a sampler
    call made to take 0.4 s)."""
    import time

    import ict_jax.diagnostics.diagnose as diagnose_mod

    real = diagnose_mod.make_generate_fn

    def slow_generate_fn(*a, **k):
        gen = real(*a, **k)

        def slow(*args):
            time.sleep(0.4)
            return gen(*args)

        return slow

    monkeypatch.setattr(diagnose_mod, "make_generate_fn", slow_generate_fn)
    tok = CharTokenizer()
    model = ict_jax.init_model(ict_jax.ModelConfig.tiny(vocab_size=tok.vocab_size, num_layers=1), seed=0)
    said: list[str] = []
    run_diagnose(model, tok, load_dataset("split?digits=2&size=2&seed=3"), settings=[Setting(2, 1.0)],
                 u_forms=("aligned",), max_new_tokens=4, batch_rows=4, template="none", say=said.append,
                 heartbeat_s=0.05)
    beats = [s for s in said if ": still running, " in s]
    assert any(s.startswith("G2_T1: sampling prompts 1-2 of 2 (compiling first): still running, ") for s in beats), said
    assert any(s.startswith("starting the reward workers: still running, ") for s in beats), said
    lines = [s for s in said if s not in beats]
    assert lines[0] == "G2_T1: setting 1 of 1 (G = 2, T = 1.0)" and lines[-1].startswith("G2_T1: done in "), said


def test_diagnose_states_the_instruction_it_adds():
    """The instruction each prompt gets is in the report and in --help."""
    from ict_jax.cli.main import build_parser
    from ict_jax.data.templates import BOXED_INSTRUCTION, MC_INSTRUCTION
    from ict_jax.diagnostics.diagnose import prompt_instruction
    from ict_jax.diagnostics.diagnose_report import format_markdown

    ds = load_dataset("split?digits=2&size=3&seed=3")
    assert prompt_instruction(ds, "qwen_chat") == prompt_instruction(ds, "plain") == BOXED_INSTRUCTION
    assert prompt_instruction(type("MC", (), {"scorer": "mc"})(), "qwen_chat") == MC_INSTRUCTION
    md = format_markdown({"title": "", "dataset": "d", "prompts": 1, "max_new_tokens": 4, "rho": 0.1, "seed": 0,
                          "template": "qwen_chat", "instruction": BOXED_INSTRUCTION, "u_forms": ["aligned"],
                          "paper": PAPER, "settings": {}})
    assert f'followed by the instruction "{BOXED_INSTRUCTION}"' in md
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["diagnose"]
    assert BOXED_INSTRUCTION in sub.format_help().replace("\n", " ").replace("  ", " ") or \
        BOXED_INSTRUCTION in next(a.help for a in sub._actions if a.dest == "template")


@pytest.mark.parametrize("args, msg", [
    (["-G", "1"], "group size"),
    (["--u-form", "aligned,index"], "--u-form"),
    (["--temperature", "0"], "--temperature"),
    (["-G", "8,8"], "distinct"),
    (["--rho", "2"], "--rho"),
])
def test_cli_bad_input_is_one_line_exit_2(args, msg, capsys, tmp_path):
    rc = main(["diagnose", "--model", "none.gguf", "--prompts", "split", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and msg in err, err


def test_aligned_ceiling():
    """The aligned ceiling diagnose reads (rl.saturation.u_ceiling, tested against every reading in
    tests/rl/test_saturation.py) in closed form is what u reaches: disjoint one-hot rows."""
    import jax.numpy as jnp

    from ict_jax.rl.token_stats import stats_from_logits

    def closed_form(n):  # 1/2 [ln(2n/(n+1)) + (1/n) ln(2/(n+1)) + (1 - 1/n) ln 2]
        return 0.5 * (np.log(2 * n / (n + 1)) + np.log(2 / (n + 1)) / n + (1 - 1 / n) * np.log(2.0))

    for n in (2, 4, 8, 16):
        logits = np.full((n, 1, n), -60.0, np.float32)
        logits[np.arange(n), 0, np.arange(n)] = 60.0
        st = stats_from_logits(jnp.asarray(logits), np.zeros((n, 1), np.int32), np.ones((n, 1)), group_size=n)
        np.testing.assert_allclose(np.asarray(st.js)[:, 0], closed_form(n), rtol=1e-5)
    np.testing.assert_allclose(closed_form(8), 0.4970, atol=1e-4)


def test_position_panels_draw_bins_as_steps_not_lines_between_bins(tmp_path, monkeypatch):
    """diagnose's position panels draw each bin as a flat step over its positions (joining bin means by
    lines would draw one slanted line across two bins); an empty bin is a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure
    from matplotlib.patches import StepPatch

    from ict_jax.diagnostics.diagnose_measures import POSITION_BIN
    from ict_jax.diagnostics.diagnose_report import plot_setting, position_steps

    edges, values = position_steps([0, 16, 32], [0.25, None, 0.5], width=16)
    assert edges == [0, 16, 32, 48] and values[0] == 0.25 and np.isnan(values[1]) and values[2] == 0.5
    assert position_steps([0], [0.1], width=16) == ([0, 16], [0.1])
    d = {"position_bins": [0, POSITION_BIN], "readings": {"aligned": {
        "sorted_u": {"curve": None}, "u_by_position": [0.1, 0.3]}},
        "selectors": {"ict[aligned]": {"selected_by_position": [0.2, None]}, "all": {"selected_by_position": [1, 1]}}}
    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figs.append(self))
    plot_setting(d, tmp_path / "x.png")
    _, pos_u, pos_sel = figs[0].axes
    for ax in (pos_u, pos_sel):
        assert not ax.get_lines()  # no line joins two bins
        steps = [p for p in ax.patches if isinstance(p, StepPatch)]
        assert len(steps) == 1 and list(steps[0].get_data().edges) == [0, POSITION_BIN, 2 * POSITION_BIN]


# ------------------------------------------------------------------------------------------------
# The advantage diagnostic, plain and with response length controlled (diagnostics.diagnose_advantage)
# ------------------------------------------------------------------------------------------------
def _hand_responses():
    """Three groups: 0 = (u 1, 3; A 1, -1), 1 = (u 2, 2, 5; A -1, -1, 2), 2 = (u 7, 9; A 0, 0: no signal);
    lengths 10, 20 | 5, 7, 6 | 1, 1."""
    mean_u = np.array([1.0, 3.0, 2.0, 2.0, 5.0, 7.0, 9.0])
    adv = np.array([1.0, -1.0, -1.0, -1.0, 2.0, 0.0, 0.0])
    group = np.array([0, 0, 1, 1, 1, 2, 2])
    length = np.array([10, 20, 5, 7, 6, 1, 1])
    return mean_u, adv, group, length


def test_average_ranks_share_ties():
    from scipy.stats import rankdata

    from ict_jax.diagnostics.diagnose_advantage import average_ranks

    np.testing.assert_array_equal(average_ranks([3.0, 1.0, 3.0, 2.0]), [3.5, 1.0, 3.5, 2.0])
    x = np.random.default_rng(0).integers(0, 5, 40).astype(float)
    np.testing.assert_array_equal(average_ranks(x), rankdata(x, method="average"))


def test_within_group_and_partial_correlation_hand_computed():
    from ict_jax.diagnostics.diagnose_advantage import within_group_corr

    mean_u, adv, group, length = _hand_responses()
    everyone = np.ones(7, bool)
    # group 2 has no signal; demeaned u = (-1, 1 | -1, -1, 2), A = (1, -1 | -1, -1, 2): sum u*A = 4,
    # sum u^2 = sum A^2 = 8 -> 0.5; the average ranks (2, 4 | 2, 2, 5) and (4, 2 | 2, 2, 5) less 3 are the
    # same numbers -> 0.5
    w = within_group_corr(mean_u, adv, group, everyone)
    assert w["n"] == 5 and w["groups"] == 2 and w["why"] is None
    np.testing.assert_allclose([w["pearson"], w["spearman"]], [0.5, 0.5], rtol=1e-12)
    # length demeaned l = (-5, 5 | -1, 1, 0): l.l = 52, l.u = 10, l.A = -10; residuals: r_u.r_A = 4 + 100/52,
    # |r_u|^2 = |r_A|^2 = 8 - 100/52 -> (4 + 25/13) / (8 - 25/13) = 77/79
    p = within_group_corr(mean_u, adv, group, everyone, length=length)
    assert p["n"] == 5 and p["groups"] == 2 and p["length_varies"] and "spearman" not in p
    np.testing.assert_allclose(p["pearson"], 77 / 79, rtol=1e-12)
    # finished only: row 3 truncated; group 0 (u -1, 1; A 1, -1), group 1 keeps u 2, 5, A -1, 2
    # (-1.5, 1.5 each): sum u*A = -2 + 4.5 = 2.5, sum u^2 = sum A^2 = 6.5 -> 5/13; ranks (2, 3, 1, 4),
    # (3, 2, 1, 4) -> 4 / 5
    finished = everyone.copy()
    finished[3] = False
    f = within_group_corr(mean_u, adv, group, finished, which="finished responses")
    assert f["n"] == 4 and f["groups"] == 2
    np.testing.assert_allclose([f["pearson"], f["spearman"]], [5 / 13, 0.8], rtol=1e-12)
    # a group keeping one finished response, or two with the same advantage, does not count
    finished[0] = False
    f = within_group_corr(mean_u, adv, group, finished, which="finished responses")
    assert f["n"] == 2 and f["groups"] == 1 and f["pearson"] is None  # 1 degree of freedom: always ±1
    assert f["why"] == "2 finished responses in 1 group leave 1 degree of freedom (a correlation needs 2)"
    finished[4] = False
    f = within_group_corr(mean_u, adv, group, finished, which="finished responses")
    assert f["n"] == 0 and f["why"] == "no group had two finished responses with different advantages"


def test_partial_correlation_when_length_or_u_does_not_vary():
    from ict_jax.diagnostics.diagnose_advantage import within_group_corr

    mean_u, adv, group, length = _hand_responses()
    everyone = np.ones(7, bool)
    same = np.array([128, 128, 64, 64, 64, 3, 9])  # constant within the groups with a signal: nothing to take out
    p = within_group_corr(mean_u, adv, group, everyone, length=same)
    assert not p["length_varies"] and abs(p["pearson"] - 0.5) < 1e-12
    flat = np.array([0.1, 0.1, 0.3, 0.3, 0.3, 0.0, 1.0])  # mean u the same within every group: rounding only
    w = within_group_corr(flat, adv, group, everyone)
    assert w["pearson"] is None and w["why"] == "mean u does not vary within the groups"
    # u exactly linear in length within groups: nothing of it is left once length is accounted for
    p = within_group_corr(0.01 * length + 0.5 * group, adv, group, everyone, length=length)
    assert p["pearson"] is None and p["why"] == "mean u does not vary within the groups once length is accounted for"


def _reference_correlations(mean_u, adv, group, length, truncated):
    """An independent float64 reference: explicit loops over groups, the partial correlation from a
    regression on one indicator per group and the length (np.linalg.lstsq), scipy's average ranks."""
    from scipy.stats import rankdata

    def within(keep, control=None):
        ids = [g for g in sorted(set(group[keep].tolist()))
               if keep[group == g].sum() >= 2 and len(set(adv[keep & (group == g)].tolist())) > 1]
        rows = np.array([keep[i] and group[i] in ids for i in range(len(adv))])
        if control is None:
            u, a = mean_u[rows].copy(), adv[rows].copy()
            for g in ids:
                m = group[rows] == g
                u[m] -= u[m].mean()
                a[m] -= a[m].mean()
            return (np.corrcoef(u, a)[0, 1], np.corrcoef(rankdata(u), rankdata(a))[0, 1], rows.sum(), len(ids))
        X = np.column_stack([(group[rows] == g).astype(float) for g in ids] + [control[rows].astype(float)])
        res = [y - X @ np.linalg.lstsq(X, y, rcond=None)[0] for y in (mean_u[rows], adv[rows])]
        return np.corrcoef(*res)[0, 1], None, rows.sum(), len(ids)

    return {"adv_corr_within": within(np.ones(len(adv), bool)), "adv_corr_finished": within(~truncated),
            "adv_corr_partial_length": within(np.ones(len(adv), bool), length)}


def test_advantage_correlations_match_a_float64_reference():
    from ict_jax.diagnostics.diagnose import outcome_advantages
    from ict_jax.diagnostics.diagnose_advantage import advantage_correlations

    rng = np.random.default_rng(3)
    G, P = 6, 9
    correct = rng.random(P * G) < 0.4
    correct[:G] = False  # one group without signal
    adv = outcome_advantages(correct, G).astype(np.float64)
    group = np.repeat(np.arange(P), G)
    length = rng.integers(5, 60, P * G)
    truncated = rng.random(P * G) < 0.3
    mean_u = 0.2 + 0.002 * length + 0.05 * correct + 0.1 * rng.random(P * G)
    got = advantage_correlations(mean_u, adv, group, length, truncated, np.ones(P * G, bool))
    ref = _reference_correlations(mean_u, adv, group, length, truncated)
    for key, (pearson, spearman, n, k) in ref.items():
        c = got[key]
        assert (c["n"], c["groups"]) == (n, k) and c["why"] is None, key
        np.testing.assert_allclose(c["pearson"], pearson, rtol=1e-10, err_msg=key)
        if spearman is not None:
            np.testing.assert_allclose(c["spearman"], spearman, rtol=1e-10, err_msg=key)
    assert got["adv_corr_partial_length"]["length_varies"]
    # the plain correlation is unchanged: over the responses with A != 0, stable-sort ranks
    nz = adv != 0
    np.testing.assert_allclose(got["adv_corr"]["pearson"], np.corrcoef(mean_u[nz], adv[nz])[0, 1], rtol=1e-12)
    assert got["adv_corr"]["n"] == nz.sum() and got["adv_corr"]["why"] is None
    np.testing.assert_allclose([got["adv_corr"]["mean_u_pos"], got["adv_corr"]["mean_u_neg"]],
                               [mean_u[adv > 0].mean(), mean_u[adv < 0].mean()], rtol=1e-12)


def test_advantage_correlations_say_why_they_are_undefined():
    from ict_jax.diagnostics.diagnose_advantage import advantage_correlations

    group = np.repeat(np.arange(3), 4)
    truncated = np.array([1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], bool)
    got = advantage_correlations(np.linspace(0, 1, 12), np.zeros(12), group, np.full(12, 128), truncated,
                                 np.ones(12, bool))
    assert got["adv_corr"]["why"] == "no group had responses with different advantages"
    assert got["adv_corr_within"]["why"] == "no group had two responses with different advantages"
    assert got["adv_corr_finished"]["why"] == "no group had two finished responses with different advantages"
    assert got["adv_corr_partial_length"]["why"] == "no group had two responses with different advantages"
    assert all(c["pearson"] is None and c["n"] == 0 for c in got.values())
    # one group with a signal, 1 of its 4 responses finished
    adv = np.array([0, 0, 0, 0, 0.87, -0.87, 0.87, -0.87, 0, 0, 0, 0])
    got = advantage_correlations(np.linspace(0, 1, 12), adv, group, np.full(12, 128), truncated, np.ones(12, bool))
    assert got["adv_corr_within"]["n"] == 4 and got["adv_corr_within"]["pearson"] is not None
    assert not got["adv_corr_partial_length"]["length_varies"]  # every response has the same length
    assert got["adv_corr_partial_length"]["pearson"] == got["adv_corr_within"]["pearson"]
    assert got["adv_corr_finished"]["n"] == 0


def _random_setting(seed: int, p_correct: float = 0.5):
    """A setting's per-token arrays (as a .npz holds them) with random statistics: G = 4, 6 prompts, up to
    24 tokens (a response of 24 is truncated); readings aligned and pooled; ICT, random and all masks."""
    from ict_jax.diagnostics.diagnose import outcome_advantages

    rng = np.random.default_rng(seed)
    G, P, N = 4, 6, 24
    R = G * P
    length = rng.integers(3, N + 1, R)
    valid = np.arange(N)[None] < length[:, None]
    correct = rng.random(R) < p_correct
    forms = ("aligned", "pooled")
    masks = {"ict[aligned]": valid & (rng.random((R, N)) < 0.1), "ict[pooled]": valid & (rng.random((R, N)) < 0.1),
             "random": valid & (rng.random((R, N)) < 0.1), "all": valid.copy()}
    return {"tokens": rng.integers(40, 60, (R, N)), "valid": valid, "logp": np.log(rng.random((R, N))),
            "H1": rng.random((R, N)), "H2": rng.random((R, N)), "pmax": np.ones((R, N)), "truncated": length == N,
            "js": {f: rng.random((R, N)) * (1 + i) for i, f in enumerate(forms)},
            "pbar_tok": {f: 0.5 * rng.random((R, N)) for f in forms}, "masks": masks,
            "reward": correct.astype(float), "correct": correct, "advantage": outcome_advantages(correct, G),
            "group": np.repeat(np.arange(P), G), "texts": [""] * R,
            "timing": {"sample_s": 0.0, "stats_s": 0.0, "score_s": 0.0}, "u_forms": forms, "group_size": G,
            "selector_forms": {"ict[aligned]": "aligned", "ict[pooled]": "pooled", "random": "aligned",
                               "all": "aligned"}}


def _results(settings: dict, seed: int = 0) -> dict:
    """A diagnose.json of ``{name: diagnostics}`` (G 4, T 1.0)."""
    return {"title": "t", "dataset": "x", "prompts": 6, "max_new_tokens": 24, "u_forms": ["aligned", "pooled"],
            "rho": 0.1, "seed": seed, "template": "none", "paper": PAPER,
            "settings": {k: d | {"setting": {"group_size": 4, "temperature": 1.0}} for k, d in settings.items()}}


def test_diagnostics_reports_the_length_controlled_correlations_per_reading():
    """diagnostics() computes mean u over the valid tokens and length = valid tokens per response, per
    reading, from the per-token arrays a setting saves."""
    tok = CharTokenizer()
    data = _random_setting(5)
    d = diagnostics(data, tok)
    truncated, length = data["truncated"], data["valid"].sum(1)
    assert d["truncated"] == int(truncated.sum()) > 0
    adv = np.asarray(data["advantage"], np.float64)
    for f in data["u_forms"]:
        mean_u = np.array([data["js"][f][i, :length[i]].mean() for i in range(len(length))])
        ref = _reference_correlations(mean_u, adv, data["group"], length, truncated)
        for key, (pearson, _, n, k) in ref.items():
            c = d["readings"][f][key]
            assert (c["n"], c["groups"]) == (n, k), (f, key)
            np.testing.assert_allclose(c["pearson"], pearson, rtol=1e-9, err_msg=f"{f} {key}")


def test_report_puts_q_beside_p_and_tabulates_the_advantage_diagnostic():
    tok = CharTokenizer()
    d = diagnostics(_random_setting(5), tok)
    md = format_markdown(_results({"G4_T1": d}))
    summary_head = next(line for line in md.splitlines() if line.startswith("| setting | selection |"))
    assert "| p(o_t) | Q(o_t) |" in summary_head
    q = d["selectors"]["ict[aligned]"]["qtok"]
    assert f"| ICT, u aligned | {d['selectors']['ict[aligned]']['p']['mean']:.2f} ± " in md
    assert f" | {q['mean']:.2f} ± {q['sd']:.2f} | " in md
    assert "It cannot tell the selections apart" in md and "about 1/G for a confident model (0.250 at G = 4)" in md
    assert "### The advantage diagnostic: corr(response mean u, A), length controlled" in md
    for f in ("aligned", "pooled"):
        r = d["readings"][f]
        w, fin, part = r["adv_corr_within"], r["adv_corr_finished"], r["adv_corr_partial_length"]
        row = next(line for line in md.splitlines() if line.startswith(f"| {f} | "))
        assert f"| {w['pearson']:+.2f} / {w['spearman']:+.2f} ({w['n']} in {w['groups']} groups) |" in row
        assert f"| {fin['pearson']:+.2f} / {fin['spearman']:+.2f} ({fin['n']} in {fin['groups']} groups) |" in row
        assert f"| {part['pearson']:+.2f} ({part['n']} in {part['groups']} groups) |" in row


def test_report_says_why_the_advantage_diagnostic_is_na():
    tok = CharTokenizer()
    data = _random_setting(6, p_correct=0.0)  # every response wrong: no group has a signal
    d = diagnostics(data, tok)
    R, t = len(data["truncated"]), int(data["truncated"].sum())
    md = format_markdown(_results({"G4_T1": d}))
    assert (f"- corr(mean u, A) n/a, G4_T1 (aligned, pooled): no group had responses with different advantages "
            f"({t} of {R} responses truncated).") in md
    assert (f"- n/a, within group (aligned, pooled): no group had two responses with different advantages ({t} of "
            f"{R} responses truncated).") in md
    assert "- n/a, finished only (aligned, pooled): no group had two finished responses" in md
    assert "| aligned | n/a (0) | n/a (0 in 0 groups) | n/a (0 in 0 groups) | n/a (0 in 0 groups) |" in md
    assert f"n/a: no group had responses with different advantages ({t} of {R} responses truncated)" in md
    assert "none with A > 0 / none with A < 0" in md
    # a diagnose.json computed before the correlations said why, and before the within-group ones: the
    # reason from the setting's counts, and the table's absence explained
    old = json.loads(json.dumps(d))
    for r in old["readings"].values():
        for key in ("adv_corr_within", "adv_corr_finished", "adv_corr_partial_length"):
            del r[key]
        del r["adv_corr"]["why"]
    del old["truncated"]
    md = format_markdown(_results({"G4_T1": old}))
    assert (f"- corr(mean u, A) n/a, G4_T1 (aligned, pooled): no group had responses with different advantages "
            f"({t} of {R} responses truncated).") in md
    assert "Not in this diagnose.json: `ict-jax diagnose --reanalyse --out DIR` computes it" in md


def _diagnose_seeds():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnose_seeds.py"
    spec = importlib.util.spec_from_file_location("diagnose_seeds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_diagnose_seeds_reports_q_and_the_advantage_correlations(tmp_path, monkeypatch, capsys):
    """benchmarks/diagnose_seeds.py: Q(o_t) beside p(o_t), and per reading the advantage correlations,
    mean ± sd over the seeds with each seed's n / groups; reports without them read as n/a."""
    import statistics

    seeds = _diagnose_seeds()
    tok = CharTokenizer()
    runs = []
    for s in (0, 1):
        out = tmp_path / f"s{s}"
        out.mkdir()
        (out / "diagnose.json").write_text(json.dumps(_results({"G4_T1": diagnostics(_random_setting(10 + s), tok)},
                                                               seed=s)))
        runs.append(out)
    reports = [json.loads((r / "diagnose.json").read_text()) for r in runs]
    summary = seeds.summarise(reports)["G4_T1"]
    per = [r["settings"]["G4_T1"] for r in reports]
    assert summary["selections"]["ict[aligned]"]["qtok"] == [x["selectors"]["ict[aligned]"]["qtok"]["mean"]
                                                             for x in per]
    w = summary["readings"]["aligned"]["adv_corr_within"]
    assert w["pearson"] == [x["readings"]["aligned"]["adv_corr_within"]["pearson"] for x in per]
    assert w["n"] == [x["readings"]["aligned"]["adv_corr_within"]["n"] for x in per]
    q = summary["selections"]["ict[aligned]"]["qtok"]
    assert f"| {statistics.mean(q):.2f} ± {statistics.stdev(q):.2f} |" in seeds.table({"G4_T1": summary}, "m")
    cell = (f"{statistics.mean(w['pearson']):+.2f} ± {statistics.stdev(w['pearson']):.2f} "
            f"(n {w['n'][0]}/{w['groups'][0]}, {w['n'][1]}/{w['groups'][1]})")
    corr = seeds.corr_table({"G4_T1": summary}, "m")
    assert "| m | G 4, T 1.0 | aligned | " in corr and cell in corr
    monkeypatch.setattr("sys.argv", ["diagnose_seeds.py", *map(str, runs), "--label", "m",
                                     "--out", str(tmp_path / "seeds.json")])
    seeds.main()
    printed = capsys.readouterr().out
    assert "| Q(o_t) |" in printed and "| within group |" in printed and cell in printed
    saved = json.loads((tmp_path / "seeds.json").read_text())["summary"]["G4_T1"]
    assert saved["readings"]["pooled"]["adv_corr_partial_length"]["pearson"] == [
        x["readings"]["pooled"]["adv_corr_partial_length"]["pearson"] for x in per]
    # reports without the within-group correlations (diagnose.json before them): n/a, nothing breaks
    for r in reports:
        for rd in r["settings"]["G4_T1"]["readings"].values():
            del rd["adv_corr_within"]
    old = seeds.summarise(reports)
    assert old["G4_T1"]["readings"]["aligned"]["adv_corr_within"]["pearson"] == [None, None]
    assert "| n/a (n ?, ?) |" in seeds.corr_table(old, "m")
