"""Non-finite inputs keep the recurrence's causality, on every backend.

The contract (README, "Precision and hostile input"): from the first step of a sequence whose k, v, beta or
gate is NaN or infinite (a gate of -inf is a decay of zero, not an error), every output of that sequence and
value head is NaN, and so is its final state; a non-finite q makes its own step's output NaN; outputs before
such a step are exact, whatever shares their chunk. The chunked forms do not keep it by themselves: a masked
in-chunk product multiplies a later step's NaN by an exact zero (0 * NaN = NaN), which reaches the earlier
steps of the chunk.

`guard` zeroes the offending steps and `poison` marks what follows them. The xla backend runs both around
every call (its passes are XLA's own). The kernels, where `TileLangConfig.nonfinite_guard` asks, run them
only for a call whose final states come out non-finite (`keep_causal`, inside their forward as each device
runs it: no collective decides it): a non-finite k, v, beta or gate always leaves its sequence's final state
non-finite (NaN and inf persist through the decays and products that carry the state on), so finite final
states everywhere mean that nothing leaked; otherwise the call runs again on guarded inputs (`lax.cond`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fla_jax import _layout


def guard(q, k, v, g, beta):
    """`(q, k, v, g, beta)` with the offending steps zeroed, and `bad_q`, `bad` `[..., HV]` (the token axes,
    then the value heads): q not finite; k, v, beta or the gate not finite (a gate of -inf is finite here:
    a decay of zero). Any layout with the heads second to last in q, k, v (`[B, T, H, K]`, or chunk rows);
    the gates `[..., H]` or per key channel `[..., H, K]`. q and k may have fewer heads than v (grouped
    value heads): they are zeroed per q/k head where they themselves are not finite (every value head of
    theirs is then bad), v, the gate and beta per value head, so that a bad value head leaves the others of
    its group as they were."""
    HV = v.shape[-2]
    nonfinite = lambda x: jnp.any(~jnp.isfinite(x), axis=-1)
    per_value_head = lambda m: m if m.shape[-1] == HV else jnp.repeat(m, HV // m.shape[-1], axis=-1)
    bad_qk, bad_k = nonfinite(q), nonfinite(k)
    bad = per_value_head(bad_k) | nonfinite(v)
    if beta is not None:
        bad = bad | ~jnp.isfinite(beta)
    if g is not None:
        gbad = jnp.isnan(g) | (g == jnp.inf)
        bad = bad | (jnp.any(gbad, axis=-1) if g.ndim == v.ndim else gbad)
    zero = lambda x, m: None if x is None else jnp.where(m.reshape(m.shape + (1,) * (x.ndim - m.ndim)), 0, x)
    return (zero(q, bad_qk), zero(k, bad_k), zero(v, bad), zero(g, bad), zero(beta, bad)), per_value_head(bad_qk), bad


def poison(o, ht, bad_q, bad, seq=None, start=None):
    """NaN in `o [B, T, HV, V]` from each sequence's first bad step on (and at bad q), and in the final
    states `[N, HV, K, V]` of the sequences with one. Each row of the batch is one sequence, or where `seq`
    is given (B = 1) the row holds N of them: `seq [T]` the sequence of each step, `start [T]` the step its
    sequence starts at (steps that belong to none are never bad)."""
    T = o.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    last_bad = lax.cummax(jnp.where(bad, t, -1), axis=1)  # the latest bad step at or before each step
    if seq is None:
        poisoned, seq_bad = last_bad >= 0, jnp.any(bad, axis=1)  # [B, HV] final states
    else:
        poisoned = last_bad >= start[None, :, None]
        seq_bad = jax.ops.segment_max(bad[0].astype(jnp.int32), seq, num_segments=ht.shape[0]) > 0  # (empty: < 0)
    o = jnp.where((poisoned | bad_q)[..., None], jnp.asarray(jnp.nan, o.dtype), o)
    return o, jnp.where(seq_bad[..., None, None], jnp.asarray(jnp.nan, ht.dtype), ht)


def token_sequences(cu_seqlens, T: int):
    """`poison`'s `(seq, start)` of a packed row of `T` tokens with boundaries `cu_seqlens`."""
    seq = _layout.token_sequences(cu_seqlens, T)
    return seq, cu_seqlens[seq]


def row_sequences(cstart, rows: int, C: int):
    """`poison`'s `(seq, start)` of a row of chunks of `C` steps (`rows` steps) holding, in order, the sequences
    that start at chunk `cstart [N]` (an empty one shares its successor's start; the slots past a sequence's
    own steps hold zeros, never bad)."""
    c = jnp.arange(rows // C, dtype=jnp.int32)
    n = jnp.clip(jnp.searchsorted(cstart, c, side="right").astype(jnp.int32) - 1, 0, cstart.shape[0] - 1)
    return jnp.repeat(n, C), jnp.repeat(cstart[n] * C, C)


def keep_causal(o, ht, again, tokens, seq=None, start=None):
    """`(o, ht)` of a chunked call that may let a non-finite input reach earlier steps of its chunk, as the
    contract has them: as they are where the final states `ht` are all finite; otherwise `again(tokens)` (the
    same call) on `guard`ed tokens `(q, k, v, g, beta)`, `poison`ed (`seq`, `start` as `poison` takes them).
    Not differentiated (the kernels' forward, inside their custom VJP): where an input is non-finite, the
    gradients are not defined."""

    def guarded():
        toks, bad_q, bad = guard(*tokens)
        o2, ht2 = again(toks)
        return poison(o2.astype(o.dtype), ht2.astype(ht.dtype), bad_q, bad, seq, start)

    return lax.cond(jnp.all(jnp.isfinite(ht)), lambda: (o, ht), guarded)
