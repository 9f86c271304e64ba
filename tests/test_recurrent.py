"""The recurrent ops (`fla_jax.fused_recurrent_*`, fla 0.6.0's meaning): against the chunk ops and the float64
recurrence, token-by-token decoding against one call over the sequence, and their own options."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax
from cases import OPS, Case, make_inputs, static_kwargs
from check import err_ratio, reference_grads

RECURRENT = {
    "simple_gla": fla_jax.fused_recurrent_simple_gla,
    "gla": fla_jax.fused_recurrent_gla,
    "delta_rule": fla_jax.fused_recurrent_delta_rule,
    "gated_delta_rule": fla_jax.fused_recurrent_gated_delta_rule,
}


def _kwargs(case, diff):
    """The recurrent op's arguments for `make_inputs`' arrays (GLA's gate is `gk` there)."""
    d = dict(diff)
    if case.op == "gla":
        d["gk"] = d.pop("g")
    kw = {n: x for n, x in static_kwargs(case).items() if n != "chunk_size"}
    return d | kw


CASES = [
    Case("simple_gla", 2, 1, 2, 16, 8, h0=True),  # a decode step
    Case("simple_gla", 2, 150, 2, 16, 8, h0=True, norm=0.1),  # past one block of 64 steps
    Case("simple_gla", 1, 40, 2, 8, 8, gate="g_gamma", cu=(0, 0, 13, 14, 40), h0=True),
    Case("gla", 2, 1, 2, 16, 8, h0=True),
    Case("gla", 1, 130, 2, 16, 8, dtype="bfloat16", norm=10),
    Case("delta_rule", 2, 1, 2, 16, 8, h0=True, l2norm=True),
    Case("delta_rule", 1, 70, 1, 16, 8, cu=(0, 5, 5, 70), h0=True),
    Case("gated_delta_rule", 2, 1, 1, 16, 8, HV=2, h0=True, l2norm=True),
    Case("gated_delta_rule", 2, 100, 1, 16, 32, HV=2, dtype="bfloat16", l2norm=True, norm=0.1),
    Case("gated_delta_rule", 1, 90, 2, 8, 8, cu=(0, 30, 31, 90), h0=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_recurrent_matches_float64(case):
    """o, the final state and every gradient against the float64 recurrence (the chunk ops' reference)."""
    diff, cot = make_inputs(case, 5)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    op = RECURRENT[case.op]

    def loss(d):
        o, ht = op(**_kwargs(case, d))
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(ht * cot["dht"]), (o, ht)

    grads, (o, ht) = jax.jit(jax.grad(loss, has_aux=True))(diff)
    tol = {"float32": 1e-5, "bfloat16": 5e-3}[case.dtype]
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)} | {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff}
    assert o.dtype == diff["q"].dtype and ht.dtype == jnp.float32
    assert all(e <= tol * (5 if n == "dg_gamma" else 1) for n, e in errs.items()), errs


def _decode_against_the_chunk_op(op: str, backend: str, dtype: str, K: int, tol: float):
    """A jitted decode loop (one token a step, the state carried; it compiles once) gives the outputs and the
    final state of the chunk op over the whole sequence after a prefill by the chunk op (on `backend`)."""
    case = Case(op, 2, 100, 1, K, K, dtype=dtype, HV=2 if op == "gated_delta_rule" else None, h0=True,
                l2norm=op.endswith("delta_rule"))
    diff, _ = make_inputs(case, 9)
    full_o, full_ht = OPS[op](**diff, **static_kwargs(case), backend=backend)
    P = 37  # prefill
    token = lambda x, t: jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)
    seqs = {n: x for n, x in diff.items() if n != "initial_state" and x.ndim >= 3}
    pre_o, state = OPS[op](**{n: x[:, :P] for n, x in seqs.items()}, initial_state=diff["initial_state"], **static_kwargs(case),
                           backend=backend)
    traces = []

    @jax.jit
    def decode(state):
        def body(state, t):
            traces.append(t)
            kw = _kwargs(case, {n: token(x, t) for n, x in seqs.items()} | {"initial_state": state})
            o, state = RECURRENT[op](**kw)
            return state, o[:, 0]
        state, o = jax.lax.scan(body, state, jnp.arange(P, case.T))
        return jnp.moveaxis(o, 0, 1), state

    o, ht = decode(state)
    assert len(traces) == 1  # (one trace of the step)
    assert o.dtype == full_o.dtype
    errs = {"prefill": err_ratio(full_o[:, :P], pre_o), "steps": err_ratio(full_o[:, P:], o), "ht": err_ratio(full_ht, ht)}
    assert all(e < tol for e in errs.values()), errs


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("op", list(OPS))
def test_decoding_step_by_step_equals_the_chunk_op(op, dtype, tol):
    _decode_against_the_chunk_op(op, "xla", dtype, 16, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_decoding_after_a_kernel_prefill_equals_the_kernels(op):
    """On the GPU: the chunk parts (prefill, whole sequence) on the TileLang kernels in bf16, the steps by the
    recurrent op; bf16 outputs rounded on different paths, hence the looser bound."""
    if not fla_jax.backends()["tilelang"].usable:
        pytest.skip(str(fla_jax.backends()["tilelang"]))
    _decode_against_the_chunk_op(op, "tilelang", "bfloat16", 64, 1e-2)


def test_reverse_walks_the_tokens_from_the_last():
    """`reverse=True` equals the forward op on the time-reversed inputs, its output reversed back (simple GLA
    and GLA, dense and packed)."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 1, 90, 2, 8, 4
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 0.5, (B, T, H)), jnp.float32)
    gk = jnp.asarray(-rng.uniform(0, 0.5, (B, T, H, K)), jnp.float32)
    flip = lambda x: jnp.flip(x, 1)
    for op, gate in ((fla_jax.fused_recurrent_simple_gla, {"g": g}), (fla_jax.fused_recurrent_gla, {"gk": gk})):
        o, ht = op(q, k, v, **gate, reverse=True, output_final_state=True)
        o2, ht2 = op(flip(q), flip(k), flip(v), **{n: flip(x) for n, x in gate.items()}, output_final_state=True)
        assert err_ratio(flip(o2), o) < 1e-6 and err_ratio(ht2, ht) < 1e-6
    cu = jnp.asarray([0, 40, 40, 90], jnp.int32)
    o, ht = fla_jax.fused_recurrent_simple_gla(q, k, v, g, reverse=True, cu_seqlens=cu, output_final_state=True)
    for n, (a, b) in enumerate(((0, 40), (40, 40), (40, 90))):
        if a == b:
            assert float(jnp.abs(ht[n]).max()) == 0.0
            continue
        o1, h1 = fla_jax.fused_recurrent_simple_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], reverse=True, output_final_state=True)
        assert err_ratio(o1, o[:, a:b]) < 1e-6 and err_ratio(h1[0], ht[n]) < 1e-6


def test_value_and_key_gates_match_a_float64_loop():
    """GLA's `gv` (a decay per value channel) and GDN's `gk` / `gv` beside its scalar g, against a float64 loop."""
    rng = np.random.default_rng(4)
    B, T, H, K, V = 2, 70, 1, 8, 4
    x = {n: rng.standard_normal((B, T, H, d)) for n, d in (("q", K), ("k", K), ("v", V))}
    x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    gk, gv, g = -rng.uniform(0, 0.3, (B, T, H, K)), -rng.uniform(0, 0.3, (B, T, H, V)), -rng.uniform(0, 0.3, (B, T, H))
    beta = rng.uniform(0, 1, (B, T, H))

    def loop(delta, gk, gv):
        S = np.zeros((B, H, K, V))
        o = np.zeros((B, T, H, V))
        for t in range(T):
            S = S * np.exp(gk[:, t])[..., None] * np.exp(gv[:, t])[..., None, :]
            vt = x["v"][:, t]
            if delta:
                vt = beta[:, t][..., None] * (vt - np.einsum("bhkv,bhk->bhv", S, x["k"][:, t]))
            S = S + x["k"][:, t][..., :, None] * vt[..., None, :]
            o[:, t] = np.einsum("bhkv,bhk->bhv", S, x["q"][:, t]) * K**-0.5
        return o, S

    f = {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}
    o, ht = fla_jax.fused_recurrent_gla(**f, gk=jnp.asarray(gk, jnp.float32), gv=jnp.asarray(gv, jnp.float32), output_final_state=True)
    ro, rS = loop(False, gk, gv)
    assert err_ratio(ro, o) < 1e-5 and err_ratio(rS, ht) < 1e-5
    o, ht = fla_jax.fused_recurrent_gated_delta_rule(**f, g=jnp.asarray(g, jnp.float32), gk=jnp.asarray(gk, jnp.float32),
                                                     gv=jnp.asarray(gv, jnp.float32), beta=jnp.asarray(beta, jnp.float32),
                                                     output_final_state=True)
    ro, rS = loop(True, gk + g[..., None], gv)
    assert err_ratio(ro, o) < 1e-5 and err_ratio(rS, ht) < 1e-5


def test_recurrent_gdn_options_equal_the_chunk_op():
    """The gate options (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`, `allow_neg_eigval`) mean what they
    mean in `chunk_gated_delta_rule`; beta None is ones; misuse is refused by name."""
    rng = np.random.default_rng(6)
    B, T, H, K = 1, 50, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(3))
    g, b = (jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32) for _ in range(2))
    opts = dict(use_gate_in_kernel=True, A_log=jnp.asarray([0.5, 1.0]), dt_bias=jnp.asarray([0.1, -0.2]), use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, use_qk_l2norm_in_kernel=True, output_final_state=True)
    o, ht = fla_jax.fused_recurrent_gated_delta_rule(q, k, v, g, beta=b, **opts)
    o2, ht2 = fla_jax.chunk_gated_delta_rule(q, k, v, g, b, backend="xla", **opts)
    assert err_ratio(o2, o) < 1e-5 and err_ratio(ht2, ht) < 1e-5
    ones = jnp.ones((B, T, H), jnp.float32)
    o, _ = fla_jax.fused_recurrent_delta_rule(q, k, v, use_qk_l2norm_in_kernel=True)
    o2, _ = fla_jax.chunk_delta_rule(q, k, v, ones, use_qk_l2norm_in_kernel=True, backend="xla")
    assert err_ratio(o2, o) < 1e-5
    with pytest.raises(ValueError, match="takes the raw gate as `g`"):
        fla_jax.fused_recurrent_gated_delta_rule(q, k, v, beta=b, use_gate_in_kernel=True, A_log=jnp.zeros(2))
    with pytest.raises(ValueError, match="`gv` must have rank 4"):
        fla_jax.fused_recurrent_gla(q, k, v, gv=g)
    with pytest.raises(TypeError, match="`reverse` must be a bool"):
        fla_jax.fused_recurrent_simple_gla(q, k, v, g, reverse=1)


# The step programs (`kernels/recurrent/step.py`): every op, K 64 / 128 / 256, V any multiple of 32 (V != K), T = 1
# (a decode step) and longer, grouped value heads, l2 norm, no initial state, strong decay, segment_ids.
STEP_CASES = [
    Case("simple_gla", 3, 1, 2, 64, 96, dtype="bfloat16", h0=True),
    Case("simple_gla", 2, 70, 2, 128, 128, dtype="float16", h0=True, norm=0.1),
    Case("simple_gla", 2, 5, 1, 128, 64, dtype="bfloat16", gate="g_gamma"),
    Case("gla", 2, 1, 2, 128, 64, dtype="bfloat16", h0=True),
    Case("gla", 1, 9, 2, 256, 512, dtype="bfloat16", h0=True, norm=0.1),
    Case("delta_rule", 2, 1, 2, 128, 256, dtype="bfloat16", h0=True, l2norm=True),
    Case("delta_rule", 2, 37, 1, 64, 64, dtype="bfloat16"),
    Case("gated_delta_rule", 2, 1, 2, 128, 128, HV=4, dtype="bfloat16", h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 3, 1, 256, 512, HV=2, dtype="bfloat16", h0=True, l2norm=True, norm=0.1),
    Case("gated_delta_rule", 2, 66, 2, 64, 128, dtype="float16", h0=True, l2norm=True),
]


def _record_launches(monkeypatch) -> list[str]:
    """The FFI targets of the programs the calls after this launch (recorded at trace time), in order."""
    from fla_jax._tilelang import runtime

    launched, launch = [], runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda p, target, *a: launched.append(target) or launch(p, target, *a))
    return launched


def _step_against_float64(monkeypatch, case, backend, segments=False):
    """The op on `backend` (which must run it on the step program) against the float64 recurrence: o, the final
    state, every gradient (XLA's VJP of the same steps)."""
    launched = _record_launches(monkeypatch)
    diff, cot = make_inputs(case, 17)
    extra = {}
    if segments:  # (three segments a row; the reference runs the decays of zero they mean)
        ids = jnp.asarray(np.repeat([[0, 1, 2]], case.B, 0).repeat(-(-case.T // 3), 1)[:, : case.T], jnp.int32)
        extra["segment_ids"] = ids
    op = RECURRENT[case.op]

    def loss(d, backend=backend):
        o, ht = op(**_kwargs(case, d), **extra, backend=backend)
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(ht * cot["dht"]), (o, ht)

    if segments:  # the float64 recurrence with the segments' decays of zero (test_segments checks it against each alone)
        ref_g, (ref_o, ref_ht) = jax.grad(functools.partial(loss, backend="xla"), has_aux=True)(
            {n: x.astype(jnp.float64) for n, x in diff.items()})
    else:
        ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = jax.jit(jax.grad(loss, has_aux=True))(diff)
    assert [t.rsplit("_c64_", 1)[1] for t in launched] == ["step"], launched
    tol = {"bfloat16": 5e-3, "float16": 2e-3}[case.dtype]
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)} | {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff}
    assert o.dtype == diff["q"].dtype and ht.dtype == jnp.float32
    assert all(e <= tol * (5 if n == "dg_gamma" else 1) for n, e in errs.items()), errs


@pytest.fixture
def emulated(monkeypatch):
    """The step programs emulated on the CPU (`tests/kernel_emulator.py`): the glue as it runs on a GPU."""
    import kernel_emulator
    from fla_jax import _variants, tilelang_backend
    from fla_jax._tilelang import runtime

    monkeypatch.setattr(runtime, "launch", kernel_emulator.launch)
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    monkeypatch.setattr(tilelang_backend, "registered", lambda: [v.target(p) for v in _variants.VARIANTS for p in v.declared])


@pytest.mark.parametrize("case", STEP_CASES[::3], ids=str)
def test_step_program_glue_matches_float64(case, emulated, monkeypatch):
    _step_against_float64(monkeypatch, case, fla_jax.TileLangConfig(poison_outputs=True))


def test_a_step_experiment_takes_the_programs_place(emulated, monkeypatch):
    """`TileLangConfig.experiments` puts a built experiment of the step program in its place (`decode.py --alt`)."""
    launched = _record_launches(monkeypatch)
    case = Case("gla", 2, 1, 2, 128, 128, dtype="bfloat16", h0=True)
    diff, _ = make_inputs(case, 4)
    config = fla_jax.TileLangConfig(experiments=((("gla", "fwd", "step"), "x_step_mb"),))
    o, ht = RECURRENT[case.op](**_kwargs(case, diff), backend=config)
    _, (ref_o, ref_ht) = reference_grads(case, diff, make_inputs(case, 4)[1])
    assert launched == ["fla_gla_fwd_bf16_k128_v128_c64_x_step_mb"]
    assert err_ratio(ref_o, o) < 5e-3 and err_ratio(ref_ht, ht) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("case", STEP_CASES, ids=str)
def test_step_program_matches_float64(case, monkeypatch):
    """On the GPU, outputs NaN-poisoned (an element the program leaves unwritten fails)."""
    if not fla_jax.backends()["tilelang"].usable:
        pytest.skip(str(fla_jax.backends()["tilelang"]))
    _step_against_float64(monkeypatch, case, fla_jax.TileLangConfig(poison_outputs=True), segments=case.T > 3)


def _gdn_step(state, q, k, v, g, beta, backend="tilelang"):
    return fla_jax.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, backend=backend)


def _step_inputs(B=2, H=2, K=64, V=64, seed=0):
    rng = np.random.default_rng(seed)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 0.5, (B, 1, H)), jnp.float32)
    return (jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32), x(B, 1, H, K), x(B, 1, H, K), x(B, 1, H, V), g,
            jax.nn.sigmoid(g))


def test_the_step_program_writes_the_state_into_its_buffer(monkeypatch):
    """The step's custom call gives its final state the initial state's buffer (XLA's `output_operand_aliases`), so a
    decode loop carrying the state moves it once a step (without, XLA copied it every step: twice the bytes)."""
    from fla_jax import _variants, tilelang_backend
    from fla_jax._tilelang import runtime

    target = "fla_delta_fwd_bf16_k64_v64_c64_step"
    if target not in runtime.interfaces():
        pytest.skip("the extension is not built")
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    monkeypatch.setattr(tilelang_backend, "registered", lambda: [v.target(p) for v in _variants.VARIANTS for p in v.declared])
    text = jax.export.export(jax.jit(_gdn_step), platforms=["cuda"],
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])(*_step_inputs()).mlir_module()
    call = re.search(rf"custom_call @{target}\(.*", text).group(0)
    h0 = [q.name for q in runtime.interfaces()[target].inputs].index("h0")
    assert re.search(rf"output_tuple_indices = \[1\], operand_index = {h0}\b", call), call


@pytest.mark.gpu
def test_the_step_program_updates_a_carried_state_in_place():
    """A jitted decode loop on the step program compiles without a copy of the state, and equals XLA's steps; a state
    the caller still holds after the step is left as it was (XLA copies it first)."""
    if not fla_jax.backends()["tilelang"].usable:
        pytest.skip(str(fla_jax.backends()["tilelang"]))
    state, q, k, v, g, beta = _step_inputs(B=4, H=4, K=128, V=128)

    def decode(step, state):
        return jax.lax.fori_loop(0, 8, lambda _, s: step(s, q, k, v, g, beta)[1], state)

    loop = jax.jit(functools.partial(decode, _gdn_step), donate_argnums=0)
    hlo = loop.lower(state).compile().as_text()
    copies = [ln for ln in hlo.splitlines() if re.search(r"= f32\[4,4,128,128\]\{[^}]*\} copy\(", ln)]
    assert not copies, copies
    want = jax.jit(functools.partial(decode, functools.partial(_gdn_step, backend="xla")))(state)
    got = loop(jnp.array(state))
    assert err_ratio(want, got) < 1e-5
    kept = jax.jit(lambda s: (_gdn_step(s, q, k, v, g, beta)[1], s + 0))(state)
    np.testing.assert_array_equal(np.asarray(kept[1]), np.asarray(state))


def test_step_program_refusals_name_the_reason(emulated):
    """"tilelang" runs a call the step program takes on it and refuses any other naming the reason; "auto" runs XLA's
    steps on small states (measured faster: `recurrent.auto_on_xla`) and the program on large ones, and
    `fla_jax.explain` says so."""
    from fla_jax import recurrent

    rng = np.random.default_rng(3)
    x = lambda *s, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(s), dt)
    q, k, v, g = x(1, 4, 2, 64), x(1, 4, 2, 64), x(1, 4, 2, 48), x(1, 4, 2, dt=jnp.float32)
    with pytest.raises(fla_jax.BackendUnavailableError, match="fused_recurrent_simple_gla: the step program takes V in blocks of 32"):
        fla_jax.fused_recurrent_simple_gla(q, k, v, g, backend="tilelang")
    e = fla_jax.explain(fla_jax.fused_recurrent_simple_gla, q, k, v, g)
    assert (e.backend, e.kernels_take_it, e.forward) == ("xla", False, ()) and "V in blocks of 32, got V = 48" in e.reason
    v = x(1, 4, 2, 64)
    with pytest.raises(fla_jax.BackendUnavailableError, match="reverse"):
        fla_jax.fused_recurrent_simple_gla(q, k, v, g, reverse=True, backend="tilelang")
    with pytest.raises(fla_jax.BackendUnavailableError, match="gate per key channel"):
        fla_jax.fused_recurrent_gated_delta_rule(q, k, v, gk=jnp.zeros((1, 4, 2, 64)), backend="tilelang")
    with pytest.raises(fla_jax.BackendUnavailableError, match="cu_seqlens"):
        fla_jax.fused_recurrent_delta_rule(q, k, v, cu_seqlens=jnp.asarray([0, 2, 4]), backend="tilelang")
    with pytest.raises(fla_jax.BackendUnavailableError, match="float32"):
        fla_jax.fused_recurrent_simple_gla(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g, backend="tilelang")
    with pytest.raises(ValueError, match="`backend` must be one of"):
        fla_jax.fused_recurrent_gla(q, k, v, backend="triton")
    # a decode step (T = 1) runs reversed or packed as it is: on the program
    one = lambda a: a[:, :1]
    fla_jax.fused_recurrent_simple_gla(*map(one, (q, k, v, g)), reverse=True, segment_ids=jnp.zeros((1, 1), jnp.int32),
                                       backend="tilelang")
    # what the program takes runs on XLA under "auto", and explain says why
    gdn = lambda backend: fla_jax.explain(fla_jax.fused_recurrent_gated_delta_rule, q, k, v, g, beta=jax.nn.sigmoid(g),
                                          use_qk_l2norm_in_kernel=True, backend=backend)
    e = gdn("auto")
    assert (e.backend, e.kernels_take_it, e.reason) == ("xla", True, recurrent.auto_on_xla("delta", 1 * 2 * 64 * 64)), e
    assert "fewer than 8388608 elements (B HV K V = 8192)" in e.reason
    e = gdn("tilelang")
    assert (e.backend, e.reason, e.forward) == ("tilelang", None, ("fla_delta_fwd_bf16_k64_v64_c64_step",)), e
    assert "step program" in str(e)


def test_explain_says_where_a_recurrent_call_runs():
    """"auto": XLA, and why (off a Hopper GPU, that; on one, the states too small: `auto_on_xla`); whether the step
    program takes the call."""
    from fla_jax import recurrent

    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    e = fla_jax.explain(fla_jax.fused_recurrent_gla, x(2, 1, 4, 128), x(2, 1, 4, 128), x(2, 1, 4, 256), x(2, 1, 4, 128))
    usable, why = fla_jax.backends()["tilelang"].usable, fla_jax.backends()["tilelang"].reason
    assert e.kernels_take_it and e.forward == ("fla_gla_fwd_bf16_k128_v128_c64_step",)
    assert e.backend == "xla" and e.reason == (recurrent.auto_on_xla("gla", 2 * 4 * 128 * 256) if usable else why)


def test_explain_names_the_experiment_a_config_puts_in_place(emulated, monkeypatch):
    """With `TileLangConfig.experiments` putting an experiment in the step program's place, explain names it, and it is
    the program that runs."""
    from fla_jax._tilelang import runtime

    x = lambda *s: jnp.ones(s, jnp.bfloat16)
    cfg = fla_jax.TileLangConfig(experiments=((("gla", "fwd", "step"), "x_step_mb"),))
    args = (x(2, 1, 4, 128), x(2, 1, 4, 128), x(2, 1, 4, 256), jnp.zeros((2, 1, 4, 128), jnp.float32))
    ran = []
    launch = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda p, target, *a: ran.append(target) or launch(p, target, *a))
    e = fla_jax.explain(fla_jax.fused_recurrent_gla, *args, backend=cfg)
    assert e.forward == ("fla_gla_fwd_bf16_k128_v128_c64_x_step_mb",), e.forward
    assert set(ran) == set(e.forward), ran


def test_auto_runs_large_states_on_the_step_program(emulated):
    """"auto" takes the step program from `AUTO_MIN_STATE` elements of state (B HV K V) up, and XLA's step below (GLA's
    from twice as many)."""
    from fla_jax import recurrent

    x = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    for B, want in ((64, "tilelang"), (63, "xla")):  # 64 x 16 x 128 x 128 = 2^24 elements; 63 x 8 x 128 x 128 < 2^23
        H = 16 if want == "tilelang" else 8
        e = fla_jax.explain(fla_jax.fused_recurrent_gated_delta_rule, x(B, 1, H, 128), x(B, 1, H, 128), x(B, 1, H, 128),
                            x(B, 1, H, dt=jnp.float32), beta=x(B, 1, H, dt=jnp.float32), initial_state=x(B, H, 128, 128, dt=jnp.float32),
                            output_final_state=True)
        assert e.backend == want, e
        assert (e.reason is None) if want == "tilelang" else e.reason == recurrent.auto_on_xla("delta", B * H * 128 * 128)
    gla = lambda B: fla_jax.explain(fla_jax.fused_recurrent_gla, x(B, 1, 16, 128), x(B, 1, 16, 128), x(B, 1, 16, 128),
                                    x(B, 1, 16, 128, dt=jnp.float32)).backend
    assert (gla(64), gla(32)) == ("tilelang", "xla")
    assert recurrent.AUTO_MIN_STATE["delta"] == 2**23
