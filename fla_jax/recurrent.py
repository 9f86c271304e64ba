"""The recurrent (token by token) ops, with the meaning and signatures of fla 0.6.0's `fused_recurrent_*`:
what generation runs (a decode step is T = 1), and what short inputs take.

Per head, with state S in R^{K x V} (initially `initial_state`, else zeros), at each step t:
decay `S = Diag(exp(gk_t)) S Diag(exp(gv_t))` (a scalar `g_t` decays all of S), then for the delta rules
`S = S + k_t (beta_t (v_t - S^T k_t))^T`, else `S = S + k_t v_t^T`, and `o_t = scale * S^T q_t`. The chunk
ops compute the same outputs; these take the tokens one by one in float32 (a `lax.scan`, checkpointed every
64 steps so that a gradient keeps one state per 64 tokens), and T = 1 as one step with no loop (XLA reads the
state twice and writes it once). `reverse` (simple GLA, GLA) walks the tokens from the last. With
`backend="tilelang"` a dense batch runs on the TileLang step program instead (`fla_jax._tilelang.recurrent`:
each state read and written once for all T tokens); "auto" runs it where the states are large
(`AUTO_MIN_STATE`) and keeps XLA's step, measured faster, on smaller ones.
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax

from fla_jax import _backends, _checks, _layout, _segments, ops, tilelang_backend
from fla_jax._tilelang import recurrent as _programs
from fla_jax._problem import l2_normalise

Array = jax.Array
_BLOCK = 64
_HI = lax.Precision.HIGHEST


def _step(delta: bool, S, q, k, v, gk, gv, beta):
    """One token for every row and head: `S [B, H, K, V]`, q, k `[B, H, K]`, v `[B, H, V]`, gk None,
    `[B, H]` or `[B, H, K]`, gv None or `[B, H, V]`, beta None or `[B, H]`; `(S, o [B, H, V])`.

    Two passes over S, the fewest XLA can fuse it to: the decayed state's products with k and q in one
    (`D(S)^T x` from S itself: a row decay scales x, a scalar or column decay the product), then the update
    `S' = D(S) + k u^T` (u = v, or the delta rule's `beta (v - D(S)^T k)`) in one read and write; the output
    `S'^T q = D(S)^T q + (k . q) u` needs no third."""
    scalar = gk is not None and gk.ndim == 2
    rows = None if gk is None or scalar else jnp.exp(gk)  # [B, H, K]
    x = jnp.stack([k, q], axis=-1)
    r = jnp.einsum("bhkv,bhkn->bhvn", S, x if rows is None else x * rows[..., None], precision=_HI)
    if scalar:
        r = r * jnp.exp(gk)[..., None, None]
    if gv is not None:
        r = r * jnp.exp(gv)[..., None]
    u = beta[..., None] * (v - r[..., 0]) if delta else v
    if scalar:
        S = S * jnp.exp(gk)[..., None, None]
    elif rows is not None:
        S = S * rows[..., None]
    if gv is not None:
        S = S * jnp.exp(gv)[..., None, :]
    S = S + k[..., :, None] * u[..., None, :]
    return S, r[..., 1] + jnp.sum(k * q, axis=-1, keepdims=True) * u


def _scan(delta: bool, reverse: bool, h0, xs, seq=None):
    """The recurrence over `xs` (q, k, v, gk, gv, beta, each `[B, T, ...]` or None) from `h0 [B, H, K, V]`:
    `(o [B, T, H, V], S after the last step)`. With `seq` (`[T]` sequence of each token of one packed row,
    `h0` then `[N, H, K, V]`): the state restarts from `h0[seq]` at each sequence's first step (in the
    direction walked) and the final states `[N, H, K, V]` are each sequence's last (h0's for an empty one)."""
    T = xs[0].shape[1]
    if T == 1 and seq is None:  # a decode step: no loop
        S, o = _step(delta, h0, *(None if x is None else x[:, 0] for x in xs))
        return o[:, None], S
    if seq is None:
        starts = ends = None
        carry0 = (h0, None)
    else:
        change = seq[1:] != seq[:-1]
        first = jnp.concatenate([jnp.ones((1,), bool), change])
        last = jnp.concatenate([change, jnp.ones((1,), bool)])
        starts, ends = (last, first) if reverse else (first, last)
        carry0 = (jnp.zeros_like(h0[:1]), h0)

    def token(carry, x):
        S, ht = carry
        x, flags = x
        if flags is not None:
            start, end, n = flags
            S = jnp.where(start, h0[n][None], S)
        S, o = _step(delta, S, *x)
        if flags is not None:
            ht = ht.at[n].set(jnp.where(end, S[0], ht[n]))
        return (S, ht), o

    steps = tuple(None if x is None else jnp.moveaxis(x, 1, 0) for x in xs)
    flags = None if seq is None else (starts, ends, seq)
    pad = -T % _BLOCK if T > _BLOCK else 0
    if pad:  # whole blocks: padding steps (zeros everywhere, no sequence flags) change no state
        at = (lambda x: [(pad, 0)] + [(0, 0)] * (x.ndim - 1)) if reverse else (lambda x: [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        steps = tuple(None if x is None else jnp.pad(x, at(x)) for x in steps)
        if flags is not None:
            flags = tuple(jnp.pad(f, at(f)) for f in flags)
    if T > _BLOCK:  # blocks of 64 steps, each checkpointed: a gradient keeps one state per block
        blocks = lambda x: None if x is None else x.reshape(-1, _BLOCK, *x.shape[1:])
        steps, flags = jax.tree.map(blocks, (steps, flags))
        body = jax.checkpoint(lambda c, x: lax.scan(token, c, x, reverse=reverse))
        (S, ht), o = lax.scan(body, carry0, (steps, flags), reverse=reverse)
        o = o.reshape(-1, *o.shape[2:])
        o = o[pad:] if reverse else o[: o.shape[0] - pad]
    else:
        (S, ht), o = lax.scan(token, carry0, (steps, flags), reverse=reverse)
    return jnp.moveaxis(o, 0, 1), (S if seq is None else ht)


# "auto" runs the step program (by its kind: "simple_gla", "gla", "delta") where the states hold at least this many
# elements (B HV K V): there it measured faster than XLA's step (which reads each state twice), below it slower (a few
# small programs, launch-bound; GLA's, not held to fewer registers, up to 2^24), on the H100 (benchmarks/RESULTS.md,
# "Decode step"); `backend="tilelang"` runs the program at any size.
AUTO_MIN_STATE: Final = {"simple_gla": 2**23, "delta": 2**23, "gla": 2**24}


def auto_on_xla(op: str, states: int) -> str:
    """Why "auto" runs a call that the step program `op` takes on XLA: its states' elements `states` are too few."""
    return (f"auto runs the recurrent ops on XLA where the states hold fewer than {AUTO_MIN_STATE[op]} elements (B HV K V "
            f"= {states}): XLA's step measured faster there (benchmarks/RESULTS.md); backend='tilelang' runs the step program")


