"""The token inspector: which tokens of a group of responses ICT, 20-Entropy and STAPO would train on.

:func:`token_report` samples G responses to one prompt, recomputes every response token's METHOD §1
statistics (logp, H1, H2 and the JS score u against the group-mean distribution) from the model's
hidden states with :func:`ict_jax.stats_from_hidden`, and applies the three METHOD §2 masks to the same
tokens. :func:`render_html` turns the report into one self-contained HTML page (inline CSS and JS, no
external resources): every token coloured by its JS score, outlined when selected, its statistics on
hover, and the ICT / entropy / STAPO masks side by side. ``ict-jax inspect`` does both (docs/inspector.md).

The module imports nothing heavy at import time (the CLI builds its parser from it).
"""

from __future__ import annotations

import argparse
import html
import math
import os
from typing import Any, Callable, Sequence

__all__ = ["token_report", "render_html", "add_inspect_args", "inspect_main"]

_LN2 = math.log(2.0)
_STATS = ("logp", "H1", "H2", "js")
_MASKS = ("ict", "entropy", "stapo")

#: Advantage source recorded in the report when no rewards are given.
ASSUMED_POSITIVE = ("assumed positive: no rewards were given, so every response is treated as having "
                    "A > 0 (STAPO then silences every token it would silence in a correct response)")


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
_STATS_FNS: dict[tuple, Any] = {}  # (graphdef, G, N, T_s, chunk) -> jitted statistics pass


def _token_text(tokenizer: Any, token_id: int) -> str:
    """The decoded text of one token, special tokens kept (``<eos>`` is shown, not dropped)."""
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except TypeError:  # a tokenizer whose decode has no skip_special_tokens
        return tokenizer.decode([int(token_id)])


