"""The paper's token diagnostics on a real model (``ict-jax diagnose``, docs/results.md "Is our u the paper's u?").

For every setting (group size G x sampling temperature T) :func:`collect` samples G responses to each of
a data set's prompts, scores them with the data set's verifiable reward, recomputes every response
token's statistics (docs/method.md §1: logp, H1, H2, max_v p, and u with Q(o_t) under every reading of
``stats.u_form``) and selects tokens with every selector (docs/method.md §2) through the train step's
entry point :func:`ict_jax.rl.selectors.select`, one sampling batch being the mini-batch; ICT under both
tie rules (``rl.selector.ties``: ``ict[r]`` keeps exactly k, ``ict[r,ties=all]`` every token tied at the cut),
and two references at ICT's count per response: 20-Entropy per response (``entropy[sequence]``) and the
diagnose-only ``lowest_p`` (each response's tokens with the lowest p(o_t), :func:`lowest_p_mask`).
:func:`ict_jax.diagnostics.diagnose_measures.diagnostics` then computes, in float64 NumPy, the paper's
diagnostics of the selected tokens (docs/method.md §5): sorted-u curves and their elbow, p(o_t), its
purity and max_v p, Q(o_t), the high/low-entropy ratio, the most frequent selected and unselected and
the forking tokens, u against position, and corr(mean u, advantage): plain, within groups, over finished
responses and given the response length (:mod:`ict_jax.diagnostics.diagnose_advantage`); and what each
selector reaches, with the train step's function (:mod:`ict_jax.rl.coverage`, float32): the shares of
its tokens that are EOS, after the group's shortest response, on truncated responses and with A < 0, and
its share of each 16-token bin's valid tokens.

:func:`run_diagnose` does every setting and writes ``diagnose.json``, the Markdown report and the plots
(:mod:`ict_jax.diagnostics.diagnose_report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ict_jax.config import RewardSection, SelectorSection, StatsSection
from ict_jax.data.prompts import PromptRefused, check_prompt_fits, encode_prompt, pad_left, prompt_fits
from ict_jax.data.templates import instruction_for
from ict_jax.diagnostics.diagnose_measures import diagnostics, marked_examples
from ict_jax.diagnostics.diagnose_report import format_markdown, plot_setting
from ict_jax.heartbeat import Heartbeat
from ict_jax.model.tokenizers import UnknownCharacterError, decode_responses
from ict_jax.rewards.pool import RewardPool
from ict_jax.rl.group_stats import GroupStatsRequest, compiled_group_stats, group_rows
from ict_jax.rl.losses import group_advantages
from ict_jax.rl.saturation import RANKED_BY, tie_decided
from ict_jax.rl.selectors import canonical_method, resolved_rho, resolved_scope, select, topk_mask
from ict_jax.rl.token_stats import ALL_STATS, U_FORMS, TokenStats
from ict_jax.rng import DIAGNOSE_STREAM, stream_key
from ict_jax.sampling.sampler import make_generate_fn

__all__ = ["LOWEST_P", "PAPER", "Setting", "collect", "ict_all_name", "lowest_p_mask", "outcome_advantages",
           "reanalyse", "run_diagnose", "selector_specs"]

#: The paper's token diagnostics of ICT's selected tokens (docs/method.md §5; Qwen2.5, GSM8K / MATH).
PAPER = {
    "p_mean": 0.18, "p_sd": 0.09,  # "mean probability of the selected tokens 0.18 +- 0.09" (A.3.3)
    "h_ratio_median": (1.03, 0.99),  # high/low-entropy ratio, GSM8K / MATH
    "elbow": "sharp elbow near the top 10 % (A.4.1)",
    "tokens": ("problem-specific content words (\"remainder\", \"duck\", \"seventh\"); \"####\", \"the\", \"is\" "
               "unselected"),
    "adv_corr": "high u goes with positive-advantage responses (A.3.4)",
}
#: Every statistic, under every reading (logp, H1, H2, pmax once; js and pbar_tok per reading).
_COMPUTE = ALL_STATS


@dataclasses.dataclass(frozen=True)
class Setting:
    """One sampling setting: G responses per prompt at temperature T."""

    group_size: int
    temperature: float

    @property
    def name(self) -> str:
        return f"G{self.group_size}_T{self.temperature:g}"


def ict_all_name(form: str) -> str:
    """The name of ICT's selection under ``ties: all`` in reading ``form`` (:func:`selector_specs`)."""
    return f"ict[{form},ties=all]"


