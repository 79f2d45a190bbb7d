"""``ict-jax eval``: pass@k of a model on benchmarks (docs/method.md §6), end to end.

    ict-jax eval --model PATH [--benchmarks math500,gsm8k_test,...] [--data-dir DIR] [--n N] [--k K,K]
                 [--temperature T] [--top-p P] [--max-new-tokens N] [--max-prompt-len N] [--batch-size B]
                 [--limit N] [--template qwen_chat|plain|none] [--out DIR] [--workers W] [--seed S]
                 [--mesh DATA,FSDP,TENSOR] [--tokenizer char|PATH] [--skip-overlong]

Every setting comes from, in order: its flag, the settings the model's training run recorded (a run
directory, its checkpoint or sft_model, a model ``ict-jax export`` wrote), the config tree's default
(:data:`ict_jax.config.EVAL_KEYS`: one source per default); the output says which. Loads the benchmarks
first (bad names and missing files fail before the model loads), templates every prompt with the
instruction of its scorer, checks prompt lengths up front, then samples with
:func:`ict_jax.make_text_generator` and scores with :func:`ict_jax.evaluate_benchmarks`. Writes
``{out}/eval.json`` (results, settings and their sources, per-benchmark ``skipped_overlong``) and
``{out}/eval_samples.jsonl``; without ``--out``, ``out`` is ``runs/eval_out`` or the first of
``runs/eval_out-2``, ``-3``, ... that does not exist (an earlier result is never replaced). docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


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


#: where ``ict-jax eval`` writes without ``--out``: this folder, else the first of ``-2``, ``-3``, ... free
DEFAULT_OUT = "runs/eval_out"
#: Settings a run's record does not decide: the sampler's batch is a resource of the machine that
#: evaluates (a recipe's 128 prompts a call suit its TPU slice, not a laptop); only the flag or the default.
_NOT_FROM_THE_RUN = {"batch_size"}
#: flag dest -> the setting of :data:`ict_jax.config.EVAL_KEYS` it overrides (all default to None: the
#: run's recorded value, else the config tree's default)
_SETTING_FLAGS = {"benchmarks": "benchmarks", "data_dir": "data_dir", "template": "template", "n": "n", "k": "k",
                  "temperature": "temperature", "top_p": "top_p", "limit": "limit",
                  "max_new_tokens": "max_new_tokens", "max_prompt_len": "max_prompt_len",
                  "batch_size": "batch_size", "seed": "seed", "workers": "workers", "time_limit": "time_limit"}


def _default_help(setting: str, shown: object = None) -> str:
    from ict_jax.config import EVAL_KEYS, eval_settings

    value = eval_settings()[setting] if shown is None else shown
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"default: the run's {EVAL_KEYS[setting]}, else {value}"


def add_eval_args(p: argparse.ArgumentParser) -> None:
    from ict_jax.data.datasets import PAPER_BENCHMARKS
    from ict_jax.data.templates import TEMPLATES

    p.add_argument("--model", required=True, metavar="PATH",
                   help="Hugging Face checkpoint directory, .gguf file, pkg:<package>/<file>, a real model split over "
                        "packages (qwen2.5-coder-0.5b-instruct, pkg:<prefix>; docs/models.md), or a training run "
                        "directory (its last checkpoint); a run directory (or a model `ict-jax export` wrote from "
                        "one) brings its own settings (template, lengths, evaluation settings), flags override them")
    p.add_argument("--tokenizer", default=None, metavar="char|PATH",
                   help="tokenizer instead of the model's own: 'char' (built-in CharTokenizer) or a path")
    p.add_argument("--benchmarks", type=_csv(str), default=None, metavar="A,B,...",
                   help="load_dataset names (" + _default_help("benchmarks", "the paper's seven: "
                                                                + ",".join(PAPER_BENCHMARKS)) + ")")
    p.add_argument("--data-dir", default=None, metavar="DIR", help="benchmark files, docs/data.md ("
                   + _default_help("data_dir") + ")")
    p.add_argument("--n", type=int, default=None, help="samples per problem (" + _default_help("n") + ")")
    p.add_argument("--k", type=_csv(int), default=None, metavar="K,K",
                   help="pass@k to report (" + _default_help("k") + ")")
    p.add_argument("--temperature", type=float, default=None, help=_default_help("temperature"))
    p.add_argument("--top-p", type=float, default=None, help=_default_help("top_p"))
    p.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="response budget (" + _default_help("max_new_tokens") + ")")
    p.add_argument("--max-prompt-len", type=int, default=None, metavar="N",
                   help="longest prompt in tokens after templating (" + _default_help("max_prompt_len") + "); "
                        "longer ones are an error unless --skip-overlong; never truncated")
    p.add_argument("--skip-overlong", action="store_true",
                   help="answer over-long prompts (and prompts that with --max-new-tokens pass the model's "
                        "max_position_embeddings) with empty responses (scored wrong) and count them")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"prompts per sampler call (default {_default_help('batch_size').rsplit(' ', 1)[-1]}; "
                        "a resource of this machine, never taken from the run)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="first N problems of each benchmark (" + _default_help("limit", "all") + ")")
    p.add_argument("--template", choices=TEMPLATES, default=None,
                   help="prompt template (" + _default_help("template") + ")")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"writes DIR/eval.json and DIR/eval_samples.jsonl (default {DEFAULT_OUT}, or the first of "
                        f"{DEFAULT_OUT}-2, -3, ... that does not exist: an earlier result is never replaced; a DIR "
                        "named here that holds one is written over, with a line that says so)")
    p.add_argument("--workers", type=int, default=None,
                   help="reward worker processes (" + _default_help("workers") + ")")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="seconds per answer check (" + _default_help("time_limit") + ")")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (" + _default_help("seed") + ")")
    p.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                   help="device mesh (-1 = the rest of the devices); default: no mesh, one device")
    p.add_argument("--gather-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="with an FSDP mesh: gather the weights once a sampler call, before the decode loop, not at "
                        "every token (default on; --no-gather-weights where the gathered copy does not fit; "
                        "rollout.gather_weights, docs/sampler.md)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="parameter dtype (default float32)")
    p.add_argument("--reward-fn", default=None, metavar="PACKAGE.MODULE:FUNCTION",
                   help="the function that scores benchmarks whose reward kind is 'custom' (file:...&reward=custom); "
                        "run in the reward worker processes (docs/rewards.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress (bar or lines)")


def resolve_settings(args: argparse.Namespace, recorded: dict | None) -> tuple[dict, dict]:
    """({setting: value}, {setting: "flag" | "run" | "default"}): a flag given on the command line wins,
    then the run's recorded config (``recorded``: the plain config tree), then the config tree's default.
    ``benchmarks`` falls back to the paper's seven when neither names any."""
    from ict_jax.config import EVAL_KEYS, eval_settings, get_dotted
    from ict_jax.data.datasets import PAPER_BENCHMARKS

    defaults = eval_settings()
    missing = object()
    values, sources = {}, {}
    for dest, name in _SETTING_FLAGS.items():
        flag = getattr(args, dest)
        run_value = (get_dotted(recorded, EVAL_KEYS[name], missing)
                     if recorded is not None and name not in _NOT_FROM_THE_RUN else missing)
        if isinstance(run_value, list):
            run_value = tuple(run_value)
        if flag is not None:
            values[name], sources[name] = (tuple(flag) if isinstance(flag, list) else flag), "flag"
        elif run_value is not missing and run_value != ():  # a recorded null (no limit, no data_dir) counts
            values[name], sources[name] = run_value, "run"
        else:
            values[name], sources[name] = defaults[name], "default"
    if not values["benchmarks"]:
        values["benchmarks"] = tuple(PAPER_BENCHMARKS)
    return values, sources


