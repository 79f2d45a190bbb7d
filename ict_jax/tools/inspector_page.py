"""The token inspector's page (:mod:`ict_jax.tools.inspector`): :func:`render_html` turns a
:func:`ict_jax.token_report` into one self-contained HTML page (inline CSS and JS, no external
resources), every token coloured by its JS score, outlined when selected, its statistics on hover, and
the ICT / entropy / STAPO masks side by side. Standard library only."""

from __future__ import annotations

import html
import math
from typing import Any

_LN2 = math.log(2.0)
#: The masks a report holds, in page order.
MASKS = ("ict", "entropy", "stapo")


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
        spans = {m: [] for m in MASKS}
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
            for m in MASKS:
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
        for m in MASKS:
            w(f"<div class=\"col {m}\" data-mask=\"{m}\"><h3>{_e(heads[m])}</h3><div class=\"toks\">"
              + "".join(spans[m]) + "</div></div>")
        w("</div></section>")
    w(f"<script>{_JS}</script></body></html>\n")
    return "".join(out)