#: The diagnose-only selector (no training method): the rho fraction of each response's tokens with the
#: lowest p(o_t) (:func:`lowest_p_mask`).
LOWEST_P = "lowest_p"


def lowest_p_mask(logp: jax.Array, valid: jax.Array, rho: float) -> jax.Array:
    """``lowest_p``: the k = max(1, ceil(rho n)) valid tokens of each response with the lowest p(o_t)
    (docs/method.md §2's count and ties: :func:`ict_jax.rl.selectors.topk_mask` of -logp, scope
    ``sequence``), float32 {0, 1}."""
    return topk_mask(-jnp.asarray(logp, jnp.float32), valid, rho=rho, scope="sequence")


def selector_specs(u_forms: Sequence[str], rho: float | None = None) -> dict[str, tuple[SelectorSection, str]]:
    """name -> (selector section with no warm-up, the reading of u it reads) for every selector the
    diagnostics compare: per reading ``ict[r]``, ``ict[r,ties=all]`` (the same cut keeping every token
    tied at it, ``rl.selector.ties: all``), ``frequent[r]`` (the paper's complement) and
    ``selectable[r]`` (valid and u > 0); then ``entropy`` (20-Entropy: rho 0.2 over the mini-batch),
    ``entropy[sequence]`` (20-Entropy at ICT's rho per response), ``stapo[low_prob_positive]``,
    ``stapo[valid]``, ``random`` (ICT's counts), ``lowest_p`` (ICT's counts, the least likely tokens:
    method :data:`LOWEST_P`, computed by :func:`lowest_p_mask`, not :func:`~ict_jax.rl.selectors.select`)
    and ``all`` (every valid token: the reference row). ``rho`` is ICT's (and its complement's, random's,
    lowest_p's and ``entropy[sequence]``'s) fraction, None = ``rl.selector.rho``'s default for ICT. Every
    other selector uses the default tie rule, ``position``."""
    specs: dict[str, tuple[SelectorSection, str]] = {}
    for form in u_forms:
        for method in ("ict", "frequent", "selectable"):
            specs[f"{method}[{form}]"] = (SelectorSection(method=method, rho=rho if method != "selectable" else None,
                                                          warmup_steps=0), form)
            if method == "ict":
                specs[ict_all_name(form)] = (SelectorSection(method="ict", rho=rho, ties="all", warmup_steps=0), form)
    default = u_forms[0]
    specs["entropy"] = (SelectorSection(method="entropy", warmup_steps=0), default)
    ict_rho = resolved_rho(SelectorSection(method="ict", rho=rho))
    specs["entropy[sequence]"] = (SelectorSection(method="entropy", rho=ict_rho, scope="sequence", warmup_steps=0),
                                  default)
    for over in ("low_prob_positive", "valid"):
        specs[f"stapo[{over}]"] = (SelectorSection(method="stapo", stapo_quantile_over=over, warmup_steps=0), default)
    specs["random"] = (SelectorSection(method="random", rho=rho, warmup_steps=0), default)
    specs[LOWEST_P] = (SelectorSection(method=LOWEST_P, rho=ict_rho, scope="sequence", warmup_steps=0), default)  # type: ignore[arg-type]
    specs["all"] = (SelectorSection(method="dense", warmup_steps=0), default)
    return specs


# ------------------------------------------------------------------------------------------------
# Sampling, rewards, statistics and masks
# ------------------------------------------------------------------------------------------------
def outcome_advantages(correct: np.ndarray, G: int, row_valid: np.ndarray | None = None) -> np.ndarray:
    """GRPO advantages (docs/method.md §3, scale ``group``) of the verifiable outcome R = 1 if correct else
    0, the paper's reward. (The data set's own reward may differ: reasoning-gym scores a wrong but
    extractable answer 0.01, which would make "gave an answer" look like a positive advantage.)"""
    rv = None if row_valid is None else jnp.asarray(row_valid, jnp.float32)
    return np.asarray(group_advantages(jnp.asarray(correct, jnp.float32), G, "group", 1e-6, rv))



def prompt_instruction(dataset: Any, template: str) -> str | None:
    """The instruction each prompt gets after its question (None with template ``none``: as given)."""
    if template == "none":
        return None
    return instruction_for(getattr(dataset, "scorer", None))