def _validate(s: dict, args: argparse.Namespace) -> None:
    from ict_jax.cli.errors import UserError

    if s["n"] < 1:
        raise UserError(f"--n must be >= 1, got {s['n']}")
    bad = [k for k in s["k"] if not 1 <= k <= s["n"]]
    if bad:
        raise UserError(f"--k {','.join(map(str, s['k']))}: every k must be between 1 and --n={s['n']}")
    for name in ("max_new_tokens", "max_prompt_len", "batch_size", "workers"):
        if s[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {s[name]}")
    if s["limit"] is not None and s["limit"] < 1:
        raise UserError(f"--limit must be >= 1, got {s['limit']}")
    if not s["temperature"] > 0:
        raise UserError(f"--temperature must be > 0, got {s['temperature']}")
    if not 0 < s["top_p"] <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {s['top_p']}")
    if not s["time_limit"] > 0:
        raise UserError(f"--time-limit must be > 0, got {s['time_limit']}")
    if args.reward_fn is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", args.reward_fn):
        raise UserError(f"--reward-fn {args.reward_fn!r}: expected package.module:function")
    if len(set(s["benchmarks"])) != len(s["benchmarks"]):
        raise UserError(f"--benchmarks lists a benchmark twice: {','.join(s['benchmarks'])}")
    from ict_jax.data.extras import check_extras

    check_extras(s["benchmarks"])  # the run's recorded benchmarks too, before the model loads


def settings_lines(values: dict, sources: dict, where: str | None) -> list[str]:
    """What the evaluation uses and where each value came from: one line per source."""
    def show(v: object) -> str:
        return ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)

    label = {"run": f"from the run ({where})", "flag": "from flags", "default": "left at the defaults"}
    lines = []
    for src in ("run", "flag", "default"):
        names = [n for n in values if sources.get(n) == src]
        if names:
            lines.append(f"settings {label[src]}: " + "  ".join(f"{n}={show(values[n])}" for n in names))
    return lines


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
    """The command, under its heartbeat from the first second (:func:`ict_jax.cli.progress.command_heartbeat`;
    unless ``--no-progress``): a line naming the phase whenever 30 s (``$ICT_JAX_HEARTBEAT_S``) pass without
    one, while JAX is imported, the model resolved, the benchmarks and the tokenizer loaded, the prompts
    measured, the weights loaded, the sampler built, the reward workers started and the results written;
    while the problems are sampled and scored the evaluation's own lines speak through it
    (:class:`ict_jax.sampling.evaluation.Progress`: problems done, ETA, the batch sampled or scored)."""
    from ict_jax.cli.progress import command_heartbeat

    with command_heartbeat("eval", enabled=not args.no_progress) as beat:
        beat.phase("starting (importing JAX and the evaluation)")
        return _eval(args, beat)


