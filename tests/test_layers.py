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


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_bfloat16_activations_track_float32(name):
    """`dtype=jnp.bfloat16` computes the projections in bf16 (what the TileLang kernels take) with
    the same float32 parameters, and follows the float32 layer within bf16's rounding."""
    build = {"gdn": GatedDeltaNet, "gla": GatedLinearAttention}[name]
    kw = {"num_v_heads": 4} if name == "gdn" else {}
    full = build(32, 2, 16, rngs=nnx.Rngs(0), **kw)
    half = build(32, 2, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **kw)
    params = jax.tree.leaves(nnx.state(half, nnx.Param))
    assert params and all(p.dtype == jnp.float32 for p in params)
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(nnx.state(full, nnx.Param)), params))
    x = jax.random.normal(jax.random.key(3), (2, 90, 32), jnp.float32)
    y, y16 = full(x), half(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert 0 < err_ratio(y, y16) < 3e-2  # (not 0: the bf16 layer really rounds)
    g, g16 = (nnx.grad(lambda m, x=x_: jnp.sum(m(x).astype(jnp.float32) ** 2))(m) for m, x_ in ((full, x), (half, x.astype(jnp.bfloat16))))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g16)):
        assert b.dtype == jnp.float32 and err_ratio(a, b) < 6e-2


@pytest.mark.parametrize("layer, dtype", [("gdn", "auto"), ("gla", "auto"), ("gdn", "bfloat16")])
def test_demo_loss_falls(layer, dtype):
    first, last = demo.main(["--steps", "60", "--layer", layer, "--dtype", dtype, "--log-every", "30"])
    assert np.isfinite(last) and last < first - 1.0


def test_demo_compiles_its_step_once(caplog):
    """The training step compiles at the first step only: the optimizer's counts start on the mesh
    (left uncommitted, they came back sharded from the first step and the second compiled again)."""
    with caplog.at_level("WARNING", logger="jax"), jax.log_compiles(True):
        demo.main(["--steps", "3", "--log-every", "3", *(["--heads-parallel", "2"] if len(jax.devices()) % 2 == 0 else [])])
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(train_step)")]
    assert len(compiles) == 1, compiles


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


@pytest.mark.skipif(len(jax.devices()) % 2, reason="needs an even number of devices")
@pytest.mark.parametrize("heads_parallel", [1, 2])
def test_demo_step_gathers_nothing(heads_parallel):
    """The demo's compiled training step on every device (8 host devices here: a 4 x 2 or 8 x 1
    mesh; on GPUs, with the kernels, benchmarks/multi_gpu.sh): all-reduces only (the
    gradients over the data axis; with heads split, the output projection's rows too), no gather,
    all-to-all or permutation of activations such as q, k and v."""
    import re

    from test_sharding import COLLECTIVES

    s = demo.setup(demo.parse(["--batch", "8", "--heads", "4", "--heads-parallel", str(heads_parallel)]))
    hlo = s.train_step.lower(s.model, s.optimizer, s.make_batch(jax.random.key(0))).compile().as_text()
    found = re.findall(rf" ({COLLECTIVES})(?:-start)?\(", hlo)
    assert found and set(found) == {"all-reduce"}, sorted(found)
