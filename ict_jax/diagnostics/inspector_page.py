"""The token inspector's page (:mod:`ict_jax.diagnostics.inspector`): :func:`render_html` turns a
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


def _pct(rho: float) -> str:
    """A fraction as a percentage, exact to 4 decimals of rho: 0.05 -> '5%', 0.025 -> '2.5%'."""
    return f"{rho * 100:.4g}%"


def _maxima(report: dict[str, Any]) -> dict[str, float]:
    """The top of each colour scale (JS, H1, H2, surprisal) over the page's tokens; never 0."""
    toks = [t for r in report["responses"] for t in r["tokens"]]
    maxima = {"js": report["summary"].get("js_max", 0.0),
              "H1": max((t["H1"] for t in toks), default=0.0), "H2": max((t["H2"] for t in toks), default=0.0),
              "surprisal": max((-t["logp"] for t in toks), default=0.0)}
    return {k: (v if v > 0 else (_LN2 if k == "js" else 1.0)) for k, v in maxima.items()}


def _column_heads(s: dict[str, Any]) -> dict[str, str]:
    return {"ict": f"ICT: top {_pct(s['rho_ict'])} by JS per {s['ict_scope']} (outlined)",
            "entropy": f"20-Entropy: top {_pct(s['rho_entropy'])} by H1 per {s['entropy_scope']} (outlined)",
            "stapo": "STAPO: silenced tokens (dashed, struck through)"}


def _prompt_box(report: dict[str, Any]) -> str:
    """The prompt (as typed, and as the model sees it) and the settings: sampling, the run's selector,
    each column's parameters, the advantages' source."""
    s = report["settings"]
    out = ["<div class=\"box\"><h2>Prompt</h2>", f"<div class=\"prompt\" id=\"prompt\">{_e(report['prompt'])}</div>"]
    if report.get("prompt_text") != report["prompt"]:
        out.append(f"<div class=\"muted\">as the model sees it (template {_e(s['template'])}):</div>")
        out.append(f"<div class=\"prompt\">{_e(report['prompt_text'])}</div>")
    run = s.get("run_selector")
    run_text = "" if run is None else (
        f"rl.selector: method {run['method']}"
        + (f", rho = {run['rho']:g} ({_pct(run['rho'])}), scope {run['scope']}" if run["rho"] is not None else "")
        + f", tau_p = {run['tau_p']}, tau_h = {run['tau_h']}. ")
    out.append("<p class=\"muted\" id=\"settings\">" + _e(
        f"G = {s['num_samples']} responses, at most {s['max_new_tokens']} new tokens, temperature "
        f"{s['temperature']} (statistics at T_s = {s['stats_temperature']}), seed {s['seed']}. " + run_text
        + f"ICT: top {_pct(s['rho_ict'])} (rho = {s['rho_ict']:g}) by JS per {s['ict_scope']}; 20-Entropy: top "
        f"{_pct(s['rho_entropy'])} (rho = {s['rho_entropy']:g}) by H1 per {s['entropy_scope']}; STAPO: tau_p = "
        f"{s['tau_p']}, tau_h = {s['tau_h']} over {s.get('stapo_quantile_over', 'valid')} tokens. Advantages: "
        f"{report['advantage_source']}.") + "</p></div>")
    return "".join(out)


def _legend_box(vmax: float) -> str:
    return ("<div class=\"box legend\"><b>Colour:</b> <span id=\"legend-name\">JS(p || group mean)</span> "
            f"<span>0</span><span class=\"ramp\"></span><span id=\"legend-max\">{_fmt(vmax)}</span>"
            "<label>colour by <select id=\"colour-by\"><option value=\"js\" selected>JS(p || group mean)</option>"
            "<option value=\"H1\">H1 (Shannon)</option><option value=\"H2\">H2 (Renyi-2)</option>"
            "<option value=\"surprisal\">surprisal -logp</option></select></label>"
            "<span><span class=\"tok\" style=\"outline:2px solid #1a5fb4\">ab</span> selected by ICT</span>"
            "<span><span class=\"tok\" style=\"outline:2px solid #26a269\">ab</span> selected by 20-Entropy</span>"
            "<span><span class=\"tok\" style=\"outline:2px dashed #c01c28;text-decoration:line-through\">ab</span>"
            " silenced by STAPO</span>"
            "<span class=\"muted\">&#8629; newline, &#8709; empty token; hover a token for its statistics</span></div>")