def _prompt_ids(dataset: Any, tokenizer: Any, template: str, vocab: int, max_new_tokens: int = 0,
                max_positions: int | None = None) -> list[np.ndarray]:
    """Every prompt through the prompt front door (:func:`ict_jax.data.prompts.encode_prompt`) with the
    data set's instruction; a prompt it refuses is an error naming the prompt, and prompts that with
    ``max_new_tokens`` pass ``max_positions`` (the model's ``max_position_embeddings``) are refused,
    counted, in one line."""
    instruction = instruction_for(getattr(dataset, "scorer", None))
    out, too_long = [], []
    for i, ex in enumerate(dataset):
        try:
            ids = encode_prompt(ex.prompt, tokenizer, template=template, instruction=instruction, vocab_size=vocab).ids
        except UnknownCharacterError as e:
            raise ValueError(f"prompt {i} of {getattr(dataset, 'name', 'the prompts')}: {e}") from None
        except PromptRefused as e:
            raise PromptRefused(f"prompt {i}: {e}") from None
        out.append(ids)
        if not prompt_fits(len(ids), max_new_tokens, max_positions):
            too_long.append(i)
    if too_long:
        first = too_long[0]
        check_prompt_fits(len(out[first]), max_new_tokens, max_positions,
                          where=f"{len(too_long)} of {len(out)} prompts pass the model's positions; the first, prompt "
                                f"{first},")
    return out