def token_report(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    num_samples: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    template: str = "none",
    rho_ict: float = 0.1,
    rho_entropy: float = 0.2,
    ict_scope: str = "sequence",
    entropy_scope: str = "batch",
    tau_p: float = 0.002,
    tau_h: float = 0.8,
    rewards: Sequence[float] | Callable[[str], float] | None = None,
    stats_temperature: float | None = None,
    chunk: int = 128,
) -> dict[str, Any]:
    """Sample ``num_samples`` (G) responses to ``prompt`` and compute, for every response token, the
    METHOD §1 statistics and the ICT, 20-Entropy and STAPO masks (METHOD §2).

    - ``template``: how the prompt is wrapped (:func:`ict_jax.format_prompt`: ``"none"`` = as is,
      ``"plain"``, ``"qwen_chat"``).
    - Sampling: :func:`ict_jax.generate` with key ``jax.random.key(seed)``, the tokenizer's EOS ids.
    - Statistics: ``hidden_states`` of prompt + response, shifted so that ``hidden[:, t]`` predicts
      response token t, then :func:`ict_jax.stats_from_hidden` with p = softmax(logits / T_s),
      T_s = ``stats_temperature`` (default: the sampling ``temperature``, as in training).
    - Masks: ``ict_mask(js, rho=rho_ict, scope=ict_scope)``, ``entropy_mask(H1, rho=rho_entropy,
      scope=entropy_scope)`` and ``stapo_mask(logp, H1, A, tau_p, tau_h)`` (1 = kept, 0 = silenced),
      all over this one group (the "mini-batch" of the entropy and STAPO quantiles is the group).
    - STAPO needs advantages: with ``rewards`` (G floats, or a callable ``text -> reward`` applied to
      each decoded response) A = :func:`ict_jax.group_advantages` (scale ``group``); without, every
      response gets A = 1 (``advantage_source`` says so: :data:`ASSUMED_POSITIVE`).

    Returns a dict of plain Python values plus ``arrays`` (numpy, ``[G, N]``): ``tokens``, ``valid``,
    ``logp``, ``H1``, ``H2``, ``js``, ``ict``, ``entropy``, ``stapo``, ``advantages``. ``responses``
    holds one dict per response with ``tokens``: a list of ``{"id", "text", "logp", "H1", "H2", "js",
    "ict", "entropy", "stapo"}`` over its valid positions (the ending EOS included), ``text`` being the
    token decoded on its own with special tokens kept.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ict_jax.data import format_prompt
    from ict_jax.grpo import group_advantages
    from ict_jax.sampler import generate
    from ict_jax.selectors import entropy_mask, ict_mask, stapo_mask, stapo_quantile
    from ict_jax.token_stats import stats_from_hidden

    G = int(num_samples)
    if G < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    t_s = float(temperature if stats_temperature is None else stats_temperature)
    if not t_s > 0:
        raise ValueError(f"the statistics temperature must be > 0, got {t_s}")
    text = format_prompt(prompt, template, tokenizer)
    prompt_ids = [int(i) for i in tokenizer.encode(text)]
    if not prompt_ids:
        raise ValueError("the prompt encodes to zero tokens")
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise ValueError(f"the prompt has token id {max(prompt_ids)} but the model's vocabulary has {vocab} ids")
    Lp, N = len(prompt_ids), int(max_new_tokens)

    ids = np.asarray([prompt_ids], np.int32)
    ro = generate(model, ids, np.ones_like(ids), jax.random.key(int(seed)), num_samples=G, max_new_tokens=N,
                  temperature=float(temperature), eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))
    tokens = np.asarray(ro.tokens, np.int32)
    valid = np.asarray(ro.valid, bool)
    truncated = np.asarray(ro.truncated, bool)

    # prompt + response; hidden[:, Lp - 1 + t] predicts response token t
    full = np.concatenate([np.repeat(ids, G, axis=0), tokens], axis=1)
    full_mask = np.concatenate([np.ones((G, Lp), np.int32), valid.astype(np.int32)], axis=1)
    graphdef, state = nnx.split(model)
    fn_key = (graphdef, G, N, t_s, int(chunk))
    stats_fn = _STATS_FNS.get(fn_key)
    if stats_fn is None:
        @jax.jit
        def stats_fn(state, full, full_mask, tokens, valid):
            m = nnx.merge(graphdef, state)
            h = m.hidden_states(full[:, :-1], full_mask[:, :-1])[:, -N:]
            return stats_from_hidden(h, m.unembedding(), tokens, valid, group_size=G, temperature=t_s, chunk=chunk)

        _STATS_FNS[fn_key] = stats_fn
    st = stats_fn(state, jnp.asarray(full), jnp.asarray(full_mask), jnp.asarray(tokens), jnp.asarray(valid))

    eos = set(int(e) for e in tokenizer.eos_ids)
    texts = [tokenizer.decode([int(t) for t, v in zip(tokens[i], valid[i]) if v and int(t) not in eos])
             for i in range(G)]
    if rewards is None:
        reward_list = None
        adv = jnp.ones((G,), jnp.float32)
        source = ASSUMED_POSITIVE
    else:
        reward_list = [float(rewards(t)) for t in texts] if callable(rewards) else [float(r) for r in rewards]
        if len(reward_list) != G:
            raise ValueError(f"rewards: expected {G} values (one per response), got {len(reward_list)}")
        adv = group_advantages(jnp.asarray(reward_list, jnp.float32), G)
        source = "rewards: A = group_advantages(rewards, G) (METHOD §3, scale 'group')"

    vj = jnp.asarray(valid)
    masks = {
        "ict": ict_mask(st.js, vj, group_size=G, rho=rho_ict, scope=ict_scope),
        "entropy": entropy_mask(st.H1, vj, group_size=G, rho=rho_entropy, scope=entropy_scope),
        "stapo": stapo_mask(st.logp, st.H1, adv, vj, tau_p=tau_p, tau_h=tau_h),
    }
    q = float(stapo_quantile(st.H1, vj, tau_h))
    arrays: dict[str, Any] = {"tokens": tokens, "valid": valid}
    for name in _STATS:
        arrays[name] = np.asarray(getattr(st, name), np.float32)
    for name, m in masks.items():
        arrays[name] = np.asarray(m, np.float32)
    arrays["advantages"] = np.asarray(adv, np.float32)

    responses = []
    for i in range(G):
        n = int(valid[i].sum())
        toks = []
        for t in range(n):
            toks.append({"id": int(tokens[i, t]), "text": _token_text(tokenizer, tokens[i, t]),
                         **{k: float(arrays[k][i, t]) for k in _STATS},
                         **{k: bool(arrays[k][i, t] > 0) for k in _MASKS}})
        responses.append({"index": i, "text": texts[i], "length": n, "truncated": bool(truncated[i]),
                          "reward": None if reward_list is None else reward_list[i],
                          "advantage": float(arrays["advantages"][i]), "tokens": toks})
    n_valid = int(valid.sum())
    ict_sel, ent_sel = arrays["ict"] > 0, arrays["entropy"] > 0
    union = int((ict_sel | ent_sel).sum())
    summary = {
        "valid_tokens": n_valid,
        "ict_selected": int(ict_sel.sum()),
        "entropy_selected": int(ent_sel.sum()),
        "stapo_silenced": int((valid & (arrays["stapo"] <= 0)).sum()),
        "ict_entropy_overlap": int((ict_sel & ent_sel).sum()),
        "ict_entropy_jaccard": (int((ict_sel & ent_sel).sum()) / union) if union else 0.0,
        "stapo_h1_quantile": q if math.isfinite(q) else None,
        **{f"{k}_mean": (float(arrays[k][valid].mean()) if n_valid else 0.0) for k in _STATS},
        "js_max": float(arrays["js"][valid].max()) if n_valid else 0.0,
    }
    settings = dict(num_samples=G, max_new_tokens=N, temperature=float(temperature), stats_temperature=t_s,
                    seed=int(seed), template=template, rho_ict=float(rho_ict), rho_entropy=float(rho_entropy),
                    ict_scope=ict_scope, entropy_scope=entropy_scope, tau_p=float(tau_p), tau_h=float(tau_h))
    return {"prompt": prompt, "prompt_text": text, "prompt_ids": prompt_ids, "settings": settings,
            "advantage_source": source, "responses": responses, "summary": summary, "arrays": arrays}


# ------------------------------------------------------------------------------------------------
# The HTML page
# ------------------------------------------------------------------------------------------------
# JS colour ramp: white -> light orange -> dark red (readable black text throughout)
_RAMP = ((0.0, (255, 255, 255)), (0.5, (253, 204, 138)), (1.0, (227, 74, 51)))


def _colour(x: float) -> str:
    x = min(1.0, max(0.0, x if math.isfinite(x) else 0.0))
    for (a, ca), (b, cb) in zip(_RAMP, _RAMP[1:]):
        if x <= b:
            f = (x - a) / (b - a)
            return "#%02x%02x%02x" % tuple(round(u + f * (v - u)) for u, v in zip(ca, cb))
    return "#%02x%02x%02x" % _RAMP[-1][1]


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 8px}h2{font-size:15px;margin:0 0 6px}
.box{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 12px;margin:0 0 12px}
.prompt{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;background:#f3f3f3;padding:6px}
.legend{display:flex;align-items:center;gap:10px;flex-wrap:wrap}
.ramp{width:220px;height:14px;border:1px solid #999;background:linear-gradient(90deg,%s)}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}
th{background:#f0f0f0}
.resp{background:#fff;border:1px solid #ddd;border-radius:6px;margin:0 0 12px;padding:8px 10px}
.cols{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:10px}
.col{border-top:3px solid #bbb;padding-top:4px}.col h3{font-size:12px;margin:0 0 4px;color:#444}
.col.ict{border-color:#1a5fb4}.col.entropy{border-color:#26a269}.col.stapo{border-color:#c01c28}
.toks{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;line-height:1.9}
.tok{border-radius:2px;padding:0 1px;cursor:default}
.tok.nl::before{content:"\\21B5";color:#888}.tok.empty::before{content:"\\2205";color:#888}
.tok.special{color:#555;font-style:italic}
.ict .tok.sel{outline:2px solid #1a5fb4;outline-offset:0}
.entropy .tok.sel{outline:2px solid #26a269;outline-offset:0}
.stapo .tok.silenced{outline:2px dashed #c01c28;text-decoration:line-through;text-decoration-color:#c01c28}
.tok:hover{outline:2px solid #000 !important}
#info{position:sticky;top:0;z-index:2;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;
 white-space:pre;background:#fffbe6;border:1px solid #e0c97a;padding:4px 8px;min-height:1.4em}
.muted{color:#666;font-size:12px}
"""

