"""The report of ``ict-jax diagnose``: a summary table over settings (p(o_t) with Q(o_t) beside it), then per
setting a Markdown table with the paper's column beside every reading of u, the advantage diagnostic
(plain, within groups, finished only, partial on length, n beside each), every selector and what it reaches
(shares of its tokens that are EOS, after the group's shortest response, truncated, with A < 0; its share of
each 16-token bin); a cell that cannot be computed says why. One figure per setting (sorted-u curves, u and
selection against position).

Reads the plain dict that :func:`ict_jax.diagnostics.diagnose.run_diagnose` builds (also ``diagnose.json``), so
a report can be rebuilt from the JSON alone: ``format_markdown(json.load(open("diagnose.json")))``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ict_jax.diagnostics.diagnose_measures import POSITION_BIN

__all__ = ["format_markdown", "format_summary", "plot_setting"]


def _num(x: Any, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _msd(s: Mapping[str, Any] | None, none: str = "no token selected") -> str:
    """``mean ± sd (median m)``; ``n/a (none)`` without tokens."""
    if not s or s.get("mean") is None:
        return f"n/a ({none})"
    return f"{s['mean']:.3f} ± {s['sd']:.3f} (med {s['median']:.3f})"


def _tok(text: str) -> str:
    """A token as a quoted, escaped string safe inside a Markdown table cell."""
    return json.dumps(text, ensure_ascii=False).replace("|", "\\|")


def _tokens(items: list, k: int = 8) -> str:
    return " ".join(f"{_tok(t)}×{c}" for t, c, _ in items[:k]) or "none"


def _corr(c: Mapping[str, Any], d: Mapping[str, Any]) -> str:
    """The plain corr(mean u, A): ``Pearson / Spearman (n responses)``, or n/a and why."""
    if c.get("pearson") is None:
        return f"n/a: {_adv_why(c, d)}"
    return f"{c['pearson']:+.2f} / {c['spearman']:+.2f} ({c['n']} responses)"


def _adv_why(c: Mapping[str, Any], d: Mapping[str, Any]) -> str:
    """Why an advantage correlation is undefined (its ``why``; from the setting's counts in a diagnose.json
    whose correlations carry none), and how many responses were truncated (no answer) when any were or
    nothing was left to correlate."""
    truncated = d.get("truncated", round(d["truncated_frac"] * d["responses"]))
    why = c.get("why") or ("no group had responses with different advantages" if d.get("groups_with_signal") == 0
                           else f"{c.get('n', 0)} responses with A ≠ 0")
    return why + (f" ({truncated} of {d['responses']} responses truncated)" if truncated or not c.get("n") else "")


def _h_ratio(ratio: float | None, counts: list[int]) -> str:
    """The high/low-entropy ratio; n/a with the counts when no selected token is at or below the threshold."""
    if ratio is None:
        return f"n/a ({counts[0]}:0, none selected at or below)"
    return f"{ratio:.2f}"


def _tie(s: Mapping[str, Any]) -> str:
    """A top-k selector's tie share; n/a and why."""
    if s.get("tie_share") is not None:
        return f"{s['tie_share']:.2f}"
    return "n/a (no token selected)" if not s["selected"] else "n/a (arrays saved without the tie record)"


#: ICT's selection under ``rl.selector.ties: all`` in a reading (diagnostics.diagnose.ict_all_name; the report
#: reads diagnose.json alone, so the name is written here too).
def _ict_all(form: str) -> str:
    return f"ict[{form},ties=all]"


def _ties_all_cell(sel: Mapping[str, Any], form: str) -> str:
    """ICT under ties: all in ``form``: selected tokens (% of valid) · the share the tie at the cut decided."""
    s = sel.get(_ict_all(form))
    if s is None:
        return "n/a (not in this diagnose.json: --reanalyse adds it)"
    return f"{s['selected']} ({100 * s['selected_frac']:.1f} %) · {_tie(s)}"


def _mean_u_by_sign(c: Mapping[str, Any]) -> str:
    pos, neg = c.get("mean_u_pos"), c.get("mean_u_neg")
    return (f"{_num(pos) if pos is not None else 'none with A > 0'} / "
            f"{_num(neg) if neg is not None else 'none with A < 0'}")


