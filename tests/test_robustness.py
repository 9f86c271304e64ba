"""Hostile input on the pure-JAX backends: invalid traced `cu_seqlens`, decays of zero (g = -inf) and
very negative gates, non-finite values, and the smaller argument checks. Each test failed before the
fix it covers (the tilelang backend's versions run in tests/test_tilelang.py on a GPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fla_jax
from cases import OPS, Case, make_inputs, static_kwargs
from check import err_ratio
from ref64 import naive

PURE = ("xla", "reference")
ALL_OPS = tuple(OPS)
T = 130


def _inputs(op, seed=0, cu=None, HV=None):
    case = Case(op, 1, T, 2, 16, 16, HV=HV, cu=cu, h0=True)
    diff, _ = make_inputs(case, seed)
    return case, {n: np.asarray(a) for n, a in diff.items()}


def _call(case, diff, backend, **over):
    kw = static_kwargs(case) | over
    return OPS[case.op](**{n: jnp.asarray(a) for n, a in diff.items()}, **kw, backend=backend)


def _ref(case, diff):
    d = dict(diff)
    return naive(case.op, d["q"], d["k"], d["v"], d.get("g"), d.get("beta"), h0=d["initial_state"],
                 cu=None if case.cu is None else list(case.cu))


# ----------------------------------------------------------------------------- cu_seqlens


HOSTILE_CU = {
    "past_T": [0, 500, 100, T],  # chunk counts [8, -6, ...] before the fix
    "huge": [0, 2**30, 100, T],  # a 16.7M-iteration loop in a kernel before the fix
    "decreasing": [0, 90, 40, T],
    "not_from_0": [5, 50, 90, T],
    "short_of_T": [0, 50, 90, T - 1],
    "negative": [0, -64, 90, T],
}
VALID_CU = (0, 50, 90, T)


@pytest.mark.parametrize("backend", PURE)
@pytest.mark.parametrize("name", list(HOSTILE_CU))
def test_invalid_traced_cu_seqlens_gives_nan_everywhere(name, backend):
    """A traced table that is no valid one: every output and final state NaN (the ops run on a
    table no kernel can read out of bounds with), on every backend alike; a valid traced table gives
    what the concrete one gives."""
    case, diff = _inputs("gated_delta_rule", cu=VALID_CU)
    f = jax.jit(lambda cu: _call(case, diff, backend, cu_seqlens=cu))
    o, ht = f(jnp.asarray(HOSTILE_CU[name], jnp.int32))
    assert np.all(np.isnan(np.asarray(o))) and np.all(np.isnan(np.asarray(ht)))
    o_ok, ht_ok = f(jnp.asarray(VALID_CU, jnp.int32))
    want_o, want_ht = _call(case, diff, backend)
    np.testing.assert_allclose(np.asarray(o_ok), np.asarray(want_o), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ht_ok), np.asarray(want_ht), rtol=1e-6, atol=1e-6)


def test_invalid_traced_cu_seqlens_is_an_error_where_asked():
    """`fla_jax.check_cu_seqlens`: a checkify error for a traced table (inside `checkify.checkify`), a
    ValueError for a concrete one; the op itself stays free of effects (`jax.export` serializes it)."""
    case, diff = _inputs("simple_gla", cu=VALID_CU)

    def f(cu):
        fla_jax.check_cu_seqlens(cu, T)
        return _call(case, diff, "xla", cu_seqlens=cu)[0]

    checked = checkify.checkify(jax.jit(f))
    err, _ = checked(jnp.asarray(HOSTILE_CU["past_T"], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="`cu_seqlens` must start at 0, end at T = 130"):
        err.throw()
    err, _ = checked(jnp.asarray(VALID_CU, jnp.int32))
    err.throw()  # (a valid table: no error)
    with pytest.raises(ValueError, match=r"`cu_seqlens` must start at 0, end at T = 130 and not decrease, got \[0, 500"):
        fla_jax.check_cu_seqlens(np.asarray(HOSTILE_CU["past_T"]), T)
    exported = jax.export.export(jax.jit(lambda cu: _call(case, diff, "xla", cu_seqlens=cu)[0]))(jnp.asarray(VALID_CU, jnp.int32))
    assert exported.serialize()


def test_int64_cu_seqlens_is_checked_before_the_cast():
    """Values outside int32 are caught in their own dtype (a cast first would wrap 2**32 + 50 to 50)."""
    case, diff = _inputs("simple_gla", cu=VALID_CU)
    o, _ = jax.jit(lambda cu: _call(case, diff, "xla", cu_seqlens=cu))(jnp.asarray([0, 2**32 + 50, 90, T], jnp.int64))
    assert np.all(np.isnan(np.asarray(o)))


# ----------------------------------------------------------------------------- decays of zero


@pytest.mark.parametrize("backend", PURE)
@pytest.mark.parametrize("op", ["simple_gla", "gla", "gated_delta_rule"])
@pytest.mark.parametrize("floor", [-np.inf, -1e8, -1e6, -300.0])
def test_gates_of_zero_decay_are_exact(op, floor, backend):
    """A decay of zero (g = -inf, what `log(sigmoid(-200.))` gives in float32) or a very negative
    finite gate at a few steps, amid ordinary ones in the same chunks: finite, and within float32's
    reach of the float64 recurrence. Before: NaN from that step (-inf), or the small gates after it
    lost in the chunk's cumulative sums (relative errors 1e-2 to 1.8)."""
    case, diff = _inputs(op)
    g = diff["g"].copy()
    for t in (3, 40, 41, 100):
        g[:, t] = floor
    diff["g"] = g
    o, ht = _call(case, diff, backend)
    want_o, want_ht = _ref(case, diff)
    assert err_ratio(want_o, o) < 2e-5 and err_ratio(want_ht, ht) < 2e-5, (err_ratio(want_o, o), err_ratio(want_ht, ht))
    grads = jax.grad(lambda d: jnp.sum(_call(case, d, backend)[0] ** 2))({n: jnp.asarray(a) for n, a in diff.items()})
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(grads))


