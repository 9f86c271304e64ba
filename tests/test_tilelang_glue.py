"""The tilelang backend's Python side (chunk layout and varlen tables, cumulative gates and their
gradient, custom_vjp, partitioning) on CPU, with kernel_emulator standing in for the CUDA kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import DELTA_BWD_MODES, delta_bwd_config, GATE_SCAN_EXPERIMENTS, OPS, Case, forward_outputs, loss_and_outputs, make_inputs, static_kwargs
from check import err_ratio, errors_against_float64, reference_grads
import kernel_emulator
from fla_jax import _backends, _tiling, tilelang_backend, xla
from fla_jax._tilelang import common, delta, plan, runtime, simple_gla
from fla_jax._problem import Problem
from fla_jax.tilelang_backend import Config, configured
from fla_jax._variants import HEAD_DIMS, VARIANTS

CASES = [
    Case("simple_gla", 2, 100, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("simple_gla", 1, 130, 2, 128, 128, dtype="float16", gate="g_gamma", norm=0.1),
    Case("simple_gla", 1, 64, 1, 64, 64, dtype="bfloat16", gate="none", h0=True),
    Case("simple_gla", 1, 300, 2, 64, 64, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True),
    Case("simple_gla", 1, 256, 2, 64, 64, dtype="float16", cu=(0, 64, 128, 256), gate="g_gamma"),
    Case("simple_gla", 1, 100, 1, 256, 256, dtype="bfloat16", h0=True),  # the consumer splits K: dv, dg in two parts
    Case("gla", 2, 100, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("gla", 1, 130, 2, 128, 128, dtype="float16", norm=0.1),
    Case("gla", 1, 300, 2, 64, 64, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True, norm=10),
    Case("gla", 1, 100, 1, 256, 256, dtype="bfloat16", h0=True),  # the consumer splits K: dv in two parts
]


@pytest.fixture
def emulated(monkeypatch):
    # (the partitioned functions are cached with what they traced: a test that records the kernels' calls
    # starts from none)
    tilelang_backend._partitioned_with.cache_clear()
    monkeypatch.setattr(runtime, "launch", kernel_emulator.launch)
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    monkeypatch.setattr(tilelang_backend, "registered", lambda: [v.target(p) for v in VARIANTS for p in v.declared])


def test_the_emulator_takes_each_built_program_by_its_interface():
    """Every built program's interface (`runtime.interfaces`: the build's record of its prim_func, carried by the
    extension) names the inputs and attributes, in order, that its stand-in in tests/kernel_emulator.py takes: the
    glue calls both by those names."""
    import inspect

    interfaces = runtime.interfaces()
    assert {v.target(p) for v in VARIANTS for p in v.programs} <= set(interfaces)
    for target, interface in interfaces.items():
        takes = [n for n in inspect.signature(kernel_emulator.program(target)).parameters if n not in ("parts", "o")]
        assert takes == [q.name for q in interface.inputs] + list(interface.attrs), (target, takes, interface)


def test_a_program_call_is_checked_against_its_interface(monkeypatch):
    """`runtime.call` refuses at trace time, naming the program and the argument, a call whose inputs are not the
    program's by name, or whose buffers do not fit its declared dtypes and shapes (a symbolic dim such as L must
    agree across every buffer); a call that fits reaches the launch with its inputs in the program's order."""
    launched = []
    monkeypatch.setattr(runtime, "launch", lambda p, target, results, named, *rest: launched.append(list(named)) or results)
    target = "fla_simple_gla_fwd_bf16_k64_v64_c64_fused"
    p = Problem(op="simple_gla", delta=False, chunk_size=64, dtype="bfloat16")
    x = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    L, H, N = 128, 2, 2
    named = dict(q=x(L, H, 64), k=x(L, H, 64), v=x(L, H, 64), g=x(L // 64, H, 64, dt=jnp.float32), h0=x(0, H, 64, 64, dt=jnp.float32),
                 cstart=x(N, dt=jnp.int32), ccount=x(N, dt=jnp.int32), scale=0.125)
    results = (x(L, H, 64), x(N, H, 64, 64, dt=jnp.float32))
    runtime.call(p, target, results, **named)
    assert launched == [list(named)]
    with pytest.raises(TypeError, match=rf"{target} takes .*missing \['k'\], unknown \['key'\]"):
        runtime.call(p, target, results, **{("key" if n == "k" else n): a for n, a in named.items()})
    with pytest.raises(ValueError, match=rf"{target}: `v` dim 0 must be L = 128, got 64"):
        runtime.call(p, target, results, **dict(named, v=x(64, H, 64)))
    with pytest.raises(TypeError, match=rf"{target}: `g` must be float32"):
        runtime.call(p, target, results, **dict(named, g=x(L // 64, H, 64)))
    with pytest.raises(ValueError, match=rf"{target}: `ht` dim 0 must be N = 2, got 3"):
        runtime.call(p, target, (results[0], x(3, H, 64, 64, dt=jnp.float32)), **named)
    # V on the program's grid (simple GLA): any multiple of its V block, no other
    wide = lambda V: (dict(named, v=x(L, H, V), h0=x(0, H, 64, V, dt=jnp.float32)), (x(L, H, V), x(N, H, 64, V, dt=jnp.float32)))
    assert runtime.interfaces()[target].multiple_of == (("V", 64),)
    runtime.call(p, target, wide(192)[1], **wide(192)[0])
    with pytest.raises(ValueError, match=rf"{target}: V = 96 must be a multiple of 64"):
        runtime.call(p, target, wide(96)[1], **wide(96)[0])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_glue_matches_float64(case, emulated):
    p = Problem(op=case.op, delta=False, chunk_size=64, dtype=case.dtype)
    varlen = case.cu is not None
    assert _backends.resolve("auto", p, K=case.K, V=case.V, varlen=varlen, grouped=False, l2norm=False).name == "tilelang"
    diff, cot = make_inputs(case, 21)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, "tilelang")(diff, cot)
    tol = 5e-3 if case.dtype == "bfloat16" else 1e-3
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
    errs.update({"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff})
    assert all(e <= tol for e in errs.values()), errs


def _watch_rows(monkeypatch, pick):
    """Emulated programs (`kernel_emulator.launch` in `runtime.launch`'s place), recording `pick(name, named)` of
    each call (its inputs by name) where it is not None (`calls`: program name -> its records) and the shapes
    XLA's `_gate_rows` transposes to per-chunk rows (`transposed`)."""
    calls, transposed = {}, []

    def record(p, target, results, named, *rest):
        name = target.rsplit("_c64_", 1)[1]
        if (seen := pick(name, named)) is not None:
            calls.setdefault(name, []).append(seen)
        return kernel_emulator.launch(p, target, results, named, *rest)

    def gate_rows(x, C):
        transposed.append(x.shape)
        return gate_rows_of(x, C)

    gate_rows_of = common.gate_rows
    monkeypatch.setattr(runtime, "launch", record)
    monkeypatch.setattr(common, "gate_rows", gate_rows)
    return calls, transposed


ROWS_CASES = [
    Case("simple_gla", 1, 300, 2, 128, 128, dtype="bfloat16", cu=(0, 37, 37, 300), h0=True),
    Case("simple_gla", 2, 130, 2, 64, 64, dtype="bfloat16", norm=0.1),
]


@pytest.mark.parametrize("case", ROWS_CASES, ids=str)
def test_simple_gla_gate_rows_match_float64(case, emulated, monkeypatch):
    """Simple GLA under a gradient with G's per-chunk rows loaded by TMA: the reverse pass `dh` (K = 64,
    128), the consumer `dqkvg` (K = 128; its columns at 64) and the forward experiment `x_fused_tp4`
    put in place (`Config.experiments`). Each takes G as rows `[NT, H, 64]`, the forward under the
    gradient hands its rows to the backward (`plan.stores_gate_rows`: XLA transposes G once, not again
    in the backward), and o, ht and every gradient match float64, emulated."""
    calls, transposes = _watch_rows(monkeypatch, lambda name, named: named["g"].shape
                                    if name in ("dh", "x_fused_tp4", "fused_h", "dqkvg") else None)
    cfg = Config(experiments=((("simple_gla", "fwd", "fused"), "x_fused_tp4"),))
    assert plan.stores_gate_rows(configured(Problem(op=case.op, delta=False, chunk_size=64, dtype=case.dtype), cfg), case.K)
    errs = errors_against_float64(case, 43, backend=cfg)
    gates = {name: shapes[-1] for name, shapes in calls.items()}
    NT = case.B * -(-case.T // 64) if case.cu is None else None
    consumer = gates.pop("dqkvg")
    assert consumer[1:] == ((case.H, 64) if case.K == 128 else (case.H,)), consumer
    assert set(gates) == {"dh", "x_fused_tp4", "fused_h"}, gates
    assert all(len(s) == 3 and s[1:] == (case.H, 64) and (NT is None or s[0] == NT) for s in gates.values()), gates
    # one transpose for the forward with no gradient, one for the forward under it (handed to the backward)
    assert len(transposes) == 2, transposes
    assert all(e <= 5e-3 for e in errs.values()), errs


SPLIT_CASES = [
    Case("simple_gla", 2, 64 * 8 - 13, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("simple_gla", 1, 64 * 8, 3, 128, 128, dtype="float16", gate="g_gamma"),
    # V != K: no split (`enter` is built for V = K), the state passes' pieces instead
    Case("simple_gla", 2, 64 * 8, 2, 64, 128, dtype="bfloat16", h0=True),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_simple_gla_forward_split_matches_float64(case, emulated, monkeypatch):
    """The forward with no gradient walks each sequence in pieces where the state pass's programs
    are few (`Config.split_programs`): here 4 pieces of 2 chunks (the state pass gets B * 4 sequences,
    the first from h0, then `enter` adds the later pieces' entering states to their 6 chunks), and
    o, ht still match float64; with the split off, B sequences and no `enter`."""
    seqs = []

    def record(p, target, results, named, *rest):
        if target.endswith("_fused"):
            seqs.append(named["ccount"].shape[0])
        if target.endswith("_enter"):
            seqs.append(("enter", named["d"].shape[0] * named["d"].shape[1]))
        return kernel_emulator.launch(p, target, results, named, *rest)

    monkeypatch.setattr(runtime, "launch", record)
    diff, cot = make_inputs(case, 31)
    _, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    for programs, pieces in ((132, 4), (0, 1)):
        seqs.clear()
        o, ht = forward_outputs(case, Config(split_programs=programs, split_min_chunks=2))(diff)
        if case.K == case.V:
            assert seqs == [case.B * pieces] + [("enter", case.B * 6)] * (pieces > 1)
        else:  # (the state passes' own pieces: from zero states, then from the entering ones)
            assert seqs == [case.B * pieces] * (1 + (pieces > 1))
        errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
        assert all(e <= (5e-3 if case.dtype == "bfloat16" else 1e-3) for e in errs.values()), (pieces, errs)


@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("a_shape", [(3,), (3, 4), (3, 4, 4)], ids=["decay", "decay_per_channel", "delta"])
@pytest.mark.parametrize("reverse", [False, True])
def test_fold_of_pieces_matches_one_after_another(P, a_shape, reverse):
    """`fla_jax._pieces.fold` (prefix compositions by doubling) against the pieces' maps applied one after
    another, with and without a first state, forward and through the maps' transposes."""
    from fla_jax import _pieces

    rng = np.random.default_rng(P)
    diag = len(a_shape) < 3
    A = rng.uniform(0.5, 1.0, (2, P, *a_shape)) if diag else rng.standard_normal((2, P, *a_shape)) * 0.3
    b, s0 = rng.standard_normal((2, P, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    for first in (None, s0):
        S, into = np.zeros(b[:, 0].shape) if first is None else first, [None] * P
        for j in reversed(range(P)) if reverse else range(P):
            into[j] = S
            a = A[:, j]
            S = (a.reshape(*a.shape, *(1,) * (b.ndim - 1 - a.ndim)) * S if diag else
                 np.einsum("nhji,nhjv->nhiv" if reverse else "nhij,nhjv->nhiv", a, S)) + b[:, j]
        got = _pieces.fold(jnp.asarray(A), jnp.asarray(b), None if first is None else jnp.asarray(first), diag, reverse)
        np.testing.assert_allclose(np.asarray(got[0]), np.stack(into, 1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1]), S, rtol=1e-5, atol=1e-5)


PIECE_CASES = [
    Case("simple_gla", 1, 64 * 8 - 13, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("gla", 1, 64 * 8, 1, 64, 64, dtype="bfloat16", h0=True, norm=10),
    Case("gated_delta_rule", 1, 64 * 8 - 13, 1, 64, 64, HV=2, dtype="bfloat16", h0=True, l2norm=True),
    Case("delta_rule", 1, 64 * 8, 2, 64, 64, dtype="float16"),
    # varlen: a long sequence in 4 pieces of 3 chunks, a short one in pieces of a chunk and empty ones, an empty one
    Case("gated_delta_rule", 1, 700, 1, 64, 64, HV=2, dtype="bfloat16", cu=(0, 0, 100, 700), h0=True),
    Case("simple_gla", 1, 700, 1, 64, 64, dtype="bfloat16", cu=(0, 600, 600, 700), h0=True),
    Case("gla", 1, 700, 1, 64, 64, dtype="bfloat16", cu=(0, 130, 700)),
    # V = 2K: the forward with no gradient with V on its grid (its identity map at V = K), in parts under a gradient
    Case("gated_delta_rule", 1, 64 * 8 - 13, 1, 64, 128, HV=2, dtype="bfloat16", h0=True, l2norm=True),
]


@pytest.mark.parametrize("case", PIECE_CASES, ids=str)
def test_state_passes_in_pieces_match_float64(case, emulated, monkeypatch):
    """Where the state passes' programs are few (`Config.split_programs`, `plan.pieces`) every op walks each
    sequence in 4 pieces at once, forward (with and without a gradient) and reverse pass, each piece from the
    state the pieces before it leave (their decays, or the delta rules' map of an identity state): o, ht and
    every gradient against float64, dense (T not a multiple of 64) and varlen (short and empty sequences,
    empty pieces); with the split off, a program walks each whole sequence; the delta rules' forward with no gradient
    also with the pieces' states and maps from one program (`carry_t`)."""
    N = case.B if case.cu is None else len(case.cu) - 1
    seqs = []

    carried = []

    def record(p, target, results, named, *rest):
        if "ccount" in named:  # (a state pass, forward or reverse)
            seqs.append(named["ccount"].shape[0])
        carried.append("_carry_t" in target)
        return kernel_emulator.launch(p, target, results, named, *rest)

    monkeypatch.setattr(runtime, "launch", record)
    runs = [(0, 1, False), (4 * N * (case.HV or case.H) * case.V // 64, 4, False)]  # (a program per V block of 64)
    runs += [(runs[1][0], 4, True)] if case.op.endswith("delta_rule") else []  # (the forward's pieces' states from `carry_t`)
    for programs, pieces, carry in runs:
        seqs.clear()
        carried.clear()
        errs = errors_against_float64(case, 43, backend=Config(split_programs=programs, split_min_chunks=1, delta_carry_t=carry))
        assert seqs and set(seqs) == {N * pieces}, (pieces, seqs)
        assert any(carried) == carry, (carry, carried)
        tol = 1e-2 if case.op in ("delta_rule", "gated_delta_rule") else 5e-3
        assert all(e <= tol for e in errs.values()), (pieces, errs)


NO_H0_CASES = [
    Case("simple_gla", 2, 64 * 8 - 13, 2, 64, 64, dtype="bfloat16"),  # (split in pieces with no gradient)
    Case("simple_gla", 1, 300, 2, 128, 128, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300)),
    Case("gla", 1, 130, 2, 64, 64, dtype="bfloat16"),
    Case("gated_delta_rule", 1, 130, 2, 128, 128, dtype="bfloat16", l2norm=True),
    Case("gated_delta_rule", 1, 300, 1, 64, 64, HV=2, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), l2norm=True),
    Case("gated_delta_rule", 1, 130, 1, 256, 256, HV=2, dtype="bfloat16", l2norm=True),
    Case("delta_rule", 1, 130, 2, 128, 128, dtype="bfloat16"),
]


@pytest.mark.parametrize("terms,zero_rows", [(("o", "ht"), True), (("o",), True), (("ht",), True), (("o",), False)],
                         ids=["loss_of_o_ht", "loss_of_o", "loss_of_ht", "loss_of_o_xla_zeros"])
@pytest.mark.parametrize("case", NO_H0_CASES, ids=str)
def test_no_initial_state_and_gates_summed_by_the_kernels(case, terms, zero_rows, emulated, monkeypatch):
    """With no initial state and `Config.zero_row_h0` every forward program gets `h0` with no rows; with the
    G_SCAN experiments put in place (`Config.experiments`) the programs that sum the gates per
    step run (simple GLA's state pass, the delta rules' inverse and training WY kernel), given the
    gates per step, and the WY VJP that sums their gradient back (`dg_sum`): o, ht (with and
    without a gradient) and every gradient against float64, emulated. With `zero_row_dht` too, under
    losses of o and ht, of o alone (the final state's cotangent a symbolic zero: the reverse pass
    gets `dht` with no rows) and of ht alone (o's a symbolic zero); dh0 with no rows throughout.
    With both switches off (`zero_rows` false) XLA's zeros, rows for every sequence."""
    rows, names, reverse = [], [], []

    def record(p, target, results, named, *rest):
        names.append(target.rsplit("_c64_", 1)[1])
        if "_fwd_" in target and "h0" in named:
            rows.append((named["h0"].shape[0], named["ccount"].shape[0]))  # h0 [N0, H, K, V], ccount [N]
        if "_bwd_" in target and target.endswith("_dh"):
            reverse.append((named["dht"].shape[0], results[1].shape[0], named["ccount"].shape[0]))  # dht [ND, ...], dh0 [N0, ...]
        return kernel_emulator.launch(p, target, results, named, *rest)

    monkeypatch.setattr(runtime, "launch", record)
    # (the experiments stand in for the WY VJP of two programs: `delta_grads_kernel` off)
    cfg = Config(zero_row_h0=zero_rows, zero_row_dht=zero_rows, split_min_chunks=2, delta_grads_kernel=(),
                 experiments=tuple(GATE_SCAN_EXPERIMENTS.items()))
    errs = errors_against_float64(case, 41, backend=cfg, terms=terms)
    print(case, names, {n: f"{e:.1e}" for n, e in errs.items()})
    N = case.B if case.cu is None else len(case.cu) - 1
    # (where the passes walk each sequence in pieces, `plan.pieces`, those from the states entering the pieces
    # take a row a piece, the others none; and the reverse passes write a dh0 row a piece)
    assert rows and all(r == (0 if zero_rows else N) for r, n in rows if n == N), rows  # (XLA's zeros: a row a sequence)
    assert all(r in (0, n) for r, n in rows if n > N) and zero_rows <= any(r == 0 for r, _ in rows), rows
    pieced = {r for r in reverse if r[2] > N}
    assert all(d0 == n and dt in (0, n) for dt, d0, n in pieced), reverse
    assert set(reverse) - pieced == {(N if "ht" in terms or not zero_rows else 0, 0 if zero_rows else N, N)} or (pieced and set(reverse) == pieced)
    # (under a gradient, with use_qk_l2norm_in_kernel, the delta rules' training WY kernel and WY VJP too)
    # (at K = 256 the forward with no gradient has no inverse experiment: wy and fused)
    scans = {"simple_gla": {"x_fused_scan"}, "gla": set(), "delta_rule": {"x_inv_scan"}}.get(case.op, {"x_inv_l2_scan"}) if case.K <= 128 else set()
    scans |= {"x_wy_t_l2_scan", "x_wy_bwd_l2_sum"} if case.l2norm else set()
    assert scans <= set(names), names
    tol = 1e-2 if case.op in ("delta_rule", "gated_delta_rule") else 5e-3
    assert all(e <= tol for e in errs.values()), errs


DELTA_CASES = [
    Case("gated_delta_rule", 2, 100, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("gated_delta_rule", 1, 300, 1, 64, 64, HV=2, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True, l2norm=True),
    Case("delta_rule", 1, 130, 2, 128, 128, dtype="float16", l2norm=True),
    Case("gated_delta_rule", 1, 64, 2, 64, 64, dtype="float16", norm=0.1),
    Case("gated_delta_rule", 1, 100, 1, 256, 256, HV=2, dtype="bfloat16", h0=True),  # the consumer splits K
]


@pytest.mark.parametrize("mode", DELTA_BWD_MODES)
@pytest.mark.parametrize("case", DELTA_CASES, ids=str)
def test_delta_glue_matches_float64(case, mode, emulated, monkeypatch):
    """The delta-rule path (WY preparation and sequential kernels, emulated here, around the XLA
    VJPs; or with the per-chunk VJP by the consumer kernel, and the WY VJP by its kernel, or the two
    in one program) against the float64 recurrence, outputs and every gradient."""
    p = Problem(op=case.op, delta=True, chunk_size=64, dtype=case.dtype)
    call = dict(K=case.K, V=case.V, varlen=case.cu is not None, grouped=case.HV is not None, l2norm=case.l2norm)
    assert _backends.resolve("auto", p, **call).name == "tilelang"
    diff, cot = make_inputs(case, 31)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, delta_bwd_config(mode))(diff, cot)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
    errs.update({"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff})
    tol = 1e-2 if case.dtype == "bfloat16" else 3e-3
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e <= tol for e in errs.values()), errs


WY_ROWS_CASES = [*DELTA_CASES[:3], Case("gated_delta_rule", 2, 130, 2, 128, 128, dtype="bfloat16", h0=True, l2norm=True)]


@pytest.mark.parametrize("case", WY_ROWS_CASES, ids=str)
def test_delta_backward_gate_rows_match_float64(case, emulated, monkeypatch):
    """The delta rules' training WY kernel (`wy_t_l2`, use_qk_l2norm_in_kernel), consumer (`dqkvg_l2`;
    `dqkvg` without) and WY VJP (`wy_bwd_l2`, `wy_bwd`), or the two in one program (`grads_l2`,
    `grads`; `Config.delta_grads_kernel`), at K <= 128 taking G, beta and the norms' 1 / |q|, 1 / |k| as
    per-chunk rows by TMA: G's the rows the forward formed for its WY kernel and
    kept (`plan.stores_gate_rows`: XLA transposes G once, in the forward; beta in the forward for the WY
    kernel and again in the backward, r in the backward), `[NT, HV, 64]` and r's `[NT, H, 64]`;
    every gradient against float64 (emulated; the kernels' own check is the GPU tests, the columns'
    programs `x_wy_t_l2_cols`, `x_dqkvg_l2_cols`, `x_wy_bwd_l2_cols` beside them)."""
    consumer, wy = ("dqkvg_l2", "wy_bwd_l2") if case.l2norm else ("dqkvg", "wy_bwd")
    grads = "grads_l2" if case.l2norm else "grads"  # (the two in one program, `delta_grads_kernel`)
    # (the consumer's G and 1 / |q|; the WY VJP's G, beta and 1 / |k|; the one program's G, beta, 1 / |q|, 1 / |k|)
    norms = lambda a, *names: tuple(a[n] for n in names) if case.l2norm else ()
    picks = {consumer: lambda a: (a["g"], *norms(a, "rq")), wy: lambda a: (a["g"], a["beta"], *norms(a, "rk")),
             grads: lambda a: (a["g"], a["beta"], *norms(a, "rq", "rk"))}
    if case.l2norm:  # (the WY kernel's G and beta)
        picks["wy_t_l2"] = lambda a: (a["g"], a["beta"])
    calls, transposed = _watch_rows(monkeypatch, lambda n, args: tuple(a.shape for a in picks[n](args)) if n in picks else None)
    errs = errors_against_float64(case, 47)
    HV = case.HV or case.H
    # G's rows once, in the forward under the gradient (the one with none starts from the inverse, which
    # writes its own rows); beta's there for the WY kernel (use_qk_l2norm_in_kernel), and in the backward
    # with both r's
    assert sorted(s[1] for s in transposed) == sorted([HV, HV] + [HV, case.H, case.H] * case.l2norm), transposed
    NT = transposed[0][0] // 64
    rs = ((NT, case.H, 64),) * case.l2norm
    if case.K in Config().delta_grads_kernel:
        want = {grads: [((NT, HV, 64), (NT, HV, 64), *rs, *rs)]}
    else:
        want = {consumer: [((NT, HV, 64), *rs)], wy: [((NT, HV, 64), (NT, HV, 64), *rs)]}
    assert calls == want | ({"wy_t_l2": [((NT, HV, 64), (NT, HV, 64))]} if case.l2norm else {}), calls
    tol = 1e-2 if case.dtype == "bfloat16" else 3e-3
    assert all(e <= tol for e in errs.values()), errs


SUM_DOT_CASES = [ROWS_CASES[0], SPLIT_CASES[1], DELTA_CASES[1], WY_ROWS_CASES[-1], Case("delta_rule", 1, 130, 2, 128, 128, dtype="bfloat16")]


@pytest.mark.parametrize("case", SUM_DOT_CASES, ids=str)
def test_gates_summed_by_a_product_match_float64(case, emulated, monkeypatch):
    """`Config.gate_sum_dot`: the gates' in-chunk sums and their VJP as XLA products with a triangle of ones, the
    per-chunk rows that the programs load by TMA (`g_rows`) straight from the forward's product: XLA
    transposes G to rows nowhere (simple GLA: no transpose at all; the delta rules: one fewer than
    with the scan, beta's and the norms' left), and o, ht (with a gradient and without) and every
    gradient match float64 and the scan's results (emulated)."""
    errs, transposes, gate_rows = {}, {}, common.gate_rows
    for on in (False, True):
        tilelang_backend._partitioned_with.cache_clear()
        monkeypatch.setattr(common, "gate_rows", gate_rows)  # (the transposes of this run alone)
        _, transposes[on] = _watch_rows(monkeypatch, lambda name, args: None)
        errs[on] = errors_against_float64(case, 53, backend=Config(gate_sum_dot=on))
    print(case, transposes, {n: f"{e:.1e}" for n, e in errs[True].items()})
    if case.op == "simple_gla":
        assert len(transposes[False]) == 2 and transposes[True] == [], transposes
    else:
        assert len(transposes[True]) == len(transposes[False]) - 1, transposes
    tol = 1e-2 if case.op != "simple_gla" else 5e-3
    assert all(e <= tol for e in errs[True].values()), errs[True]
    assert all(abs(errs[True][n] - errs[False][n]) <= 0.1 * errs[False][n] + 1e-4 for n in errs[False]), errs


@pytest.mark.parametrize("shape", [(2, 192, 3), (256, 2)])
def test_in_chunk_sums_by_a_product(shape):
    """`_in_chunk_cumsum` (both directions, chunk rows `[B, NT * C, H]` and flat `[NT * C, H]`) as a float32
    product equals the scan's within float32 rounding, `_in_chunk_rows` is the same in per-chunk rows
    (`_gate_rows`'s layout), and the product asks for full float32 (no TF32 on a GPU)."""
    g = jax.random.normal(jax.random.key(3), shape, jnp.float32)
    C = 64
    for reverse in (False, True):
        p = Problem(op="simple_gla", delta=False, chunk_size=C, dtype="bfloat16")
        want = common.in_chunk_cumsum(configured(p, Config(gate_sum_dot=False)), g, C, reverse)
        got = common.in_chunk_cumsum(configured(p, Config(gate_sum_dot=True)), g, C, reverse)
        assert got.shape == g.shape and float(jnp.max(jnp.abs(got - want))) <= 2e-5, float(jnp.max(jnp.abs(got - want)))
        rows = common.in_chunk_rows(g, C, reverse)
        assert jnp.array_equal(rows, common.gate_rows(got.reshape(-1, shape[-1]), C).reshape(rows.shape))
        hlo = jax.jit(common.in_chunk_rows, static_argnums=(1, 2)).lower(g, C, reverse).as_text()
        assert "HIGHEST" in hlo, hlo


@pytest.mark.parametrize("case", [c for c in DELTA_CASES if c.l2norm] + [Case("gated_delta_rule", 1, 100, 1, 256, 256, HV=2, dtype="bfloat16", l2norm=True)], ids=str)
def test_delta_l2norm_gradient_folded(case, emulated, monkeypatch):
    """use_qk_l2norm_in_kernel under a gradient: with `Config.delta_l2norm_fused` the WY kernel normalises q
    and k (`wy_t_l2`, at K <= 128; a `norm` pass per tensor before it elsewhere), and the consumer
    and the WY VJP take the normalisation's gradient (`dqkvg_l2`, `wy_bwd_l2`, or the one program for
    both, `grads_l2`; at K = 256, where the consumer splits a row's channels, dq by `norm_bwd`);
    without it a `norm` and a `norm_bwd` pass per tensor; both against the float64 recurrence (emulated kernels)."""
    calls = []

    def record(p, target, *args):
        calls.append(target.rsplit("_c64_", 1)[1])
        return kernel_emulator.launch(p, target, *args)

    monkeypatch.setattr(runtime, "launch", record)
    diff, cot = make_inputs(case, 43)
    ref_g, _ = reference_grads(case, diff, cot)
    tol = 1e-2 if case.dtype == "bfloat16" else 3e-3
    for on in (True, False):
        jax.clear_caches()  # (an earlier test may have traced the same partitioned backward)
        calls.clear()
        grads, _ = loss_and_outputs(case, Config(delta_l2norm_fused=on))(diff, cot)
        bwd = [c for c in calls if c in ("dqkvg", "dqkvg_l2", "wy_bwd", "wy_bwd_l2", "norm_bwd", "grads", "grads_l2")]
        if case.K in Config().delta_grads_kernel:  # (the consumer and the WY VJP in one program)
            want = ["grads_l2"] if on else ["grads", "norm_bwd", "norm_bwd"]
        else:
            want = (["dqkvg_l2" if case.K <= 128 else "dqkvg", "wy_bwd_l2"] + ["norm_bwd"] * (case.K > 128)) if on else ["dqkvg", "wy_bwd", "norm_bwd", "norm_bwd"]
        assert bwd == want, (on, calls)
        fwd = [c for c in calls if c in ("norm", "wy_t", "wy_t_l2")]
        assert fwd == (["wy_t_l2"] if on and case.K <= 128 else ["norm", "norm", "wy_t"]), (on, calls)
        errs = {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff}
        print(case, on, {n: f"{e:.1e}" for n, e in errs.items()})
        assert all(e <= tol for e in errs.values()), (on, errs)


# (and K = 256 with the normalisation folded into `inv_l2` and `chunk_delta_fwd_t_wide`, grouped heads)
@pytest.mark.parametrize("case", DELTA_CASES + [Case("gated_delta_rule", 1, 130, 1, 256, 256, HV=2, dtype="bfloat16", h0=True, l2norm=True)],
                         ids=str)
def test_delta_forward_from_the_inverse_matches_float64(case, emulated, monkeypatch):
    """`Config.delta_fwd_inverse`: the forward with no gradient takes the gate-free inverse (`inv`) and the
    state pass that forms v_new from it (`fused_t`; with l2 normalisation `inv_l2` and
    `fused_t_l2` from the raw q and k; with V blocks of 32 for these few sequences and heads,
    `Config.delta_narrow_programs`, and of 64 without), emulated, against the float64 recurrence; switched
    off, the WY kernel and the state pass on w and u."""
    calls = []

    def record(p, target, *args):
        calls.append(target.rsplit("_c64_", 1)[1])
        return kernel_emulator.launch(p, target, *args)

    monkeypatch.setattr(runtime, "launch", record)
    diff, cot = make_inputs(case, 37)
    _, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    tol = 1e-2 if case.dtype == "bfloat16" else 3e-3
    # with use_qk_l2norm_in_kernel the inverse and its state pass normalise q and k themselves
    # (`Config.delta_l2norm_fused`), else XLA does before them
    l2 = case.l2norm
    narrow = "_v32" if case.K <= 128 else ""  # (the narrow state pass is built where the inverse's path is taken)
    paths = [(True, True, wide, ["inv_l2", "fused_t_l2"] if l2 else ["inv", "fused_t"]) for wide in (True, False)]
    paths += [(True, False, wide, ["inv", "fused_t"]) for wide in (True, False)] + [(False, True, True, ["wy", "fused"])]
    for on, folded, wide, programs in paths:
        if not case.l2norm and not folded:
            continue
        cfg = Config(delta_fwd_inverse=HEAD_DIMS if on else (), delta_l2norm_fused=folded, delta_narrow_programs=0 if wide else 132)
        if on and not wide:
            programs = [programs[0], programs[1] + narrow]
        calls.clear()
        o, ht = jax.jit(lambda d: OPS[case.op](**d, **static_kwargs(case), backend=cfg))(diff)
        assert calls == programs
        errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
        print(case, on, wide, {n: f"{e:.1e}" for n, e in errs.items()})
        assert all(e <= tol for e in errs.values()), (on, wide, errs)


@pytest.mark.parametrize("op,norm_fused", [("simple_gla", True), ("gla", True), ("gated_delta_rule", True), ("gated_delta_rule", False)])
def test_glue_partitions_along_batch_and_heads(op, norm_fused, emulated, monkeypatch):
    """The backend's custom-partitioned forward and backward (emulated kernels) under an auto
    mesh with B and H sharded: same values as unsharded, no collectives in the compiled step
    (GDN with use_qk_l2norm_in_kernel, with and without `Config.delta_l2norm_fused`: under a gradient its
    forward also returns the normalised q, k and their 1 / |x|, `wy_t_l2`, or `norm` returns them).
    (With XLA's excess precision allowed, q's and k's gradients came out one bf16 rounding apart
    with the heads split: `tests/conftest.py` turns it off.)"""
    import re

    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    case = Case(op, 4, 100, 4, 64, 64, dtype="bfloat16", h0=True, l2norm=op == "gated_delta_rule")
    diff, cot = make_inputs(case, 41)
    step = loss_and_outputs(case, Config(delta_l2norm_fused=norm_fused))
    want_g, (want_o, want_ht) = step(diff, cot)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    spec = {"q": P("data", None, "model"), "k": P("data", None, "model"), "v": P("data", None, "model"),
            "g": P("data", None, "model"), "beta": P("data", None, "model"), "initial_state": P("data", "model")}
    with jax.set_mesh(mesh):
        sdiff = {n: jax.device_put(a, NamedSharding(mesh, spec[n])) for n, a in diff.items()}
        scot = {"do": jax.device_put(cot["do"], NamedSharding(mesh, P("data", None, "model"))),
                "dht": jax.device_put(cot["dht"], NamedSharding(mesh, P("data", "model")))}
        hlo = step.lower(sdiff, scot).compile().as_text()
        got_g, (got_o, got_ht) = step(sdiff, scot)
    assert not re.findall(r"all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce", hlo)
    assert err_ratio(want_o, got_o) < 1e-6 and err_ratio(want_ht, got_ht) < 1e-6
    for n in want_g:
        assert err_ratio(want_g[n], got_g[n]) < 1e-6, n


def test_forward_split_partitions_along_batch_and_heads(emulated, monkeypatch):
    """Simple GLA's forward in pieces (`Config.split_programs`) under an auto mesh with B and H sharded:
    each device splits its own sequences (2 of them, one head: 4 pieces of 2 chunks); the same
    values as unsharded, no collectives."""
    import re

    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    pieces = []

    def record(p, target, results, named, *rest):
        if target.endswith("_fused"):
            pieces.append(named["ccount"].shape[0] * 64 * 8 // named["q"].shape[0])  # pieces a sequence (of 8 chunks)
        return kernel_emulator.launch(p, target, results, named, *rest)

    monkeypatch.setattr(runtime, "launch", record)
    case = Case("simple_gla", 4, 64 * 8, 4, 64, 64, dtype="bfloat16", h0=True)
    diff, _ = make_inputs(case, 43)
    fwd = forward_outputs(case, Config(split_min_chunks=2))
    want_o, want_ht = fwd(diff)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    spec = {"q": P("data", None, "model"), "k": P("data", None, "model"), "v": P("data", None, "model"),
            "g": P("data", None, "model"), "initial_state": P("data", "model")}
    with jax.set_mesh(mesh):
        sdiff = {n: jax.device_put(a, NamedSharding(mesh, spec[n])) for n, a in diff.items()}
        hlo = fwd.lower(sdiff).compile().as_text()
        got_o, got_ht = fwd(sdiff)
    assert not re.findall(r"all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce", hlo)
    assert pieces and set(pieces) == {4}  # (the unsharded call, 16 programs: 4 pieces too)
    assert err_ratio(want_o, got_o) < 1e-6 and err_ratio(want_ht, got_ht) < 1e-6


@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3)])
def test_wy_vjp_matches_autodiff(H, HV, monkeypatch):
    """`_wy_vjp` (the WY preparation's VJP from the kernel's stored T) against JAX's VJP of the
    xla backend's WY math, float32 at HIGHEST precision, tight tolerance: catches a wrong term
    that the end-to-end tests' bf16 tolerance could hide."""
    p = configured(Problem(op="gated_delta_rule", delta=True, chunk_size=64, dtype="float32"), Config(vjp_precision=jax.lax.Precision.HIGHEST))
    C, K, V, L = 64, 32, 16, 128
    ks = jax.random.split(jax.random.key(7), 6)
    k = jax.random.normal(ks[0], (L, H, K)) / K**0.5
    v = jax.random.normal(ks[1], (L, HV, V))
    G = jnp.cumsum(-jax.random.uniform(ks[2], (L // C, C, HV)) * 0.2, axis=1).reshape(L, HV)
    beta = jax.random.uniform(ks[3], (L, HV))
    dw, du = jax.random.normal(ks[4], (L, HV, K)), jax.random.normal(ks[5], (L, HV, V))

    def prepare(k, v, G, beta):
        row = lambda x: xla._chunks(x[None], C)
        kc, vc, Gc, bc = row(jnp.repeat(k, HV // H, axis=1)), row(v), row(G), row(beta)
        Tm = xla.delta_solve(xla.wy_matrix(kc, Gc, bc))
        w, u = xla.wy_apply(Tm, kc, vc, Gc, bc, precision=jax.lax.Precision.HIGHEST)
        return xla._unchunk(w)[0], xla._unchunk(u)[0]

    want = jax.vjp(prepare, k, v, G, beta)[1]((dw, du))
    _, _, Tm = kernel_emulator.delta_wy_t(k, v, G, beta)
    got = delta.wy_vjp(p, C, Tm, k, v, G, beta, dw, du)
    errs = {n: err_ratio(a, b) for n, a, b in zip(("dk", "dv", "dG", "dbeta"), want, got)}
    assert all(e <= 1e-5 for e in errs.values()), errs


@pytest.mark.parametrize("op", ["simple_gla", "gla", "delta"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bench_kernels_feeds_every_dispatched_program(op, D, emulated):
    """benchmarks/bench_kernels.py builds inputs for every dispatched program of a variant that the
    program takes (shapes and dtypes as the emulated kernels check them), and each runs; so for the
    experiments that sum the gates or their gradient (their inputs and results differ from their
    kind's)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_kernels

    names, sums = [], {p.name for d in ("fwd", "bwd") for p in tilelang_backend._find_variant(op, d, "bfloat16", D, D).experiments
                       if {"g_scan", "dg_sum"} & set(dict(p.config))}
    for name, fn, args in bench_kernels.programs(2, 256, 2, D, op=op, xla=False):
        if name.split(":", 1)[1].startswith("x_") and name.split(":", 1)[1] not in sums:  # (other experiments: the emulator
            continue  # knows the dispatched programs' inputs only)
        jax.block_until_ready(fn(*args))
        names.append(name.split(":", 1)[1].split("@")[0])  # (GLA's a and dqkvg also at other gate scales, `@label`)
    want = {prog.name for d in ("fwd", "bwd") for prog in tilelang_backend._find_variant(op, d, "bfloat16", D, D).programs}
    assert set(names) == want | sums


def test_bench_rounds_interleaves_the_implementations(tmp_path):
    """benchmarks/bench.py --rounds: every JAX implementation of an op and shape (an `--alt`
    configuration among them) gets a row with times and its paired ratio to the first one; an
    unknown implementation a row with its error, not a crash; the JSON holds the rows."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench

    rows = bench.main(["--ops", "simple_gla", "--shapes", "1x128x2x64", "--impls", "fla_jax:xla,fla_jax:xla@z,nope:x",
                       "--alt", "z=xla-zeros", "--rounds", "2", "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == json.loads(json.dumps(rows))
    assert [r["impl"] for r in rows] == ["fla_jax:xla", "fla_jax:xla@z", "nope:x"]
    first, alt, bad = rows
    assert first["fwd_ratio"] == first["fwdbwd_ratio"] == 1.0 and first["rounds"] == alt["rounds"] == 2
    assert all(r[k] > 0 for r in (first, alt) for k in ("fwd_ms", "fwdbwd_ms", "fwd_ratio", "fwdbwd_ratio"))
    assert "error" in bad and "nope:x" in bad["error"]


@pytest.mark.parametrize("op", ["simple_gla", "gla", "gated_delta_rule"])
def test_hostile_traced_cu_seqlens_reach_no_kernel(op, emulated, monkeypatch):
    """Whatever a traced `cu_seqlens` holds, the chunk tables every program gets (first chunk and chunk
    count of each sequence, the loop bounds and row offsets of the kernels) stay inside the chunk rows,
    and the op's outputs are NaN (as on the xla backend); before, `[0, 500, 100, T]` gave counts
    [8, -6, ...] and `[0, 2**30, ...]` a 16.7M-iteration loop."""
    from test_robustness import HOSTILE_CU, VALID_CU, T

    tables = []

    def record(p, target, results, named, *rest):
        arrays = [a for a in named.values() if hasattr(a, "ndim")]
        rows = max(a.shape[0] for a in arrays if a.ndim >= 2 and a.dtype != jnp.int32)
        if "ccount" in named:  # (the tables' values as the program would get them)
            jax.debug.callback(lambda cstart, ccount: tables.append((target, (cstart, ccount), rows)), named["cstart"], named["ccount"])
        return kernel_emulator.launch(p, target, results, named, *rest)

    monkeypatch.setattr(runtime, "launch", record)
    case = Case(op, 1, T, 2, 64, 64, dtype="bfloat16", cu=VALID_CU, h0=True)
    diff, cot = make_inputs(case, 3)
    run = jax.jit(lambda d, c, cu: _grads_with_cu(case, d, c, cu))
    for name, cu in HOSTILE_CU.items():
        tables.clear()
        grads, (o, ht) = jax.block_until_ready(run(diff, cot, jnp.asarray(cu, jnp.int32)))
        assert bool(jnp.all(jnp.isnan(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isnan(ht))), name
        checked = 0
        for target, (cstart, ccount), rows in ((t, i, r) for t, i, r in tables if len(i) == 2):
            nt = rows // 64
            cstart, ccount = jnp.asarray(cstart), jnp.asarray(ccount)
            assert bool(jnp.all(ccount >= 0) & jnp.all(cstart >= 0) & jnp.all(cstart + ccount <= nt)), (name, target, cstart, ccount)
            checked += 1
        assert checked >= 2, (name, [t for t, _, _ in tables])  # (the forward storing h and the reverse pass at least)


def _grads_with_cu(case, diff, cot, cu):
    """`loss_and_outputs`'s loss on the tilelang backend with `cu_seqlens` as an argument (traced)."""
    def loss(d):
        kw = static_kwargs(case) | {"cu_seqlens": cu}
        o, ht = OPS[case.op](**d, **kw, backend="tilelang")
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(ht * cot["dht"]), (o, ht)

    return jax.grad(loss, has_aux=True)(diff)


@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])
def test_scalar_gates_of_zero_decay_reach_the_kernels_finite(op, emulated):
    """Scalar gates of -inf (a decay of zero) or -1e8 go to the programs as `xla.GATE_FLOOR`: o, ht and every
    gradient finite and against float64 as with ordinary gates (before: NaN from the in-chunk sums)."""
    case = Case(op, 2, 130, 2, 64, 64, dtype="bfloat16", h0=True, l2norm=op == "gated_delta_rule")
    diff, cot = make_inputs(case, 17)
    g = jnp.asarray(diff["g"]).at[:, (3, 40, 41, 100)].set(-jnp.inf).at[:, 70].set(-1e8)
    diff["g"] = g
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, "tilelang")(diff, cot)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)} | {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff if n != "g"}
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads)), "non-finite gradient"
    assert all(e <= 0.01 for e in errs.values()), errs


# ----------------------------------------------------------------------------- K != V (`fla_jax._tiling`)


@pytest.mark.parametrize("op, K, V, expected", [
    ("simple_gla", 128, 128, (128, 1, 128)), ("gated_delta_rule", 128, 128, (128, 1, 128)),
    ("gated_delta_rule", 128, 256, (128, 2, 256)), ("gated_delta_rule", 256, 512, (256, 2, 512)), ("delta_rule", 64, 256, (64, 4, 256)),
    ("delta_rule", 256, 128, (256, 1, 256)), ("gated_delta_rule", 128, 64, (128, 1, 128)),  # (V padded: K is not separable)
    ("gated_delta_rule", 32, 64, (64, 1, 64)), ("delta_rule", 96, 200, (128, 2, 256)),
    # the gated ops' programs take V on their grid: K padded to D, V to a multiple of 64
    ("simple_gla", 64, 128, (64, 1, 128)), ("simple_gla", 128, 512, (128, 1, 512)), ("gla", 128, 512, (128, 1, 512)),
    ("gla", 64, 128, (64, 1, 128)), ("gla", 128, 256, (128, 1, 256)), ("simple_gla", 128, 64, (128, 1, 64)),
    ("gla", 256, 128, (256, 1, 128)), ("simple_gla", 256, 64, (256, 1, 64)), ("simple_gla", 64, 96, (64, 1, 128)),
    ("gla", 128, 96, (128, 1, 128)), ("simple_gla", 96, 192, (128, 1, 192)), ("gla", 100, 30, (128, 1, 64)),
])
def test_tiling_plans_the_head_dims(op, K, V, expected):
    t = _tiling.tiling(op, K, V, HEAD_DIMS)
    assert (t.D, t.v_parts, t.Vp) == expected, t
    assert t.D >= K and t.Vp >= V and t.v_grid == (op in ("simple_gla", "gla"))
    assert "K = 512 is above" in _tiling.tiling(op, 512, 128, HEAD_DIMS)


TILED_CASES = [
    Case("simple_gla", 2, 100, 2, 64, 128, dtype="bfloat16", h0=True),  # V = 2K
    # K = 2V (a strong constant decay's gradient is all cancellation: ~1e-5 from fp16 terms ~1e-2, on every backend)
    Case("simple_gla", 1, 130, 1, 128, 64, dtype="float16", gate="g_gamma"),
    Case("simple_gla", 1, 300, 2, 64, 256, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True, norm=0.1),  # V = 4K
    Case("simple_gla", 2, 130, 2, 96, 160, dtype="bfloat16", h0=True),  # K and V padded (to 128 and 192)
    Case("gla", 2, 100, 2, 64, 128, dtype="bfloat16", h0=True),  # fla's GLA default, K = V / 2
    Case("gla", 1, 130, 1, 128, 64, dtype="float16", norm=0.1, h0=True),  # K = 2V
    Case("gla", 1, 300, 2, 64, 96, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True, norm=10),  # V padded
    Case("delta_rule", 2, 100, 2, 64, 128, dtype="bfloat16", h0=True),
    Case("gated_delta_rule", 1, 130, 1, 64, 256, HV=2, dtype="bfloat16", norm=0.1, l2norm=True, h0=True),  # V = 4K, grouped
    Case("gated_delta_rule", 1, 300, 2, 128, 64, dtype="bfloat16", cu=(0, 0, 37, 37, 200, 300), h0=True, l2norm=True),  # K = 2V
    Case("gated_delta_rule", 2, 70, 2, 32, 64, dtype="float16", h0=True),  # K padded
]


@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_tiled_head_dims_match_float64(case, emulated, monkeypatch):
    """K != V (and K, V off the built head dims): the gated ops with V on their programs' grid, the delta rules
    with V on the grid of their forward with no gradient and in parts as value heads on the square programs
    under a gradient, zeros padding the rest; outputs, the final state and every gradient against the float64
    recurrence (emulated; NaN-poisoned on the GPU: test_tilelang_tiled_head_dims_match_float64)."""
    delta = case.op in ("delta_rule", "gated_delta_rule")
    p = Problem(op=case.op, delta=delta, chunk_size=64, dtype=case.dtype)
    call = dict(K=case.K, V=case.V, varlen=case.cu is not None, grouped=case.HV is not None, l2norm=case.l2norm)
    assert _backends.resolve("auto", p, **call).name == "tilelang"
    t = tilelang_backend.tiling(p, case.K, case.V)
    assert (t.v_grid or t.v_parts > 1 or not t.identity) and t.D in HEAD_DIMS
    diff, cot = make_inputs(case, 41)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    shapes = []
    record = lambda p, target, results, named, *a: shapes.append((target, named)) or kernel_emulator.launch(p, target, results, named, *a)
    monkeypatch.setattr(runtime, "launch", record)
    grads, (o, ht) = loss_and_outputs(case, "tilelang")(diff, cot)
    assert shapes and all(f"_k{t.D}_v{t.D}_" in n for n, _ in shapes), shapes  # (the programs of head dim D ran)
    if t.v_grid:  # (V on the programs' grid: v as the call gives it, padded to a multiple of 64; no parts as heads)
        assert {x["v"].shape[-2:] for _, x in shapes if "v" in x} == {(case.HV or case.H, t.Vp)}, t
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
    errs.update({"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff})
    tol = (1e-2 if delta else 5e-3) if case.dtype == "bfloat16" else 3e-3
    limit = lambda n: 2e-2 if n in ("dg", "dbeta") and delta else tol  # (fla's and the GPU suite's for the delta rules' gates)
    assert o.shape == ref_o.shape and ht.shape == ref_ht.shape
    assert all(e <= limit(n) for n, e in errs.items()), " ".join(f"{n} {e:.1e}" for n, e in errs.items())
    shapes.clear()
    o2, ht2 = forward_outputs(case, "tilelang")(diff)  # the forward with no gradient (other programs)
    assert err_ratio(ref_o, o2) <= tol and err_ratio(ref_ht, ht2) <= tol
    if delta:  # (V on the grid: one inverse per value head for all of V, no parts as heads)
        assert {x["v"].shape[-2:] for _, x in shapes if "v" in x} == {(case.HV or case.H, t.Vp)}, shapes
        assert {x["beta"].shape[-1] for _, x in shapes if "beta" in x} == {case.HV or case.H}, shapes


@pytest.mark.parametrize("op", ["simple_gla", "gla", "delta_rule", "gated_delta_rule"])
def test_nonfinite_guard_keeps_causality(op, emulated):
    """`TileLangConfig(nonfinite_guard=True)` on the glue (emulated programs): a NaN v or k at step 40 of a 64-step
    chunk, forward alone and a training step's forward, leaves steps 0..39 as with clean input and poisons the
    head from it on (the final state too); GDN also with grouped value heads, V in parts under a gradient and
    packed sequences. Without the guard the chunked programs let the NaN v reach steps 0..39 (so that the test
    can fail; on the GPU: test_tilelang_non_finite_input_keeps_causality)."""
    from test_robustness import _bad_step

    cases = [Case(op, 1, 130, 2, 64, 64, dtype="bfloat16", h0=True, l2norm=op.endswith("delta_rule"))]
    if op == "gated_delta_rule":
        cases.append(Case(op, 1, 130, 2, 64, 128, HV=4, dtype="bfloat16", cu=(0, 20, 20, 130), h0=True, l2norm=True))
    for case in cases:
        diff, _ = make_inputs(case, 5)
        diff = {n: np.asarray(a) for n, a in diff.items()}
        call = lambda cfg: lambda d: OPS[op](**d, **static_kwargs(case), backend=cfg)
        f32 = lambda out: tuple(np.asarray(x, np.float32) for x in out)
        guarded = tilelang_backend.Config(nonfinite_guard=True)
        for run in (jax.jit(call(guarded)), jax.jit(lambda d: jax.vjp(call(guarded), d)[0])):
            o0, ht0 = f32(run(diff))
            for name in ("v", "k"):
                o, ht = f32(run(_bad_step(diff, name, 40)))
                np.testing.assert_allclose(o[0, :40], o0[0, :40], rtol=1e-2, atol=1e-2)
                np.testing.assert_allclose(o[0, :, -1], o0[0, :, -1], rtol=1e-2, atol=1e-2)  # (another value head)
                assert np.isnan(o[0, 40:, 0]).all(), (case, name)
                assert np.isnan(ht[-1, 0]).all() and np.isfinite(ht[:, -1]).all(), (case, name)
        o, _ = f32(jax.jit(call(tilelang_backend.Config()))(_bad_step(diff, "v", 40)))
        assert np.isnan(o[0, :40, 0]).any(), case