def _summary_box(report: dict[str, Any]) -> str:
    """Per response: length, end, reward, advantage, selected / silenced counts, mean statistics; totals."""
    summ = report["summary"]
    out = [("<div class=\"box\"><h2>Summary</h2><table id=\"summary\"><tr><th>response</th><th>tokens</th>"
            "<th>end</th><th>reward</th><th>advantage</th><th>ICT</th><th>entropy</th><th>STAPO silenced</th>"
            "<th>mean JS</th><th>mean H1</th><th>mean H2</th></tr>")]
    for r in report["responses"]:
        toks = r["tokens"]
        n = max(1, len(toks))
        out.append("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            r["index"], r["length"], "truncated" if r["truncated"] else "eos",
            "-" if r["reward"] is None else _fmt(r["reward"]), _fmt(r["advantage"]),
            sum(t["ict"] for t in toks), sum(t["entropy"] for t in toks), sum(not t["stapo"] for t in toks),
            _fmt(sum(t["js"] for t in toks) / n), _fmt(sum(t["H1"] for t in toks) / n),
            _fmt(sum(t["H2"] for t in toks) / n))) + "</tr>")
    q = summ["stapo_h1_quantile"] if summ["stapo_h1_quantile"] is not None else math.inf
    out.append("</table><p class=\"muted\">" + _e(
        f"{summ['valid_tokens']} tokens; ICT selects {summ['ict_selected']}, 20-Entropy "
        f"{summ['entropy_selected']} ({summ['ict_entropy_overlap']} in both, Jaccard "
        f"{summ['ict_entropy_jaccard']:.2f}); STAPO silences {summ['stapo_silenced']} "
        f"(H1 quantile q = {_fmt(q)}).") + "</p></div>")
    return "".join(out)


def _token_spans(r: dict[str, Any], t_idx: int, t: dict[str, Any], vmax: float) -> dict[str, str]:
    """One token's ``<span>`` in each mask column: text escaped, JS colour, statistics in title / data-*."""
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
    spans = {}
    for m in MASKS:
        cls = list(base)
        if m == "stapo":
            if not t["stapo"]:
                cls.append("silenced")
        elif t[m]:
            cls.append("sel")
        spans[m] = f'<span class="{" ".join(cls)}" {attrs}>{_e(text)}</span>'
    return spans


def _response_section(r: dict[str, Any], heads: dict[str, str], vmax: float) -> str:
    """One response: its header line and its tokens three times, one column per mask."""
    toks = r["tokens"]
    spans: dict[str, list[str]] = {m: [] for m in MASKS}
    for t_idx, t in enumerate(toks):
        for m, span in _token_spans(r, t_idx, t, vmax).items():
            spans[m].append(span)
    end = "truncated" if r["truncated"] else "eos"
    reward = "" if r["reward"] is None else f", reward {_fmt(r['reward'])}"
    line = f"{len(toks)} tokens ({end}){reward}, advantage {_fmt(r['advantage'])}"
    out = [f"<section class=\"resp\" id=\"r{r['index']}\" data-index=\"{r['index']}\">",
           f"<h2>response {r['index']}</h2><div class=\"muted\">{_e(line)}</div>", "<div class=\"cols\">"]
    for m in MASKS:
        out.append(f"<div class=\"col {m}\" data-mask=\"{m}\"><h3>{_e(heads[m])}</h3><div class=\"toks\">"
                   + "".join(spans[m]) + "</div></div>")
    out.append("</div></section>")
    return "".join(out)


def render_html(report: dict[str, Any], *, title: str = "ict_jax token inspector") -> str:
    """One self-contained HTML page for a :func:`token_report` (inline CSS and JS, nothing external).

    Every response appears three times side by side, in columns ICT, 20-Entropy and STAPO; each token
    is a ``<span class="tok">`` holding its decoded text (escaped), its background coloured by its JS
    score on a 0 .. max(JS) scale (the legend), ``class="sel"`` (solid outline) where the column's
    method selects it, ``class="silenced"`` (dashed, struck through) where STAPO silences it, and
    logp / p / H1 / H2 / JS / the three masks in its ``title`` (hover) and ``data-*`` attributes. The
    settings paragraph states the inspected run's selector and each column's rho, scope and tau. All
    text from the prompt and the model is escaped with :func:`html.escape`; the script only reads
    ``data-*`` numbers and sets colours and ``textContent``.
    """
    maxima = _maxima(report)
    vmax = maxima["js"]
    ramp_css = ",".join(_colour(x / 4) for x in range(5))
    heads = _column_heads(report["settings"])
    out = ["<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
           ("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "script-src 'unsafe-inline'\">"),
           f"<title>{_e(title)}</title><style>{_CSS % ramp_css}</style></head>",
           "<body " + " ".join(f'data-max-{k}="{_fmt(v)}"' for k, v in maxima.items()) + ">",
           f"<h1>{_e(title)}</h1>", _prompt_box(report), _legend_box(vmax), _summary_box(report),
           "<div id=\"info\">hover a token</div>"]
    out += [_response_section(r, heads, vmax) for r in report["responses"]]
    out.append(f"<script>{_JS}</script></body></html>\n")
    return "".join(out)
