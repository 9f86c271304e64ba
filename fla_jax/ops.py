"""The four chunked linear-attention ops, with the meaning they have in fla 0.6.0.

Layout `[B, T, H, K]` for q and k, `[B, T, H, V]` for v; gates are per-step natural-log decays.
Per head, with state S in R^{K x V} (initially `initial_state`, else zeros):

* `chunk_simple_gla`:        `S = exp(g_t) S + k_t v_t^T`
* `chunk_gla`:               `S = Diag(exp(g_t)) S + k_t v_t^T`
* `chunk_delta_rule`:        `S = S + k_t (beta_t (v_t - S^T k_t))^T`
* `chunk_gated_delta_rule`:  `S = exp(g_t) S`, then the delta-rule update

and every op outputs `o_t = scale * S^T q_t` (after the update at step t). `o` has q's dtype; the
final state is float32 `[N, H, K, V]` (N = B, or the number of sequences with `cu_seqlens`).
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp

from fla_jax import _backends, _checks, _layout, _segments, _sharding
from fla_jax._problem import Problem, l2_normalise

Array = jax.Array

# `fla_jax.explain` sets a list here to receive each call's plan (what `_run` decided); ops append to it and
# compute as usual. Nothing else sets it: it changes no result.
PLANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fla_jax_plans", default=None)


def _run(op, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size, backend, l2norm=False,
         segment_ids=None):
    """Checks what is common, reduces the call to a `Problem` and runs the chosen backend (`segment_ids`: as
    decays of zero at each segment start, `fla_jax._segments`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    scale = _checks.scale(scale, K)
    segment_ids = _segments.check(segment_ids, B, T, cu_seqlens)
    g = _segments.reset_gates(g, segment_ids, (B, T, HV) if g is None else g.shape)
    cu_seqlens, cu_valid = _checks.cu_seqlens(cu_seqlens, B, T)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    what = "[N, H, K, V]" + (" (N = number of sequences in cu_seqlens)" if cu_seqlens is not None else " (N = B)")
    h0 = _checks.initial_state(initial_state, N, HV, K, V, what)
    output_final_state = _checks.flag("output_final_state", output_final_state)
    l2norm = _checks.flag("use_qk_l2norm_in_kernel", l2norm)
    problem = Problem(op=op, delta=beta is not None, chunk_size=chunk_size, dtype=jnp.dtype(q.dtype).name)
    call = {"K": K, "V": V, "varlen": cu_seqlens is not None, "grouped": HV != H, "l2norm": l2norm}
    chosen = _backends.resolve(backend, problem, **call)

    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0, "cu_seqlens": cu_seqlens}
    if (plans := PLANS.get()) is not None:
        shapes = {n: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in args.items()}
        plans.append({"problem": problem, "call": call, "backend": chosen.name, "asked": backend, "scale": scale, "args": shapes})
    o, ht = _sharding.apply(functools.partial(_compute, chosen, problem, scale, l2norm), args, varlen=cu_seqlens is not None)
    if cu_valid is not None:  # a traced cu_seqlens that is no valid table: every output NaN (`_checks.cu_seqlens`)
        o, ht = (jnp.where(cu_valid, x, jnp.asarray(jnp.nan, x.dtype)) for x in (o, ht))
    return o, (ht if output_final_state else None)


