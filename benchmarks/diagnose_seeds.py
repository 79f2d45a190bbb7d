"""The paper's token diagnostics over seeds: mean ± sd of ``ict-jax diagnose`` reports of one model.

    python benchmarks/diagnose_seeds.py runs/diagnose_q05_s0 runs/diagnose_q05_s1 --label "Qwen2.5-Coder-0.5B" \
        --out benchmarks/results/diagnose_q05.json

Each folder is one ``ict-jax diagnose --out`` (its ``diagnose.json``), the same data set and settings at
another ``--seed``. Per setting (G, T) and selection (ICT under each reading of u, 20-Entropy, random 10 %,
all tokens) the first table gives, as mean ± sd over the seeds (each seed's number is over its selected
tokens): p(o_t) of the selected tokens and beside it Q(o_t), the compared distribution's mass on the same
token (about 1/G for every selection under ``aligned`` and ``literal`` once a group has diverged, about 0
under ``loo`` and ``pooled``: it cannot tell selections apart), the median high/low-entropy ratio (the
paper's ~1.0), the forking tokens selected (summed), u at its ceiling (the share of valid tokens within
5 % of the largest u their position allows, per reading) and the tie share (ICT's selected tokens that the
tie rule decided; docs/statistics.md "u at its ceiling, and ties"), then the most frequent selected tokens
of the first seed. The second table gives per setting and reading the advantage diagnostic
(:mod:`ict_jax.diagnostics.diagnose_advantage`): the Pearson correlation of a response's mean u with its
advantage over the responses with A ≠ 0, within groups, over finished responses only and given the
response length, mean ± sd over the seeds that define it, with each seed's responses / groups; a
correlation no seed defines is n/a, with the first seed's reason under the table. Prints both markdown
tables and writes the numbers as JSON (per selection ``p``, ``qtok``, ...; per reading ``adv_corr``,
``adv_corr_within``, ``adv_corr_finished``, ``adv_corr_partial_length``, each ``{pearson, spearman, n,
groups, why}`` lists over seeds, None where a seed's diagnose.json lacks it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SELECTIONS = ("ict[aligned]", "ict[loo]", "ict[literal]", "ict[pooled]", "entropy", "random", "all")
NAMES = {"entropy": "20-Entropy", "random": "random 10 %", "all": "all tokens"}
#: The advantage correlations of a reading (ict_jax.diagnostics.diagnose_advantage) and their columns.
ADVANTAGE = {"adv_corr": "A ≠ 0 responses", "adv_corr_within": "within group", "adv_corr_finished": "finished only",
             "adv_corr_partial_length": "partial on length"}


def _ms(xs: list[float | None], fmt: str = ".2f") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt)}"


def summarise(reports: list[dict]) -> dict:
    """{setting: {"setting": what it was (label, accuracy, ...), "selections": {selection: {metric: [one value
    per seed]}}, "readings": {reading: {correlation: {pearson, spearman, n, groups, why: [one per seed]}}}}}
    from the seeds' diagnose.json."""
    settings = list(reports[0]["settings"])
    for r in reports[1:]:
        if list(r["settings"]) != settings or r["dataset"] != reports[0]["dataset"]:
            raise SystemExit("the reports differ in data set or settings: not seeds of one run")
    out: dict = {}
    for name in settings:
        per_seed = [r["settings"][name] for r in reports]
        selections = {}
        for sel in SELECTIONS:
            rows = [s["selectors"].get(sel) for s in per_seed]
            if any(x is None for x in rows):
                continue
            form = sel[4:-1] if sel.startswith("ict[") else None
            selections[sel] = {
                "p": [x["p"]["mean"] for x in rows],
                "qtok": [x["qtok"]["mean"] for x in rows],
                "h_ratio_median": [x.get("h_ratio_median") for x in rows],
                "forks_selected": [x.get("forks_selected") for x in rows],
                "forks": [x.get("forks") for x in rows],
                "u_at_ceiling": [s["readings"][form]["u"].get("u_at_ceiling") for s in per_seed] if form else [],
                "tie_share": [x.get("tie_share") for x in rows] if form else [],
                "top_selected": [t[0] for t in rows[0].get("top_selected", [])[:5]],
            }
        setting = {k: [s[k] for s in per_seed] for k in ("accuracy", "truncated_frac", "valid_tokens")}
        setting["label"] = "G {group_size}, T {temperature}".format(**per_seed[0]["setting"])
        forms = [f for f in reports[0]["u_forms"] if all(f in s["readings"] for s in per_seed)]
        readings = {f: {key: _per_seed([s["readings"][f].get(key) for s in per_seed]) for key in ADVANTAGE}
                    for f in forms}
        out[name] = {"setting": setting, "selections": selections, "readings": readings}
    return out


