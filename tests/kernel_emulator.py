"""Pure-JAX stand-ins for the simple_gla TileLang programs, with the same inputs and outputs
(see kernels/simple_gla/*.py): they let CPU tests drive the tilelang backend's Python glue
(padding, cumulative gates, custom_vjp, partitioning). Written independently of fla_jax/xla.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

C = 64
f32 = jnp.float32


def _chunks(x):
    B, T = x.shape[:2]
    return x.reshape(B, T // C, C, *x.shape[2:]).astype(f32)


def _scan_states(k, v, G, h0, reverse=False, q=None, scale=1.0):
    """Forward: states before each chunk; reverse (q given): state gradients after each chunk."""
    kc, vc, Gc = _chunks(k), _chunks(v), _chunks(G)  # [B, N, C, H, .]
    qc = None if q is None else _chunks(q)

    def step(S, n):
        g = Gc[:, n]  # [B, C, H]
        glast = g[:, -1]  # [B, H]
        if qc is None:
            upd = jnp.einsum("bchk,bchv->bhkv", kc[:, n] * jnp.exp(glast[:, None] - g)[..., None], vc[:, n])
        else:
            upd = scale * jnp.einsum("bchk,bchv->bhkv", qc[:, n] * jnp.exp(g)[..., None], vc[:, n])
        return jnp.exp(glast)[..., None, None] * S + upd, S

    order = jnp.arange(kc.shape[1])
    final, states = jax.lax.scan(step, h0.astype(f32), order[::-1] if reverse else order)
    states = jnp.moveaxis(states, 0, 1)
    return (states[:, ::-1] if reverse else states), final


def fwd_h(k, v, G, h0):
    h, ht = _scan_states(k, v, G, h0)
    return h.astype(k.dtype), ht


def fwd_o(q, k, v, G, h, *, scale):
    qc, kc, vc, Gc = _chunks(q), _chunks(k), _chunks(v), _chunks(G)
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    decay = jnp.where(mask, jnp.exp(Gc[:, :, :, None] - Gc[:, :, None, :]), 0.0)  # [B, N, i, j, H]
    A = jnp.einsum("bnihk,bnjhk->bnijh", qc, kc) * decay * scale
    o = jnp.einsum("bnijh,bnjhv->bnihv", A, vc)
    o += scale * jnp.einsum("bnihk,bnhkv->bnihv", qc * jnp.exp(Gc)[..., None], h.astype(f32))
    return o.reshape(q.shape[0], q.shape[1], *o.shape[3:]).astype(q.dtype)


def bwd_dh(q, do, G, dht, *, scale):
    dh, dh0 = _scan_states(q, do, G, dht, reverse=True, q=q, scale=scale)
    return dh.astype(q.dtype), dh0


def bwd_dqkvg(q, k, v, G, h, do, dh, *, scale):
    qc, kc, vc, Gc, doc = (_chunks(x) for x in (q, k, v, G, do))
    h, dh = h.astype(f32), dh.astype(f32)
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    decay = jnp.where(mask, jnp.exp(Gc[:, :, :, None] - Gc[:, :, None, :]), 0.0)
    A = jnp.einsum("bnihk,bnjhk->bnijh", qc, kc) * decay * scale
    glast = Gc[:, :, -1:]  # [B, N, 1, H]
    kd = kc * jnp.exp(glast - Gc)[..., None]
    dv = jnp.einsum("bnchk,bnhkv->bnchv", kd, dh) + jnp.einsum("bnijh,bnihv->bnjhv", A, doc)
    dS = jnp.einsum("bnihv,bnjhv->bnijh", doc, vc) * decay * scale
    dq_inter = scale * jnp.exp(Gc)[..., None] * jnp.einsum("bnihv,bnhkv->bnihk", doc, h)
    dk_inter = jnp.exp(glast - Gc)[..., None] * jnp.einsum("bnihv,bnhkv->bnihk", vc, dh)
    dq = dq_inter + jnp.einsum("bnijh,bnjhk->bnihk", dS, kc)
    dk = dk_inter + jnp.einsum("bnijh,bnihk->bnjhk", dS, qc)
    dG = jnp.sum(qc * dq - kc * dk, -1)
    last = jnp.exp(glast[:, :, 0]) * jnp.sum(h * dh, (-1, -2)) + jnp.sum(kc * dk_inter, (2, 4))
    dG = dG.at[:, :, -1].add(last)
    flat = lambda x, dt: x.reshape(q.shape[0], q.shape[1], *x.shape[3:]).astype(dt)
    return flat(dq, q.dtype), flat(dk, k.dtype), flat(dv, v.dtype), flat(dG, f32)


PROGRAMS = {"_h": fwd_h, "_o": fwd_o, "_dh": bwd_dh, "_dqkvg": bwd_dqkvg}


def call(target, results, *args, **attrs):
    """Drop-in for fla_jax.tilelang_backend._call."""
    fn = next(f for suffix, f in PROGRAMS.items() if target.endswith(suffix))
    attrs = {k: float(v) for k, v in attrs.items()}
    out = fn(*args, **attrs)
    shapes = results if isinstance(results, tuple) else (results,)
    outs = out if isinstance(out, tuple) else (out,)
    for o, r in zip(outs, shapes):
        assert o.shape == r.shape and o.dtype == r.dtype, (target, o.shape, r.shape, o.dtype, r.dtype)
    return out