def _compute(backend, problem, scale, l2norm, *, q, k, v, g, beta, initial_state, cu_seqlens):
    """The op on (per-device) arrays: l2 norm, scale and grouped heads, then the backend."""
    H, HV = q.shape[2], v.shape[2]
    cdt = problem.compute_dtype
    o_dtype = q.dtype
    if backend.raw:  # (with no initial state the kernels start from zeros: none written for them)
        return backend.run(problem, q, k, v, g, beta, initial_state, cu_seqlens, scale=scale, l2norm=l2norm)
    if initial_state is None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        initial_state = jnp.zeros((N, HV, q.shape[3], v.shape[3]), cdt)
        initial_state = _layout.varying_like(initial_state, v)  # (inside `shard_map`: as the backends' scans carry it)
    q, k = q.astype(cdt), k.astype(cdt)
    if l2norm:
        q, k = l2_normalise(q), l2_normalise(k)
    q = q * jnp.asarray(scale, cdt)
    if HV != H:
        q, k = jnp.repeat(q, HV // H, axis=2), jnp.repeat(k, HV // H, axis=2)
    g = None if g is None else g.astype(cdt)
    beta = None if beta is None else beta.astype(cdt)
    o, ht = backend.run(problem, q, k, v, g, beta, initial_state.astype(cdt), cu_seqlens)
    return o.astype(o_dtype), ht


def chunk_simple_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None = None,
    g_gamma: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    chunk_size: int = 64,
    backend: "str | TileLangConfig" = "auto",
    *,
    segment_ids: Array | None = None,
) -> tuple[Array, Array | None]:
    """Simple GLA: linear attention with a scalar decay per head and step.

    Args:
      q: queries `[B, T, H, K]` (bfloat16, float16, float32 or float64).
      k: keys `[B, T, H, K]`, q's dtype.
      v: values `[B, T, H, V]`, q's dtype.
      g: log decays `[B, T, H]` (float32 preferred), or None.
      g_gamma: constant log decay per head `[H]`, or None. At most one of `g`, `g_gamma`;
        with neither there is no decay.
      scale: multiplies q; defaults to `K ** -0.5`.
      initial_state: `[N, H, K, V]` states to start from (N = B, or the number of sequences).
      output_final_state: return the final states `[N, H, K, V]`.
      cu_seqlens: int32 `[N + 1]` sequence boundaries for packed input (B must be 1); may be
        traced under `jit`, only its length is static.
      chunk_size: chunk length of the chunked backends, one of 16, 32, 64, 128.
      segment_ids: integer `[B, T]` for packed rows (JAX's packing; any B, traced): every change of id
        along T starts a new sequence from a zero state; `initial_state` `[B, ...]` enters each row's
        first segment and the final state leaves its last. Not with `cu_seqlens`.
      backend: "auto", "reference", "xla" or "tilelang" (see `fla_jax.backends()`), or a
        `fla_jax.TileLangConfig`: the tilelang backend with other than its dispatched choices (tests, benchmarks).

    Returns:
      `o [B, T, H, V]` in q's dtype, and the final state (or None).

    Raises:
      ValueError, TypeError: an argument of the wrong shape, dtype or value (the message names it).
    """
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    g = _checks.scalar_gate(g, g_gamma, *q.shape[:3])
    chunk_size = _checks.chunk_size(chunk_size)
    return _run(
        "simple_gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
        segment_ids=segment_ids,
    )


def chunk_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    backend: "str | TileLangConfig" = "auto",
    *,
    segment_ids: Array | None = None,
) -> tuple[Array, Array | None]:
    """GLA: linear attention with a decay per key channel.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]`, one floating dtype.
      g: log decays `[B, T, H, K]` (float32 preferred).
      scale, initial_state, output_final_state, cu_seqlens, segment_ids, backend: as in `chunk_simple_gla`.

    Returns:
      `o [B, T, H, V]` in q's dtype, and the final state `[N, H, K, V]` (or None).
    """
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    g = _checks.gate("g", g, q.shape, "[B, T, H, K]")
    return _run(
        "gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=64, backend=backend, segment_ids=segment_ids,
    )


def chunk_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    backend: "str | TileLangConfig" = "auto",
    *,
    segment_ids: Array | None = None,
) -> tuple[Array, Array | None]:
    """Delta rule: `S = S + k_t (beta_t (v_t - S^T k_t))^T`.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]`, one floating dtype. Without l2 normalisation the
        keys should have norm <= 1 for a stable recurrence, as in fla.
      beta: write strengths `[B, T, H]`.
      use_qk_l2norm_in_kernel: normalise q and k as `x / sqrt(sum(x^2) + 1e-6)` inside the op.
      scale, initial_state, output_final_state, cu_seqlens, segment_ids, backend: as in `chunk_simple_gla`.

    Returns:
      `o [B, T, H, V]` in q's dtype, and the final state `[N, H, K, V]` (or None).
    """
    q, k, v = _checks.qkv(q, k, v, grouped=False)
    B, T, H, _ = q.shape
    beta = _checks.gate("beta", beta, (B, T, H), "[B, T, H]")
    return _run(
        "delta_rule", q, k, v, None, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=64, backend=backend,
        l2norm=use_qk_l2norm_in_kernel, segment_ids=segment_ids,
    )


