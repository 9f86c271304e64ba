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


def test_fla_default_head_dims_run_on_the_kernels():
    """fla's default configurations, GDN's head_dim 256 with expand_v 2 and GLA's expand_k 0.5, make K != V
    calls that the kernels take (lowered for CUDA on any machine: `fla_jax.explain` of the layer's op call),
    and a bad expand is refused by name."""
    import fla_jax

    calls = []
    real = {n: getattr(fla_jax.layers, n) for n in ("chunk_gated_delta_rule", "chunk_gla")}
    for name, fn in real.items():
        def spy(*a, _fn=fn, **kw):
            calls.append((_fn, a, kw))
            return _fn(*a, **kw)
        setattr(fla_jax.layers, name, spy)
    try:
        x = jnp.zeros((1, 64, 512), jnp.bfloat16)
        GatedDeltaNet(512, 2, 256, expand_v=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x)
        GatedLinearAttention(512, 2, 256, expand_k=0.5, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x)
    finally:
        for name, fn in real.items():
            setattr(fla_jax.layers, name, fn)
    (gdn, ga, gkw), (gla, la, lkw) = calls
    assert ga[0].shape[-1] == 256 and ga[2].shape[-1] == 512 and la[0].shape[-1] == 128 and la[2].shape[-1] == 256
    for fn, a, kw in calls:
        e = fla_jax.explain(fn, *a, **kw)
        assert e.kernels_take_it and e.training, e
    assert "in 2 parts as value heads under a gradient" in fla_jax.explain(gdn, *ga, **gkw).tiling
    with pytest.raises(ValueError, match="`expand_k` times head_dim"):
        GatedLinearAttention(32, 2, 16, expand_k=0.3, rngs=nnx.Rngs(0))


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
def test_layer_segments_equal_separate_sequences(name):
    """Packed rows with `segment_ids` (B = 2, segments of 1 to 70 tokens, ids that come back) give what each
    segment gives alone, short convolutions and state restarting; the final state is each row's last segment's."""
    layer = LAYERS[name]()
    rows = [[5, 70, 1, 20], [96]]
    x = jax.random.normal(jax.random.key(1), (2, 96, 32), jnp.float32)
    seg = jnp.asarray([np.concatenate([np.full(n, i % 2) for i, n in enumerate(r)]) for r in rows], jnp.int32)
    packed, ht = layer(x, segment_ids=seg, output_final_state=True)
    for b, lens in enumerate(rows):
        start = 0
        for n in lens:
            alone, ht_i = layer(x[b : b + 1, start : start + n], output_final_state=True)
            assert err_ratio(alone, packed[b : b + 1, start : start + n]) < 1e-5, (b, start)
            start += n
        assert err_ratio(ht_i[0], ht[b]) < 1e-5
    with pytest.raises(ValueError, match="not `segment_ids`"):
        layer(x, segment_ids=seg, return_cache=True)


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


# (GDN in float32 trains in the other demo tests' runs and in tests/test_training.py: here the layer in bf16)
@pytest.mark.parametrize("layer, dtype", [("gla", "auto"), ("gdn", "bfloat16")])
def test_demo_loss_falls(layer, dtype):
    first, last = demo.main(["--steps", "60", "--layer", layer, "--dtype", dtype, "--log-every", "30", "--sample", "0"])
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
    common = ["--steps", "6", "--log-every", "3", "--batch", "8", "--sample", "0"]
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


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_cache_prefill_then_steps_equals_the_whole_sequence(name):
    """Generation: packed prompts of different lengths prefilled by the chunk op (`return_cache=True` with
    cu_seqlens: one cache row per prompt), then token steps for all rows at once in one jitted loop, give each
    row what the layer gives on its prompt and continuation in one call (outputs and the final state)."""
    _cache_against_the_whole_sequence(LAYERS[name](), jnp.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "gla"])