_JS = """
(function(){
  var info=document.getElementById('info');
  document.addEventListener('mouseover',function(ev){
    var t=ev.target;
    if(t&&t.classList&&t.classList.contains('tok')){info.textContent=t.getAttribute('title');}
  });
  var ramp=[[0,[255,255,255]],[0.5,[253,204,138]],[1,[227,74,51]]];
  function colour(x){
    if(!isFinite(x))x=0;x=Math.min(1,Math.max(0,x));
    for(var i=1;i<ramp.length;i++){
      if(x<=ramp[i][0]){var a=ramp[i-1],b=ramp[i],f=(x-a[0])/(b[0]-a[0]),c=[];
        for(var k=0;k<3;k++)c.push(Math.round(a[1][k]+f*(b[1][k]-a[1][k])));
        return 'rgb('+c.join(',')+')';}
    }
    return 'rgb(227,74,51)';
  }
  var sel=document.getElementById('colour-by');
  sel.addEventListener('change',function(){
    var key=sel.value,vmax=parseFloat(document.body.getAttribute('data-max-'+key))||1;
    var toks=document.querySelectorAll('.tok');
    for(var i=0;i<toks.length;i++){
      var v=parseFloat(toks[i].getAttribute('data-'+key));
      toks[i].style.background=colour(v/vmax);
    }
    document.getElementById('legend-max').textContent=vmax.toFixed(3);
    document.getElementById('legend-name').textContent=sel.options[sel.selectedIndex].text;
  });
})();
"""


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def render_html(report: dict[str, Any], *, title: str = "ict_jax token inspector") -> str:
    """One self-contained HTML page for a :func:`token_report` (inline CSS and JS, nothing external).

    Every response appears three times side by side, in columns ICT, 20-Entropy and STAPO; each token
    is a ``<span class="tok">`` holding its decoded text (escaped), its background coloured by its JS
    score on a 0 .. max(JS) scale (the legend), ``class="sel"`` (solid outline) where the column's
    method selects it, ``class="silenced"`` (dashed, struck through) where STAPO silences it, and
    logp / p / H1 / H2 / JS / the three masks in its ``title`` (hover) and ``data-*`` attributes. All
    text from the prompt and the model is escaped with :func:`html.escape`; the script only reads
    ``data-*`` numbers and sets colours and ``textContent``.
    """
    s = report["settings"]
    summ = report["summary"]
    maxima = {"js": summ.get("js_max", 0.0)}
    for key in ("H1", "H2"):
        maxima[key] = max((t[key] for r in report["responses"] for t in r["tokens"]), default=0.0)
    maxima["surprisal"] = max((-t["logp"] for r in report["responses"] for t in r["tokens"]), default=0.0)
    maxima = {k: (v if v > 0 else (_LN2 if k == "js" else 1.0)) for k, v in maxima.items()}
    vmax = maxima["js"]
    ramp_css = ",".join(_colour(x / 4) for x in range(5))

    out: list[str] = []
    w = out.append
    w("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">")
    w("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
      "script-src 'unsafe-inline'\">")
    w(f"<title>{_e(title)}</title><style>{_CSS % ramp_css}</style></head>")
    w("<body " + " ".join(f'data-max-{k}="{_fmt(v)}"' for k, v in maxima.items()) + ">")
    w(f"<h1>{_e(title)}</h1>")

    # prompt and settings
    w("<div class=\"box\"><h2>Prompt</h2>")
    w(f"<div class=\"prompt\" id=\"prompt\">{_e(report['prompt'])}</div>")
    if report.get("prompt_text") != report["prompt"]:
        w(f"<div class=\"muted\">as the model sees it (template {_e(s['template'])}):</div>")
        w(f"<div class=\"prompt\">{_e(report['prompt_text'])}</div>")
    w("<p class=\"muted\">" + _e(
        f"G = {s['num_samples']} responses, at most {s['max_new_tokens']} new tokens, temperature "
        f"{s['temperature']} (statistics at T_s = {s['stats_temperature']}), seed {s['seed']}. "
        f"ICT: top {s['rho_ict']:.0%} by JS per {s['ict_scope']}; 20-Entropy: top {s['rho_entropy']:.0%} by H1 "
        f"per {s['entropy_scope']}; STAPO: tau_p = {s['tau_p']}, tau_h = {s['tau_h']}. "
        f"Advantages: {report['advantage_source']}.") + "</p></div>")

    # legend and colouring control
    w("<div class=\"box legend\"><b>Colour:</b> <span id=\"legend-name\">JS(p || group mean)</span> "
      f"<span>0</span><span class=\"ramp\"></span><span id=\"legend-max\">{_fmt(vmax)}</span>")
    w("<label>colour by <select id=\"colour-by\"><option value=\"js\" selected>JS(p || group mean)</option>"
      "<option value=\"H1\">H1 (Shannon)</option><option value=\"H2\">H2 (Renyi-2)</option>"
      "<option value=\"surprisal\">surprisal -logp</option></select></label>")
    w("<span><span class=\"tok\" style=\"outline:2px solid #1a5fb4\">ab</span> selected by ICT</span>"
      "<span><span class=\"tok\" style=\"outline:2px solid #26a269\">ab</span> selected by 20-Entropy</span>"
      "<span><span class=\"tok\" style=\"outline:2px dashed #c01c28;text-decoration:line-through\">ab</span>"
      " silenced by STAPO</span>"
      "<span class=\"muted\">&#8629; newline, &#8709; empty token; hover a token for its statistics</span></div>")

    # summary table
    w("<div class=\"box\"><h2>Summary</h2><table id=\"summary\"><tr><th>response</th><th>tokens</th><th>end</th>"
      "<th>reward</th><th>advantage</th><th>ICT</th><th>entropy</th><th>STAPO silenced</th>"
      "<th>mean JS</th><th>mean H1</th><th>mean H2</th></tr>")
    for r in report["responses"]:
        toks = r["tokens"]
        n = max(1, len(toks))
        w("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            r["index"], r["length"], "truncated" if r["truncated"] else "eos",
            "-" if r["reward"] is None else _fmt(r["reward"]), _fmt(r["advantage"]),
            sum(t["ict"] for t in toks), sum(t["entropy"] for t in toks), sum(not t["stapo"] for t in toks),
            _fmt(sum(t["js"] for t in toks) / n), _fmt(sum(t["H1"] for t in toks) / n),
            _fmt(sum(t["H2"] for t in toks) / n))) + "</tr>")
    w("</table><p class=\"muted\">" + _e(
        f"{summ['valid_tokens']} tokens; ICT selects {summ['ict_selected']}, 20-Entropy "
        f"{summ['entropy_selected']} ({summ['ict_entropy_overlap']} in both, Jaccard "
        f"{summ['ict_entropy_jaccard']:.2f}); STAPO silences {summ['stapo_silenced']} "
        f"(H1 quantile q = {_fmt(summ['stapo_h1_quantile'] if summ['stapo_h1_quantile'] is not None else math.inf)}).") + "</p></div>")
    w("<div id=\"info\">hover a token</div>")

    heads = {"ict": f"ICT: top {s['rho_ict']:.0%} by JS (outlined)",
             "entropy": f"20-Entropy: top {s['rho_entropy']:.0%} by H1 (outlined)",
             "stapo": "STAPO: silenced tokens (dashed, struck through)"}
    for r in report["responses"]:
        toks = r["tokens"]
        spans = {m: [] for m in _MASKS}
        for t_idx, t in enumerate(toks):
            text = t["text"]
            p = math.exp(t["logp"]) if math.isfinite(t["logp"]) else 0.0
            tip = (f"response {r['index']}, token {t_idx}: id {t['id']} {text!r}\n"
                   f"logp {t['logp']:.4f} (p = {p:.4g})   H1 {t['H1']:.4f}   H2 {t['H2']:.4f}   JS {t['js']:.5f}\n"
                   f"ICT {'selected' if t['ict'] else '-'}   entropy {'selected' if t['entropy'] else '-'}   "
                   f"STAPO {'kept' if t['stapo'] else 'silenced'}")
            base = ["tok"]
            if text == "":
                base.append("empty")
            elif "\n" in text:
                base.append("nl")
            if text.startswith("<") and text.endswith(">") and len(text) > 2:
                base.append("special")
            attrs = (f'title="{_e(tip)}" style="background:{_colour(t["js"] / vmax)}" data-i="{t_idx}" '
                     f'data-id="{t["id"]}" data-js="{_fmt(t["js"])}" data-H1="{_fmt(t["H1"])}" '
                     f'data-H2="{_fmt(t["H2"])}" data-surprisal="{_fmt(-t["logp"])}" data-logp="{_fmt(t["logp"])}"')
            for m in _MASKS:
                cls = list(base)
                if m == "stapo":
                    if not t["stapo"]:
                        cls.append("silenced")
                elif t[m]:
                    cls.append("sel")
                spans[m].append(f'<span class="{" ".join(cls)}" {attrs}>{_e(text)}</span>')
        end = "truncated" if r["truncated"] else "eos"
        reward = "" if r["reward"] is None else f", reward {_fmt(r['reward'])}"
        w(f"<section class=\"resp\" id=\"r{r['index']}\" data-index=\"{r['index']}\">")
        line = f"{len(toks)} tokens ({end}){reward}, advantage {_fmt(r['advantage'])}"
        w(f"<h2>response {r['index']}</h2><div class=\"muted\">{_e(line)}</div>")
        w("<div class=\"cols\">")
        for m in _MASKS:
            w(f"<div class=\"col {m}\" data-mask=\"{m}\"><h3>{_e(heads[m])}</h3><div class=\"toks\">"
              + "".join(spans[m]) + "</div></div>")
        w("</div></section>")
    w(f"<script>{_JS}</script></body></html>\n")
    return "".join(out)


