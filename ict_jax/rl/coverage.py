"""What a selector reaches (docs/method.md §5): where in the responses its selected tokens lie.

u's ceiling falls with the number of rollouts active at t (docs/method.md §1), so a top-k cut by u on
a confident model lies where every rollout of the group is still running. These measures say where a
mask's selected tokens are, for any selector; the train step logs :func:`reach_shares` every step and
``ict-jax diagnose`` reports both per selector on a batch.

Definitions, for a batch of B = P*G rows prompt-major (row = p*G + j). A row counts when
``row_valid > 0``; its length L_i is its number of response tokens (``response_valid``, the EOS that
ended it included; responses are right-padded, so they occupy t = 0..L_i - 1). A token is selected
when M[i,t] > 0 on a real response token of a row that counts. With S the number of selected tokens
(every share is 0 when S = 0, float32):

- ``mask/selected_eos_frac``: selected tokens that are their response's EOS: t = L_i - 1 of a row
  that did not hit the length limit (``truncated`` 0; the last token of a truncated response is no EOS);
- ``mask/selected_after_shortest_frac``: selected tokens at t >= min_j L_j, the minimum over the rows of
  the group that count: at or past the position just after the group's shortest response's last token,
  where fewer than G of the group's rollouts are still active. The EOS of the shortest response itself
  (t = min L - 1) is not after it;
- ``mask/selected_truncated_frac``: selected tokens of rows that hit the length limit (``truncated`` 1);
- ``mask/selected_neg_adv_frac``: selected tokens of rows with advantage A_i < 0.

:func:`selected_share_by_bin`: per bin of ``bin_size`` positions (t in [b*bin_size, (b+1)*bin_size)),
the share of that bin's valid tokens that are selected (0 for a bin without valid tokens), with the
valid-token count of each bin beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["REACH_KEYS", "reach_shares", "response_lengths", "selected_share_by_bin"]

F32 = jnp.float32
Tokens = Float[Array, "B T"] | Bool[Array, "B T"]
#: The metric names of :func:`reach_shares` (docs/method.md §5).
REACH_KEYS = ("mask/selected_eos_frac", "mask/selected_after_shortest_frac", "mask/selected_truncated_frac",
              "mask/selected_neg_adv_frac")


def response_lengths(response_valid: Tokens, row_valid: Float[Array, " B"] | None = None) -> Int[Array, " B"]:
    """L_i: the response tokens of each row (``response_valid > 0``, the EOS included), 0 for a row that
    does not count (``row_valid`` 0), int32 ``[B]``."""
    n = jnp.sum(jnp.asarray(response_valid) > 0, axis=1, dtype=jnp.int32)
    return n if row_valid is None else jnp.where(jnp.asarray(row_valid) > 0, n, 0)


def reach_shares(mask: Tokens, response_valid: Tokens, truncated: Float[Array, " B"],
                 advantages: Float[Array, " B"], group_size: int,
                 row_valid: Float[Array, " B"] | None = None) -> dict[str, jax.Array]:
    """The four shares of the selected tokens of the module docstring, float32 scalars keyed by
    :data:`REACH_KEYS`; all 0 when nothing is selected. Rows prompt-major in groups of ``group_size``."""
    mask, rv = jnp.asarray(mask), jnp.asarray(response_valid) > 0
    B, T = rv.shape
    if group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch size B={B}")
    real = jnp.ones((B,), bool) if row_valid is None else jnp.asarray(row_valid) > 0
    sel = (mask > 0) & rv & real[:, None]
    length = response_lengths(rv, real)
    truncated = jnp.asarray(truncated) > 0
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    eos = (t == (length - 1)[:, None]) & ~truncated[:, None]
    # the group's shortest response among the rows that count (T + 1 for a group with none: nothing after)
    shortest = jnp.where(real, length, T + 1).reshape(B // group_size, group_size).min(axis=1)
    after = t >= jnp.repeat(shortest, group_size)[:, None]
    rows = {"mask/selected_truncated_frac": truncated, "mask/selected_neg_adv_frac": jnp.asarray(advantages) < 0}
    n_sel = jnp.maximum(jnp.sum(sel, dtype=jnp.int32), 1).astype(F32)

    def share(where: jax.Array) -> jax.Array:
        return jnp.sum(sel & where, dtype=jnp.int32).astype(F32) / n_sel

    out = {"mask/selected_eos_frac": share(eos), "mask/selected_after_shortest_frac": share(after)}
    out.update({k: share(v[:, None]) for k, v in rows.items()})
    return {k: out[k] for k in REACH_KEYS}


def selected_share_by_bin(mask: Tokens, valid: Tokens, bin_size: int = 16
                          ) -> tuple[Float[Array, " nbins"], Int[Array, " nbins"]]:
    """(share, valid): for each bin b of ``bin_size`` positions (t in [b*bin_size, (b+1)*bin_size); the
    last bin may be shorter), the share of the bin's valid tokens that are selected (M > 0 and valid),
    0 where the bin has no valid token, float32; and the bin's valid-token count, int32."""
    if bin_size < 1:
        raise ValueError(f"bin_size={bin_size} must be >= 1")
    v = jnp.asarray(valid) > 0
    sel = (jnp.asarray(mask) > 0) & v
    B, T = v.shape
    nbins = -(-T // bin_size)
    pad = nbins * bin_size - T

    def per_bin(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, ((0, 0), (0, pad)))
        return jnp.sum(x.reshape(B, nbins, bin_size), axis=(0, 2), dtype=jnp.int32)

    n_valid, n_sel = per_bin(v), per_bin(sel)
    return n_sel.astype(F32) / jnp.maximum(n_valid, 1).astype(F32), n_valid