def _score(pool: Any, dataset: Any, tokenizer: Any, idx: list[int], real: int, G: int, tokens: np.ndarray,
           valid: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Decode and score the responses of the first ``real`` prompts of ``idx`` (G each; the rest are
    filler rows): ``(texts, reward, correct, row_valid)``, the arrays over every row (filler rows 0)."""
    rows = real * G
    texts = decode_responses(tokenizer, tokens[:rows], valid[:rows])
    exs = [dataset[i] for i in idx[:real] for _ in range(G)]
    checks = pool.check(dataset.scorer, texts, [ex.answer for ex in exs], [ex.meta for ex in exs])
    reward, correct, row_valid = (np.zeros(len(idx) * G, np.float32) for _ in range(3))
    reward[:rows] = [c.reward for c in checks]
    correct[:rows] = [float(c.correct) for c in checks]
    row_valid[:rows] = 1.0
    return texts, reward, correct, row_valid


def _select_all(specs: Mapping[str, tuple[SelectorSection, str]], per: Mapping[str, TokenStats], first: str,
                adv: np.ndarray, valid: np.ndarray, step: int, G: int, key: jax.Array) -> dict[str, np.ndarray]:
    """Every selector's mask (bool) of one sampling batch, its mini-batch, through the train step's
    :func:`~ict_jax.rl.selectors.select`, each reading its own reading of u; ``key``: the root key (the
    random control draws its stream from it at ``step``, the batch index, as in training)."""
    base, out = per[first], {}
    for name, (cfg, form) in specs.items():
        st = TokenStats(base.logp, base.H1, base.H2, per[form].js)
        out[name] = np.asarray(_mask(cfg, st, jnp.asarray(adv), jnp.asarray(valid), step, G, key)) > 0
    return out


def _mask(cfg: SelectorSection, st: TokenStats, adv: jax.Array, valid: jax.Array, step: int, G: int,
          key: jax.Array) -> jax.Array:
    """The mask of one selector spec: :func:`lowest_p_mask` for :data:`LOWEST_P`, else the train step's
    :func:`~ict_jax.rl.selectors.select`."""
    if cfg.method == LOWEST_P:
        return lowest_p_mask(st.logp, valid, resolved_rho(cfg))
    return select(cfg.method, st, adv, valid, step=step, config=cfg, key=key, group_size=G)


def _checked_setting(setting: Setting, max_new_tokens: int) -> tuple[int, float, int]:
    """(G, temperature, max new tokens) of a setting; ValueError (one line) for a G or temperature that
    cannot be diagnosed."""
    G, T = int(setting.group_size), float(setting.temperature)
    if G < 2:
        raise ValueError(f"G = {G}: the diagnostics compare a response with its group; use G >= 2")
    if not T > 0:
        raise ValueError(f"temperature {T}: must be > 0")
    return G, T, int(max_new_tokens)


#: :func:`~ict_jax.rl.saturation.tie_decided` compiled once per candidate-set shape (not op by op)
_tie_decided = jax.jit(tie_decided, static_argnames=("scope", "group_size", "set_rows", "ties", "rho"))


def _ties_all(specs: Mapping[str, tuple[SelectorSection, str]], per: Mapping[str, TokenStats], first: str,
              masks: Mapping[str, np.ndarray], valid: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """The selected tokens the tie at the cut decided (:func:`~ict_jax.rl.saturation.tie_decided`) for every
    top-k selector (:data:`~ict_jax.rl.saturation.RANKED_BY`: ict by u of its reading, entropy by H1), under
    its tie rule (``position``: kept by position; ``all``: kept because they tie), one sampling batch being
    the mini-batch (its candidate set under scope ``batch``)."""
    out = {}
    for name, (cfg, form) in specs.items():
        stat = RANKED_BY.get(canonical_method(cfg.method))
        if stat is None:
            continue
        score = getattr(per[form] if stat == "js" else per[first], stat)
        out[name] = np.asarray(_tie_decided(score, masks[name], valid, scope=resolved_scope(cfg), group_size=G,
                                            ties=cfg.ties, rho=resolved_rho(cfg)))
    return out


def _append_masks(masks: dict[str, list], ties: dict[str, list], rows: int,
                  specs: Mapping[str, tuple[SelectorSection, str]], per: Mapping[str, TokenStats], first: str,
                  adv: np.ndarray, valid: np.ndarray, step: int, G: int, key: jax.Array) -> None:
    """Every selector's mask of one sampling batch (:func:`_select_all`) and the tokens the tie decided
    (:func:`_ties_all`), their first ``rows`` rows appended to ``masks`` / ``ties`` by selector name."""
    batch_masks = _select_all(specs, per, first, adv, valid, step, G, key)
    for name, m in batch_masks.items():
        masks[name].append(m[:rows])
    for name, t in _ties_all(specs, per, first, batch_masks, valid, G).items():
        ties.setdefault(name, []).append(t[:rows])


def collect(model: Any, tokenizer: Any, dataset: Any, setting: Setting, *, u_forms: Sequence[str] = U_FORMS,
            max_new_tokens: int = 256, batch_rows: int = 64, template: str = "qwen_chat", seed: int = 0,
            rho: float | None = None, chunk: int | None = None, pool: Any = None,
            stats_temperature: float | None = None, say: Callable[[str], None] = lambda s: None,
            heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    """Sample ``setting.group_size`` responses to every prompt of ``dataset`` (``batch_rows // G`` prompts,
    at least one, a program run: the mini-batch of the batch-scoped selectors), score them, and return the per-token
    arrays (NumPy, rows prompt-major): ``tokens``, ``valid`` ``[R, N]``; ``logp``, ``H1``, ``H2``,
    ``pmax``; ``js`` and ``pbar_tok`` dicts by reading; ``masks`` by selector name
    (:func:`selector_specs`); ``ties`` by top-k selector name (the selected tokens the tie rule decided);
    per row ``reward`` (the data set's), ``correct``, ``advantage``
    (:func:`outcome_advantages`), ``group``, ``truncated``; ``texts``; ``timing`` (sampling, statistics,
    scoring seconds). ``heartbeat``: told each phase of each batch (sampling, scoring, statistics and masks)
    to name it in its lines. ``rho`` None: ICT's default (:func:`selector_specs`); ``chunk`` None: ``stats.chunk``'s
    default; the statistics go through :func:`ict_jax.rl.group_stats.group_stats` (the train step's)."""
    u_forms = tuple(u_forms)
    G, T, N = _checked_setting(setting, max_new_tokens)
    t_s = T if stats_temperature is None else float(stats_temperature)
    # every statistic under every reading (checked: stats.u_form), blocks of stats.chunk
    request = GroupStatsRequest(G, t_s, StatsSection().chunk if chunk is None else int(chunk), _COMPUTE, u_forms)
    batch_prompts = min(max(1, int(batch_rows) // G), len(dataset))
    prompts = _prompt_ids(dataset, tokenizer, template, model.config.vocab_size, N,
                          model.config.max_position_embeddings)
    Lp = max(len(p) for p in prompts)
    graphdef, state = nnx.split(model)
    gen = make_generate_fn(graphdef, num_samples=G, max_new_tokens=N, temperature=T,
                           eos_ids=tuple(tokenizer.eos_ids), pad_id=int(tokenizer.pad_id))
    stats_fn = compiled_group_stats(graphdef, request)
    specs = selector_specs(u_forms, rho)
    root = jax.random.key(int(seed))  # batch b samples on the diagnose stream at b (ict_jax.rng)
    arrays: dict[str, list] = {k: [] for k in ("tokens", "valid", "logp", "H1", "H2", "pmax", "truncated", "reward",
                                              "correct", "advantage", "group")}
    per_form: dict[str, dict[str, list]] = {f: {"js": [], "pbar_tok": []} for f in u_forms}
    masks: dict[str, list] = {name: [] for name in specs}
    ties: dict[str, list] = {}
    texts: list[str] = []
    timing = {"sample_s": 0.0, "stats_s": 0.0, "score_s": 0.0}
    n_prompts = len(prompts)
    phase = heartbeat.phase if heartbeat is not None else (lambda text: None)
    for b, start in enumerate(range(0, n_prompts, batch_prompts)):
        idx = list(range(start, min(start + batch_prompts, n_prompts)))
        real = len(idx)
        idx += [idx[-1]] * (batch_prompts - real)  # filler prompts keep one compiled shape; dropped below
        ids, mask = pad_left([prompts[i] for i in idx], Lp, int(tokenizer.pad_id))
        say(f"{setting.name}: sampling prompts {start + 1}-{start + real} of {n_prompts} ({G} responses each, up to "
            f"{N} tokens{', compiling first' if b == 0 else ''}) ...")
        which = f"prompts {start + 1}-{start + real} of {n_prompts}"
        phase(f"{setting.name}: sampling {which}" + (" (compiling first)" if b == 0 else ""))
        t0 = time.perf_counter()
        ro = gen(state, ids, mask, stream_key(root, DIAGNOSE_STREAM, b))
        tokens, valid, trunc = (np.asarray(x) for x in jax.block_until_ready((ro.tokens, ro.valid, ro.truncated)))
        timing["sample_s"] += (t_sample := time.perf_counter() - t0)
        rows = real * G
        phase(f"{setting.name}: scoring the responses to {which}")
        t0 = time.perf_counter()
        batch_texts, rew, ok, row_valid = _score(pool, dataset, tokenizer, idx, real, G, tokens, valid)
        timing["score_s"] += time.perf_counter() - t0
        adv = outcome_advantages(ok, G, row_valid)
        vmask = valid.copy()
        vmask[rows:] = False  # filler rows count nowhere
        phase(f"{setting.name}: statistics and masks of {which}" + (" (compiling first)" if b == 0 else ""))
        t0 = time.perf_counter()
        per = stats_fn(state, *group_rows(ids, mask, tokens, valid, G), jnp.asarray(vmask))
        base = per[u_forms[0]]  # logp, H1, H2, pmax: the same under every reading
        _append_masks(masks, ties, rows, specs, per, u_forms[0], adv, vmask, b, G, root)
        jax.block_until_ready(base.logp)
        timing["stats_s"] += (t_stats := time.perf_counter() - t0)
        for k, x in (("tokens", tokens), ("valid", vmask), ("logp", base.logp), ("H1", base.H1), ("H2", base.H2),
                     ("pmax", base.pmax), ("truncated", trunc), ("reward", rew), ("correct", ok > 0),
                     ("advantage", adv), ("group", np.repeat(np.asarray(idx), G))):
            arrays[k].append(np.asarray(x)[:rows])
        for form, k in itertools.product(u_forms, ("js", "pbar_tok")):
            per_form[form][k].append(np.asarray(getattr(per[form], k))[:rows])
        texts += batch_texts
        say(f"{setting.name}: prompts {start + 1}-{start + real} of {n_prompts} sampled in {t_sample:.0f} s, "
            f"statistics and masks in {t_stats:.0f} s ({int(ok[:rows].sum())}/{rows} correct)")
    out = _concatenated(arrays, per_form, masks, ties)
    out.update(texts=texts, timing=timing, u_forms=u_forms, group_size=G,
               selector_forms={k: f for k, (_, f) in specs.items()})
    return out


def _concatenated(arrays: Mapping[str, list], per_form: Mapping[str, Mapping[str, list]],
                  masks: Mapping[str, list], ties: Mapping[str, list]) -> dict[str, Any]:
    """The batches' per-token and per-row arrays of :func:`collect`, each concatenated over the batches."""
    cat = lambda xs: np.concatenate(xs, axis=0)  # noqa: E731
    out: dict[str, Any] = {k: cat(v) for k, v in arrays.items()}
    out["valid"] = out["valid"].astype(bool)
    out.update({k: {f: cat(v[k]) for f, v in per_form.items()} for k in ("js", "pbar_tok")})
    out["masks"] = {k: cat(v) for k, v in masks.items()}
    out["ties"] = {k: cat(v) for k, v in ties.items()}
    return out


def _save_arrays(data: Mapping[str, Any], path: Path) -> None:
    """The per-token arrays of a setting (to recompute the diagnostics without sampling again)."""
    flat = {k: np.asarray(v) for k, v in data.items()
            if isinstance(v, np.ndarray)}
    for key in ("js", "pbar_tok", "masks", "ties"):
        flat.update({f"{key}.{k}": np.asarray(v) for k, v in data.get(key, {}).items()})
    np.savez_compressed(path, **flat)


def _load_arrays(path: Path, meta: Mapping[str, Any], u_forms: Sequence[str]) -> dict[str, Any]:
    """The :func:`collect` output of a setting from its ``.npz`` (:func:`_save_arrays`) and the settings
    saved in ``diagnose.json``."""
    z = np.load(path)
    data: dict[str, Any] = {k: z[k] for k in z.files if "." not in k}
    for key in ("js", "pbar_tok", "masks", "ties"):  # ties: absent from arrays saved before they were
        data[key] = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith(key + ".")}
    data.update(u_forms=tuple(u_forms), group_size=int(meta["setting"]["group_size"]), timing=meta["timing"],
                texts=[""] * len(data["tokens"]))
    data["selector_forms"] = {k: f for k, (_, f) in selector_specs(u_forms).items()}
    return data


def reanalyse(out: str | Path, tokenizer: Any, *, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Rebuild the diagnostics of a finished :func:`run_diagnose` in ``out`` from its saved per-token arrays
    (no sampling): the advantages from correctness (:func:`outcome_advantages`), the STAPO masks from them
    (the one selector that reads A), the masks of every selector the arrays predate (ICT's ``ties: all``,
    ``entropy[sequence]``, ``lowest_p``; with their tie records for the top-k selectors), then
    :func:`diagnostics`; rewrites ``diagnose.json``,
    ``diagnose.md`` and the plots. Wall and phase times are the original run's."""
    out = Path(out)
    results = json.loads((out / "diagnose.json").read_text())
    forms = results["u_forms"]
    specs = selector_specs(forms, results["rho"])
    for name, old in results["settings"].items():
        data = _load_arrays(out / f"{name}.npz", old, forms)
        G = data["group_size"]
        data["advantage"] = outcome_advantages(data["correct"], G)
        st = TokenStats(jnp.asarray(data["logp"]), jnp.asarray(data["H1"]), None, None)
        rows_per_batch = results.get("batch_rows", 64) // G * G or G
        for sel_name, (cfg, form) in specs.items():
            # a selector absent from arrays saved before it was (not random: its masks drew the run's keys)
            missing = sel_name not in data["masks"] and canonical_method(cfg.method) != "random"
            if canonical_method(cfg.method) != "stapo" and not missing:
                continue
            ranked = RANKED_BY.get(canonical_method(cfg.method)) if missing else None  # its tie record too
            masks, ties = [], []
            for start in range(0, len(data["tokens"]), rows_per_batch):  # the original mini-batches
                sl = slice(start, start + rows_per_batch)
                sub = TokenStats(st.logp[sl], st.H1[sl], None, jnp.asarray(data["js"][form][sl]))
                v = jnp.asarray(data["valid"][sl])
                m = np.asarray(_mask(cfg, sub, jnp.asarray(data["advantage"][sl]), v, 0, G, jax.random.key(0))) > 0
                masks.append(m)
                if ranked:
                    ties.append(np.asarray(_tie_decided(getattr(sub, ranked), m, v, scope=resolved_scope(cfg),
                                                        group_size=G, ties=cfg.ties, rho=resolved_rho(cfg))))
            data["masks"][sel_name] = np.concatenate(masks)
            if ranked:
                data["ties"][sel_name] = np.concatenate(ties)
        d = diagnostics(data, tokenizer)
        d.update(wall_s=old.get("wall_s"), setting=old["setting"], examples=marked_examples(data, tokenizer, forms[0]))
        results["settings"][name] = d
        _save_arrays(data, out / f"{name}.npz")
        plot_setting(d, out / f"{name}.png", title=f"{results.get('title', '')} {name}".strip())
        say(f"{name}: reanalysed")
    (out / "diagnose.json").write_text(json.dumps(results, indent=1))
    (out / "diagnose.md").write_text(format_markdown(results))
    return results


def run_diagnose(model: Any, tokenizer: Any, dataset: Any, *, settings: Sequence[Setting],
                 u_forms: Sequence[str] = U_FORMS, max_new_tokens: int = 256, batch_rows: int = 64,
                 template: str = "qwen_chat", seed: int = 0, rho: float | None = None, chunk: int | None = None,
                 reward_workers: int = 1, out: str | Path | None = None, title: str = "",
                 say: Callable[[str], None] = lambda s: None, heartbeat_s: float | None = None,
                 heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    """Every setting: :func:`collect`, :func:`diagnostics`; with ``out`` write ``diagnose.json``,
    ``diagnose.md``, ``<setting>.png`` and the per-token arrays ``<setting>.npz`` there. Returns
    ``{"settings": {name: diagnostics}, ...}``. ``rho`` / ``chunk`` None: the config's defaults (ICT's
    rho, ``stats.chunk``); responses are scored with ``rl.reward.time_limit``'s default.

    ``say`` gets a line as each setting and batch starts and ends and, whenever ``heartbeat_s`` seconds
    (None: ``$ICT_JAX_HEARTBEAT_S``, else 30) pass without one, a heartbeat naming the phase that runs
    (:class:`ict_jax.heartbeat.Heartbeat`): ``G8_T1: sampling prompts 1-4 of 4: still running, 2m30s so far
    (6m10s in all)``; a sampler call of a real model on a CPU takes minutes. ``heartbeat``: the caller's
    running heartbeat to tell the phases instead (``ict-jax diagnose``'s, from its first second; its lines go
    where the caller's go)."""
    rho = resolved_rho(SelectorSection(method="ict", rho=rho))
    results: dict[str, Any] = {"title": title, "dataset": getattr(dataset, "name", ""), "prompts": len(dataset),
                               "max_new_tokens": int(max_new_tokens), "batch_rows": int(batch_rows),
                               "u_forms": list(u_forms), "rho": rho, "seed": int(seed), "template": template,
                               "instruction": prompt_instruction(dataset, template), "paper": PAPER, "settings": {}}
    outdir = None if out is None else Path(out)
    if outdir is not None:
        outdir.mkdir(parents=True, exist_ok=True)
    beat = heartbeat if heartbeat is not None else Heartbeat(say, interval=heartbeat_s)

    tell = beat.counted(say)  # every line of the run counts for the heartbeat

    beat.phase("starting the reward workers")
    with contextlib.nullcontext() if heartbeat is not None else beat, \
            RewardPool(reward_workers, time_limit=RewardSection().time_limit) as pool:
        for i, setting in enumerate(settings, start=1):
            tell(f"{setting.name}: setting {i} of {len(settings)} (G = {setting.group_size}, "
                 f"T = {setting.temperature})")
            t0 = time.perf_counter()
            data = collect(model, tokenizer, dataset, setting, u_forms=u_forms, max_new_tokens=max_new_tokens,
                           batch_rows=batch_rows, template=template, seed=seed, rho=rho, chunk=chunk, pool=pool,
                           say=tell, heartbeat=beat)
            beat.phase(f"{setting.name}: the diagnostics of the selected tokens")
            d = diagnostics(data, tokenizer)
            d["wall_s"] = time.perf_counter() - t0
            d["setting"] = {"group_size": setting.group_size, "temperature": setting.temperature}
            d["examples"] = marked_examples(data, tokenizer, u_forms[0])
            results["settings"][setting.name] = d
            tell(f"{setting.name}: done in {d['wall_s']:.0f} s")
            beat.phase(f"{setting.name}: writing the report and plots")
            if outdir is not None:
                _save_arrays(data, outdir / f"{setting.name}.npz")
                plot_setting(d, outdir / f"{setting.name}.png", title=f"{title} {setting.name}".strip())
                (outdir / "diagnose.json").write_text(json.dumps(results, indent=1))
                (outdir / "diagnose.md").write_text(format_markdown(results))
            beat.phase(None)
        beat.phase("stopping the reward workers")
    beat.phase(None)
    return results
