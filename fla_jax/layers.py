"""Flax NNX layers built on the ops, shaped as fla's `GatedDeltaNet` and `GatedLinearAttention`.

Both take `x [B, T, D]` and return `[B, T, D]`; with `cu_seqlens` (B = 1, packed sequences) the
short convolutions and the recurrence restart at every sequence boundary. `dtype` is the
projections' compute dtype (parameters stay float32): `jnp.bfloat16` for mixed-precision training,
which is what the TileLang kernels take (they are built for bfloat16 and float16 only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fla_jax import _layout
from fla_jax.ops import chunk_gated_delta_rule, chunk_gla


def _tokens(x, d_model: int, layer: str) -> tuple[int, int]:
    """`(B, T)` of a layer's input `x [B, T, d_model]`, or a ValueError naming it."""
    if getattr(x, "ndim", None) != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{layer} takes `x` of shape [B, T, d_model = {d_model}], got {tuple(getattr(x, 'shape', ()))}")
    return x.shape[0], x.shape[1]


def _positions(T: int, cu_seqlens: jax.Array | None) -> jax.Array:
    """Position of each token inside its own sequence, `[T]`."""
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

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        T = x.shape[1]
        w = self.weight[...].astype(x.dtype)
        y = jnp.zeros_like(x)
        for i in range(self.kernel_size):
            back = self.kernel_size - 1 - i  # tap i reads x[t - back]
            shifted = jnp.pad(x, ((0, 0), (back, 0), (0, 0)))[:, :T]
            y = y + jnp.where((pos >= back)[None, :, None], shifted, 0) * w[i]
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
    gated RMS norm and output projection. `num_v_heads` > `num_heads` gives grouped value heads."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        num_v_heads: int | None = None,
        expand_v: int = 1,
        conv_size: int = 4,
        backend: str = "auto",
        dtype=None,
        rngs: nnx.Rngs,
    ):
        self.H, self.K = num_heads, head_dim
        self.HV = num_v_heads or num_heads
        self.V = head_dim * expand_v
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

    def __call__(self, x, *, cu_seqlens=None, initial_state=None, output_final_state=False):
        B, T = _tokens(x, self.d_model, "GatedDeltaNet")
        pos = _positions(T, cu_seqlens)
        q = self.q_conv(self.q_proj(x), pos).reshape(B, T, self.H, self.K)
        k = self.k_conv(self.k_proj(x), pos).reshape(B, T, self.H, self.K)
        v = self.v_conv(self.v_proj(x), pos).reshape(B, T, self.HV, self.V)
        a = self.a_proj(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        o, ht = chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend=self.backend,
        )
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, self.HV, self.V))
        o = self.o_proj(o.reshape(B, T, self.HV * self.V))
        return (o, ht) if output_final_state else o


class GatedLinearAttention(nnx.Module):
    """GLA attention: projections, low-rank per-channel forget gate, `chunk_gla`, gated RMS norm
    and output projection (fla's `GatedLinearAttention` with its defaults)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_v: int = 1,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: float = 16.0,
        backend: str = "auto",
        dtype=None,
        rngs: nnx.Rngs,
    ):
        self.H, self.K, self.V = num_heads, head_dim, head_dim * expand_v
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

    def __call__(self, x, *, cu_seqlens=None, initial_state=None, output_final_state=False):
        B, T = _tokens(x, self.d_model, "GatedLinearAttention")
        q = self.q_proj(x).reshape(B, T, self.H, self.K)
        k = self.k_proj(x).reshape(B, T, self.H, self.K)
        v = self.v_proj(x).reshape(B, T, self.H, self.V)
        gk = self.gk_up(self.gk_down(x)).astype(jnp.float32).reshape(B, T, self.H, self.K)
        gk = jax.nn.log_sigmoid(gk) / self.normalizer
        o, ht = chunk_gla(
            q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, backend=self.backend,
        )
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, self.H, self.V))
        o = self.o_proj(o.reshape(B, T, self.H * self.V))
        return (o, ht) if output_final_state else o
