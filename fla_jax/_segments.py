"""Packed rows as JAX stacks pack them: `segment_ids [B, T]`, every change of id along T starting a new
sequence (padding is just another id).

Each op takes a segment start as a decay of zero (a gate of -inf at its first token): the state carried
into the segment is wiped before the token's update, so nothing of an earlier segment reaches it, and the
op runs unchanged on every backend (the kernels included: the ops' own zero-decay path). `initial_state`
enters each row's first segment (no start at t = 0) and the final state leaves its last; the gate a
segment's first token had multiplies nothing and gets no gradient. In-chunk sums of the gates then carry
a floor (`fla_jax.xla.GATE_FLOOR`) per earlier start in the chunk, which costs float32 about 7e-6 of
relative precision each in the decays of the later tokens of that chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def check(segment_ids, B: int, T: int, cu_seqlens) -> jax.Array | None:
    """`segment_ids` as an integer `[B, T]` array, or None; a ValueError or TypeError naming it otherwise."""
    if segment_ids is None:
        return None
    if cu_seqlens is not None:
        raise ValueError("pass `segment_ids` ([B, T]) or `cu_seqlens` ([N + 1], B = 1), not both")
    x = jnp.asarray(segment_ids) if not isinstance(segment_ids, jax.Array) else segment_ids
    if not jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_):
        raise TypeError(f"`segment_ids` must have an integer dtype, got {x.dtype}")
    if x.shape != (B, T):
        raise ValueError(f"`segment_ids` must have shape [B, T] = {(B, T)}, got {tuple(x.shape)}")
    return x


def _along_whole_rows(fn, segment_ids: jax.Array) -> jax.Array:
    """`fn(segment_ids)` (a `[B, T]` result that reads along T) where T may be split over an explicit mesh
    (context parallelism): the ids, 4 bytes a token, gathered along T for it, the result split back."""
    from fla_jax._sharding import _explicit_mesh  # (no cycle at import)

    if _explicit_mesh() is None:
        return fn(segment_ids)
    spec = tuple(jax.typeof(segment_ids).sharding.spec) + (None, None)
    if spec[1] is None:
        return fn(segment_ids)
    whole = jax.sharding.reshard(segment_ids, P(spec[0], None))
    return jax.sharding.reshard(fn(whole), P(spec[0], spec[1]))


def _starts(segment_ids: jax.Array) -> jax.Array:
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((segment_ids.shape[0], 1), bool), change], axis=1)


def starts(segment_ids: jax.Array) -> jax.Array:
    """`[B, T]` bool: the tokens where a new segment starts after another one in the row (not t = 0)."""
    return _along_whole_rows(_starts, segment_ids)


def _positions(segment_ids: jax.Array) -> jax.Array:
    t = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    return t - jax.lax.cummax(jnp.where(_starts(segment_ids), t, 0), axis=1)


def positions(segment_ids: jax.Array) -> jax.Array:
    """`[B, T]` int32: each token's position inside its segment."""
    return _along_whole_rows(_positions, segment_ids)


def reset_gates(g, segment_ids: jax.Array | None, shape: tuple[int, ...]):
    """The log decays `g` (None: none, or an array `shape` = `[B, T, H]` or `[B, T, H, K]`) with -inf at every
    segment start: what the ops run with `segment_ids`. `g` itself where there are none."""
    if segment_ids is None:
        return g
    s = starts(segment_ids).reshape(*segment_ids.shape, *(1,) * (len(shape) - 2))
    base = jnp.zeros(shape, jnp.float32) if g is None else g
    return jnp.where(s, jnp.asarray(-jnp.inf, base.dtype), base)
