"""``ict-jax inspect``: an HTML page of a group's tokens coloured by their statistics, with the masks of
the selectors (:mod:`ict_jax.diagnostics.inspector`)."""

from __future__ import annotations

import argparse
import os
import typing
from typing import Any

from ict_jax.config import Scope, SelectorSection

_DEFAULT = SelectorSection()  # the selector of a --model (no checkpoint): ict_jax.config's defaults


def add_inspect_args(p: argparse.ArgumentParser) -> None:
    from ict_jax.data.templates import TEMPLATES

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="a run directory, its checkpoints/ folder or one <step>/ directory (the tokenizer and "
                          "defaults come from the checkpoint's metadata)")
    src.add_argument("--model", metavar="PATH",
                     help="instead of a checkpoint: a Hugging Face directory, a .gguf file, pkg:<package>/<file>, "
                          "a real model split over packages (qwen2.5-coder-0.5b-instruct, pkg:<prefix>), "
                          "a training run directory (its last checkpoint, else its sft_model) or preset:<name>")
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
    p.add_argument("--template", default=None, choices=TEMPLATES,
                   help="prompt template (default: the checkpoint config's data.template, else none)")
    # the parser builds without JAX, so the registry's numbers are not read here: docs/method.md §2 has them
    own = "(default: the checkpoint's rl.selector.{key} when the run trained {who}, else {value}'s registered one)"
    p.add_argument("--rho-ict", type=float, default=None, metavar="RHO",
                   help="ICT fraction " + own.format(key="rho", who="ict or random", value="ict"))
    p.add_argument("--rho-entropy", type=float, default=None, metavar="RHO", help="20-Entropy fraction "
                   + own.format(key="rho", who="entropy", value="entropy"))
    p.add_argument("--ict-scope", default=None, choices=typing.get_args(Scope), help="ICT candidate sets "
                   + own.format(key="scope", who="ict or random", value="ict"))
    p.add_argument("--entropy-scope", default=None, choices=typing.get_args(Scope), help="20-Entropy candidate sets "
                   + own.format(key="scope", who="entropy", value="entropy"))
    p.add_argument("--tau-p", type=float, default=None,
                   help=f"STAPO probability threshold (default: the checkpoint's, else {_DEFAULT.tau_p})")
    p.add_argument("--tau-h", type=float, default=None,
                   help=f"STAPO entropy quantile (default: the checkpoint's, else {_DEFAULT.tau_h})")
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
    from ict_jax.diagnostics.inspector import checkpoint_selector, token_report
    from ict_jax.diagnostics.inspector_page import render_html
    from ict_jax.outputs import check_output_file
    from ict_jax.train.model_source import resolve_model

    check_output_file(args.out, "--out")  # before the model loads
    cfg: dict[str, Any] = {}
    meta: dict[str, Any] | None = None
    if args.checkpoint is not None:  # the checkpoint's own settings are the page's defaults
        source = resolve_model(args.checkpoint, step=args.step, tokenizer=args.tokenizer, checkpoint=True)
        meta = source.meta
        cfg = meta.get("config") or {}
        where = f"checkpoint {args.checkpoint} (step {source.step})"
    else:
        if args.step is not None:
            raise ValueError("--step needs --checkpoint")
        source = resolve_model(args.model, tokenizer=args.tokenizer)
        where = source.where
    tok = source.tokenizer()  # before the weights: a model without one fails at once
    model = source.load()

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
        template=str(pick(args.template, "data", "template", default="none")),
        selector=checkpoint_selector(meta),  # the run's method, rho, scope, tau_p, tau_h (defaults: no checkpoint)
        rho_ict=args.rho_ict, rho_entropy=args.rho_entropy, ict_scope=args.ict_scope,
        entropy_scope=args.entropy_scope, tau_p=args.tau_p, tau_h=args.tau_h, rewards=rewards,
        stats_temperature=_cfg_get(cfg, "stats", "temperature"),  # None: the sampling temperature
        u_form=_cfg_get(cfg, "stats", "u_form"))  # the run's reading of u (None: the config default)
    page = render_html(report, title=f"ict_jax token inspector: {where}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    print(out)
    return 0