def _eval(args: argparse.Namespace, beat) -> int:
    from ict_jax.data.extras import check_extras
    from ict_jax.data.prompts import prompt_fits
    from ict_jax.data.templates import template_dataset, template_mismatch
    from ict_jax.model.tokenizers import UnknownCharacterError
    from ict_jax.outputs import check_output_dir
    from ict_jax.rewards.checks import CUSTOM_KIND
    from ict_jax.rewards.pool import RewardPool
    from ict_jax.sampling.evaluation import evaluate
    from ict_jax.sampling.text_generation import make_text_generator
    from ict_jax.train.model_source import resolve_model

    check_output_dir(args.out or DEFAULT_OUT, "--out")  # before any work
    check_extras(args.benchmarks or ())  # a missing optional extra (gym:, tfds:) before the model is resolved
    beat.phase(f"resolving the model {args.model}")
    record = (source := resolve_model(args.model, tokenizer=args.tokenizer)).run_config  # no weights read yet
    s, sources = resolve_settings(args, record[0] if record else None)
    _validate(s, args)
    for line in settings_lines(s, sources, record[1] if record else None):
        print(line, flush=True)
    beat.phase(f"loading the benchmarks ({','.join(s['benchmarks'])})")
    datasets = _load_benchmarks(s, args.reward_fn)
    mesh = _mesh(args.mesh)
    tokenizer = args.tokenizer or _recorded_tokenizer(source)
    beat.phase("loading the tokenizer")
    tok = source.tokenizer()  # cheap: template and length-check first
    why = template_mismatch(tok, s["template"])
    if why:
        print(f"ict-jax eval: warning: template {s['template']}: {why}", file=sys.stderr)
    if record is None:
        _warn_defaults_guessed(s, sources)
    beat.phase("templating the prompts and counting their tokens")
    templated = {name: template_dataset(ds, tok, s["template"]) for name, ds in datasets.items()}
    lengths = {name: _prompt_lengths(ds, tok, UnknownCharacterError) for name, ds in templated.items()}
    overlong = {name: sum(n > s["max_prompt_len"] for n in ls) for name, ls in lengths.items()}
    _refuse(overlong, args.skip_overlong, f"longer than --max-prompt-len={s['max_prompt_len']} tokens after templating "
            "(never truncated): raise --max-prompt-len or pass --skip-overlong")
    beat.phase(f"loading {args.model}")  # a real model's first load: a minute or more
    model, where = source.load(mesh=mesh, dtype=args.dtype), source.where
    limit = model.config.max_position_embeddings
    no_room = {name: sum(n <= s["max_prompt_len"] and not prompt_fits(n, s["max_new_tokens"], limit) for n in ls)
               for name, ls in lengths.items()}
    _refuse(no_room, args.skip_overlong, f"that with --max-new-tokens={s['max_new_tokens']} pass the model's "
            f"max_position_embeddings={limit} (the positions past it were never trained): lower --max-new-tokens "
            "or pass --skip-overlong")
    beat.phase("building the sampler")
    gen = make_text_generator(model, tok, max_new_tokens=s["max_new_tokens"], temperature=s["temperature"],
                              top_p=s["top_p"], top_k=args.top_k, template="none",
                              max_prompt_len=s["max_prompt_len"], batch_size=s["batch_size"], seed=s["seed"],
                              mesh=mesh, overlong="skip" if args.skip_overlong else "error",
                              gather_weights=args.gather_weights)
    settings = {"model": args.model, "loaded": where, "reward_fn": args.reward_fn, "tokenizer": tokenizer,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}, "top_k": args.top_k,
                "mesh": args.mesh, "gather_weights": args.gather_weights, "sources": sources,
                "run_config": record[1] if record else None}
    out = _output_folder(args.out)
    json_path = os.path.join(out, "eval.json")
    checkers = {CUSTOM_KIND: args.reward_fn} if args.reward_fn else None  # imported in the workers only
    beat.phase(f"starting the reward workers ({s['workers']})")
    with RewardPool(s["workers"], time_limit=s["time_limit"], checkers=checkers, plugins=_run_plugins(record)) as pool:
        beat.phase(None)  # the evaluation's own lines from here, through this heartbeat
        results = evaluate(gen, templated, pool, n=s["n"], ks=s["k"], batch_size=s["batch_size"],
                           samples_path=os.path.join(out, "eval_samples.jsonl"), settings=settings,
                           progress=not args.no_progress, print_table=True, heartbeat=beat)
        beat.phase("stopping the reward workers")
    beat.phase(f"writing {json_path}")
    for name in overlong:
        results["benchmarks"][name]["skipped_overlong"] = int(overlong[name] + no_room[name])
    results["compiled_programs"] = gen.compiled_programs()
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    skipped = {k: overlong[k] + no_room[k] for k in overlong}
    if sum(skipped.values()):
        print(f"{sum(skipped.values())} over-long prompt(s) answered with empty responses (scored wrong): "
              + ", ".join(f"{k} {v}" for k, v in skipped.items() if v))
    print(f"wrote {json_path} and {os.path.join(out, 'eval_samples.jsonl')}")
    return 0


