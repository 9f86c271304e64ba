"""An independent float64 recurrence for every op, written token by token, one sequence at a time.

It shares no code with fla_jax: it is what the tests compare every backend against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def naive(op, q, k, v, g=None, beta=None, *, scale=None, h0=None, cu=None, l2norm=False):
    """Returns `(o [B, T, HV, V], ht [N, HV, K, V])` in float64. `cu` is a Python list or None."""
    f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
    q, k, v, g, beta, h0 = map(f64, (q, k, v, g, beta, h0))
    if l2norm:
        q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    head = np.arange(HV) // (HV // H)  # value head -> q/k head
    scale = K**-0.5 if scale is None else scale
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]

    def step(S, x):
        qt, kt, vt, gt, bt = x
        qh, kh = qt[head], kt[head]
        if gt is not None:
            S = S * (jnp.exp(gt)[:, :, None] if gt.ndim == 2 else jnp.exp(gt)[:, None, None])
        if bt is not None:
            vt = bt[:, None] * (vt - jnp.einsum("hkv,hk->hv", S, kh))
        S = S + kh[:, :, None] * vt[:, None, :]
        return S, scale * jnp.einsum("hkv,hk->hv", S, qh)

    o = jnp.zeros((B, T, HV, V), jnp.float64)
    finals = []
    for n, (b, s, e) in enumerate(seqs):
        S = jnp.zeros((HV, K, V), jnp.float64) if h0 is None else h0[n]
        if e > s:
            sl = lambda x: None if x is None else x[b, s:e]
            S, ob = jax.lax.scan(step, S, (sl(q), sl(k), sl(v), sl(g), sl(beta)))
            o = o.at[b, s:e].set(ob)
        finals.append(S)
    return o, jnp.stack(finals)