def test_layer_cache_on_the_kernels(name):
    """The same on the GPU in bf16 with head dims the kernels take: the prefill and the whole sequences on the
    TileLang kernels (a fallback to XLA is an error here), the steps by the recurrent ops."""
    import warnings

    import fla_jax

    if not fla_jax.backends()["tilelang"].usable:
        pytest.skip(str(fla_jax.backends()["tilelang"]))
    make = {"gdn": lambda: GatedDeltaNet(32, 2, 64, num_v_heads=4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
            "gla": lambda: GatedLinearAttention(32, 2, 64, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fla_jax.FallbackWarning)
        _cache_against_the_whole_sequence(make(), jnp.bfloat16, 2e-2)


def _cache_against_the_whole_sequence(layer, dtype, tol):
    from fla_jax.layers import Cache

    lens, steps = [5, 70, 1], 6
    rng = jax.random.key(3)
    prompts = jax.random.normal(rng, (1, sum(lens), 32), dtype)
    more = jax.random.normal(jax.random.key(4), (len(lens), steps, 32), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    y_pre, cache = layer(prompts, cu_seqlens=cu, return_cache=True)
    assert isinstance(cache, Cache) and cache.state.shape[0] == len(lens)
    traces = []

    @nnx.jit
    def decode(layer, cache, xs):
        def body(cache, x):
            traces.append(1)
            y, cache = layer(x[:, None], cache=cache)
            return cache, y[:, 0]
        cache, ys = jax.lax.scan(body, cache, jnp.moveaxis(xs, 1, 0))
        return jnp.moveaxis(ys, 0, 1), cache

    ys, cache = decode(layer, cache, more)
    assert len(traces) == 1
    start = 0
    for n, L in enumerate(lens):
        whole = jnp.concatenate([prompts[:, start : start + L], more[n : n + 1]], axis=1)
        y, ht = layer(whole, output_final_state=True)
        assert err_ratio(y[:, :L], y_pre[:, start : start + L]) < tol
        assert err_ratio(y[0, L:], ys[n]) < tol, n
        assert err_ratio(ht[0], cache.state[n]) < tol
        start += L
    # a dense prefill (equal-length rows) continues the same way, from an empty cache too
    x = jax.random.normal(jax.random.key(5), (2, 9, 32), dtype)
    y_all = layer(x)
    y1, c = layer(x[:, :4], cache=layer.init_cache(2))
    y2, c = layer(x[:, 4:5], cache=c)
    y3, c = layer(x[:, 5:], cache=c)
    assert err_ratio(y_all, jnp.concatenate([y1, y2, y3], 1)) < tol
    with pytest.raises(ValueError, match="a `cache` continues dense rows"):
        layer(x, cache=c, cu_seqlens=jnp.asarray([0, 9], jnp.int32))
    with pytest.raises(TypeError, match="`cache` must be a fla_jax.layers.Cache"):
        layer(x, cache=(1, 2))


@pytest.mark.parametrize("layer", ["gdn", "gla"])
def test_demo_generation_equals_sampling_from_the_whole_sequence(layer):
    """The demo's generation (packed prefill, then cached token steps in one jitted loop) draws the tokens that
    sampling with the same keys from the model run over each whole prefix draws, for prompts of different lengths."""
    model = demo.LanguageModel(64, 32, 2, layer, 2, 16, "auto", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n) for n in (3, 66, 1)]
    key = jax.random.key(7)
    toks, _ = demo.generate(model, prompts, 3, key)
    seqs = [list(p) for p in prompts]
    for i, k in enumerate(jax.random.split(key, 3)):
        logits = jnp.stack([model(jnp.asarray(s_)[None])[0, -1] for s_ in seqs]).astype(jnp.float32)
        tok = np.asarray(jax.random.categorical(k, logits))
        assert (tok == toks[:, i]).all(), (i, tok, toks[:, i])
        for s_, t in zip(seqs, tok):
            s_.append(int(t))