def chunk_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    backend: "str | TileLangConfig" = "auto",
    *,
    use_gate_in_kernel: bool = False,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    segment_ids: Array | None = None,
) -> tuple[Array, Array | None]:
    """Gated delta rule (GDN): `S = exp(g_t) S`, then the delta-rule update.

    Grouped values: v, g and beta may have HV heads, a multiple of q/k's H; value head j then
    reads q/k head `j // (HV / H)`.

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`, one floating dtype.
      g: log decays `[B, T, HV]`.
      beta: write strengths `[B, T, HV]`.
      initial_state: `[N, HV, K, V]`.
      use_qk_l2norm_in_kernel, scale, output_final_state, cu_seqlens, segment_ids, backend: as in
        `chunk_delta_rule`.
      use_gate_in_kernel: fla's option: `g` is the raw gate input and the op takes
        `g = -exp(A_log) * softplus(g + dt_bias)` (in float32), differentiable in all three.
      A_log: `[HV]`, required with `use_gate_in_kernel`; dt_bias: `[HV]` or None.
      use_beta_sigmoid_in_kernel: `beta` holds logits and the op takes `sigmoid(beta)`.
      allow_neg_eigval: with `use_beta_sigmoid_in_kernel`, `2 sigmoid(beta)` (in [0, 2)) instead.

    These options are elementwise maps of g and beta that XLA fuses into the op's own pass over them
    (the tilelang backend's gate sums, the xla backend's chunking); no kernel or pass of their own.

    Returns:
      `o [B, T, HV, V]` in q's dtype, and the final state `[N, HV, K, V]` (or None).
    """
    q, k, v = _checks.qkv(q, k, v, grouped=True)
    B, T, HV = v.shape[:3]
    g = _checks.gate("g", g, (B, T, HV), "[B, T, HV]")
    beta = _checks.gate("beta", beta, (B, T, HV), "[B, T, HV]")
    g, beta = _gdn_gates(g, beta, HV, _checks.flag("use_gate_in_kernel", use_gate_in_kernel), A_log, dt_bias,
                         _checks.flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                         _checks.flag("allow_neg_eigval", allow_neg_eigval))
    return _run(
        "gated_delta_rule", q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=64, backend=backend,
        l2norm=use_qk_l2norm_in_kernel, segment_ids=segment_ids,
    )


def _gdn_gates(g, beta, HV: int, gate_in_kernel: bool, A_log, dt_bias, beta_sigmoid: bool, neg_eigval: bool):
    """fla 0.6.0's GDN gate options (`chunk_gated_delta_rule`): g and beta as the recurrence takes them."""
    if neg_eigval and not beta_sigmoid:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True` (as in fla)")
    if not gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError("`A_log` and `dt_bias` are read only with `use_gate_in_kernel=True`; pass g in log space, or set it")
    if gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` ([HV]) is required with `use_gate_in_kernel=True`")
        dt = jnp.promote_types(g.dtype, jnp.float32)  # (float32, or float64 for float64 input)
        A_log = _checks.gate("A_log", A_log, (HV,), "[HV]").astype(dt)
        x = g.astype(dt)
        if dt_bias is not None:
            x = x + _checks.gate("dt_bias", dt_bias, (HV,), "[HV]").astype(dt)
        g = -jnp.exp(A_log) * jax.nn.softplus(x)
    if beta_sigmoid:
        beta = jax.nn.sigmoid(beta.astype(jnp.promote_types(beta.dtype, jnp.float32))) * (2.0 if neg_eigval else 1.0)
    return g, beta
