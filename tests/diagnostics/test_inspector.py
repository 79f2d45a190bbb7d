"""The token inspector (ict_jax.diagnostics.inspector): the report's statistics and masks, the HTML page's
structure and escaping, the `ict-jax inspect` command, and (slow) a headless-Chromium screenshot."""

from __future__ import annotations

import math
import shutil
import subprocess
from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ict_jax
from ict_jax.config import SelectorSection
from ict_jax.config_load import load_config
from ict_jax.diagnostics.inspector import ASSUMED_POSITIVE, checkpoint_selector, column_selectors, token_report
from ict_jax.diagnostics.inspector_page import render_html
from ict_jax.rl.selectors import resolved_rho, resolved_scope

G, N = 4, 12
PROMPT = "12+34=<script>alert('x')</script>&amp;"


@pytest.fixture(scope="module")
def tiny(tiny_model, char_tokenizer):  # the session's tiny model (conftest.py): vocabulary 100, seed 0
    return tiny_model, char_tokenizer


@pytest.fixture(scope="module")
def report(tiny):
    model, tok = tiny
    return token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=N, temperature=1.0, seed=0)


class _Page(HTMLParser):
    """Collects, per response section and mask column, the tokens' text, classes and attributes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict]] = []
        self.cols: dict[tuple[int, str], list[dict]] = {}
        self.scripts: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self._tok: dict | None = None
        self._in_script = False

    def _ctx(self, key: str) -> str | None:
        for _tag, a in reversed(self.stack):
            if key in a:
                return a[key]
        return None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script":
            self._in_script = True
            self.scripts.append("")
        if tag == "span" and "tok" in (a.get("class") or "").split():
            idx, mask = self._ctx("data-index"), self._ctx("data-mask")
            if idx is not None and mask is not None:
                self._tok = {"text": "", "class": a["class"].split(), **a}
                self.cols.setdefault((int(idx), mask), []).append(self._tok)
        if tag not in ("meta", "br", "input"):
            self.stack.append((tag, a))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False
        if tag == "span":
            self._tok = None
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data
        elif self._tok is not None:
            self._tok["text"] += data


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    return p


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
def test_statistics_equal_the_full_logits_reference(tiny, report):
    model, tok = tiny
    a = report["arrays"]
    ids = np.asarray([report["prompt_ids"]], np.int32)
    assert report["prompt_ids"] == tok.encode(PROMPT)
    full = np.concatenate([np.repeat(ids, G, 0), a["tokens"]], 1)
    mask = np.concatenate([np.ones((G, ids.shape[1]), np.int32), a["valid"].astype(np.int32)], 1)

    @jax.jit
    def reference(full, mask, tokens, valid):  # the full [G, N, V] logits, the plain path
        logits = model(full[:, :-1], mask[:, :-1])[:, -N:]
        return ict_jax.stats_from_logits(logits, tokens, valid, group_size=G)

    ref = reference(full, mask, a["tokens"], a["valid"])
    for name in ("logp", "H1", "H2", "js"):
        np.testing.assert_allclose(a[name], np.asarray(getattr(ref, name)), rtol=1e-5, atol=2e-6, err_msg=name)
    # a random model's group does diverge: JS is not all 0 (identical prefixes give 0 at t = 0 only)
    assert a["js"][:, 1:][a["valid"][:, 1:]].max() > 0
    np.testing.assert_array_equal(a["js"][:, 0], 0.0)
    assert a["valid"].shape == (G, N) and a["tokens"].shape == (G, N)


def test_masks_follow_method_section_2(report):
    a = report["arrays"]
    valid = a["valid"]
    vj = jnp.asarray(valid)
    np.testing.assert_array_equal(a["ict"], np.asarray(ict_jax.ict_mask(jnp.asarray(a["js"]), vj, rho=0.1)))
    np.testing.assert_array_equal(a["entropy"], np.asarray(ict_jax.entropy_mask(jnp.asarray(a["H1"]), vj, rho=0.2)))
    np.testing.assert_array_equal(a["stapo"], np.asarray(ict_jax.stapo_mask(
        jnp.asarray(a["logp"]), jnp.asarray(a["H1"]), jnp.ones(G), vj, tau_p=0.002, tau_h=0.75,
        quantile_over="low_prob_positive")))
    for i in range(G):  # ICT per response: k = max(1, ceil(0.1 n)), the highest JS
        n = int(valid[i].sum())
        assert a["ict"][i].sum() == max(1, math.ceil(0.1 * n))
        sel = a["js"][i][a["ict"][i] > 0]
        rest = a["js"][i][(a["ict"][i] == 0) & valid[i]]
        assert sel.min() >= rest.max()
    assert a["entropy"].sum() == max(1, math.ceil(0.2 * valid.sum()))  # global over the group
    assert np.all(a["ict"] <= valid) and np.all(a["entropy"] <= valid) and np.all(a["stapo"] <= valid)
    assert report["advantage_source"] == ASSUMED_POSITIVE
    np.testing.assert_array_equal(a["advantages"], 1.0)
    # the per-token lists mirror the arrays
    for r in report["responses"]:
        i, n = r["index"], r["length"]
        assert n == int(valid[i].sum()) and len(r["tokens"]) == n
        assert [t["id"] for t in r["tokens"]] == a["tokens"][i, :n].tolist()
        assert [t["ict"] for t in r["tokens"]] == (a["ict"][i, :n] > 0).tolist()
        assert [t["stapo"] for t in r["tokens"]] == (a["stapo"][i, :n] > 0).tolist()


def test_rewards_give_stapo_its_advantages(tiny):
    model, tok = tiny
    rewards = [1.0, 0.0, 1.0, 0.0]
    r = token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=N, seed=0, rewards=rewards,
                     tau_p=0.999, tau_h=1.0)  # p < 0.999 everywhere: silence every H1 below the max
    a = r["arrays"]
    np.testing.assert_allclose(a["advantages"], np.asarray(ict_jax.group_advantages(jnp.asarray(rewards), G)))
    assert [x["reward"] for x in r["responses"]] == rewards
    # STAPO's default reading: the quantile over the low-probability tokens of positive-advantage responses
    cand = a["valid"] & (a["advantages"] > 0)[:, None] & (np.exp(a["logp"]) < 0.999)
    q = a["H1"][cand].max()
    for i in range(G):
        v = a["valid"][i]
        silenced = v & (a["stapo"][i] == 0)
        if rewards[i] > 0:
            np.testing.assert_array_equal(silenced, v & (a["H1"][i] < q))
            assert silenced.any()
        else:  # A < 0: STAPO never silences
            assert not silenced.any()
    # a callable reward is applied to each decoded response
    r2 = token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=N, seed=0,
                      rewards=lambda text: float(len(text) % 2))
    assert [x["reward"] for x in r2["responses"]] == [float(len(x["text"]) % 2) for x in r2["responses"]]
    with pytest.raises(ValueError, match="expected 4 values"):
        token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=N, rewards=[1.0, 0.0])


def test_columns_take_the_runs_selector_settings():
    defaults = column_selectors()
    assert [(c.method, resolved_rho(c), resolved_scope(c)) for c in defaults.values()] == [
        ("ict", 0.1, "sequence"), ("entropy", 0.2, "batch"), ("stapo", None, None)]
    assert all(c.warmup_steps == 0 and (c.tau_p, c.resolved_tau_h, c.stapo_quantile_over) == (0.002, 0.75, "low_prob_positive")
               for c in defaults.values())
    # the run's own method takes its rho and scope; the others keep their defaults; tau from the run
    cols = column_selectors(SelectorSection(method="entropy", rho=0.3, scope="sequence", tau_p=0.01, tau_h=0.5))
    assert (resolved_rho(cols["entropy"]), resolved_scope(cols["entropy"])) == (0.3, "sequence")
    assert (resolved_rho(cols["ict"]), resolved_scope(cols["ict"])) == (0.1, "sequence")
    assert (cols["stapo"].tau_p, cols["stapo"].tau_h) == (0.01, 0.5)
    # random keeps ICT's counts, so its run shows in the ICT column; arguments override the run
    assert resolved_rho(column_selectors(SelectorSection(method="random", rho=0.05))["ict"]) == 0.05
    cols = column_selectors(SelectorSection(rho=0.05, scope="group"), rho_ict=0.25, entropy_scope="group", tau_h=0.7)
    assert (resolved_rho(cols["ict"]), resolved_scope(cols["ict"])) == (0.25, "group")
    assert resolved_scope(cols["entropy"]) == "group" and cols["stapo"].tau_h == 0.7
    # a checkpoint's saved config gives back its selector section; no checkpoint gives the defaults
    cfg = load_config(None, ["rl.selector.method=random", "rl.selector.rho=0.05", "rl.selector.scope=batch"])
    assert checkpoint_selector({"config": cfg.to_dict()}) == cfg.rl.selector
    assert checkpoint_selector(None) == checkpoint_selector({"config": {}}) == SelectorSection()


def test_report_selects_with_the_runs_rho_and_scope(tiny):
    model, tok = tiny
    r = token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=N, seed=0,
                     selector=SelectorSection(method="ict", rho=0.25, scope="group"))
    a, vj = r["arrays"], jnp.asarray(r["arrays"]["valid"])
    np.testing.assert_array_equal(a["ict"], np.asarray(ict_jax.ict_mask(
        jnp.asarray(a["js"]), vj, group_size=G, rho=0.25, scope="group")))
    np.testing.assert_array_equal(a["entropy"], np.asarray(ict_jax.entropy_mask(jnp.asarray(a["H1"]), vj, rho=0.2)))
    s = r["settings"]
    assert (s["rho_ict"], s["ict_scope"], s["rho_entropy"], s["entropy_scope"]) == (0.25, "group", 0.2, "batch")
    assert s["run_selector"] == {"method": "ict", "rho": 0.25, "scope": "group", "tau_p": 0.002, "tau_h": 0.75,
                                 "stapo_quantile_over": "low_prob_positive"}


# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------
def test_html_holds_every_token_the_three_masks_and_hover_data(report):
    page = render_html(report)
    p = _parse(page)
    assert page.startswith("<!DOCTYPE html>")
    for r in report["responses"]:
        for mask in ("ict", "entropy", "stapo"):
            spans = p.cols[(r["index"], mask)]
            assert [s["text"] for s in spans] == [t["text"] for t in r["tokens"]], (r["index"], mask)
            for s, t in zip(spans, r["tokens"]):
                if mask == "stapo":
                    assert ("silenced" in s["class"]) == (not t["stapo"])
                else:
                    assert ("sel" in s["class"]) == t[mask]
                for key, name in (("js", "JS"), ("H1", "H1"), ("H2", "H2"), ("logp", "logp")):
                    assert f"{name} {t[key]:.4f}" in s["title"] or f"{name} {t[key]:.5f}" in s["title"]
                    assert math.isclose(float(s[f"data-{key.lower()}"]), t[key], rel_tol=1e-3, abs_tol=1e-6)
                assert s["style"].startswith("background:#")
    assert len(p.cols) == 3 * G
    # the colour encodes JS: the largest score gets the darkest colour of the legend's ramp
    best = max((t for r in report["responses"] for t in r["tokens"]), key=lambda t: t["js"])
    assert "background:#e34a33\" data-i" in page or best["js"] == 0
    # self-contained: no external resource of any kind
    for tag, a in p.tags:
        for k in ("src", "href"):
            assert k not in a, (tag, a)
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert len(p.scripts) == 1 and "innerHTML" not in p.scripts[0]


def test_untrusted_text_is_escaped(report):
    page = render_html(report)
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;amp;" in page
    p = _parse(page)
    assert sum(tag == "script" for tag, _ in p.tags) == 1
    # model output is escaped too: a response holding '<', '>' or '&' never opens a tag
    hostile = {**report, "responses": [dict(report["responses"][0], tokens=[
        dict(report["responses"][0]["tokens"][0], text='<img src=x onerror="alert(1)">'),
        dict(report["responses"][0]["tokens"][0], text="\n"),
        dict(report["responses"][0]["tokens"][0], text="")])]}
    page = render_html(hostile)
    assert "<img" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    p = _parse(page)
    assert not any(tag == "img" for tag, _ in p.tags)
    spans = p.cols[(0, "ict")]
    assert [s["text"] for s in spans] == ['<img src=x onerror="alert(1)">', "\n", ""]
    assert "nl" in spans[1]["class"] and "empty" in spans[2]["class"]


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_cli_inspect_from_a_checkpoint_and_an_hf_dir(tiny, tiny_hf_dir, tmp_path, capsys):
    from ict_jax.cli.main import main
    from ict_jax.rl.state import init_train_state
    from ict_jax.train.checkpoints import Checkpointer

    model, _ = tiny
    cfg = load_config(None, ["rollout.max_new_tokens=12", "rollout.num_samples=4", "data.template=none"])
    with Checkpointer(tmp_path / "run" / "checkpoints", async_save=False) as ck:
        ck.save(3, init_train_state(cfg, model), {"tokenizer": "char", "config": cfg.to_dict()})
    out = tmp_path / "page.html"
    assert main(["inspect", "--checkpoint", str(tmp_path / "run"), "--prompt", PROMPT, "-n", "4",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    p = _parse(out.read_text())
    assert {k[1] for k in p.cols} == {"ict", "entropy", "stapo"} and len(p.cols) == 12
    assert "step 3" in out.read_text()

    out2 = tmp_path / "sub" / "page2.html"  # the same model saved as a HF directory (conftest.py)
    assert main(["inspect", "--model", str(tiny_hf_dir), "--tokenizer", "char", "--prompt", PROMPT, "-n", "4",
                 "--max-new-tokens", "12", "--rewards", "1,0,0,1", "--out", str(out2)]) == 0
    assert "reward" in out2.read_text() and out2.exists()

    # user errors: one line, exit 2
    capsys.readouterr()
    assert main(["inspect", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ict-jax inspect: error:") and err.count("\n") == 1
    assert main(["inspect", "--model", str(tiny_hf_dir), "--tokenizer", "char", "--prompt", PROMPT, "-n", "4",
                 "--max-new-tokens", "12", "--rewards", "1,x", "--out", str(out2)]) == 2
    assert "--rewards" in capsys.readouterr().err


@pytest.mark.e2e  # a run then the CLI (11 s)
def test_cli_inspects_a_run_at_the_rho_it_trained_with(tmp_path, capsys):
    """A run trained at rl.selector.rho=0.05 is shown at 5 %, not at ICT's default 10 % (the page used to
    take temperature and STAPO's thresholds from the checkpoint, but not rho, scope or the method)."""
    from ict_jax.cli.main import main
    from ict_jax.train.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(None, [  # the shortest run there is: one RL step of a tiny model, no warm start
        "model.preset=tiny", "model.tokenizer=char", "rollout.num_samples=4", "train.prompts_per_step=4",
        "rollout.max_new_tokens=4", "rollout.max_prompt_len=8", "data.train=[\"arith?digits=1&size=16\"]",
        "data.eval=[]", "data.template=none", "stats.chunk=4", "rl.reward.workers=1", "train.steps=1",
        "train.save_every=1", "rl.selector.rho=0.05", f"run_dir={run}", "mesh.data=-1", "mesh.tensor=2"])
    with Trainer(cfg, progress=False) as t:
        t.train()
    out = tmp_path / "page.html"
    assert main(["inspect", "--checkpoint", str(run), "--prompt", "3+4=", "-n", "4", "--max-new-tokens", "40",
                 "--out", str(out)]) == 0
    page = out.read_text()
    p = _parse(page)
    lengths = []
    for i in range(4):  # ICT keeps k = max(1, ceil(0.05 n)) tokens of each response of n tokens
        spans = p.cols[(i, "ict")]
        n = len(spans)
        lengths.append(n)
        assert sum("sel" in s["class"] for s in spans) == max(1, (n + 19) // 20), (i, n)
    assert any(n > 10 for n in lengths), lengths  # where 5 % and 10 % keep different counts
    total = sum(lengths)  # 20-Entropy (not the run's method) keeps its default: 20 % of the group
    assert sum("sel" in s["class"] for i in range(4) for s in p.cols[(i, "entropy")]) == max(1, (total + 4) // 5)
    assert "rl.selector: method ict, rho = 0.05 (5%), scope sequence" in page
    assert "ICT: top 5% by JS per sequence" in page and "20-Entropy: top 20% by H1 per batch" in page
    # a flag still overrides the checkpoint
    assert main(["inspect", "--checkpoint", str(run), "--prompt", "3+4=", "-n", "4", "--max-new-tokens", "40",
                 "--rho-ict", "0.5", "--out", str(out)]) == 0
    p = _parse(out.read_text())
    assert all(sum("sel" in s["class"] for s in p.cols[(i, "ict")]) == max(1, (n + 1) // 2)
               for i, n in enumerate(lengths))


# ------------------------------------------------------------------------------------------------
# Headless Chromium (slow)
# ------------------------------------------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.slow
def test_page_renders_in_headless_chromium(report, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    from PIL import Image

    page = tmp_path / "page.html"
    page.write_text(render_html(report), encoding="utf-8")
    png = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1200,900",
           page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    img = np.asarray(Image.open(png).convert("RGB"), np.float32)
    assert img.shape == (900, 1200, 3)
    assert img.std() > 10, "the screenshot is blank"
    # the token colours made it to the screen: some pixels are the ramp's orange/red
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    assert ((r > 200) & (g < 215) & (b < 160)).sum() > 200
