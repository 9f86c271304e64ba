"""The Flax NNX layers and the demo's training loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from check import err_ratio
from fla_jax import demo
from fla_jax.layers import GatedDeltaNet, GatedLinearAttention

LAYERS = {
    "gdn": lambda: GatedDeltaNet(32, 2, 16, num_v_heads=4, rngs=nnx.Rngs(0)),
    "gla": lambda: GatedLinearAttention(32, 2, 16, rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_varlen_equals_separate_sequences(name):
    """Packed sequences with cu_seqlens give what each sequence gives alone (conv and state reset)."""
    layer = LAYERS[name]()
    lens = [5, 0, 70, 1, 20]
    x = jax.random.normal(jax.random.key(1), (1, sum(lens), 32), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    packed, ht = layer(x, cu_seqlens=cu, output_final_state=True)
    assert packed.shape == x.shape and ht.shape[0] == len(lens)
    start = 0
    for i, n in enumerate(lens):
        if n:
            alone, ht_i = layer(x[:, start : start + n], output_final_state=True)
            assert err_ratio(alone, packed[:, start : start + n]) < 1e-5
            assert err_ratio(ht_i[0], ht[i]) < 1e-5
        else:
            assert float(jnp.abs(ht[i]).max()) == 0.0
        start += n


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_is_causal_and_differentiable(name):
    layer = LAYERS[name]()
    x = jax.random.normal(jax.random.key(2), (2, 40, 32), jnp.float32)
    y = layer(x)
    y2 = layer(x.at[:, 30:].set(0.0))
    np.testing.assert_allclose(np.asarray(y[:, :30]), np.asarray(y2[:, :30]), rtol=1e-5, atol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


@pytest.mark.parametrize("layer", ["gdn", "gla"])
def test_demo_loss_falls(layer):
    first, last = demo.main(["--steps", "60", "--layer", layer, "--log-every", "30"])
    assert np.isfinite(last) and last < first - 1.0