# ------------------------------------------------------------------------------------------------
# CLI: ict-jax inspect
# ------------------------------------------------------------------------------------------------
def add_inspect_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a run directory, its checkpoints/ folder or one <step>/ directory (the tokenizer and "
                          "defaults come from the checkpoint's metadata)")
    src.add_argument("--model", metavar="PATH",
                     help="instead of a checkpoint: a Hugging Face directory, a .gguf file or pkg:<package>/<file>")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest finished one)")
    p.add_argument("--tokenizer", default=None, metavar="char|PATH",
                   help="tokenizer instead of the model's / checkpoint's own: 'char' or a tokenizer directory / .gguf")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (one)")
    p.add_argument("-n", "--num-samples", type=int, default=8, metavar="G", help="responses (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="default: the checkpoint config's rollout.max_new_tokens, else 64")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling and statistics temperature (default: the checkpoint config's, else 1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampler seed (default 0)")
    p.add_argument("--template", default=None, choices=("none", "plain", "qwen_chat"),
                   help="prompt template (default: the checkpoint config's data.template, else none)")
    p.add_argument("--rho-ict", type=float, default=0.1, metavar="RHO", help="ICT fraction (default 0.1)")
    p.add_argument("--rho-entropy", type=float, default=0.2, metavar="RHO", help="20-Entropy fraction (default 0.2)")
    p.add_argument("--tau-p", type=float, default=None, help="STAPO probability threshold (default: config's, else 0.002)")
    p.add_argument("--tau-h", type=float, default=None, help="STAPO entropy quantile (default: config's, else 0.8)")
    p.add_argument("--rewards", default=None, metavar="R1,R2,...",
                   help="G comma-separated rewards, one per response, for STAPO's advantages (default: all "
                        "responses treated as positive-advantage)")
    p.add_argument("--out", default="inspect.html", metavar="PAGE.html", help="output page (default inspect.html)")


def _cfg_get(cfg: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get(k)
    return cfg


def inspect_main(args: argparse.Namespace) -> int:
    from ict_jax.checkpoint import load_params_from_checkpoint
    from ict_jax.loading import load_model_and_tokenizer, load_tokenizer_spec

    cfg: dict[str, Any] = {}
    if args.checkpoint is not None:
        model, meta = load_params_from_checkpoint(args.checkpoint, args.step)
        spec = args.tokenizer or meta.get("tokenizer")
        if not spec:
            raise ValueError(f"{args.checkpoint}: the checkpoint names no tokenizer; pass --tokenizer char|PATH")
        tok = load_tokenizer_spec(spec)
        cfg = meta.get("config") or {}
        where = f"checkpoint {args.checkpoint} (step {meta.get('step')})"
    else:
        if args.step is not None:
            raise ValueError("--step needs --checkpoint")
        model, tok = load_model_and_tokenizer(args.model, tokenizer=args.tokenizer)
        where = args.model

    def pick(value: Any, *keys: str, default: Any) -> Any:
        if value is not None:
            return value
        found = _cfg_get(cfg, *keys)
        return default if found is None else found

    rewards = None
    if args.rewards is not None:
        try:
            rewards = [float(x) for x in args.rewards.split(",")]
        except ValueError:
            raise ValueError(f"--rewards {args.rewards!r}: expected comma-separated numbers") from None
    if args.num_samples < 1:
        raise ValueError(f"-n/--num-samples must be >= 1, got {args.num_samples}")
    report = token_report(
        model, tok, args.prompt, num_samples=args.num_samples,
        max_new_tokens=int(pick(args.max_new_tokens, "rollout", "max_new_tokens", default=64)),
        temperature=float(pick(args.temperature, "rollout", "temperature", default=1.0)), seed=args.seed,
        template=str(pick(args.template, "data", "template", default="none")), rho_ict=args.rho_ict,
        rho_entropy=args.rho_entropy, tau_p=float(pick(args.tau_p, "rl", "selector", "tau_p", default=0.002)),
        tau_h=float(pick(args.tau_h, "rl", "selector", "tau_h", default=0.8)), rewards=rewards,
        stats_temperature=_cfg_get(cfg, "stats", "temperature"))  # None: the sampling temperature
    page = render_html(report, title=f"ict_jax token inspector: {where}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(out)
    return 0
