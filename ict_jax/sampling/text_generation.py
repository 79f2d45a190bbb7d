"""Text in, text out: the bridge from prompt strings to the jitted sampler, for ``ict-jax eval`` and the
trainer's periodic evaluation (the ``generate_fn`` of :func:`ict_jax.evaluate_benchmarks`).

    gen = make_text_generator(model, tokenizer, max_new_tokens=1024, max_prompt_len=512, batch_size=8)
    responses = gen(["What is 2+3?", "Solve x + 1 = 3."], n=4)   # 2 lists of 4 strings
    gen.state = nnx.split(new_model)[1]                         # trainer: sample from the current weights

Fixed shapes, few programs: each prompt is templated and tokenised (:func:`ict_jax.data.prompts.encode_prompt`,
the one prompt front door) and left-padded to a length bucket (:func:`ict_jax.buckets.make_buckets`
of ``max_prompt_len``), and every batch is filled to ``batch_size`` prompts with copies of its last prompt
(their samples are discarded), so one program is compiled per (bucket, n) whatever the number of prompts
in a call.

Over-long prompts are never truncated: a prompt of more than ``max_prompt_len`` tokens, or one that
with ``max_new_tokens`` after it would pass the model's ``max_position_embeddings``, raises
``ValueError`` (``overlong="error"``, the default), or (``overlong="skip"``) gets n empty responses
(scored wrong: no answer) and is counted in ``gen.skipped``.

Each response is a :class:`Response`, a ``str`` that also says whether it was cut at ``max_new_tokens``
(``.truncated``: no EOS within the limit), which the evaluation counts (``truncated_frac``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from ict_jax.buckets import bucket_for, make_buckets
from ict_jax.config import RolloutSection, eval_settings
from ict_jax.data.prompts import PromptRefused, PromptTooLong, encode_prompt, pad_left, prompt_fits
from ict_jax.data.templates import BOXED_INSTRUCTION, TEMPLATES
from ict_jax.model.tokenizers import UnknownCharacterError, decode_response
from ict_jax.rng import EVAL_STREAM, stream_key
from ict_jax.sampling.sampler import SampleSettings, make_generate_fn, state_mesh
from ict_jax.sharding import check_prompts_divide, to_host

__all__ = ["Response", "TextGenerator", "make_text_generator"]
_ROLLOUT = RolloutSection()  # the config tree's defaults (one source per default)


class Response(str):
    """A decoded response: the text itself (a ``str``), with ``truncated`` True when the sampler hit
    ``max_new_tokens`` before an EOS. ``str(r)`` is the plain text."""

    truncated: bool

    def __new__(cls, text: str, truncated: bool = False) -> Response:
        obj = super().__new__(cls, text)
        obj.truncated = bool(truncated)
        return obj


class TextGenerator:
    """``gen(prompts, n) -> list[list[Response]]``: n responses per prompt, in order (each a ``str``
    with ``.truncated``). Built by :func:`make_text_generator` (its docstring lists the settings).
    Attributes: ``state`` (the model state sampled from; assign a new one to follow training),
    ``skipped`` (over-long prompts answered with empty responses), ``calls`` (generate programs run; the
    sampling key of run i is ``fold_in(key(seed), i)``), ``buckets``, ``fns`` (n ->
    :class:`ict_jax.sampling.sampler.GenerateFn`)."""

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, template: str, max_prompt_len: int, batch_size: int, seed: int, mesh: Any,
                 overlong: str, instruction: str | None, kv_cache_dtype: str | None,
                 generate_fns: Mapping[int, Callable[..., Any]] | None = None,
                 min_response_bucket: int | None = _ROLLOUT.min_response_bucket,
                 gather_weights: bool = True):
        if template not in TEMPLATES:
            raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
        if overlong not in ("error", "skip"):
            raise ValueError(f"overlong must be 'error' or 'skip', got {overlong!r}")
        if max_prompt_len < 1 or batch_size < 1:
            raise ValueError(f"need max_prompt_len >= 1 and batch_size >= 1, got {max_prompt_len}, {batch_size}")
        if isinstance(model, tuple):
            self.graphdef, self.state = model
        else:
            self.graphdef, self.state = nnx.split(model)
        self.max_positions = _max_positions(model, self.graphdef, self.state)
        if not prompt_fits(1, max_new_tokens, self.max_positions):
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                             f"max_position_embeddings={self.max_positions}")
        self.mesh = mesh if mesh is not None else state_mesh(self.state)
        if self.mesh is not None:
            check_prompts_divide(batch_size, self.mesh)
        self.tokenizer, self.template = tokenizer, template
        self.instruction = BOXED_INSTRUCTION if instruction is None else instruction
        self.max_prompt_len, self.batch_size, self.overlong = int(max_prompt_len), int(batch_size), overlong
        self.buckets = make_buckets(self.max_prompt_len)
        self.sample_kwargs = dict(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                  top_p=float(top_p), top_k=int(top_k), eos_ids=tuple(tokenizer.eos_ids),
                                  pad_id=int(tokenizer.pad_id), kv_cache_dtype=kv_cache_dtype,
                                  min_response_bucket=min_response_bucket, gather_weights=bool(gather_weights))
        SampleSettings(**{k: v for k, v in self.sample_kwargs.items() if k != "kv_cache_dtype"})  # validate now
        self.key = generator_key(seed)
        self.fns: dict[int, Any] = dict(generate_fns or {})
        self.skipped = 0
        self.calls = 0

    def _fn(self, n: int) -> Any:
        if n not in self.fns:
            self.fns[n] = make_generate_fn(self.graphdef, num_samples=n, mesh=self.mesh, **self.sample_kwargs)
        return self.fns[n]

    def encode(self, prompt: str) -> np.ndarray:
        """The templated prompt's token ids (int32), untruncated (:func:`ict_jax.data.prompts.encode_prompt`)."""
        return encode_prompt(prompt, self.tokenizer, template=self.template, instruction=self.instruction).ids

    def _encode_all(self, prompts: Sequence[str]) -> tuple[list[np.ndarray | None], list[int]]:
        """(the ids of every prompt, None where refused; the indices kept). A prompt over ``max_prompt_len``,
        of no token, or that with ``max_new_tokens`` after it passes the model's ``max_position_embeddings``
        is refused (:class:`~ict_jax.data.prompts.PromptRefused`, one line) or, with ``overlong="skip"``,
        counted in ``skipped``. A character the tokenizer cannot represent is always refused."""
        encoded: list[np.ndarray | None] = []
        for i, p in enumerate(prompts):
            try:
                encoded.append(encode_prompt(p, self.tokenizer, template=self.template, instruction=self.instruction,
                                             max_len=self.max_prompt_len, limit_key="max_prompt_len",
                                             max_new_tokens=self.sample_kwargs["max_new_tokens"],
                                             max_positions=self.max_positions,
                                             where=f"prompt {i} (after templating)").ids)
            except UnknownCharacterError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            except PromptRefused as e:
                if self.overlong != "skip":
                    # a PromptTooLong names the prompt itself (``where``); the other refusals get its index here
                    raise (e if isinstance(e, PromptTooLong) else type(e)(f"prompt {i}: {e}")) from None
                self.skipped += 1
                encoded.append(None)
        return encoded, [i for i, ids in enumerate(encoded) if ids is not None]

    def __call__(self, prompts: Sequence[str], n: int) -> list[list[Response]]:
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings, got one string")
        n = int(n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        encoded, keep = self._encode_all(prompts)
        out: list[list[Response]] = [[Response("")] * n for _ in prompts]  # a skipped prompt: nothing sampled
        fn, bs, tok = self._fn(n), self.batch_size, self.tokenizer
        for start in range(0, len(keep), bs):
            rows = keep[start:start + bs]
            seqs = [encoded[i] for i in rows]
            seqs += [seqs[-1]] * (bs - len(seqs))  # filler rows: same shape every batch, samples dropped
            ids, mask = pad_left(seqs, bucket_for(max(len(s) for s in seqs), self.buckets), tok.pad_id)
            r = fn(self.state, ids, mask, jax.random.fold_in(self.key, self.calls))
            self.calls += 1
            tokens, valid, truncated = to_host((r.tokens, r.valid, r.truncated))  # all-gathered in a multi-process run
            for p, i in enumerate(rows):
                for j in range(n):
                    row = p * n + j
                    out[i][j] = Response(decode_response(tok, tokens[row], valid[row]), bool(truncated[row]))
        return out

    def compiled_programs(self) -> int:
        """Executables compiled so far over all n (one per bucket and n used)."""
        return sum(len(fn.executables) if hasattr(fn, "executables") else fn.jitted._cache_size()
                   for fn in self.fns.values())


def _max_positions(model: Any, graphdef: Any, state: Any) -> int | None:
    """The model's ``max_position_embeddings`` (None when it has no config saying so)."""
    config = getattr(model, "config", None)
    if config is None:
        try:
            config = getattr(nnx.merge(graphdef, state), "config", None)
        except Exception:  # noqa: BLE001 - an unusual graph: no position limit known
            config = None
    limit = getattr(config, "max_position_embeddings", None)
    return None if limit is None else int(limit)


def generator_key(seed: int) -> jax.Array:
    """The root key of a text generator's calls: ``key(seed)`` folded with the evaluation stream
    (``ict_jax.rng.EVAL_STREAM``); call i samples with ``fold_in(generator_key(seed), i)``."""
    return stream_key(jax.random.key(int(seed)), EVAL_STREAM)


_EVAL = eval_settings()  # the defaults below are the config tree's (ict_jax.config.EVAL_KEYS)


def make_text_generator(model: Any, tokenizer: Any, *, max_new_tokens: int,
                        temperature: float = _EVAL["temperature"], top_p: float = _EVAL["top_p"], top_k: int = 0,
                        template: str = _EVAL["template"], max_prompt_len: int,
                        batch_size: int, seed: int = 0, mesh: Any = None, overlong: str = "error",
                        instruction: str | None = None, kv_cache_dtype: str | None = None,
                        generate_fns: Mapping[int, Callable[..., Any]] | None = None,
                        min_response_bucket: int | None = _ROLLOUT.min_response_bucket,
                        gather_weights: bool = True) -> TextGenerator:
    """``generate_fn(prompts: list[str], n: int) -> list[list[Response]]`` sampling from ``model``.

    - ``model``: a :class:`ict_jax.Qwen2`, or ``(graphdef, state)`` from ``nnx.split`` (the returned
      generator's ``.state`` can be reassigned later, e.g. to the trainer's current weights);
    - prompts are questions: ``template`` (``qwen_chat`` | ``plain`` | ``none``) and ``instruction``
      (default ``BOXED_INSTRUCTION``) go to :func:`ict_jax.data.templates.format_prompt`; with ``template="none"``
      prompts are used exactly as given (already templated, see :func:`template_dataset`);
    - sampling: ``temperature``, ``top_p``, ``top_k`` (0 = off), ``max_new_tokens`` (docs/method.md §6 defaults
      0.6 / 0.95 and the template, read from the config tree: ``data.eval_temperature``,
      ``data.eval_top_p``, ``data.template``); stops at ``tokenizer.eos_ids``;
    - shapes: up to ``batch_size`` prompts per program run (a multiple of data * fsdp under ``mesh``),
      left-padded to a bucket of :func:`ict_jax.buckets.make_buckets(max_prompt_len)`;
    - responses: :func:`ict_jax.model.tokenizers.decode_response` of the valid tokens (EOS dropped,
      special tokens skipped);
    - ``overlong``: ``"error"`` (ValueError) or ``"skip"`` (n empty responses, counted in ``.skipped``);
    - ``seed``: the same seed and the same sequence of calls give the same responses (call i samples with
      ``fold_in(generator_key(seed), i)``);
    - ``generate_fns``: {n: the compiled generate function for n samples} to use instead of building one
      (a run's evaluation program, ``ict_jax.train.programs``), called as ``fn(state, ids, mask, key)``;
    - ``min_response_bucket`` (``rollout.min_response_bucket``): the decode attends over a growing
      bucket of its KV cache (:func:`ict_jax.sampling.sampler.make_generate_fn`); None: the whole cache;
    - ``gather_weights`` (``rollout.gather_weights``): under an FSDP mesh, the weights gathered once a
      program run, before the decode loop (:func:`ict_jax.sampling.sampler.make_generate_fn`).
    ``mesh`` defaults to the mesh the model's parameters are sharded on (None: no mesh).
    """
    return TextGenerator(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, template=template, max_prompt_len=max_prompt_len, batch_size=batch_size,
                         seed=seed, mesh=mesh, overlong=overlong, instruction=instruction,
                         kv_cache_dtype=kv_cache_dtype, generate_fns=generate_fns,
                         min_response_bucket=min_response_bucket, gather_weights=gather_weights)


