"""The ops inside training-loop machinery: lax.scan over stacked layers, buffer donation, and
jax.export round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax
from check import err_ratio

D, H, K = 16, 2, 8
LAYERS = 3


def _layer(x, w, backend):
    """A minimal GDN block: projections, the op, output projection, residual."""
    B, T, _ = x.shape
    q = (x @ w["q"]).reshape(B, T, H, K)
    k = (x @ w["k"]).reshape(B, T, H, K)
    v = (x @ w["v"]).reshape(B, T, H, K)
    g = jax.nn.log_sigmoid(x @ w["g"])
    beta = jax.nn.sigmoid(x @ w["b"])
    o, _ = fla_jax.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend)
    return x + o.reshape(B, T, H * K) @ w["o"]


def _weights(key):
    ks = jax.random.split(key, 6)
    shapes = {"q": (D, H * K), "k": (D, H * K), "v": (D, H * K), "g": (D, H), "b": (D, H), "o": (H * K, D)}
    return {n: 0.3 * jax.random.normal(k_, (LAYERS, *s), jnp.float32) for k_, (n, s) in zip(ks, shapes.items())}


@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_scan_over_stacked_layers(backend):
    w = _weights(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 70, D), jnp.float32)

    def scanned(w, x):
        y, _ = jax.lax.scan(lambda h, wl: (_layer(h, wl, backend), None), x, w)
        return jnp.sum(y**2)

    def unrolled(w, x):
        for i in range(LAYERS):
            x = _layer(x, jax.tree.map(lambda a: a[i], w), backend)
        return jnp.sum(x**2)

    l1, g1 = jax.jit(jax.value_and_grad(scanned))(w, x)
    l2, g2 = jax.jit(jax.value_and_grad(unrolled))(w, x)
    assert err_ratio(l2, l1) < 1e-6
    for n in w:
        assert err_ratio(g2[n], g1[n]) < 1e-5, n
    # and with the layer rematerialised, as a memory-saving training loop would
    remat = jax.checkpoint(lambda h, wl: (_layer(h, wl, backend), None), policy=jax.checkpoint_policies.dots_saveable)
    g3 = jax.jit(jax.grad(lambda w, x: jnp.sum(jax.lax.scan(remat, x, w)[0] ** 2)))(w, x)
    for n in w:
        assert err_ratio(g2[n], g3[n]) < 1e-5, n


def test_train_step_with_donated_buffers():
    w = _weights(jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (2, 50, D), jnp.float32)

    def loss(w, x):
        y, _ = jax.lax.scan(lambda h, wl: (_layer(h, wl, "auto"), None), x, w)
        return jnp.mean(y**2)

    @jax.jit
    def step_ref(w, x):
        l, g = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, w, g), l

    step = jax.jit(lambda w, x: step_ref(w, x), donate_argnums=0)
    w_copy = jax.tree.map(jnp.copy, w)
    w_new, l0 = step(w, x)
    assert all(a.is_deleted() for a in jax.tree.leaves(w)), "the donated weights should be consumed"
    w_expected, l_expected = step_ref(w_copy, x)
    assert err_ratio(l_expected, l0) < 1e-6
    for n in w_new:
        assert err_ratio(w_expected[n], w_new[n]) < 1e-6
    losses = [float(l0)]
    for _ in range(5):
        w_new, l = step(w_new, x)
        losses.append(float(l))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("op", ["simple_gla", "gla", "delta_rule", "gated_delta_rule"])
def test_export_round_trip(op):
    """`jax.export` of the op and its gradient serialises, deserialises and gives the same numbers,
    with a symbolic-free static signature and traced cu_seqlens."""
    rng = np.random.default_rng(0)
    T = 90
    q = jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32)
    k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    v = jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32)
    g3 = jnp.asarray(-np.abs(rng.standard_normal((1, T, 2))), jnp.float32)
    g4 = jnp.asarray(-np.abs(rng.standard_normal((1, T, 2, 8))), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(1, T, 2)), jnp.float32)
    cu = jnp.asarray([0, 30, 90], jnp.int32)
    call = {
        "simple_gla": lambda q, k, v, cu: fla_jax.chunk_simple_gla(q, k, v, g3, cu_seqlens=cu, output_final_state=True),
        "gla": lambda q, k, v, cu: fla_jax.chunk_gla(q, k, v, g4, cu_seqlens=cu, output_final_state=True),
        "delta_rule": lambda q, k, v, cu: fla_jax.chunk_delta_rule(q, k, v, beta, cu_seqlens=cu, output_final_state=True),
        "gated_delta_rule": lambda q, k, v, cu: fla_jax.chunk_gated_delta_rule(q, k, v, g3, beta, cu_seqlens=cu, output_final_state=True),
    }[op]
    grad = jax.grad(lambda q, k, v, cu: jnp.sum(call(q, k, v, cu)[0] ** 2) + jnp.sum(call(q, k, v, cu)[1]), argnums=(0, 1, 2))
    for fn in (call, grad):
        exp = jax.export.export(jax.jit(fn))(q, k, v, cu)
        back = jax.export.deserialize(exp.serialize())
        got, want = back.call(q, k, v, cu), fn(q, k, v, cu)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert err_ratio(b, a) < 1e-6
        # other packings of the same total length reuse the exported program
        other = jnp.asarray([0, 89, 90], jnp.int32)
        for a, b in zip(jax.tree.leaves(back.call(q, k, v, other)), jax.tree.leaves(fn(q, k, v, other))):
            assert err_ratio(b, a) < 1e-6
