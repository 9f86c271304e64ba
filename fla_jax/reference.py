"""The `reference` backend: the recurrences token by token, as a `lax.scan` in float32.

Per head, with state `S` in R^{K x V}:

* gated (simple GLA, GLA):  `S = Diag(exp(g_t)) S + k_t v_t^T`
* delta (delta rule, GDN):  `S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T`
* output:                    `o_t = S^T q_t` (q already carries the scale)

The scan runs over blocks of 64 tokens with a checkpointed inner scan, so differentiating it keeps
one state per block, never one per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fla_jax import _layout
from fla_jax._problem import Problem

_BLOCK = 64
_HI = lax.Precision.HIGHEST


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens):
    """Runs the recurrence; arguments as `fla_jax._problem.Problem` describes, q pre-scaled."""
    B, T, H, _ = q.shape
    cdt = p.compute_dtype
    layout = _layout.make_layout(T, cu_seqlens, 1)
    L = layout.length
    Lp = _layout.cdiv(L, _BLOCK) * _BLOCK
    S = layout.num_seqs
    # Token-level sequence flags, padded to whole blocks with padding tokens.
    pad = Lp - L
    reset = jnp.pad(layout.reset, (0, pad), constant_values=True)
    seq = jnp.pad(layout.seq, (0, pad), constant_values=S)
    is_last = jnp.zeros((Lp,), bool).at[layout.last].max(layout.nonempty)

    def prep(x):
        x = _layout.pack(None if x is None else x.astype(cdt), layout)
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x, 0, 1).reshape(Lp // _BLOCK, _BLOCK, B, *x.shape[2:])

    xs = tuple(prep(x) for x in (q, k, v, g, beta))
    flags = tuple(f.reshape(Lp // _BLOCK, _BLOCK) for f in (reset, seq, is_last))
    table = _layout.state_table(h0.astype(cdt), layout)  # [B, S+1, H, K, V]

    def token(carry, x):
        state, ht = carry
        (qt, kt, vt, gt, bt), (rt, st, lt) = x
        state = jnp.where(rt, table[:, st], state)
        if gt is not None:
            decay = jnp.exp(gt)
            state = state * (decay[..., None] if gt.ndim == 3 else decay[..., None, None])
        if p.delta:
            vt = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", state, kt, precision=_HI))
        state = state + kt[..., :, None] * vt[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", state, qt, precision=_HI)
        ht = ht.at[:, st].set(jnp.where(lt, state, ht[:, st]), mode="drop")
        return (state, ht), o

    @jax.checkpoint
    def block(carry, x):
        return lax.scan(token, carry, x)

    state0 = jnp.zeros_like(table[:, 0])
    (_, ht), o = lax.scan(block, (state0, table), (xs, flags))
    o = jnp.swapaxes(o.reshape(Lp, B, H, -1), 0, 1)[:, :L]
    o = _layout.unpack(o, layout, T)
    return o, _layout.final_states(ht[:, :S], layout)