def _ict_table(d: Mapping[str, Any], paper: Mapping[str, Any], forms: list[str]) -> list[str]:
    sel, rd = d["selectors"], d["readings"]
    cols = [f"ict[{f}]" for f in forms] + ["random", "all"]
    head = ["diagnostic", "paper (Qwen2.5, GSM8K / MATH)"] + [
        c.replace("ict[", "ICT, u ").replace("]", "") if c.startswith("ict[") else
        ("random 10 %" if c == "random" else "all tokens") for c in cols]
    rows = [
        ["p(o_t) mean ± sd (median)", f"{paper['p_mean']} ± {paper['p_sd']}"] + [_msd(sel[c]["p"]) for c in cols],
        ["purity β = Σ p² mean ± sd (median)", "(0.18 ± 0.09 may be this)"] + [_msd(sel[c]["beta"]) for c in cols],
        ["max_v p mean ± sd (median)", "(or this)"] + [_msd(sel[c]["pmax"]) for c in cols],
        ["Q(o_t): the compared distribution's mass on o_t", "(or this)"] + [_msd(sel[c]["qtok"]) for c in cols],
        ["high/low-entropy ratio (median of H1)", " / ".join(map(str, paper["h_ratio_median"]))]
        + [_h_ratio(sel[c]["h_ratio_median"], sel[c]["h_counts_median"]) for c in cols],
        ["high/low-entropy ratio (top-20 % of H1); share in top 20 %", "not given (0.25; 0.20 if entropy-blind)"]
        + [f"{_h_ratio(sel[c]['h_ratio_top20'], sel[c]['h_counts_top20'])}; {sel[c]['top20_share']:.2f}"
           for c in cols],
        ["sorted u: elbow E (slope 2-10 % / 10-30 %; 1 = straight) · knee", paper["elbow"]]
        + [_elbow(rd[f]["sorted_u"]) for f in forms] + ["", ""],
        ["u: mean · p90 · max · share u = 0 · share at its ceiling (u_at_ceiling)", ""]
        + [f"{_num(rd[f]['u']['mean'])} · {_num(rd[f]['u']['p90'])} · {_num(rd[f]['u']['max'])} · "
           f"{_num(rd[f]['u']['zero_share'], '.2f')} · {_num(rd[f]['u'].get('u_at_ceiling'), '.2f')}" for f in forms]
        + ["", ""],
        ["ties = position (exactly k): selected tokens decided by the tie rule (share)", "not given"]
        + [_tie(sel[c]) if c.startswith("ict[") else "" for c in cols],
        ["ties = all (every token tied at the cut kept): selected tokens (% of valid) · share in the tie at "
         "the cut", "M = 1[u >= Percentile(u, 90)]"]
        + [_ties_all_cell(sel, f) for f in forms] + ["", ""],
        ["mean u by position (bins of 16 tokens, every other bin)", ""]
        + [" ".join(_num(x, ".2f") for x in rd[f]["u_by_position"][::2]) for f in forms] + ["", ""],
        ["selected share by position (same bins)", "not given"]
        + [" ".join(_num(x, ".2f") for x in sel[c]["selected_by_position"][::2]) for c in cols],
        ["corr(response mean u, A): Pearson / Spearman", paper["adv_corr"]]
        + [_corr(rd[f]["adv_corr"], d) for f in forms] + ["", ""],
        ["mean u of A > 0 / A < 0 responses", ""] + [_mean_u_by_sign(rd[f]["adv_corr"]) for f in forms] + ["", ""],
        ["forking tokens selected", "not given"] + [f"{sel[c]['forks_selected']} of {sel[c]['forks']}" for c in cols],
        ["selected tokens (% of valid)", "10 %"] + [f"{sel[c]['selected']} ({100 * sel[c]['selected_frac']:.1f} %)"
                                                   for c in cols],
        ["most frequent selected", "content words (\"remainder\", \"duck\", \"seventh\")"]
        + [_tokens(sel[c]["top_selected"]) for c in cols],
        ["most frequent unselected", "\"####\", \"the\", \"is\""] + [_tokens(sel[c]["top_unselected"]) for c in cols],
    ]
    return _table(head, rows)


