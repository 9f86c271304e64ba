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


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_demo_heads_parallel_matches_data_parallel():
    """Splitting heads over 2 devices (4 x 2 mesh) trains the same model as pure data parallelism."""
    common = ["--steps", "6", "--log-every", "3", "--batch", "8"]
    first_dp, last_dp = demo.main(common)
    first_tp, last_tp = demo.main(common + ["--heads-parallel", "2"])
    assert abs(first_dp - first_tp) < 1e-4 and abs(last_dp - last_tp) < 1e-3


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_demo_param_sharding_splits_heads():
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    model = demo.LanguageModel(64, 32, 1, "gdn", 2, 16, "auto", rngs=nnx.Rngs(0))
    state = nnx.state(model)
    specs = jax.tree_util.tree_map_with_path(lambda path, _: demo.param_sharding(mesh, path).spec, state)
    attn = specs["blocks"][0]["attn"]
    assert attn["q_proj"]["kernel"].get_value() == jax.sharding.PartitionSpec(None, "model")
    assert attn["o_proj"]["kernel"].get_value() == jax.sharding.PartitionSpec("model", None)
    assert attn["A_log"].get_value() == jax.sharding.PartitionSpec("model")
    assert specs["embed"]["embedding"].get_value() == jax.sharding.PartitionSpec()