# ----------------------------------------------------------------------------- non-finite values


def assert_causal(o0, ht0, o, ht, name, close=None):
    """`(o, ht)` with a non-finite `name` at step 40 of head 0 against `(o0, ht0)` with none: the steps before it
    and the other head as they were (`close(got, want)`; within 1e-6 where None), NaN from it on in head 0 (the
    final state too), or at that step alone for q."""
    close = close or (lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6))
    close(o[0, :40], o0[0, :40])
    close(o[0, :, 1], o0[0, :, 1])
    close(ht[:, 1], ht0[:, 1])
    if name == "q":
        assert np.all(np.isnan(o[0, 40, 0])) and np.all(np.isfinite(o[0, 41:, 0])) and np.all(np.isfinite(ht))
    else:
        assert np.all(np.isnan(o[0, 40:, 0])) and np.all(np.isnan(ht[:, 0])), name


def _bad_step(diff, name, t, value=np.nan, head=0):
    d = {n: a.copy() for n, a in diff.items()}
    d[name][0, t, head] = value
    return d


TAKES = {"simple_gla": "qkvg", "gla": "qkvg", "delta_rule": ("q", "k", "v", "beta"), "gated_delta_rule": ("q", "k", "v", "g", "beta")}


@pytest.mark.parametrize("backend", PURE)
@pytest.mark.parametrize("op,name", [(op, name) for op in ALL_OPS for name in TAKES[op]])
def test_non_finite_input_keeps_causality(op, name, backend):
    """NaN in one step's input (head 0, step 40, inside the first chunk of 64): outputs before it
    unchanged; from it on NaN in that head (k, v, g, beta: the state is NaN from there, and the final
    state) or at that step alone (q); the other head untouched. Before: the NaN reached steps 0..39
    of the same chunk (xla)."""
    case, diff = _inputs(op)
    o0, ht0 = (np.asarray(x) for x in _call(case, diff, backend))
    o, ht = (np.asarray(x) for x in _call(case, _bad_step(diff, name, 40), backend))
    assert_causal(o0, ht0, o, ht, name)