def _elbow(s: Mapping[str, Any]) -> str:
    if s.get("E") is None:
        n = s.get("responses", 0)
        return f"n/a ({f'u = 0 in all {n} responses of >= 20 tokens' if n else 'no response of >= 20 tokens'})"
    return (f"E {s['E']:.2f} (per response med {_num(s['E_response_median'], '.2f')}) · knee {_knee(s['knee'])} "
            f"({s['responses']} responses)")


def _knee(knee: float | None) -> str:
    return "none (never below its chord)" if knee is None else f"{knee:.2f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _others_table(d: Mapping[str, Any], forms: list[str]) -> list[str]:
    sel = d["selectors"]
    names = [n for n in sel if not n.startswith("ict[")]
    head = ["selector", "selected (% of valid)", "responses left with none", "p(o_t) mean ± sd (median)", "β mean",
            "Q(o_t) mean", "H-ratio (median; high:low counts)", "top-20 % share", "forks selected", "tie share",
            "most frequent selected"]
    rows = [[n, f"{s['selected']} ({100 * s['selected_frac']:.1f} %)", str(s["rows_without_selected"]), _msd(s["p"]),
             _num(s["beta"]["mean"]), _num(s["qtok"]["mean"]),
             f"{_num(s['h_ratio_median'], '.2f')} ({s['h_counts_median'][0]}:{s['h_counts_median'][1]})",
             f"{s['top20_share']:.2f}", f"{s['forks_selected']} of {s['forks']}",
             _num(s.get("tie_share"), ".2f") if s.get("tie_share") is not None else "", _tokens(s["top_selected"], 6)]
            for n, s in ((n, sel[n]) for n in names)]
    return _table(head, rows)


#: The shares of a selector's tokens that ``reach`` holds (ict_jax.rl.coverage, docs/method.md §5) and
#: their columns in the report.
REACH_COLUMNS = {"selected_eos_frac": "EOS", "selected_after_shortest_frac": "after the group's shortest",
                 "selected_truncated_frac": "on truncated responses", "selected_neg_adv_frac": "with A < 0"}


def _reach_table(d: Mapping[str, Any]) -> list[str]:
    """Per selector: the shares of its selected tokens that are EOS, after the group's shortest response, on
    truncated responses and with A < 0, then its share of every 16-token bin's valid tokens."""
    sel = d["selectors"]
    if any("reach" not in s for s in sel.values()):
        return ["Not in this diagnose.json: `ict-jax diagnose --reanalyse --out DIR` computes it from the saved "
                "per-token arrays."]
    head = ["selector", "selected (% of valid)"] + [f"share {c}" for c in REACH_COLUMNS.values()] + [
        f"selected share of each bin's valid tokens (bins of {POSITION_BIN} from t = 0; - = no valid token)"]
    rows = [[n, f"{s['selected']} ({100 * s['selected_frac']:.1f} %)"]
            + [_num(s["reach"][k], ".2f") for k in REACH_COLUMNS]
            + [" ".join("-" if x is None else format(x, ".2f") for x in s["selected_by_position"])]
            for n, s in sel.items()]
    return _table(head, rows)


def _ms(stat: Mapping[str, Any] | None) -> str:
    if not stat or stat.get("mean") is None:
        return "n/a (none selected)"
    return f"{stat['mean']:.2f} ± {stat['sd']:.2f}"


#: The advantage measures of a reading (ict_jax.diagnostics.diagnose_advantage) and their columns in the report.
ADVANTAGE_COLUMNS = {"adv_corr_within": "within group", "adv_corr_finished": "finished only",
                     "adv_corr_partial_length": "partial on length"}