def _use_kernel(backend, name: str, why: str | None, op: str, states: int) -> bool:
    """Whether `backend` runs the call on the step program (`why`: why it cannot here, None where it can):
    "tilelang" or a `TileLangConfig` (an error naming the reason where it cannot); "auto" where it can and the
    states hold at least `AUTO_MIN_STATE[op]` elements (`states`); "xla" and "reference" never."""
    _backends._check_name(backend)
    if backend == "auto":
        return why is None and states >= AUTO_MIN_STATE[op]
    if not isinstance(backend, tilelang_backend.Config) and backend != "tilelang":
        return False
    if why is not None:
        raise _backends.BackendUnavailableError(f"backend 'tilelang' cannot run {name}: {why}")
    return True


def _steps(delta: bool, scale: float, l2norm: bool, reverse: bool, seq, gv, q, k, v, gk, beta, h0):
    """The recurrence in XLA from the raw inputs (q, k in their dtype, not normalised, scaled or repeated for
    grouped heads; h0 `[N, HV, K, V]`), in float32 (float64 for float64 inputs): `(o, ht float32)`. With
    `(reverse, seq, gv) = (False, None, None)` what the step program computes, from its inputs (`_programs.run`'s
    `fallback`: its VJP is the program's gradient)."""
    H, HV = q.shape[2], v.shape[2]
    cdt = jnp.promote_types(q.dtype, jnp.float32)
    f = lambda x: None if x is None else x.astype(cdt)
    q, k = f(q), f(k)
    if l2norm:
        q, k = l2_normalise(q), l2_normalise(k)
    q = q * jnp.asarray(scale, cdt)
    if HV != H:
        q, k = jnp.repeat(q, HV // H, axis=2), jnp.repeat(k, HV // H, axis=2)
    o, ht = _scan(delta, reverse, f(h0), (q, k, f(v), f(gk), f(gv), f(beta)), seq)
    return o.astype(v.dtype), ht.astype(jnp.float32)


def _run(delta, q, k, v, gk, gv, beta, *, scale, initial_state, output_final_state, cu_seqlens, reverse=False, l2norm=False,
         segment_ids=None, backend="auto", name: str):
    """Checks what is common and runs the TileLang step program (`_programs`, where `backend` asks for the tilelang
    backend) or `_steps` in XLA; `segment_ids` as decays of zero at each segment start (`fla_jax._segments`; with
    `reverse`, at each segment's last token)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = _checks.scale(scale, K)
    segment_ids = _segments.check(segment_ids, B, T, cu_seqlens)
    if segment_ids is not None and reverse:  # (walking from the last token, a segment starts at its last)
        segment_ids = jnp.flip(segment_ids, axis=1)
        gk = jnp.flip(_segments.reset_gates(None if gk is None else jnp.flip(gk, 1), segment_ids, (B, T, HV) if gk is None else gk.shape), 1)
    else:
        gk = _segments.reset_gates(gk, segment_ids, (B, T, HV) if gk is None else gk.shape)
    cu, cu_valid = _checks.cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else cu.shape[0] - 1
    h0 = _checks.initial_state(initial_state, N, HV, K, V, "[N, HV, K, V]" + (" (N = number of sequences)" if cu is not None else " (N = B)"))
    output_final_state = _checks.flag("output_final_state", output_final_state)
    reverse = _checks.flag("reverse", reverse)
    op = "delta" if delta else "simple_gla" if gk is None or gk.ndim == 3 else "gla"
    coverage = _programs.unsupported(op, dtype=str(q.dtype), K=K, V=V, varlen=cu is not None, reverse=reverse and T > 1,
                                     gv=gv is not None, gate_rows=gk is not None and gk.ndim == 4)
    why = coverage or tilelang_backend.status()[1] or _programs.missing(op, str(q.dtype), K, tilelang_backend.registered())
    states = N * HV * K * V
    kernel = _use_kernel(backend, name, why, op, states)
    if (plans := ops.PLANS.get()) is not None:  # (`fla_jax.explain`)
        plans.append({"recurrent": name, "backend": "tilelang" if kernel else "xla", "asked": backend, "coverage": coverage,
                      "here": why or auto_on_xla(op, states), "target": _programs.program(op, str(q.dtype), K, backend if isinstance(backend, tilelang_backend.Config) else None)
                      if coverage is None else None})
    if kernel:
        g = jnp.zeros(v.shape[:3] if op != "gla" else q.shape, jnp.float32) if gk is None else gk.astype(jnp.float32)
        beta = None if beta is None else beta.astype(jnp.float32)
        h0 = jnp.zeros((B, HV, K, V), jnp.float32) if h0 is None else h0.astype(jnp.float32)
        fallback = functools.partial(_steps, delta, scale, l2norm, False, None, None)
        o, ht = _programs.run(op, fallback, q, k, v, g, beta, h0, scale=scale, l2norm=l2norm,
                              config=backend if isinstance(backend, tilelang_backend.Config) else None)
        return o, (ht if output_final_state else None)
    h0 = jnp.zeros((N, HV, K, V), jnp.promote_types(q.dtype, jnp.float32)) if h0 is None else h0
    seq = None if cu is None else _layout.token_sequences(cu, T)
    o, ht = _steps(delta, scale, l2norm, reverse, seq, gv, q, k, v, gk, beta, h0)
    if cu_valid is not None:  # an invalid traced table: every output NaN, as the chunk ops
        o, ht = (jnp.where(cu_valid, x, jnp.asarray(jnp.nan, x.dtype)) for x in (o, ht))
    return o, (ht if output_final_state else None)


def fused_recurrent_simple_gla(
    q: Array, k: Array, v: Array, g: Array | None = None, g_gamma: Array | None = None, scale: float | None = None,
    initial_state: Array | None = None, output_final_state: bool = False, reverse: bool = False, cu_seqlens: Array | None = None,
    *, segment_ids: Array | None = None, backend: "str | tilelang_backend.Config" = "auto",
) -> tuple[Array, Array | None]:
    """Simple GLA token by token (fla's `fused_recurrent_simple_gla`); arguments as `chunk_simple_gla`'s, and
    `reverse`: walk the tokens from the last (the state then flows backwards in time; with `segment_ids`
    each segment is walked from its last token, `initial_state` entering each row's last segment)."""
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    g = _checks.scalar_gate(g, g_gamma, *q.shape[:3])
    return _run(False, q, k, v, g, None, None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, reverse=reverse, segment_ids=segment_ids,
                backend=backend, name="fused_recurrent_simple_gla")


def fused_recurrent_gla(
    q: Array, k: Array, v: Array, gk: Array | None = None, gv: Array | None = None, scale: float | None = None,
    initial_state: Array | None = None, output_final_state: bool = False, reverse: bool = False, cu_seqlens: Array | None = None,
    *, segment_ids: Array | None = None, backend: "str | tilelang_backend.Config" = "auto",
) -> tuple[Array, Array | None]:
    """GLA token by token (fla's `fused_recurrent_gla`): `gk [B, T, H, K]` decays the state's rows (the key
    channels, `chunk_gla`'s g), `gv [B, T, H, V]` its columns; either may be None. Other arguments as
    `fused_recurrent_simple_gla`'s."""
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    gk = None if gk is None else _checks.gate("gk", gk, q.shape, "[B, T, H, K]")
    gv = None if gv is None else _checks.gate("gv", gv, v.shape, "[B, T, H, V]")
    return _run(False, q, k, v, gk, gv, None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, reverse=reverse, segment_ids=segment_ids,
                backend=backend, name="fused_recurrent_gla")


def fused_recurrent_delta_rule(
    q: Array, k: Array, v: Array, beta: Array | None = None, scale: float | None = None, initial_state: Array | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Array | None = None,
    *, segment_ids: Array | None = None, backend: "str | tilelang_backend.Config" = "auto",
) -> tuple[Array, Array | None]:
    """The delta rule token by token (fla's `fused_recurrent_delta_rule`); beta None means ones, as in fla.
    Other arguments as `chunk_delta_rule`'s."""
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    B, T, H, _ = q.shape
    beta = jnp.ones((B, T, H), jnp.float32) if beta is None else _checks.gate("beta", beta, (B, T, H), "[B, T, H]")
    return _run(True, q, k, v, None, None, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, l2norm=_checks.flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), segment_ids=segment_ids,
                backend=backend, name="fused_recurrent_delta_rule")


def fused_recurrent_gated_delta_rule(
    q: Array, k: Array, v: Array, g: Array | None = None, gk: Array | None = None, gv: Array | None = None,
    beta: Array | None = None, scale: float | None = None, initial_state: Array | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False, A_log: Array | None = None,
    dt_bias: Array | None = None, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    cu_seqlens: Array | None = None, segment_ids: Array | None = None, backend: "str | tilelang_backend.Config" = "auto",
) -> tuple[Array, Array | None]:
    """GDN token by token (fla's `fused_recurrent_gated_delta_rule`): a scalar decay `g [B, T, HV]` and/or
    per key channel `gk [B, T, HV, K]` and per value channel `gv [B, T, HV, V]`; beta None means ones; the
    gate options (`use_gate_in_kernel` with `A_log`, `dt_bias`, on g; `use_beta_sigmoid_in_kernel`,
    `allow_neg_eigval`) and grouped value heads as `chunk_gated_delta_rule`'s."""
    q, k, v = _checks.qkv(q, k, v, grouped=True)
    B, T, HV, V = v.shape
    K = q.shape[3]
    beta_sigmoid = _checks.flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    gate_in_kernel = _checks.flag("use_gate_in_kernel", use_gate_in_kernel)
    if gate_in_kernel and g is None:
        raise ValueError("`use_gate_in_kernel=True` takes the raw gate as `g` ([B, T, HV]), got none")
    g = None if g is None else _checks.gate("g", g, (B, T, HV), "[B, T, HV]")
    if beta is None:
        if beta_sigmoid:
            raise ValueError("`use_beta_sigmoid_in_kernel=True` takes beta's logits as `beta`, got none")
        beta = jnp.ones((B, T, HV), jnp.float32)
    beta = _checks.gate("beta", beta, (B, T, HV), "[B, T, HV]")
    g, beta = ops._gdn_gates(g, beta, HV, gate_in_kernel, A_log, dt_bias, beta_sigmoid, _checks.flag("allow_neg_eigval", allow_neg_eigval))
    gk = None if gk is None else _checks.gate("gk", gk, (B, T, HV, K), "[B, T, HV, K]")
    gv = None if gv is None else _checks.gate("gv", gv, (B, T, HV, V), "[B, T, HV, V]")
    if g is not None:  # (one decay of the rows: the scalar's and the per-channel one's together)
        gk = g if gk is None else gk + g[..., None]
    return _run(True, q, k, v, gk, gv, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, l2norm=_checks.flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), segment_ids=segment_ids,
                backend=backend, name="fused_recurrent_gated_delta_rule")
