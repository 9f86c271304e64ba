"""Bad input gets a ValueError/TypeError naming the argument, never a crash or a wrong answer."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax

B, T, H, K, V = 2, 10, 2, 8, 4
f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


q, k, v = z(B, T, H, K), z(B, T, H, K), z(B, T, H, V)
g3, g4, beta = z(B, T, H), z(B, T, H, K), z(B, T, H)


CASES = [
    # (call, exception, pattern in the message)
    (lambda: fla_jax.chunk_simple_gla(q[0], k, v), ValueError, r"`q` must have rank 4"),
    (lambda: fla_jax.chunk_simple_gla(q, k[:, :, :, :4], v), ValueError, r"`k` must have shape"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v[:, :5]), ValueError, r"`v` must have shape \[B, T, HV, V\]"),
    (lambda: fla_jax.chunk_simple_gla(q, k, z(B, T, 1, V)), ValueError, r"`v` must have H = 2 heads"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v.astype(jnp.bfloat16)), TypeError, r"share one dtype"),
    (lambda: fla_jax.chunk_simple_gla(q.astype(jnp.int32), k, v), TypeError, r"`q` must have a floating dtype"),
    (lambda: fla_jax.chunk_simple_gla([[1.0]], k, v), TypeError, r"`q` must be an array"),
    (lambda: fla_jax.chunk_simple_gla(q[:, :0], k[:, :0], v[:, :0]), ValueError, r"T must be >= 1"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g4), ValueError, r"`g` must have rank 3"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3[:, :3]), ValueError, r"`g` must have shape \[B, T, H\]"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, g_gamma=z(H)), ValueError, r"at most one of `g`"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g_gamma=z(H + 1)), ValueError, r"`g_gamma` must have shape \[H\]"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, chunk_size=48), ValueError, r"`chunk_size` must be one of"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, backend="triton"), ValueError, r"`backend` must be one of"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, scale="x"), TypeError, r"`scale` must be a Python float"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, output_final_state=1), TypeError, r"`output_final_state` must be a bool"),
    (lambda: fla_jax.chunk_simple_gla(q, k, v, g3, initial_state=z(B, H, V, K)), ValueError, r"`initial_state` must have shape \[N, H, K, V\]"),
    (lambda: fla_jax.chunk_gla(q, k, v, g3), ValueError, r"`g` must have rank 4"),
    (lambda: fla_jax.chunk_gla(q, k, v, g4[..., :3]), ValueError, r"`g` must have shape \[B, T, H, K\]"),
    (lambda: fla_jax.chunk_gla(q, k, v, g4.astype(jnp.int32)), TypeError, r"`g` must have a floating dtype"),
    (lambda: fla_jax.chunk_delta_rule(q, k, v, beta[..., None]), ValueError, r"`beta` must have rank 3"),
    (lambda: fla_jax.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel="yes"), TypeError, r"use_qk_l2norm_in_kernel"),
    (lambda: fla_jax.chunk_gated_delta_rule(q, k, z(B, T, 3, V), z(B, T, 3), z(B, T, 3)), ValueError, r"HV = 3 must be a multiple of the q/k heads H = 2"),
    (lambda: fla_jax.chunk_gated_delta_rule(q, k, z(B, T, 4, V), g3, z(B, T, 4)), ValueError, r"`g` must have shape \[B, T, HV\]"),
    (lambda: fla_jax.chunk_gated_delta_rule(q, k, z(B, T, 4, V), z(B, T, 4), beta), ValueError, r"`beta` must have shape \[B, T, HV\]"),
    (lambda: fla_jax.chunk_gated_delta_rule(q, k, z(B, T, 4, V), z(B, T, 4), z(B, T, 4), initial_state=z(B, H, K, V)), ValueError, r"`initial_state` must have shape"),
    # cu_seqlens
    (lambda: fla_jax.chunk_simple_gla(q, k, v, cu_seqlens=jnp.array([0, 10], jnp.int32)), ValueError, r"batch size B must be 1"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([0.0, 10.0])), TypeError, r"`cu_seqlens` must have an integer dtype"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([[0, 10]])), ValueError, r"`cu_seqlens` must have rank 1"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([0])), ValueError, r"N >= 1"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([0, 4, 9])), ValueError, r"end at T = 10"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([0, 6, 4, 10])), ValueError, r"not decrease"),
    (lambda: fla_jax.chunk_simple_gla(q[:1], k[:1], v[:1], cu_seqlens=jnp.array([0, 4, 10]), initial_state=z(1, H, K, V)), ValueError, r"N = number of sequences in cu_seqlens"),
]


@pytest.mark.parametrize("call,exc,pattern", CASES, ids=[c[2] for c in CASES])
def test_bad_input_raises_naming_argument(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
