"""Flax NNX layers built on the ops, shaped as fla's `GatedDeltaNet` and `GatedLinearAttention`.

Both take `x [B, T, D]` and return `[B, T, D]`; with `cu_seqlens` (B = 1, packed sequences) or
`segment_ids [B, T]` (packed rows, any B) the short convolutions and the recurrence restart at every
sequence boundary. `dtype` is the
projections' compute dtype (parameters stay float32): `jnp.bfloat16` for mixed-precision training,
which is what the TileLang kernels take (they are built for bfloat16 and float16 only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from typing import NamedTuple

from fla_jax import _layout, _segments
from fla_jax.ops import chunk_gated_delta_rule, chunk_gla
from fla_jax.recurrent import fused_recurrent_gated_delta_rule, fused_recurrent_gla


class Cache(NamedTuple):
    """What a layer carries from one call to the next in generation (a pytree: it goes through `jit` and
    `lax.scan`): `conv`, the last `conv_size - 1` inputs of each short convolution (`[B, conv_size - 1, dim]`
    each; none for GLA), and `state`, the recurrent state `[B, HV, K, V]` float32."""

    conv: tuple[jax.Array, ...]
    state: jax.Array


def _conv_tails(u: jax.Array, W: int, cu_seqlens: jax.Array | None) -> jax.Array:
    """The last `W - 1` inputs `[N, W - 1, dim]` of each row (or packed sequence) of `u [B, T, dim]`, zeros
    before a sequence's start: what a short convolution reads of the past at the next token."""
    if W == 1:
        return jnp.zeros((u.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1, 0, u.shape[-1]), u.dtype)
    if cu_seqlens is None:
        return jnp.pad(u, ((0, 0), (W - 1, 0), (0, 0)))[:, -(W - 1):]
    idx = cu_seqlens[1:, None] - (W - 1) + jnp.arange(W - 1)[None]  # [N, W - 1] token of each tail slot
    inside = idx >= cu_seqlens[:-1, None]
    return jnp.where(inside[..., None], u[0, jnp.clip(idx, 0, u.shape[1] - 1)], 0).astype(u.dtype)


def _tokens(x, d_model: int, layer: str) -> tuple[int, int]:
    """`(B, T)` of a layer's input `x [B, T, d_model]`, or a ValueError naming it."""
    if getattr(x, "ndim", None) != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{layer} takes `x` of shape [B, T, d_model = {d_model}], got {tuple(getattr(x, 'shape', ()))}")
    return x.shape[0], x.shape[1]


def _head_dim(head_dim: int, expand, name: str) -> int:
    """`head_dim * expand` (fla's `expand_k` / `expand_v`), or a ValueError naming `name` where it is no
    positive whole number."""
    d = head_dim * expand
    if not isinstance(expand, (int, float)) or isinstance(expand, bool) or d <= 0 or d != int(d):
        raise ValueError(f"`{name}` times head_dim ({head_dim}) must be a positive whole number, got {name} = {expand!r}")
    return int(d)


def _positions(T: int, cu_seqlens: jax.Array | None, segment_ids: jax.Array | None = None) -> jax.Array:
    """Position of each token inside its own sequence, `[T]` (`[B, T]` with `segment_ids`)."""
    if segment_ids is not None:
        return _segments.positions(segment_ids)
    t = jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:
        return t
    return t - cu_seqlens[_layout.token_sequences(cu_seqlens, T)]


class ShortConvolution(nnx.Module):
    """Causal depthwise convolution over time followed by SiLU (fla's `ShortConvolution`)."""

    def __init__(self, dim: int, kernel_size: int = 4, *, rngs: nnx.Rngs):
        self.kernel_size = kernel_size
        bound = kernel_size**-0.5
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, dim), jnp.float32, -bound, bound))

    def __call__(self, x: jax.Array, pos: jax.Array, tail: jax.Array | None = None) -> jax.Array:
        """`x [B, T, dim]`, `pos` each token's position in its sequence (`[T]`, or `[B, T]`); `tail`: the `kernel_size - 1` inputs
        before x (a cache's), which the first taps then read (all positions count as inside)."""
        if tail is not None:
            W = self.kernel_size - 1
            return self(jnp.concatenate([tail.astype(x.dtype), x], axis=1), jnp.arange(x.shape[1] + W) + W)[:, W:]
        T = x.shape[1]
        w = self.weight[...].astype(x.dtype)
        y = jnp.zeros_like(x)
        for i in range(self.kernel_size):
            back = self.kernel_size - 1 - i  # tap i reads x[t - back]
            shifted = jnp.pad(x, ((0, 0), (back, 0), (0, 0)))[:, :T]
            inside = (pos >= back)[None, :, None] if pos.ndim == 1 else (pos >= back)[:, :, None]
            y = y + jnp.where(inside, shifted, 0) * w[i]
        return jax.nn.silu(y)