def _per_seed(corrs: list[dict | None]) -> dict:
    """{pearson, spearman, n, groups, why: [one per seed]} of one correlation (None where a seed lacks it)."""
    return {k: [None if c is None else c.get(k) for c in corrs] for k in ("pearson", "spearman", "n", "groups", "why")}


def table(summary: dict, label: str) -> str:
    lines = ["| model | setting | selection | p(o_t) | Q(o_t) | H-ratio (median) | forks selected | u at ceiling | "
             "tie share | most frequent selected (first seed) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in summary.values():
        shown = entry["setting"]["label"]
        for sel, m in entry["selections"].items():
            forks = (f"{sum(x or 0 for x in m['forks_selected'])}/{sum(x or 0 for x in m['forks'])}"
                     if any(m["forks"]) else "")
            top = " ".join(json.dumps(t, ensure_ascii=False) for t in m["top_selected"])
            what = f"ICT, u {sel[4:-1]}" if sel.startswith("ict[") else NAMES.get(sel, sel)
            lines.append(f"| {label} | {shown} | {what} | {_ms(m['p'])} | {_ms(m.get('qtok', []))} | "
                         f"{_ms(m['h_ratio_median'])} | {forks} | "
                         f"{_ms(m['u_at_ceiling']) if m['u_at_ceiling'] else ''} | "
                         f"{_ms(m['tie_share']) if m['tie_share'] else ''} | {top} |")
    return "\n".join(lines)


def _corr_cell(c: dict) -> str:
    """Pearson mean ± sd over the seeds that define it (how many, when not all), then responses / groups per
    seed."""
    defined = [x for x in c["pearson"] if x is not None]
    seeds = "" if len(defined) in (0, len(c["pearson"])) else f" ({len(defined)} of {len(c['pearson'])} seeds)"
    n = ", ".join("?" if k is None else (f"{k}" if g is None else f"{k}/{g}") for k, g in zip(c["n"], c["groups"]))
    if not defined:
        return f"n/a (n {n})"
    sd = f" ± {statistics.stdev(defined):.2f}" if len(defined) > 1 else ""
    return f"{statistics.mean(defined):+.2f}{sd}{seeds} (n {n})"


def corr_table(summary: dict, label: str) -> str:
    """Per setting and reading: the advantage correlations (Pearson, mean ± sd over seeds; n = responses /
    groups per seed), then each n/a's reason (the first seed's) once."""
    lines = ["| model | setting | reading | " + " | ".join(ADVANTAGE.values()) + " |",
             "|---|---|---|" + "---|" * len(ADVANTAGE)]
    why: dict[str, list[str]] = {}
    for entry in summary.values():
        shown = entry["setting"]["label"]
        for form, r in entry.get("readings", {}).items():
            lines.append(f"| {label} | {shown} | {form} | " + " | ".join(_corr_cell(r[k]) for k in ADVANTAGE) + " |")
            for key, col in ADVANTAGE.items():
                reason = next((w for w in r[key]["why"] if w), None)
                if all(x is None for x in r[key]["pearson"]) and reason:
                    why.setdefault(f"{shown}, {col}: {reason}", []).append(form)
    return "\n".join(lines + ([""] + [f"- n/a, {k} ({', '.join(fs)})" for k, fs in why.items()] if why else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="diagnose output folders, one per seed")
    ap.add_argument("--label", default="", help="the model's name in the table")
    ap.add_argument("--out", help="write the numbers as JSON here")
    args = ap.parse_args()
    reports = [json.loads((Path(d) / "diagnose.json").read_text()) for d in args.runs]
    summary = summarise(reports)
    label = args.label or reports[0].get("title", "")
    print(table(summary, label))
    print()
    print(corr_table(summary, label))
    for name, entry in summary.items():
        s = entry["setting"]
        print(f"{name}: accuracy {s['accuracy']}, truncated {s['truncated_frac']}, valid tokens {s['valid_tokens']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": args.runs, "seeds": [r["seed"] for r in reports],
                                              "dataset": reports[0]["dataset"], "summary": summary}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