@pytest.mark.parametrize("backend", PURE)
def test_non_finite_input_stays_in_its_sequence(backend):
    """Packed sequences: an infinite v in the second sequence poisons it alone."""
    case, diff = _inputs("gated_delta_rule", cu=(0, 37, 37, 100, T))
    o0, ht0 = (np.asarray(x) for x in _call(case, diff, backend))
    o, ht = (np.asarray(x) for x in _call(case, _bad_step(diff, "v", 50, np.inf), backend))
    np.testing.assert_allclose(o[0, :50], o0[0, :50], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o[0, 100:], o0[0, 100:], rtol=1e-6, atol=1e-6)
    assert np.all(np.isnan(o[0, 50:100, 0])) and np.all(np.isfinite(o[0, 50:100, 1]))
    assert np.all(np.isnan(ht[2, 0])) and np.all(np.isfinite(np.delete(ht, 2, axis=0)))


class _NoGuard:
    """`fla_jax._nonfinite` as the xla backend would see it with no guard: what the kernels' chunked form is
    by itself (a later step's NaN reaches the earlier steps of its chunk through the masked products)."""

    @staticmethod
    def guard(q, k, v, g, beta):
        none = jnp.zeros(v.shape[:3], bool)
        return (q, k, v, g, beta), none, none

    @staticmethod
    def poison(o, ht, *_):
        return o, ht

    @staticmethod
    def token_sequences(cu_seqlens, T):
        return ()


