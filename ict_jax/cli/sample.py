"""``ict-jax sample``: a model and its tokenizer from any model spec (:func:`ict_jax.resolve_model`: a Hugging
Face directory, a .gguf file, ``pkg:<package>/<file>``, a real model split over packages, a training run
directory or ``preset:<name>``), G responses per prompt sampled with :func:`ict_jax.generate`, printed
decoded.

    ict-jax sample --model PATH --prompt "What is 2+3?" [--prompt ...] [-n G] [--max-new-tokens N]
                   [--temperature T] [--top-p P] [--top-k K] [--greedy] [--seed S] [--chat/--no-chat]
                   [--tokenizer char|PATH]
"""

from __future__ import annotations

import argparse
import sys
import time


def add_sample_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer files), a .gguf "
                        "file, pkg:<package>/<file> (a file inside an installed Python package), a real model split "
                        "over packages (qwen2.5-coder-0.5b-instruct, pkg:<prefix>; docs/models.md), a training "
                        "run directory (its last checkpoint) or preset:<name> (random weights)")
    p.add_argument("--tokenizer", default=None, metavar="char|PATH",
                   help="tokenizer to use instead of the model's own: 'char' (the built-in CharTokenizer) or a "
                        "tokenizer directory / .gguf file")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="a prompt (repeat the flag for several)")
    p.add_argument("-n", "--num-samples", type=int, default=1, metavar="G", help="responses per prompt (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default 256")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="default 1.0")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely ids (default 0 = off)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-p/top-k)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampler seed (default 0)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt as a user turn in the chat template (default: when the tokenizer has "
                        "one; --chat without one uses the Qwen2.5 template)")
    p.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16"), default=None,
                   help="KV-cache dtype (default: the compute dtype)")


def _template(tok, chat: bool | None) -> str:
    """``--chat`` -> the prompt template: the chat template when asked, or (no flag) when the tokenizer
    has one; the prompt as typed otherwise. No instruction is added."""
    if chat is None:
        chat = getattr(tok, "chat_template", None) is not None
    return "qwen_chat" if chat else "none"


def _validate(args: argparse.Namespace) -> None:
    """The flags, checked before anything loads, each error naming its flag (not an internal parameter)."""
    from ict_jax.cli.errors import UserError

    if args.num_samples < 1:
        raise UserError(f"-n/--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.greedy and not args.temperature > 0:
        raise UserError(f"--temperature must be > 0, got {args.temperature} (for argmax decoding pass --greedy)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")


def sample_main(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from ict_jax.cli.errors import UserError
    from ict_jax.data.prompts import encode_prompt, pad_left
    from ict_jax.model.tokenizers import UnknownCharacterError, decode_response
    from ict_jax.sampling.sampler import generate
    from ict_jax.train.model_source import resolve_model

    _validate(args)
    source = resolve_model(args.model, tokenizer=args.tokenizer)
    tok = source.tokenizer()
    model = source.load()
    if source.where != str(args.model):
        print(f"model: {source.where}", file=sys.stderr)
    template = _template(tok, args.chat)
    encoded = []
    for i, text in enumerate(args.prompt, start=1):
        try:
            encoded.append(encode_prompt(text, tok, template=template, instruction="",
                                         vocab_size=model.config.vocab_size, max_new_tokens=args.max_new_tokens,
                                         max_positions=model.config.max_position_embeddings,
                                         where=f"--prompt {i}").ids)
        except UnknownCharacterError as e:
            raise UserError(f"--prompt {i}: {e}") from None
    ids, mask = pad_left(encoded, max(len(e) for e in encoded), tok.pad_id)  # every prompt ends at the last column
    t0 = time.perf_counter()
    r = generate(model, ids, mask, jax.random.key(args.seed), num_samples=args.num_samples,
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 top_k=args.top_k, greedy=args.greedy, eos_ids=tok.eos_ids, pad_id=tok.pad_id,
                 kv_cache_dtype=args.kv_cache_dtype)
    r = jax.tree.map(np.asarray, r)
    seconds = time.perf_counter() - t0
    G = args.num_samples
    for row in range(r.tokens.shape[0]):
        p, j = divmod(row, G)
        if j == 0:
            print(f"=== prompt {p}: {args.prompt[p]!r}")
        n = int(r.lengths[row])
        text = decode_response(tok, r.tokens[row], r.valid[row])
        end = "truncated" if r.truncated[row] else "eos"
        print(f"--- sample {j} ({n} tokens, {end}, logp {float(r.logp[row, :n].sum()):.2f})")
        print(text)
    print(f"[{int(r.lengths.sum())} tokens in {seconds:.1f} s, compile included]")
    return 0