def _adv_cell(c: Mapping[str, Any]) -> str:
    """``Pearson / Spearman (n in k groups)``; Pearson alone for the partial correlation, n alone for the
    plain correlation (no groups)."""
    n = f"{c['n']}" + (f" in {c['groups']} groups" if "groups" in c else "")
    if c["pearson"] is None:
        return f"n/a ({n})"
    r = f"{c['pearson']:+.2f}" + (f" / {c['spearman']:+.2f}" if "spearman" in c else "")
    return f"{r} ({n}{'' if c.get('length_varies', True) else '; length constant within groups'})"


def _advantage_table(d: Mapping[str, Any], forms: list[str]) -> list[str]:
    """Per reading: corr(mean u, A) within groups, over finished responses, and given the response length
    (n beside each), then why a cell is n/a (each reason once, with the readings it holds for)."""
    rd = d["readings"]
    if any(key not in rd[f] for f in forms for key in ADVANTAGE_COLUMNS):
        return ["Not in this diagnose.json: `ict-jax diagnose --reanalyse --out DIR` computes it from the saved "
                "per-token arrays."]
    head = ["reading", "all responses with A ≠ 0: Pearson / Spearman (n)"] + [
        f"{col}: Pearson{' / Spearman' if key != 'adv_corr_partial_length' else ''} (n)"
        for key, col in ADVANTAGE_COLUMNS.items()]
    rows = [[f] + [_adv_cell(rd[f][key]) for key in ("adv_corr", *ADVANTAGE_COLUMNS)] for f in forms]
    why: dict[tuple[str, str], list[str]] = {}
    for f in forms:
        for key, col in {"adv_corr": "all responses", **ADVANTAGE_COLUMNS}.items():
            c = rd[f][key]
            if c.get("pearson") is None:
                why.setdefault((col, _adv_why(c, d)), []).append(f)
    notes = [f"- n/a, {col} ({', '.join(fs)}): {reason}." for (col, reason), fs in why.items()]
    return _table(head, rows) + ([""] + notes if notes else [])


def format_summary(results: Mapping[str, Any], label: str = "") -> list[str]:
    """One table over every setting: per reading, ICT's selected tokens against the paper's numbers
    (mean ± sd over tokens), then the random 10 % and all tokens as references."""
    forms = list(results["u_forms"])
    paper = results["paper"]
    head = ["setting", "selection", "p(o_t)", "Q(o_t)", "β = Σ p²", "max p", "H-ratio (median)", "top-20 % share",
            "elbow E · knee", "u at ceiling · tie share (position / all)", "forks selected", "corr(mean u, A)",
            "most frequent selected"]
    rows = [[label or "paper", "ICT (Qwen2.5, GSM8K / MATH)", f"{paper['p_mean']} ± {paper['p_sd']}", "?", "?", "?",
             " / ".join(map(str, paper["h_ratio_median"])), "", "sharp, near 10 %", "?", "", "positive",
             "content words"]]
    for name, d in results["settings"].items():
        sel, rd = d["selectors"], d["readings"]
        for c in [f"ict[{f}]" for f in forms] + ["random", "all"]:
            s = sel[c]
            form = c[4:-1] if c.startswith("ict[") else None
            el = rd[form]["sorted_u"] if form else None
            corr = rd[form]["adv_corr"] if form else None
            rows.append([
                name, f"ICT, u {form}" if form else ("random 10 %" if c == "random" else "all tokens"),
                _ms(s["p"]), _ms(s["qtok"]), _ms(s["beta"]), _ms(s["pmax"]),
                _h_ratio(s["h_ratio_median"], s["h_counts_median"]), f"{s['top20_share']:.2f}",
                (f"{_num(el['E'], '.2f')} · {'none' if el['knee'] is None else format(el['knee'], '.2f')}"
                 if el else ""),
                (f"{_num(rd[form]['u'].get('u_at_ceiling'), '.2f')} · {_num(s.get('tie_share'), '.2f')} / "
                 f"{_num(sel.get(_ict_all(form), {}).get('tie_share'), '.2f')}" if form else ""),
                f"{s['forks_selected']}/{s['forks']}",
                ("n/a" if not corr or corr.get("pearson") is None else f"{corr['pearson']:+.2f}"),
                _tokens(s["top_selected"], 5)])
    return _table(head, rows)


