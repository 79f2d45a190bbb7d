"""``ict-jax diagnose``: the paper's token diagnostics of every reading of u and every selector on a real
model (:mod:`ict_jax.diagnostics.diagnose`; docs/results.md). A line as each setting and batch starts and ends,
and a heartbeat from the command's first second, at least every ``$ICT_JAX_HEARTBEAT_S`` seconds (30 by
default), naming the phase that runs (importing JAX, loading the prompts and the model, sampling, scoring,
statistics and masks, the diagnostics, the report)."""

from __future__ import annotations

import argparse
import itertools
import time
import typing

from ict_jax.cli.errors import UserError
from ict_jax.config import StatsSection, UForm
from ict_jax.outputs import check_output_dir


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    from ict_jax.data.templates import BOXED_INSTRUCTION, MC_INSTRUCTION, TEMPLATES

    forms = ",".join(typing.get_args(UForm))
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a Hugging Face directory, a .gguf file, pkg:<package>/<file>, a real model split over "
                        "packages (qwen2.5-coder-0.5b-instruct, pkg:<prefix>; docs/models.md) or a training run "
                        "directory (its last checkpoint)")
    p.add_argument("--tokenizer", default=None, metavar="char|PATH", help="tokenizer instead of the model's own")
    p.add_argument("--prompts", default=None, metavar="SRC",
                   help="the prompts (required unless --reanalyse): a data set spec, e.g. "
                        "'gym:gsm_symbolic?size=8&seed=0', 'split?digits=2&size=16' (docs/data.md); its answers and "
                        "scorer give the rewards")
    p.add_argument("--data-dir", default=None, help="folder of the data set's files (file-based data sets)")
    p.add_argument("-G", "--group-sizes", default="8,16", metavar="G1,G2", help="responses per prompt (default 8,16)")
    p.add_argument("--temperature", default="1.0,0.7", metavar="T1,T2",
                   help="sampling temperatures, also the statistics' (default 1.0,0.7)")
    p.add_argument("--u-form", default=forms, metavar="F1,F2",
                   help=f"readings of u (docs/method.md §1; default all: {forms}); the first is the one the "
                        "non-ICT selectors' Q(o_t) column uses")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="response length limit (default 256)")
    p.add_argument("--num-prompts", type=int, default=None, metavar="P", help="use the first P prompts (default all)")
    p.add_argument("--batch-rows", type=int, default=64, metavar="R",
                   help="responses per sampling run (R // G prompts, at least one): the mini-batch of the "
                        "batch-scoped selectors (default 64)")
    p.add_argument("--template", default="qwen_chat", choices=TEMPLATES,
                   help="prompt template (default qwen_chat: the model's own chat template). With qwen_chat or plain "
                        "every question is followed by the instruction \"" + BOXED_INSTRUCTION.replace("%", "%%")
                        + "\" (multiple-choice data sets: \"" + MC_INSTRUCTION.replace("%", "%%") + "\"); none: the "
                        "prompts as given. The report states it")
    p.add_argument("--rho", type=float, default=None,
                   help="ICT's fraction per response (default: ict's registered rho), also the count of "
                        "random, lowest_p and entropy[sequence]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chunk", type=int, default=StatsSection().chunk,
                   help=f"positions per statistics block (default stats.chunk's {StatsSection().chunk})")
    p.add_argument("--title", default="", help="a title for the report")
    p.add_argument("--out", default="runs/diagnose", help="output folder (default runs/diagnose)")
    p.add_argument("--force", action="store_true", help="write over an existing report in --out")
    p.add_argument("--reanalyse", action="store_true",
                   help="no sampling: rebuild the report in --out from its saved per-token arrays with this code "
                        "(only the tokenizer of --model is loaded, not its weights; --prompts and the sampling "
                        "options are not needed)")


def _say(line: str) -> None:
    print(f"[diagnose] {line}", flush=True)