class GatedRMSNorm(nnx.Module):
    """`rmsnorm(o) * silu(gate)` over the last axis, fla's `FusedRMSNormGated`."""

    def __init__(self, dim: int, eps: float = 1e-5, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.eps) * self.scale[...]
        return (o32 * jax.nn.silu(gate.astype(jnp.float32))).astype(o.dtype)


class GatedDeltaNet(nnx.Module):
    """Gated delta rule attention: projections, short convolutions, `chunk_gated_delta_rule`,
    gated RMS norm and output projection. `num_v_heads` > `num_heads` gives grouped value heads;
    keys of `head_dim`, values of `expand_v * head_dim` (fla's GatedDeltaNet: head_dim 256, expand_v 2)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        num_v_heads: int | None = None,
        expand_v: float = 1,
        conv_size: int = 4,
        allow_neg_eigval: bool = False,
        backend: str = "auto",
        dtype=None,
        rngs: nnx.Rngs,
    ):
        self.H, self.K = num_heads, head_dim
        self.HV = num_v_heads or num_heads
        self.V = _head_dim(head_dim, expand_v, "expand_v")
        self.allow_neg_eigval = bool(allow_neg_eigval)  # fla's option: beta in [0, 2)
        self.backend = backend
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.q_proj, self.k_proj = lin(d_model, self.H * self.K), lin(d_model, self.H * self.K)
        self.v_proj = lin(d_model, self.HV * self.V)
        self.a_proj, self.b_proj = lin(d_model, self.HV), lin(d_model, self.HV)
        self.g_proj = lin(d_model, self.HV * self.V)
        self.o_proj = lin(self.HV * self.V, d_model)
        self.q_conv = ShortConvolution(self.H * self.K, conv_size, rngs=rngs)
        self.k_conv = ShortConvolution(self.H * self.K, conv_size, rngs=rngs)
        self.v_conv = ShortConvolution(self.HV * self.V, conv_size, rngs=rngs)
        # Mamba-2 style decay: g = -exp(A_log) * softplus(a + dt_bias), A in [1, 16].
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.HV,), jnp.float32, 1.0, 16.0)))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (self.HV,), jnp.float32) * (jnp.log(0.1) - jnp.log(0.001)) + jnp.log(0.001))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.o_norm = GatedRMSNorm(self.V, rngs=rngs)
        self.d_model = d_model

    def init_cache(self, batch: int) -> Cache:
        """An empty cache for `batch` rows (zero state, zero convolution tails)."""
        W = self.q_conv.kernel_size - 1
        dims = (self.H * self.K, self.H * self.K, self.HV * self.V)
        return Cache(tuple(jnp.zeros((batch, W, d), jnp.float32) for d in dims), jnp.zeros((batch, self.HV, self.K, self.V), jnp.float32))

    def __call__(self, x, *, cu_seqlens=None, segment_ids=None, initial_state=None, output_final_state=False, cache=None,
                 return_cache=False):
        """`x [B, T, d_model]` -> `[B, T, d_model]`; with `output_final_state` also the final states. `segment_ids`
        `[B, T]`: packed rows (the ops' meaning; the short convolutions restart at each segment too).

        Generation: `cache` (`init_cache`, or a previous call's) continues from it, dense rows only, and
        returns `(y, cache)`: T = 1 (a decode step) by `fused_recurrent_gated_delta_rule`, longer inputs by
        the chunk op. `return_cache=True` (without `cache`) returns `(y, cache)` from a fresh start, one row
        per sequence with `cu_seqlens`: a packed prefill of prompts of different lengths."""
        B, T = _tokens(x, self.d_model, "GatedDeltaNet")
        streaming = _streaming(cache, return_cache, cu_seqlens, initial_state, output_final_state, "GatedDeltaNet", segment_ids)
        pos = _positions(T, cu_seqlens, segment_ids)
        tails = (None,) * 3 if cache is None else cache.conv
        proj = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        convs = (self.q_conv, self.k_conv, self.v_conv)
        q, k, v = (c(u, pos, t) for c, u, t in zip(convs, proj, tails))
        q, k, v = q.reshape(B, T, self.H, self.K), k.reshape(B, T, self.H, self.K), v.reshape(B, T, self.HV, self.V)
        # (the decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), or 2 sigmoid(b) with
        # allow_neg_eigval, taken inside the op, as fla's layer does)
        opts = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, segment_ids=segment_ids, use_gate_in_kernel=True, A_log=self.A_log[...],
                    dt_bias=self.dt_bias[...], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                    initial_state=initial_state if cache is None else cache.state, output_final_state=output_final_state or streaming)
        if cache is not None and T == 1:
            o, ht = fused_recurrent_gated_delta_rule(q, k, v, self.a_proj(x), beta=self.b_proj(x), **opts)
        else:
            o, ht = chunk_gated_delta_rule(q, k, v, self.a_proj(x), self.b_proj(x), backend=self.backend, **opts)
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, self.HV, self.V))
        o = self.o_proj(o.reshape(B, T, self.HV * self.V))
        if streaming:
            W = self.q_conv.kernel_size
            if cache is None:
                conv = tuple(_conv_tails(u, W, cu_seqlens).astype(jnp.float32) for u in proj)
            else:
                conv = tuple(_conv_tails(jnp.concatenate([t.astype(u.dtype), u], 1), W, None).astype(jnp.float32) for t, u in zip(tails, proj))
            return o, Cache(conv, ht)
        return (o, ht) if output_final_state else o


class GatedLinearAttention(nnx.Module):
    """GLA attention: projections, low-rank per-channel forget gate, `chunk_gla`, gated RMS norm
    and output projection (fla's `GatedLinearAttention`). Keys of `expand_k * head_dim`, values of
    `expand_v * head_dim`: fla's defaults (expand_k 0.5, expand_v 1, head dims from d_model / num_heads)
    are `head_dim = d_model // num_heads, expand_k = 0.5`."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_k: float = 1,
        expand_v: float = 1,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        backend: str = "auto",
        dtype=None,
        rngs: nnx.Rngs,
    ):
        self.H = num_heads
        self.K, self.V = _head_dim(head_dim, expand_k, "expand_k"), _head_dim(head_dim, expand_v, "expand_v")
        self.normalizer = gate_logit_normalizer
        self.backend = backend
        lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, dtype=dtype, rngs=rngs)
        self.q_proj, self.k_proj = lin(d_model, self.H * self.K), lin(d_model, self.H * self.K)
        self.v_proj = lin(d_model, self.H * self.V)
        self.gk_down, self.gk_up = lin(d_model, gate_low_rank_dim), lin(gate_low_rank_dim, self.H * self.K, True)
        self.g_proj = lin(d_model, self.H * self.V)
        self.o_proj = lin(self.H * self.V, d_model)
        self.o_norm = GatedRMSNorm(self.V, rngs=rngs)
        self.d_model = d_model

    def init_cache(self, batch: int) -> Cache:
        """An empty cache for `batch` rows (zero state; GLA has no short convolutions)."""
        return Cache((), jnp.zeros((batch, self.H, self.K, self.V), jnp.float32))

    def __call__(self, x, *, cu_seqlens=None, segment_ids=None, initial_state=None, output_final_state=False, cache=None,
                 return_cache=False):
        """As `GatedDeltaNet.__call__` (a decode step by `fused_recurrent_gla`)."""
        B, T = _tokens(x, self.d_model, "GatedLinearAttention")
        streaming = _streaming(cache, return_cache, cu_seqlens, initial_state, output_final_state, "GatedLinearAttention", segment_ids)
        q = self.q_proj(x).reshape(B, T, self.H, self.K)
        k = self.k_proj(x).reshape(B, T, self.H, self.K)
        v = self.v_proj(x).reshape(B, T, self.H, self.V)
        gk = self.gk_up(self.gk_down(x)).astype(jnp.float32).reshape(B, T, self.H, self.K)
        gk = jax.nn.log_sigmoid(gk) / self.normalizer
        kw = dict(initial_state=initial_state if cache is None else cache.state, output_final_state=output_final_state or streaming,
                  cu_seqlens=cu_seqlens, segment_ids=segment_ids)
        if cache is not None and T == 1:
            o, ht = fused_recurrent_gla(q, k, v, gk, **kw)
        else:
            o, ht = chunk_gla(q, k, v, gk, backend=self.backend, **kw)
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, self.H, self.V))
        o = self.o_proj(o.reshape(B, T, self.H * self.V))
        if streaming:
            return o, Cache((), ht)
        return (o, ht) if output_final_state else o


def _streaming(cache, return_cache, cu_seqlens, initial_state, output_final_state, layer: str, segment_ids=None) -> bool:
    """Whether a layer call returns a cache; refuses the combinations that mean nothing."""
    if segment_ids is not None and (cache is not None or return_cache):
        raise ValueError(f"{layer}: a cache holds one sequence a row; prefill packed prompts with `cu_seqlens`, not `segment_ids`")
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"{layer}: `cache` must be a fla_jax.layers.Cache (from init_cache or a previous call), got {type(cache).__name__}")
    if cache is not None and (cu_seqlens is not None or initial_state is not None):
        raise ValueError(f"{layer}: a `cache` continues dense rows: pass neither `cu_seqlens` nor `initial_state` with it")
    if (cache is not None or return_cache) and output_final_state:
        raise ValueError(f"{layer}: with a cache the final state is the cache's `state`; do not also ask for `output_final_state`")
    return cache is not None or bool(return_cache)