def _run_plugins(record: tuple[dict, str] | None) -> tuple[str, ...]:
    """The ``plugins`` of the run a model comes from (none without a recorded run), imported here; the reward
    workers import them too."""
    from ict_jax.train.plugins import import_plugins

    plugins = tuple((record[0] or {}).get("plugins") or ()) if record else ()
    import_plugins(plugins)
    return plugins


def _load_benchmarks(s: dict, reward_fn: str | None) -> dict:
    """{name: Dataset} of the settings' benchmarks; a custom-scored one needs ``--reward-fn``, none may be empty."""
    from ict_jax.cli.errors import UserError
    from ict_jax.data.datasets import load_dataset
    from ict_jax.rewards.checks import CUSTOM_KIND

    datasets = {name: load_dataset(name, data_dir=s["data_dir"], limit=s["limit"], seed=s["seed"])
                for name in s["benchmarks"]}
    custom = [name for name, ds in datasets.items() if ds.scorer == CUSTOM_KIND]
    if custom and not reward_fn:
        raise UserError(f"benchmark {custom[0]!r} is scored by reward=custom: name the function with --reward-fn")
    empty = [name for name, ds in datasets.items() if len(ds) == 0]
    if empty:
        raise UserError(f"benchmark {empty[0]!r} has no problems")
    return datasets