def _kept_causal(monkeypatch, case, guarded=True):
    """The op as the kernels' backend runs it (`_nonfinite.keep_causal` around the call, q and k with H heads),
    on the xla backend's chunked form with no guard of its own; `guarded=False`: that form alone."""
    from fla_jax import _nonfinite, xla
    from fla_jax._problem import Problem

    monkeypatch.setattr(xla, "_nonfinite", _NoGuard)
    p = Problem(op=case.op, delta=case.op in ("delta_rule", "gated_delta_rule"), chunk_size=64, dtype=case.dtype)
    cu = None if case.cu is None else jnp.asarray(case.cu, jnp.int32)

    def run(d):
        def call(tokens):
            q, k, v, g, beta = tokens
            rep = lambda x: jnp.repeat(x, v.shape[2] // x.shape[2], axis=2)
            return xla.run(p, rep(q), rep(k), v, g, beta, d["initial_state"], cu)

        tokens = (d["q"], d["k"], d["v"], d.get("g"), d.get("beta"))
        o, ht = call(tokens)
        seqs = () if cu is None else _nonfinite.token_sequences(cu, T)
        return _nonfinite.keep_causal(o, ht, call, tokens, *seqs) if guarded else (o, ht)

    return run


def _on(run, diff):
    return tuple(np.asarray(x) for x in jax.jit(run)({n: jnp.asarray(a) for n, a in diff.items()}))


@pytest.mark.parametrize("op,name", [(op, name) for op in ALL_OPS for name in TAKES[op]])
def test_kept_causal_mends_a_chunked_form_that_leaks(op, name, monkeypatch):
    """`keep_causal`, what the tilelang backend runs around the kernels: a chunked form that lets a NaN at step
    40 reach steps 0..39 of its chunk (shown for v, so that the test can fail) comes out causal, NaN from the
    step on in that head (or at that step alone for q); the other head untouched."""
    case, diff = _inputs(op)
    leaky, kept = _kept_causal(monkeypatch, case, guarded=False), _kept_causal(monkeypatch, case)
    o0, ht0 = _on(kept, diff)
    bad = _bad_step(diff, name, 40)
    if name == "v":  # (every op's chunked form leaks a NaN v; some also a NaN k, beta or gate)
        assert np.isnan(_on(leaky, bad)[0][0, :40, 0]).any()
    o, ht = _on(kept, bad)
    assert_causal(o0, ht0, o, ht, name)


@pytest.mark.parametrize("name", ["k", "v", "beta"])
def test_kept_causal_with_grouped_heads_and_sequences(name, monkeypatch):
    """Grouped value heads (q, k with 2 heads, v with 4) and packed sequences: a bad v or beta poisons its
    value head alone, a bad k both value heads of its group, and only from that step to its sequence's end;
    the other sequences and heads as they were."""
    case, diff = _inputs("gated_delta_rule", cu=(0, 37, 37, 100, T), HV=4)
    kept = _kept_causal(monkeypatch, case)
    o0, ht0 = _on(kept, diff)
    o, ht = _on(kept, _bad_step(diff, name, 50))
    heads = [0, 1] if name == "k" else [0]
    others = [h for h in range(4) if h not in heads]
    np.testing.assert_allclose(o[0, :50], o0[0, :50], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o[0, 100:], o0[0, 100:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(o[0, :, others], o0[0, :, others], rtol=1e-6, atol=1e-6)
    assert np.all(np.isnan(o[0, 50:100][:, heads])) and np.all(np.isnan(ht[2][heads]))
    assert np.all(np.isfinite(np.delete(ht, 2, axis=0))) and np.all(np.isfinite(ht[2][others]))


# ----------------------------------------------------------------------------- smaller checks


def test_numpy_bools_are_flags():
    case, diff = _inputs("delta_rule")
    o, ht = _call(case, diff, "xla", output_final_state=np.bool_(True), use_qk_l2norm_in_kernel=np.bool_(False))
    assert ht is not None


def test_tilelang_reason_without_the_extension_says_not_built(monkeypatch):
    """Without a built extension the tilelang backend says so (it once showed a circular-import message)."""
    from fla_jax._tilelang import runtime

    ext, why = runtime.load_extension("fla_jax._not_built_ext")
    assert ext is None and why == "fla_jax._not_built_ext is not built", why
    monkeypatch.setattr(runtime, "_ext", None)
    monkeypatch.setattr(runtime, "IMPORT_ERROR", why)
    runtime.status.cache_clear()
    try:
        reason = fla_jax.backends()["tilelang"].reason
    finally:
        runtime.status.cache_clear()
    assert "not built" in reason and "circular" not in reason, reason


@pytest.mark.parametrize("argv,pattern", [
    (["--steps", "0"], "--steps: must be an integer >= 1"),
    (["--batch", "0"], "--batch: must be an integer >= 1"),
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr: must be a finite number > 0"),
    (["--vocab", "1"], "--vocab: must be an integer >= 4"),
])
def test_demo_refuses_arguments_it_cannot_train_with(argv, pattern, capsys):
    """Before: --steps 0 crashed, --batch 0 and --lr nan trained NaN and exited 0, --vocab 1 failed
    inside NumPy."""
    from fla_jax import demo

    with pytest.raises(SystemExit) as e:
        demo.parse(argv)
    assert e.value.code == 2 and pattern in capsys.readouterr().err


def test_demo_help_shows_defaults(capsys):
    from fla_jax import demo

    with pytest.raises(SystemExit):
        demo.parse(["--help"])
    out = capsys.readouterr().out
    assert "(default: 300)" in out and "(default: 0.003)" in out


@pytest.mark.parametrize("layer", ["GatedDeltaNet", "GatedLinearAttention"])
def test_layer_names_a_wrong_input_shape(layer):
    from flax import nnx

    from fla_jax import layers

    m = getattr(layers, layer)(16, 2, 8, rngs=nnx.Rngs(0))
    for x in (jnp.zeros((10, 16)), jnp.zeros((1, 10, 12))):
        with pytest.raises(ValueError, match=re.escape(f"{layer} takes `x` of shape [B, T, d_model = 16], got {tuple(x.shape)}")):
            m(x)


# ----------------------------------------------------------------------------- explain


def test_explain_names_the_programs_and_the_reason():
    """`fla_jax.explain` says which backend a call runs on and why not the kernels, and the programs the
    kernels launch for it (lowered for CUDA on any machine): GDN with grouped heads at K = V = 128 takes
    the forward from the inverse and the training step's four programs; K != V runs them with V in parts;
    K above 256 has no kernel."""
    S = jax.ShapeDtypeStruct
    q, v, g = S((2, 256, 4, 128), jnp.bfloat16), S((2, 256, 8, 128), jnp.bfloat16), S((2, 256, 8), jnp.float32)
    e = fla_jax.explain(fla_jax.chunk_gated_delta_rule, q, q, v, g, g, use_qk_l2norm_in_kernel=True)
    assert e.kernels_take_it and e.op == "chunk_gated_delta_rule"
    assert e.backend == ("tilelang" if fla_jax.backends()["tilelang"].usable else "xla")
    short = lambda names: [n.rsplit("_c64_", 1)[1] for n in names]
    assert short(e.forward) == ["inv_l2", "fused_t_l2_v32"], e.forward
    assert short(e.training) == ["wy_t_l2", "fused_h", "dh", "grads_l2"], e.training
    assert all(n.startswith("fla_delta_") and "_bf16_k128_v128_" in n for n in e.forward + e.training)
    wide = fla_jax.explain(fla_jax.chunk_gated_delta_rule, q, q, S((2, 256, 8, 256), jnp.bfloat16), g, g)
    assert wide.kernels_take_it and short(wide.training) == ["wy_t", "fused_h", "dh", "grads"], wide.training
    assert wide.tiling == ("K = 128, V = 256 on the K = V = 128 programs (V on the forward's grid, in 2 parts as value heads "
                           "under a gradient)"), wide.tiling
    assert wide.tiling in str(wide) and all("_k128_v128_" in n for n in wide.forward + wide.training)
    big = fla_jax.explain(fla_jax.chunk_gated_delta_rule, S((2, 256, 4, 320), jnp.bfloat16), S((2, 256, 4, 320), jnp.bfloat16), v, g, g)
    assert big.backend == "xla" and not big.kernels_take_it and big.forward == big.training == () and big.tiling is None
    assert "K = 320 is above the largest head dim the kernels take (256)" in big.reason and big.reason in str(big)
    asked = fla_jax.explain(fla_jax.chunk_gla, q, q, q, S((2, 256, 4, 128), jnp.float32), backend="xla")
    assert asked.backend == "xla" and asked.reason == "backend 'xla' was asked for" and asked.kernels_take_it


def test_explain_takes_packed_calls_and_refuses_other_functions():
    S = jax.ShapeDtypeStruct
    x, g = S((1, 256, 2, 64), jnp.bfloat16), S((1, 256, 2, 64), jnp.float32)
    e = fla_jax.explain(fla_jax.chunk_gla, x, x, x, g, cu_seqlens=S((4,), jnp.int32), initial_state=S((3, 2, 64, 64), jnp.float32))
    assert [n.rsplit("_c64_", 1)[1] for n in e.forward] == ["a", "fused"], e.forward
    with pytest.raises(ValueError, match="`fn` must be one of fla_jax's ops"):
        fla_jax.explain(lambda x: x, x)


# Calls that take each of the planner's rules: whole sequences, pieces (one long sequence, few heads), simple GLA's
# forward split, V blocks of 32 in the delta rules' forward from the inverse, grouped heads, K != V, K = 256 (no
# folded norms, split consumers), varlen, and a `Config` that turns the delta rules' kernels off one by one.
PLANNED = [
    ("chunk_gated_delta_rule", (4, 4096, 16, 16, 128, 128), None, {"use_qk_l2norm_in_kernel": True}),
    ("chunk_gated_delta_rule", (1, 32768, 16, 16, 128, 128), None, {"use_qk_l2norm_in_kernel": True}),
    ("chunk_gated_delta_rule", (2, 8192, 2, 4, 64, 64), None, {}),
    ("chunk_gated_delta_rule", (2, 512, 4, 8, 128, 256), None, {}),
    ("chunk_gated_delta_rule", (2, 512, 4, 4, 256, 256), None, {"use_qk_l2norm_in_kernel": True}),
    ("chunk_delta_rule", (1, 4096, 2, 2, 128, 128), (0, 100, 100, 3000, 4096), {"use_qk_l2norm_in_kernel": True}),
    ("chunk_simple_gla", (1, 32768, 16, 16, 128, 128), None, {}),
    ("chunk_simple_gla", (1, 8192, 4, 4, 64, 64), (0, 5000, 8192), {}),
    ("chunk_gla", (1, 16384, 4, 4, 64, 64), None, {}),
    ("chunk_gla", (2, 512, 4, 4, 256, 256), None, {}),
]


@pytest.mark.parametrize("op,shape,cu,kw", PLANNED, ids=[f"{o}-{'x'.join(map(str, s))}{'-varlen' if c else ''}" for o, s, c, _ in PLANNED])
def test_the_planner_names_the_programs_a_call_lowers_to(op, shape, cu, kw):
    """The planner (`fla_jax._tilelang.plan`) is where dispatch is decided: the programs it names for a call's forward
    and training step are those the call lowers to for CUDA (`fla_jax.explain`), and its pieces are those the state
    passes walk."""
    from fla_jax import _explain, ops
    from fla_jax.tilelang_backend import Config

    S = jax.ShapeDtypeStruct
    B, T, H, HV, K, V = shape
    x, v = S((B, T, H, K), jnp.bfloat16), S((B, T, HV, V), jnp.bfloat16)
    g = S((B, T, HV, K) if op == "chunk_gla" else (B, T, HV), jnp.float32)
    args = {"chunk_simple_gla": (x, x, v, g), "chunk_gla": (x, x, v, g), "chunk_delta_rule": (x, x, v, S((B, T, HV), jnp.float32)),
            "chunk_gated_delta_rule": (x, x, v, g, g)}[op]
    extra = {} if cu is None else {"cu_seqlens": S((len(cu),), jnp.int32)}
    configs = [Config()] + ([Config(delta_grads_kernel=()), Config(delta_grads_kernel=(), delta_wy_bwd_kernel=False)] if "delta" in op and K == 128 else [])
    configs += [Config(delta_carry_t=True)] if "delta" in op and K <= 128 else []
    fn = getattr(fla_jax, op)
    e = fla_jax.explain(fn, *args, **kw, **extra)
    assert str(e.plan) in str(e)
    plans = []
    token = ops.PLANS.set(plans)
    try:
        jax.eval_shape(lambda a, arrays: fn(*a, **kw, **arrays), args, extra)
    finally:
        ops.PLANS.reset(token)
    kinds = lambda names: {n.rsplit("_c64_", 1)[1] for n in names}
    for cfg in configs:  # (the call as the kernels take it under each configuration: lowered for CUDA, on any machine)
        call = dict(plans[0], asked=cfg)
        forward, training = _explain._kernel_programs(call)
        planned = _explain.planned(call)
        assert kinds(forward) == set(planned.forward), (cfg, forward, planned)
        assert kinds(training) == set(planned.training), (cfg, training, planned)
    if T >= 16384 and B * HV <= 16:  # (few programs: the passes in pieces)
        assert planned.training_pieces > 1 and planned.forward_pieces > 1, planned


def test_kernels_and_runtime_share_the_gate_floor():
    """GLA's kernel clamps its per-channel gates at the value the runtime clamps scalar gates at."""
    pytest.importorskip("tilelang")  # (the build extra: CI has it)
    from fla_jax import xla
    from kernels.gla import fwd

    assert fwd.GATE_FLOOR == xla.GATE_FLOOR


def test_demo_writes_its_loss_curve_and_summary(tmp_path):
    """The main job leaves a loss curve (a PNG, with no plotting library) and a one-line summary."""
    import struct
    import zlib

    from fla_jax import demo

    demo.main(["--steps", "4", "--log-every", "2", "--seq-len", "32", "--out", str(tmp_path)])
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (480, 240)
    pixels = zlib.decompress(png[png.index(b"IDAT") + 4 : png.index(b"IEND") - 8])
    assert len(pixels) == 240 * 481 and pixels.count(b"\x00") > 480  # (the frame and the curve drawn)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and "backend" in summary[0] and "4 steps" in summary[0] and "tokens/s" in summary[0], summary