#: What the advantage table of a setting shows (ict_jax.diagnostics.diagnose_advantage).
ADVANTAGE_INTRO = (
    "A point is a response: its mean u over its valid tokens and its advantage A (from correctness). All "
    "responses: over the responses with A ≠ 0. Within group: both less their group's mean, over the groups with "
    "two responses whose A differ. Finished only: the same over the responses that were not truncated (a group "
    "counts with two finished responses whose A differ). Partial on length: the within-group mean u and A each "
    "less their least-squares fit on the within-group length (valid tokens), then correlated. n: responses "
    "(in groups).")


#: What the reach table of a setting shows (ict_jax.rl.coverage, docs/statistics.md).
REACH_INTRO = (
    "Shares of each selector's selected tokens: the response's EOS (its last token, in a response that was not "
    "truncated); at or past the position just after the group's shortest response's last token (t >= the shortest "
    "length: fewer than G responses still running, where u's ceiling is lower); in responses cut at the length "
    "limit; in responses with A < 0. Then, per bin of positions, the share of the bin's valid tokens selected.")


def _summary_notes(results: Mapping[str, Any]) -> list[str]:
    """Under the summary table: why Q(o_t) cannot tell the selections apart, and why a cell is n/a."""
    gs = sorted({int(d["setting"]["group_size"]) for d in results["settings"].values()})
    inv = ", ".join(f"{1 / g:.3f} at G = {g}" for g in gs)
    out = ["Q(o_t) sits beside p(o_t) because the paper's 0.18 ± 0.09 may be either. It cannot tell the "
           "selections apart: once a group's responses have diverged, the other responses put little mass on a "
           "response's own token at its position, so Q(o_t) is about the response's own p(o_t) / G, about 1/G for a "
           "confident model" + (f" ({inv})" if inv else "") + ", under `aligned` and `literal` for every selector, "
           "the random 10 % included (`aligned` divides by the responses still running: a little more late in a "
           "response); under `loo` (the response itself left out) and `pooled` (the group's mass spread over all "
           "its positions) it is about 0 for every selector."]
    notes = []
    for name, d in results["settings"].items():
        forms = [f for f in results["u_forms"] if d["readings"][f]["adv_corr"].get("pearson") is None]
        if forms:
            notes.append(f"- corr(mean u, A) n/a, {name} ({', '.join(forms)}): "
                         f"{_adv_why(d['readings'][forms[0]]['adv_corr'], d)}.")
    if any(s["h_ratio_median"] is None for d in results["settings"].values() for s in d["selectors"].values()):
        notes.append("- H-ratio n/a (h:0): none of the selected tokens has H1 at or below the median (h above it).")
    readings = [r for d in results["settings"].values() for r in d["readings"].values()]
    if any(r["sorted_u"].get("E") is None for r in readings):
        notes.append("- elbow E n/a: no response has 20 tokens or more, or u is 0 throughout every one that has.")
    if any(r["sorted_u"].get("E") is not None and r["sorted_u"].get("knee") is None for r in readings):
        notes.append("- knee none: the mean sorted-u curve is nowhere below its chord (no elbow).")
    if any(s.get("tie_share") is None for d in results["settings"].values()
           for n, s in d["selectors"].items() if n.startswith("ict[")):
        notes.append("- tie share n/a: no token selected, or per-token arrays saved without the tie record.")
    return out + ([""] + notes if notes else [])