def _parse_list(text: str, cast: type, flag: str) -> list:
    try:
        values = [cast(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a comma-separated list") from None
    if not values or len(set(values)) != len(values):
        raise UserError(f"{flag} {text!r}: expected distinct values")
    return values


def diagnose_main(args: argparse.Namespace) -> int:
    groups = _parse_list(args.group_sizes, int, "-G")
    temps = _parse_list(args.temperature, float, "--temperature")
    forms = _parse_list(args.u_form, str, "--u-form")
    allowed = typing.get_args(UForm)
    if any(g < 2 for g in groups):
        raise UserError(f"-G {args.group_sizes}: every group size must be >= 2")
    if any(not t > 0 for t in temps):
        raise UserError(f"--temperature {args.temperature}: temperatures must be > 0")
    if any(f not in allowed for f in forms):
        raise UserError(f"--u-form {args.u_form}: allowed readings: {', '.join(allowed)}")
    for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--batch-rows", args.batch_rows),
                    ("--chunk", args.chunk)):
        if v < 1:
            raise UserError(f"{flag} {v}: must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError(f"--num-prompts {args.num_prompts}: must be >= 1")
    if args.rho is not None and not 0 < args.rho <= 1:
        raise UserError(f"--rho {args.rho}: allowed 0 < rho <= 1")
    out = check_output_dir(args.out, "--out")
    from ict_jax.heartbeat import Heartbeat

    with Heartbeat(_say) as beat:  # from the first second: importing JAX alone takes a while
        beat.phase("starting (importing JAX and the diagnostics)")
        return _diagnose(args, out, beat, groups=groups, temps=temps, forms=forms)


def _diagnose(args: argparse.Namespace, out, beat, *, groups: list, temps: list, forms: list) -> int:
    if args.reanalyse:
        if not (out / "diagnose.json").is_file():
            raise UserError(f"--reanalyse: {str(out / 'diagnose.json')!r} does not exist")
        from ict_jax.diagnostics.diagnose import reanalyse
        from ict_jax.train.model_source import resolve_model

        beat.phase(f"loading the tokenizer of {args.model}")
        tok = resolve_model(args.model, tokenizer=args.tokenizer).tokenizer()  # the tokenizer only, never the weights
        beat.phase(f"rebuilding the report in {out}")
        reanalyse(out, tok, say=_say)
        print(f"wrote {out / 'diagnose.md'}, {out / 'diagnose.json'}")
        return 0
    if args.prompts is None:
        raise UserError("--prompts SRC is required (except with --reanalyse)")
    from ict_jax.data.extras import check_extras

    check_extras([args.prompts])  # a missing optional extra (gym:, tfds:) before anything loads
    if (out / "diagnose.json").exists() and not args.force:
        raise UserError(f"--out {str(out)!r} already holds a report (pass --force to write over it)")

    from ict_jax.data.datasets import load_dataset
    from ict_jax.diagnostics.diagnose import Setting, prompt_instruction, run_diagnose
    from ict_jax.train.model_source import resolve_model

    beat.phase(f"loading the prompts ({args.prompts})")
    dataset = load_dataset(args.prompts, data_dir=args.data_dir, limit=args.num_prompts)
    if len(dataset) == 0:
        raise UserError(f"--prompts {args.prompts!r}: no prompts")
    say = beat.counted(_say)  # the command's own lines count for the heartbeat
    say(f"loading {args.model} ...")
    t0 = time.perf_counter()
    beat.phase(f"loading {args.model}")  # a real model's first load assembles and dequantises it: a minute or more
    source = resolve_model(args.model, tokenizer=args.tokenizer)
    tok, model = source.tokenizer(), source.load()
    beat.phase(None)
    say(f"loaded in {time.perf_counter() - t0:.0f} s; {len(dataset)} prompts, "
         + (f"each followed by the instruction {instr!r}" if (instr := prompt_instruction(dataset, args.template))
            else "as given (template none)"))
    settings = [Setting(g, t) for g, t in itertools.product(groups, temps)]
    results = run_diagnose(model, tok, dataset, settings=settings, u_forms=forms, max_new_tokens=args.max_new_tokens,
                           batch_rows=args.batch_rows, template=args.template, seed=args.seed, rho=args.rho,
                           chunk=args.chunk, out=out, title=args.title or f"{args.model} on {args.prompts}",
                           say=_say, heartbeat=beat)
    print(f"wrote {out / 'diagnose.md'}, {out / 'diagnose.json'}, "
          + ", ".join(str(out / f"{n}.png") for n in results["settings"]))
    return 0
