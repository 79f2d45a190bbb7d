"""``ict-jax eval``: pass@k of a model on benchmarks (docs/method.md §6), end to end.

    ict-jax eval --model PATH [--benchmarks math500,gsm8k_test,...] [--data-dir DIR] [--n 4] [--k 1,4]
                 [--temperature 0.6] [--top-p 0.95] [--max-new-tokens 1024] [--max-prompt-len 1024]
                 [--batch-size 8] [--limit N] [--template qwen_chat|plain|none] [--out DIR] [--workers 2]
                 [--seed 0] [--mesh DATA,FSDP,TENSOR] [--tokenizer char|PATH] [--skip-overlong]

Loads the benchmarks first (bad names and missing files fail before the model loads), templates every
prompt with the instruction of its scorer, checks prompt lengths up front, then samples with
:func:`ict_jax.make_text_generator` and scores with :func:`ict_jax.evaluate_benchmarks`. Writes
``{out}/eval.json`` (results, settings, per-benchmark ``skipped_overlong``) and ``{out}/eval_samples.jsonl``.
docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re


def _csv(kind: type):
    def parse(text: str) -> list:
        try:
            items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None
        if not items:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        return items

    return parse


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from ict_jax.data.datasets import PAPER_BENCHMARKS
    from ict_jax.data.templates import TEMPLATES

    p.add_argument("--model", required=True, metavar="PATH",
                   help="Hugging Face checkpoint directory, .gguf file, pkg:<package>/<file>, or a training run "
                        "directory (its last checkpoint)")
    p.add_argument("--tokenizer", default=None, metavar="char|PATH",
                   help="tokenizer instead of the model's own: 'char' (built-in CharTokenizer) or a path")
    p.add_argument("--benchmarks", type=_csv(str), default=list(PAPER_BENCHMARKS), metavar="A,B,...",
                   help="load_dataset names (default: the paper's seven: " + ",".join(PAPER_BENCHMARKS) + ")")
    p.add_argument("--data-dir", default=None, metavar="DIR", help="benchmark files (docs/data.md)")
    p.add_argument("--n", type=int, default=4, help="samples per problem (default 4)")
    p.add_argument("--k", type=_csv(int), default=[1, 4], metavar="K,K", help="pass@k to report (default 1,4)")
    p.add_argument("--temperature", type=float, default=0.6, help="default 0.6")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    p.add_argument("--max-new-tokens", type=int, default=1024, metavar="N",
                   help="response budget (default 1024 = the training default rollout.max_new_tokens)")
    p.add_argument("--max-prompt-len", type=int, default=1024, metavar="N",
                   help="longest prompt in tokens after templating (default 1024); longer ones are an error "
                        "unless --skip-overlong; never truncated")
    p.add_argument("--skip-overlong", action="store_true",
                   help="answer over-long prompts with empty responses (scored wrong) and count them")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts per sampler call (default 8)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N problems of each benchmark")
    p.add_argument("--template", choices=TEMPLATES, default="qwen_chat", help="prompt template (default qwen_chat)")
    p.add_argument("--out", default="eval_out", metavar="DIR",
                   help="writes DIR/eval.json and DIR/eval_samples.jsonl (default ./eval_out)")
    p.add_argument("--workers", type=int, default=2, help="reward worker processes (default 2)")
    p.add_argument("--time-limit", type=float, default=5.0, metavar="S", help="seconds per answer check (default 5)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                   help="device mesh (-1 = the rest of the devices); default: no mesh, one device")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="parameter dtype (default float32)")
    p.add_argument("--reward-fn", default=None, metavar="PACKAGE.MODULE:FUNCTION",
                   help="the function that scores benchmarks whose reward kind is 'custom' (file:...&reward=custom); "
                        "run in the reward worker processes (docs/rewards.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _validate(args: argparse.Namespace) -> None:
    from ict_jax.cli.errors import UserError

    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    bad = [k for k in args.k if not 1 <= k <= args.n]
    if bad:
        raise UserError(f"--k {','.join(map(str, args.k))}: every k must be between 1 and --n={args.n}")
    for name in ("max_new_tokens", "max_prompt_len", "batch_size", "workers"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if not args.temperature > 0:
        raise UserError(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.reward_fn is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", args.reward_fn):
        raise UserError(f"--reward-fn {args.reward_fn!r}: expected package.module:function")
    if len(set(args.benchmarks)) != len(args.benchmarks):
        raise UserError(f"--benchmarks lists a benchmark twice: {','.join(args.benchmarks)}")


def _mesh(spec: str | None):
    from ict_jax.cli.errors import UserError

    if spec is None:
        return None
    try:
        sizes = [int(x) for x in spec.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 3:
        raise UserError(f"--mesh {spec!r}: expected three integers DATA,FSDP,TENSOR")
    from ict_jax.sharding import make_mesh

    return make_mesh(*sizes)


def eval_main(args: argparse.Namespace) -> int:
    from ict_jax.cli.errors import UserError
    from ict_jax.data.datasets import load_dataset
    from ict_jax.sampling.evaluation import evaluate
    from ict_jax.sampling.text_generation import make_text_generator
    from ict_jax.data.templates import template_dataset
    from ict_jax.rewards.checks import CUSTOM_KIND
    from ict_jax.rewards.pool import RewardPool
    from ict_jax.train.checkpoints import load_run_model, run_model_tokenizer

    _validate(args)
    datasets = {name: load_dataset(name, data_dir=args.data_dir, limit=args.limit, seed=args.seed)
                for name in args.benchmarks}
    custom = [name for name, ds in datasets.items() if ds.scorer == CUSTOM_KIND]
    if custom and not args.reward_fn:
        raise UserError(f"benchmark {custom[0]!r} is scored by reward=custom: name the function with --reward-fn")
    empty = [name for name, ds in datasets.items() if len(ds) == 0]
    if empty:
        raise UserError(f"benchmark {empty[0]!r} has no problems")
    mesh = _mesh(args.mesh)
    tok = run_model_tokenizer(args.model, args.tokenizer)  # cheap: template and length-check first
    templated = {name: template_dataset(ds, tok, args.template) for name, ds in datasets.items()}
    overlong = {name: sum(len(tok.encode(ex.prompt)) > args.max_prompt_len for ex in ds)
                for name, ds in templated.items()}
    if any(overlong.values()) and not args.skip_overlong:
        name = next(k for k, v in overlong.items() if v)
        raise UserError(f"{name}: {overlong[name]} prompt(s) longer than --max-prompt-len={args.max_prompt_len} "
                        "tokens after templating (never truncated): raise --max-prompt-len or pass --skip-overlong")
    model, tok, where = load_run_model(args.model, mesh=mesh, dtype=args.dtype, tokenizer=args.tokenizer)
    gen = make_text_generator(model, tok, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, template="none",
                              max_prompt_len=args.max_prompt_len, batch_size=args.batch_size, seed=args.seed,
                              mesh=mesh, overlong="skip" if args.skip_overlong else "error")
    settings = {"model": args.model, "loaded": where, "reward_fn": args.reward_fn, "tokenizer": args.tokenizer, "template": args.template,
                "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_new_tokens": args.max_new_tokens, "max_prompt_len": args.max_prompt_len,
                "batch_size": args.batch_size, "limit": args.limit, "seed": args.seed, "mesh": args.mesh,
                "data_dir": args.data_dir}
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "eval.json")
    checkers = {CUSTOM_KIND: args.reward_fn} if args.reward_fn else None  # imported in the workers only
    with RewardPool(args.workers, time_limit=args.time_limit, checkers=checkers) as pool:
        results = evaluate(gen, templated, pool, n=args.n, ks=args.k, batch_size=args.batch_size,
                           samples_path=os.path.join(args.out, "eval_samples.jsonl"), settings=settings,
                           progress=not args.no_progress, print_table=True)
    for name, count in overlong.items():
        results["benchmarks"][name]["skipped_overlong"] = int(count)
    results["compiled_programs"] = gen.compiled_programs()
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    skipped = sum(overlong.values())
    if skipped:
        print(f"{skipped} over-long prompt(s) answered with empty responses (scored wrong): "
              + ", ".join(f"{k} {v}" for k, v in overlong.items() if v))
    print(f"wrote {json_path} and {os.path.join(args.out, 'eval_samples.jsonl')}")
    return 0
