"""Joining pieces of a sequence walked at once: the state passes' pieces inside one GPU
(`fla_jax._tilelang.common.split_pass`) and context parallelism's shards (`fla_jax._sharding`).

Every op maps the state entering a piece to the state leaving it affinely, `S_out = A S_in + b` (per sequence
and head; A acts on the key axis: the gates' decay `exp(sum g)`, diagonal, or for the delta rules `[K, K]`).
Given each piece's A and b (b: the piece walked from a zero state), a fold from the first piece's state gives
the state entering every piece, and the one leaving the last; in reverse, the cotangents through `A^T`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fold(A, b, s0, diag: bool, reverse: bool = False):
    """The states entering each piece `[N, P, HV, K, V]` and the one leaving the last, from the pieces' maps
    `S -> A S + b` (A `[N, P, HV(, K)]` diagonal or `[N, P, HV, K, K]`; b `[N, P, HV, K, V]`) and the first
    piece's `s0 [N, HV, K, V]` (None: zeros). `reverse`: the cotangents, from the last piece's end (`s0`: dht)
    to the first's start, each through `A^T`. The maps' prefix compositions by doubling (log2 P rounds of
    batched products, not P products one after another: each is a launch or two)."""
    f32 = jnp.float32
    A, b = A.astype(f32), b.astype(f32)
    if reverse:  # (the last piece first, through A^T)
        A, b = jnp.flip(A, 1), jnp.flip(b, 1)
        A = A if diag else jnp.swapaxes(A, -1, -2)
    P = b.shape[1]
    if diag:
        apply = lambda a, x: a[..., None] * x if a.ndim == b.ndim - 1 else a[..., None, None] * x
        compose = lambda a2, a1: a2 * a1
        one = jnp.ones_like(A[:, :1])
    else:
        apply = lambda a, x: jnp.einsum("nphij,nphjv->nphiv", a, x, precision=jax.lax.Precision.HIGHEST)
        compose = lambda a2, a1: jnp.einsum("nphij,nphjk->nphik", a2, a1, precision=jax.lax.Precision.HIGHEST)
        one = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=f32), A[:, :1].shape)
    s = 1
    while s < P:  # (A, b)_j <- (A, b)_j o (A, b)_{j - s}: after the round, each the composition of up to 2s maps
        A_before = jnp.concatenate([jnp.broadcast_to(one, (A.shape[0], s, *A.shape[2:])), A[:, : P - s]], axis=1)
        b_before = jnp.concatenate([jnp.zeros_like(b[:, :s]), b[:, : P - s]], axis=1)
        A, b = compose(A, A_before), apply(A, b_before) + b
        s *= 2
    after = b if s0 is None else apply(A, jnp.broadcast_to(s0.astype(f32)[:, None], b.shape)) + b  # the state after each piece
    first = jnp.zeros_like(b[:, :1]) if s0 is None else s0.astype(f32)[:, None]
    into = jnp.concatenate([first, after[:, :-1]], axis=1)
    return (jnp.flip(into, 1) if reverse else into), after[:, -1]