def format_markdown(results: Mapping[str, Any]) -> str:
    """The report: the summary over settings and its notes (Q(o_t), why a cell is n/a), then per setting
    ICT's selected tokens under every reading beside the paper's numbers, the advantage diagnostic, every
    other selector, what each selector reaches, and two responses with ICT's tokens in brackets."""
    forms = list(results["u_forms"])
    paper = results["paper"]
    intro = (f"Data {results['dataset']}, {results['prompts']} prompts, up to {results['max_new_tokens']} new "
             f"tokens, rho {results['rho']}, template {results['template']}, seed {results['seed']}."
             + (f" Every prompt is the question followed by the instruction \"{results['instruction']}\"."
                if results.get("instruction") else "")
             + " Readings of u: "
             f"{', '.join(forms)} (docs/method.md §1). The paper's column: Qwen2.5 on GSM8K / MATH "
             "(docs/method.md §5).")
    out = [f"# Token diagnostics{': ' + results['title'] if results.get('title') else ''}", "", intro, "",
           "## Summary (mean ± sd over the selected tokens)", ""]
    out += format_summary(results)
    out += [""] + _summary_notes(results) + [""]
    for name, d in results["settings"].items():
        t = d["timing"]
        head = (f"{d['groups']} prompts x G = {d['setting']['group_size']} at T = {d['setting']['temperature']}: "
                f"accuracy {d['accuracy']:.3f}, {d['groups_with_signal']} of {d['groups']} groups with A ≠ 0 "
                f"(A from correctness), mean length {d['length_mean']:.0f} tokens ({100 * d['truncated_frac']:.0f} % "
                f"truncated), {d['valid_tokens']} tokens; p(o_t) of all tokens {_msd(d['p_all'])}; median H1 "
                f"{d['H1_median']:.3f}. Wall {d.get('wall_s') or 0:.0f} s (sampling {t['sample_s']:.0f} s, statistics "
                f"and masks {t['stats_s']:.0f} s, rewards {t['score_s']:.0f} s).")
        out += [f"## {name}", "", head, "",
                "### ICT's selected tokens, by reading of u", ""]
        out += _ict_table(d, paper, forms)
        out += ["", "### The advantage diagnostic: corr(response mean u, A), length controlled", "",
                ADVANTAGE_INTRO, ""]
        out += _advantage_table(d, forms)
        out += ["", "### Every selector", ""]
        out += _others_table(d, forms)
        out += ["", "### What each selector reaches", "", REACH_INTRO, ""]
        out += _reach_table(d)
        out += ["", f"### Two responses, ICT's tokens (u {forms[0]}) in brackets", ""]
        for ex in d.get("examples", []):
            out += ["```", f"{'correct' if ex.get('correct') else 'wrong'} (reward {ex['reward']:g}): {ex['marked']}",
                    "```"]
        out.append("")
    return "\n".join(out) + "\n"


def position_steps(bins: list[int], values: list[float | None], width: int = POSITION_BIN) -> tuple[list, list]:
    """(edges, values) drawing binned means as what they are: one flat step over each bin
    ``[start, start + width)``, a gap (NaN) where a bin has no token. Joining bin means by lines would
    draw a trend between bins that was never measured (two bins gave one slanted line)."""
    edges = [*bins, (bins[-1] + width) if bins else width]
    return edges, [float("nan") if v is None else float(v) for v in values]


def plot_setting(d: Mapping[str, Any], path: str | Path, title: str = "") -> None:
    """Three panels: the mean normalised sorted-u curve per reading; mean u against position per reading;
    the selected share against position for ICT under each reading, 20-Entropy and random."""
    import matplotlib  # plots only (matplotlib is heavy and optional on this path)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.4))
    for form, r in d["readings"].items():
        s = r["sorted_u"]
        if s["curve"] is not None:
            ax[0].plot(s["grid"], s["curve"], label=f"{form} (E {s['E']:.2f})")
        if d["position_bins"]:
            ax[1].stairs(*reversed(position_steps(d["position_bins"], r["u_by_position"])), label=form)
    ax[0].axvline(0.1, color="grey", linestyle=":", linewidth=1)
    ax[0].set(title="sorted u / max u, mean over responses", xlabel="rank fraction", ylabel="u / max u")
    ax[1].set(title=f"mean u against position (bins of {POSITION_BIN})", xlabel="response position", ylabel="u")
    for name, s in d["selectors"].items():
        if (name.startswith("ict[") and "," not in name) or name in ("entropy", "random"):
            if d["position_bins"]:
                ax[2].stairs(*reversed(position_steps(d["position_bins"], s["selected_by_position"])), label=name)
    ax[2].set(title=f"selected share against position (bins of {POSITION_BIN})", xlabel="response position",
              ylabel="share selected")
    for a in ax:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