def _warn_defaults_guessed(s: dict, sources: dict) -> None:
    """For a model that records no training settings: say which settings that shape its prompts and
    responses are defaults, not necessarily what it was trained with."""
    guessed = [n for n in ("template", "max_new_tokens", "max_prompt_len") if sources[n] == "default"]
    if guessed:
        print("ict-jax eval: warning: the model records no training settings, so these are defaults, not "
              "necessarily what it was trained with: " + ", ".join(f"{n}={s[n]}" for n in guessed) + " (pass "
              + " / ".join("--" + n.replace("_", "-") for n in guessed) + " if it was trained otherwise)",
              file=sys.stderr)


def _output_folder(out: str | None) -> str:
    """The folder this evaluation writes, created: ``--out`` as given (an earlier result there is replaced,
    and a line on stderr says so), else the first free one of ``runs/eval_out``, ``runs/eval_out-2``, ..."""
    from ict_jax.outputs import numbered_dir

    if out is None:
        folder = str(numbered_dir(DEFAULT_OUT))
        print(f"writing to {folder} (no --out given)", flush=True)
        return folder
    if os.path.isfile(os.path.join(out, "eval.json")):
        print(f"ict-jax eval: --out {out} holds an earlier result (eval.json): it is replaced", file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    return out


def _recorded_tokenizer(source) -> str | None:
    """The tokenizer a model's files do not carry but its recorded run names (the built-in ``char`` of an
    exported directory, :meth:`ict_jax.model.source.ModelSource.from_files`), for eval.json's settings; None
    when the model's own is used (a run directory's checkpoint names its tokenizer itself)."""
    own = source.kind in ("hf", "gguf") and source.tokenizer_spec != source.spec
    return source.tokenizer_spec if own else None


def _prompt_lengths(dataset, tok, unknown_error) -> list[int]:
    from ict_jax.cli.errors import UserError

    out = []
    for i, ex in enumerate(dataset):
        try:
            out.append(len(tok.encode(ex.prompt)))
        except unknown_error as e:
            raise UserError(f"{dataset.name} problem {i}: {e}") from None
    return out


def _refuse(counts: dict, skip: bool, what: str) -> None:
    from ict_jax.cli.errors import UserError

    if any(counts.values()) and not skip:
        name = next(k for k, v in counts.items() if v)
        raise UserError(f"{name}: {counts[name]} prompt(s) {what}")
