"""Independent PyTorch reference for ict_jax/grpo.py (docs/method.md §3-§5), written from the docs/method.md text.

Plain torch in float64, no import of ict_jax. Builds one fixed, seeded batch (P = 3 prompts x G = 4,
T = 7) plus a group-of-one batch and a padded (row_valid) batch, and writes every golden value to
grpo_golden.json next to this file (or to the path given as the first argument):

- advantages in the three scale_rewards modes;
- per-token ratio, clipped surrogate (clip-higher, with and without dual clip) and k3;
- the loss, its docs/method.md §5 metrics and d loss / d logp for every loss_agg x normalize_over x kl_masked
  combination and each method's mask (dense = valid; fixed hand-made masks for ict, entropy, stapo,
  random), plus dual clip off and kl_coef = 0 variants.

Inputs are float32-representable (generated in float32) so the float32 JAX code sees the same numbers.
Padding tokens hold -inf / NaN / +inf log-probs on purpose (NaN/inf safety).

Run: python tests/rl/golden/grpo_reference.py [out.json]
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import torch

torch.set_default_dtype(torch.float64)

P, G, T = 3, 4, 7
B = P * G
EPS_ADV = 1e-6
EPS_LOW, EPS_HIGH, DUAL_C, KL_COEF = 0.2, 0.28, 3.0, 0.05


# ------------------------------------------------------------------------------------------- §3
def advantages(rewards, group_size, mode, eps=EPS_ADV, row_valid=None):
    """Loop over groups, one group at a time."""
    n_rows = len(rewards)
    if row_valid is None:
        row_valid = [True] * n_rows
    real_all = [float(rewards[i]) for i in range(n_rows) if row_valid[i]]
    if len(real_all) >= 2:
        batch_std = torch.tensor(real_all).std(unbiased=True).item()
    else:
        batch_std = 1.0
    out = [0.0] * n_rows
    for g in range(n_rows // group_size):
        idx = [g * group_size + j for j in range(group_size) if row_valid[g * group_size + j]]
        vals = [float(rewards[i]) for i in idx]
        if not vals:
            continue
        if len(vals) == 1:  # verl: a group of one has mean 0, std 1
            a = vals[0] if mode == "none" else vals[0] / (1.0 + eps)
            out[idx[0]] = a
            continue
        if max(vals) == min(vals):
            continue  # all equal: zero advantage, exactly
        t = torch.tensor(vals)
        mean = t.mean().item()
        if mode == "group":
            scale = t.std(unbiased=True).item() + eps
        elif mode == "batch":
            scale = batch_std + eps
        else:
            scale = 1.0
        for i, v in zip(idx, vals):
            out[i] = (v - mean) / scale
    return out


# ------------------------------------------------------------------------------------------- §4
def ratio_of(logp, logp_old):
    return torch.exp(torch.clamp(logp - logp_old, min=-20.0, max=20.0))


def surrogate(logp, logp_old, adv_bt, dual_c):
    r = ratio_of(logp, logp_old)
    unclipped = r * adv_bt
    clipped = torch.clamp(r, 1.0 - EPS_LOW, 1.0 + EPS_HIGH) * adv_bt
    s = torch.minimum(unclipped, clipped)
    if dual_c is not None:
        s = torch.where(adv_bt < 0, torch.maximum(s, dual_c * adv_bt), s)
    return s


def k3(logp, logp_ref):
    d = torch.clamp(logp_ref - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


def agg(x, w, d, mode, n_resp):
    """w, d: bool [B, T]; x may hold garbage where w is False. seq-mean-token-mean averages over the
    rows that have a token in d (a row with no selected token under normalize_over=selected has no
    per-row mean and is left out of R); seq-mean-token-sum-norm over the n_resp rows with a valid token."""
    x = torch.where(w, x, torch.zeros_like(x))
    if mode == "seq-mean-token-mean":
        total = torch.zeros(())
        rows = 0
        for i in range(x.shape[0]):
            if d[i].any():
                total = total + x[i].sum() / int(d[i].sum())
                rows += 1
        return total / max(1, rows)
    if mode == "token-mean":
        return x.sum() / max(1, int(d.sum()))
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (max(1, n_resp) * x.shape[1])
    raise ValueError(mode)


def loss_and_metrics(logp_in, logp_old, logp_ref, adv, valid, M, *, loss_agg, normalize_over, kl_masked,
                     kl_coef=KL_COEF, dual_c=DUAL_C):
    logp = logp_in.clone().requires_grad_(True)
    sel = M & valid
    w_kl = sel if kl_masked else valid
    d_pg = sel if normalize_over == "selected" else valid
    d_kl = w_kl if normalize_over == "selected" else valid
    n_resp = int(valid.any(dim=1).sum())
    adv_bt = adv[:, None].expand(B, T)
    zero = torch.zeros(B, T)
    # Sanitise masked-out inputs, then compute.
    s = surrogate(torch.where(sel, logp, zero), torch.where(sel, logp_old, zero),
                  torch.where(sel, adv_bt, zero), dual_c)
    pg_loss = -agg(s, sel, d_pg, loss_agg, n_resp)
    kl_term = agg(k3(torch.where(w_kl, logp, zero), torch.where(w_kl, logp_ref, zero)), w_kl, d_kl,
                  loss_agg, n_resp)
    loss = pg_loss + kl_coef * kl_term if kl_coef != 0 else pg_loss
    (grad,) = torch.autograd.grad(loss, logp)
    with torch.no_grad():
        lp = torch.where(valid, logp_in, zero)
        r = ratio_of(lp, torch.where(valid, logp_old, zero))
        is_clipped = valid & (((adv_bt > 0) & (r > 1 + EPS_HIGH)) | ((adv_bt < 0) & (r < 1 - EPS_LOW)))
        n_valid, n_sel = int(valid.sum()), int(sel.sum())
        kv = torch.where(valid, k3(lp, torch.where(valid, logp_ref, zero)), zero)
        metrics = {
            "loss/policy": pg_loss.item(),
            "loss/kl": kl_term.item(),
            "kl/valid_mean": kv.sum().item() / max(1, n_valid),
            "clip/frac_selected": int((is_clipped & sel).sum()) / max(1, n_sel),
            "clip/frac_unselected": int((is_clipped & valid & ~sel).sum()) / max(1, n_valid - n_sel),
            "mask/selected_frac": n_sel / max(1, n_valid),
        }
    return loss.item(), metrics, grad


# ------------------------------------------------------------------------------------------- data
def build_batch():
    gen = torch.Generator().manual_seed(1234)
    lengths = [7, 5, 3, 6, 7, 4, 2, 7, 6, 1, 0, 5]  # row 10 is an empty (padding) response
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, :n] = True
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float32) * 3.0 - 0.05
    delta = torch.randn(B, T, generator=gen, dtype=torch.float32) * 0.3
    logp_old = logp - delta
    logp_ref = logp + torch.randn(B, T, generator=gen, dtype=torch.float32) * 0.5
    # Hand-placed extremes on valid tokens: ratios far beyond the clip bounds, clip-higher band,
    # the [-20, 20] clamp of log r and of k3's log difference.
    logp_old[0, 1] = logp[0, 1] - 0.25     # r = e^0.25 = 1.284 > 1.28 (A > 0)
    logp_old[0, 2] = logp[0, 2] - 0.22     # r = 1.246: inside clip-higher band (1.2, 1.28)
    logp_old[1, 0] = logp[1, 0] + 30.0     # log r = -30 -> clamped to -20 (A < 0)
    logp_old[3, 2] = logp[3, 2] - 1.6      # r = 4.95, A < 0: dual clip
    logp_old[3, 4] = logp[3, 4] + 0.7      # r = 0.50 < 0.8, A < 0: clipped
    logp_old[8, 1] = logp[8, 1] - 25.0     # log r = 25 -> clamped to 20, A < 0: dual clip
    logp_old[8, 3] = logp[8, 3] + 0.4      # r = 0.67 < 0.8, A < 0: clipped
    logp_ref[2, 0] = logp[2, 0] + 25.0     # k3 log difference clamped to 20, k3 clamped to 10
    logp_ref[4, 3] = logp[4, 3] + 2.5      # k3 = e^2.5 - 3.5 = 8.68
    logp_ref[7, 5] = logp[7, 5] - 30.0     # d = -20: k3 = 19 + e^-20 -> clamped to 10
    # NaN / inf at padding: must never reach the loss or its gradient.
    logp_old[1, 6] = float("nan")
    logp[2, 5] = float("-inf")
    logp_ref[10, 0] = float("inf")
    logp[11, 6] = float("nan")
    logp_old[6, 4] = float("-inf")
    rewards = [1.0, 0.0, 1.0, 0.0,   0.7, 0.7, 0.7, 0.7,   0.0, 1.0, 0.5, 0.0]
    masks = {"dense": valid.clone()}
    rnd = torch.Generator().manual_seed(99)
    for name, rate in (("ict", 0.3), ("entropy", 0.2), ("random", 0.3)):
        m = (torch.rand(B, T, generator=rnd) < rate) & valid
        for i in range(B):  # ict / random (scope sequence) keep >= 1 token per real response
            if name != "entropy" and valid[i].any() and not m[i].any():
                m[i, int(torch.randint(int(valid[i].sum()), (1,), generator=rnd))] = True
        masks[name] = m
    m = valid.clone()  # stapo: valid minus a few silenced tokens of A > 0 responses
    for i, t in ((0, 3), (0, 5), (2, 1), (9, 0)):
        m[i, t] = False
    masks["stapo"] = m
    # Guarantee the interesting cases: selected extremes, a real row with no selected token (entropy).
    masks["ict"][0, 1] = masks["ict"][3, 2] = masks["ict"][8, 1] = True
    masks["entropy"][5] = False
    masks["entropy"][1, 0] = masks["entropy"][0, 2] = True
    return rewards, valid, logp.double(), logp_old.double(), logp_ref.double(), masks


def f32_round(x):
    return torch.tensor(x, dtype=torch.float32).double()


def tolist(x):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return x


def main(out_path: Path) -> None:
    rewards, valid, logp, logp_old, logp_ref, masks = build_batch()
    modes = ("group", "batch", "none")
    rewards_one = [1.0, 0.0, 0.5, 1.0, -0.2]
    rewards_pad = [1.0, 0.0, 0.0, 1.0,   1.0, 9.0, 9.0, 9.0,   0.0, 0.0, 0.0, 0.0]
    row_valid_pad = [True, True, False, True,   True, False, False, False,   False, False, False, False]
    adv_golden = {
        "main": {"rewards": rewards, "group_size": G, **{m: advantages(rewards, G, m) for m in modes}},
        "group_of_one": {"rewards": rewards_one, "group_size": 1,
                         **{m: advantages(rewards_one, 1, m) for m in modes}},
        "row_valid": {"rewards": rewards_pad, "group_size": G, "row_valid": row_valid_pad,
                      **{m: advantages(rewards_pad, G, m, row_valid=row_valid_pad) for m in modes}},
    }
    adv = f32_round(advantages(rewards, G, "group"))  # the loss's input advantages
    adv_bt = adv[:, None].expand(B, T)
    zero = torch.zeros(B, T)
    lp, lpo, lpr = (torch.where(valid, x, zero) for x in (logp, logp_old, logp_ref))
    per_token = {  # on valid tokens (padding zeroed)
        "ratio": tolist(ratio_of(lp, lpo)),
        "surr_dual": tolist(surrogate(lp, lpo, adv_bt, DUAL_C)),
        "surr_nodual": tolist(surrogate(lp, lpo, adv_bt, None)),
        "k3": tolist(k3(lp, lpr)),
    }
    aggs = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
    combos = [(a, n, k, KL_COEF, DUAL_C) for a, n, k in itertools.product(aggs, ("selected", "valid"), (True, False))]
    combos += [(a, "selected", True, 0.0, DUAL_C) for a in aggs]  # kl_coef = 0
    combos += [(a, "selected", True, KL_COEF, None) for a in aggs]  # dual clip off
    cases = []
    for loss_agg, norm, kl_masked, kl_coef, dual_c in combos:
        for method, M in masks.items():
            loss, metrics, grad = loss_and_metrics(
                logp, logp_old, logp_ref, adv, valid, M, loss_agg=loss_agg, normalize_over=norm,
                kl_masked=kl_masked, kl_coef=kl_coef, dual_c=dual_c)
            assert all(math.isfinite(v) for v in metrics.values()) and torch.isfinite(grad).all()
            cases.append({"method": method, "loss_agg": loss_agg, "normalize_over": norm,
                          "kl_masked": kl_masked, "kl_coef": kl_coef,
                          "dual_clip_c": dual_c, "loss": loss, "metrics": metrics,
                          "grad_logp": tolist(grad)})
    golden = {
        "about": "written by tests/rl/golden/grpo_reference.py (PyTorch, float64); do not edit",
        "config": {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "eps_adv": EPS_ADV},
        "advantages": adv_golden,
        "inputs": {"logp": tolist(logp), "logp_old": tolist(logp_old), "logp_ref": tolist(logp_ref),
                   "adv": tolist(adv), "valid": tolist(valid.int()),
                   "masks": {k: tolist(v.int()) for k, v in masks.items()}},
        "per_token": per_token,
        "loss_cases": cases,
    }
    out_path.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("grpo_golden.json"))
