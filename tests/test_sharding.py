"""The ops under jit with sharded activations: batch and heads split without gathers, results
equal to the unsharded run, output shardings as asked, T sharded as context parallelism (states alone
travel), K/V sharding correct (auto) or refused (explicit)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from cases import OPS, Case, make_inputs, static_kwargs
from check import err_ratio

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

COLLECTIVES = r"all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce"

CASES = [
    Case("simple_gla", 4, 100, 4, 16, 8, h0=True),
    Case("gla", 4, 100, 4, 16, 8, h0=True),
    Case("delta_rule", 4, 100, 4, 16, 8, h0=True, l2norm=True),
    Case("gated_delta_rule", 4, 100, 4, 16, 8, HV=8, h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 150, 4, 16, 8, HV=8, h0=True, cu=(0, 40, 40, 150)),
    Case("gla", 1, 150, 4, 16, 8, h0=True, cu=(0, 70, 150)),
]
WHOLE = Case("gated_delta_rule", 2, 128, 2, 16, 8, HV=4, h0=True, l2norm=True)  # T, K, V divisible by 8


def _specs(case, diff, batch, heads):
    """PartitionSpec per argument: B on `batch`, H on `heads` (sequences whole)."""
    varlen = case.cu is not None
    out = {}
    for name, x in diff.items():
        if name == "initial_state":
            out[name] = P(None if varlen else batch, heads, None, None)
        else:
            out[name] = P(None if varlen else batch, None, heads, *([None] * (x.ndim - 3)))
    return out


def _fns(case):
    op = OPS[case.op]
    kw = static_kwargs(case)
    fwd = lambda d: op(**d, **kw)

    def loss(d):
        o, ht = fwd(d)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(ht))

    return fwd, jax.grad(loss)


def jit_without_collectives(mesh, specs, diff, fwd, grad, must_call=None):
    """`(sdiff, jf, jg)`: `diff` placed on `mesh` by `specs`, the forward and gradient jitted, their
    compiled HLO checked for collectives (none) and, with `must_call`, for that pattern (the kernels'
    custom calls). Under `jax.set_mesh(mesh)`."""
    sdiff = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in diff.items()}
    jf, jg = jax.jit(fwd), jax.jit(grad)
    for fn in (jf, jg):
        hlo = fn.lower(sdiff).compile().as_text()
        assert not re.findall(COLLECTIVES, hlo), sorted(set(re.findall(COLLECTIVES, hlo)))
        assert must_call is None or re.search(must_call, hlo), must_call
    return sdiff, jf, jg


def _compare(case, got, want):
    (o, ht), g = got
    (o0, ht0), g0 = want
    assert err_ratio(o0, o) < 1e-5 and err_ratio(ht0, ht) < 1e-5
    for n in g0:
        assert err_ratio(g0[n], g[n]) < 1e-5, n


@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_batch_and_head_sharding_without_gathers(case, mode):
    diff, _ = make_inputs(case, 3)
    fwd, grad = _fns(case)
    want = (jax.jit(fwd)(diff), jax.jit(grad)(diff))
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
    batch = None if case.cu is not None else "data"
    specs = _specs(case, diff, batch, "model")
    with jax.set_mesh(mesh):
        sdiff, jf, jg = jit_without_collectives(mesh, specs, diff, fwd, grad)
        got = (jf(sdiff), jg(sdiff))
    _compare(case, got, want)
    o, ht = got[0]
    assert _spec(o) == (batch, None, "model", None)
    assert _spec(ht) == (batch, "model", None, None)
    for n, gx in got[1].items():
        assert _spec(gx) == tuple(specs[n]) + (None,) * (gx.ndim - len(specs[n])), n


def _spec(x):
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


@pytest.mark.parametrize("axis", [1, 3])  # T, K
def test_sharded_time_or_head_dim_auto_is_correct(axis):
    case = WHOLE
    diff, _ = make_inputs(case, 4)
    fwd, grad = _fns(case)
    want = (jax.jit(fwd)(diff), jax.jit(grad)(diff))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    spec = [None] * 4
    spec[axis] = "x"
    with jax.set_mesh(mesh):
        sdiff = dict(diff, q=jax.device_put(diff["q"], NamedSharding(mesh, P(*spec))))
        got = (jax.jit(fwd)(sdiff), jax.jit(grad)(sdiff))
    _compare(case, got, want)


CP_CASES = [
    Case("simple_gla", 2, 256, 2, 16, 8, h0=True, norm=0.1),
    Case("simple_gla", 2, 256, 2, 16, 8, h0=True, gate="none"),
    Case("gla", 2, 256, 2, 16, 8, h0=True),
    Case("delta_rule", 2, 256, 2, 16, 8, h0=True, l2norm=True),
    Case("gated_delta_rule", 2, 512, 1, 16, 8, HV=2, h0=True, l2norm=True),
]


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=["time8", "batch2xtime4"])
@pytest.mark.parametrize("case", CP_CASES, ids=str)
def test_context_parallel_matches_the_unsharded_op(case, mesh_shape):
    """T sharded under an explicit mesh (alone over 8 devices, or with the batch: 2 x 4): outputs, the final
    state and every gradient (initial state included) equal the unsharded op's, and the compiled forward and
    gradient move only states between devices (no collective carries a q, k, v or o sized array)."""
    diff, _ = make_inputs(case, 6)
    fwd, grad = _fns(case)
    want = (jax.jit(fwd)(diff), jax.jit(grad)(diff))
    names = ("time",) if len(mesh_shape) == 1 else ("data", "time")
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Explicit,) * len(names))
    batch = "data" if "data" in names else None
    specs = {n: P(batch, None, None, None) if n == "initial_state" else P(batch, "time", *([None] * (x.ndim - 2)))
             for n, x in diff.items()}
    with jax.set_mesh(mesh):
        sdiff = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in diff.items()}
        got = (jax.jit(fwd)(sdiff), jax.jit(grad)(sdiff))
        P_ = mesh_shape[-1]
        state = case.heads_v * case.K * max(case.K, case.V) * case.B * P_  # elements of the gathered states
        for fn in (fwd, grad):
            hlo = jax.jit(fn).lower(sdiff).compile().as_text()
            results = [ln.split("=", 1)[1].split(op)[0] for ln in hlo.splitlines() for op in re.findall(rf" ({COLLECTIVES})\(", ln)]
            sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for r in results for dims in re.findall(r"\w+\[([\d,]*)\]", r)]
            assert sizes and max(sizes) <= state < diff["q"].size, (sizes, state)  # (state-sized, below any activation)
    # (the pieces' states are combined in another order than one pass takes them: float32 rounding apart, 1e-4;
    # dg, a sum that cancels under strong decay, 5e-4 as in test_ops)
    (o, ht), g = got
    (o0, ht0), g0 = want
    errs = {"o": err_ratio(o0, o), "ht": err_ratio(ht0, ht)} | {"d" + n: err_ratio(g0[n], g[n]) for n in g0}
    assert all(e < (5e-4 if n == "dg" else 1e-4) for n, e in errs.items()), errs
    assert _spec(o)[1] == "time"  # o stays split along T


# one packed row over 8 devices of 256 tokens: sequences crossing several devices, one starting at a device's first
# token, empty ones (inside, and at T), one ending a token into a device
CP_VARLEN_CASES = [
    Case("gated_delta_rule", 1, 2048, 1, 16, 8, HV=2, h0=True, l2norm=True, cu=(0, 0, 300, 512, 1100, 2048, 2048)),
    Case("simple_gla", 1, 2048, 2, 16, 8, h0=True, cu=(0, 37, 37, 1500, 1793, 2048)),
    Case("gla", 1, 2048, 2, 16, 8, cu=(0, 768, 2000, 2048)),
    Case("delta_rule", 1, 2048, 2, 16, 8, h0=True, cu=(0, 5, 2047, 2048)),
]


@pytest.mark.parametrize("case", CP_VARLEN_CASES, ids=str)
def test_context_parallel_varlen_matches_the_unsharded_op(case):
    """T sharded with `cu_seqlens`, the packed row's sequences crossing devices: outputs, the final states and
    every gradient (initial states included) equal the unsharded op's, and only states travel between devices."""
    diff, _ = make_inputs(case, 7)
    fwd, grad = _fns(case)
    want = (jax.jit(fwd)(diff), jax.jit(grad)(diff))
    mesh = jax.make_mesh((8,), ("time",), axis_types=(AxisType.Explicit,))
    specs = {n: P(None, None, None, None) if n == "initial_state" else P(None, "time", *([None] * (x.ndim - 2))) for n, x in diff.items()}
    with jax.set_mesh(mesh):
        sdiff = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in diff.items()}
        got = (jax.jit(fwd)(sdiff), jax.jit(grad)(sdiff))
        state = case.heads_v * case.K * max(case.K, case.V) * (len(case.cu) - 1) * 8  # elements of the gathered states
        assert state < diff["q"].size
        for fn in (fwd, grad):
            hlo = jax.jit(fn).lower(sdiff).compile().as_text()
            results = [ln.split("=", 1)[1].split(op)[0] for ln in hlo.splitlines() for op in re.findall(rf" ({COLLECTIVES})\(", ln)]
            sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for r in results for dims in re.findall(r"\w+\[([\d,]*)\]", r)]
            assert sizes and max(sizes) <= state, (sizes, state)
    (o, ht), g = got
    (o0, ht0), g0 = want
    errs = {"o": err_ratio(o0, o), "ht": err_ratio(ht0, ht)} | {"d" + n: err_ratio(g0[n], g[n]) for n in g0}
    assert all(e < (5e-4 if n == "dg" else 1e-4) for n, e in errs.items()), errs


@pytest.mark.parametrize("name,axis,letter", [("v", 3, "V"), ("k", 3, "K")])
def test_sharded_head_dim_explicit_is_refused(name, axis, letter):
    case = WHOLE
    diff, _ = make_inputs(case, 5)
    fwd, _ = _fns(case)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    spec = [None] * 4
    spec[axis] = "x"
    with jax.set_mesh(mesh):
        sdiff = dict(diff, **{name: jax.device_put(diff[name], NamedSharding(mesh, P(*spec)))})
        with pytest.raises(ValueError, match=rf"`{name}` is sharded along {letter}"):
            jax.jit(fwd)(sdiff)


def test_custom_partitioning_helper_splits_batch_and_heads_only():
    """The wrapper the TileLang kernels use (custom calls cannot run on CPU, so a pure-JAX body
    stands in): B/H sharding compiles with no collectives; a V-sharded operand is resharded and
    the result stays right; outputs keep the operands' B/H sharding."""
    from fla_jax import _partition, _problem, xla

    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype="float32")

    def body(q, k, v, g, h0):
        return xla.run(p, q * 0.25, k, v, g, None, h0, None)

    f = _partition.batch_head_partitioned(body, ("bthk", "bthk", "bthv", "bth", "bhkv"), ("bthv", "bhkv"))
    case = Case("simple_gla", 4, 128, 8, 16, 16, h0=True)
    d, _ = make_inputs(case, 6)
    args = (d["q"], d["k"], d["v"], d["g"], d["initial_state"])
    want = jax.jit(body)(*args)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    bh = P("data", None, "model", None)
    for v_spec, collectives in ((bh, False), (P(None, None, None, "model"), True)):
        specs = (bh, bh, v_spec, P("data", None, "model"), P("data", "model"))
        with jax.set_mesh(mesh):
            sargs = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
            jf = jax.jit(f)
            hlo = jf.lower(*sargs).compile().as_text()
            got = jf(*sargs)
        assert bool(re.findall(COLLECTIVES, hlo)) == collectives
        assert err_ratio(want[0], got[0]) < 1e-6 and err_ratio(want[1], got[1]) < 1e-6
        assert _spec(got[0]) == ("data", None, "model", None) and _spec(got[1]) == ("data", "model", None, None)
    # vmap (and vmap of vmap) folds the mapped axes into the batch axis
    stacked = [jnp.stack([x, 2 * x]) for x in args]
    got = jax.jit(jax.vmap(f))(*stacked)
    for i in range(2):
        ref = body(*(s[i] for s in stacked))
        assert err_ratio(ref[0], got[0][i]) < 1e-6 and err_ratio(ref[1], got[1][i]) < 1e-6
    got2 = jax.vmap(jax.vmap(f, in_axes=(0, 0, 0, 0, None)), in_axes=(0, 0, 0, 0, None))(
        *(jnp.stack([x, x]) for x in stacked[:4]), args[4]
    )
    assert got2[0].shape == (2, 2, *args[0].shape[:3], args[2].shape[3])
    ref = body(*(x[1] for x in stacked[:4]), args[4])  # the unmapped initial state is shared
    assert err_ratio(ref[0], got2[0][1, 1]) < 1e-6 and err_ratio(ref[1], got2[1][0, 1]) < 1e-6


def test_custom_partitioning_helper_varlen_tables_stay_whole():
    """Varlen calls carry per-sequence arrays (no b or h axis): heads still split with no
    collectives, the tables and states' sequence axis stay whole, and vmap maps one slice at a time."""
    from fla_jax import _partition, _problem, xla

    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype="float32")

    def body(q, k, v, g, h0, cu):
        return xla.run(p, q * 0.25, k, v, g, None, h0, cu)

    f = _partition.batch_head_partitioned(body, ("bthk", "bthk", "bthv", "bth", "nhkv", "s"), ("bthv", "nhkv"))
    case = Case("simple_gla", 1, 200, 8, 16, 16, h0=True, cu=(0, 0, 70, 200))
    d, _ = make_inputs(case, 7)
    cu = jnp.asarray(case.cu, jnp.int32)
    args = (d["q"], d["k"], d["v"], d["g"], d["initial_state"], cu)
    want = jax.jit(body)(*args)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    specs = (P(None, None, "model", None),) * 3 + (P(None, None, "model"), P(None, "model"), P())
    with jax.set_mesh(mesh):
        sargs = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        jf = jax.jit(f)
        hlo = jf.lower(*sargs).compile().as_text()
        got = jf(*sargs)
    assert not re.findall(COLLECTIVES, hlo)
    assert err_ratio(want[0], got[0]) < 1e-6 and err_ratio(want[1], got[1]) < 1e-6
    assert _spec(got[0]) == (None, None, "model", None) and _spec(got[1]) == (None, "model", None, None)
    stacked = [jnp.stack([x, 2 * x]) for x in args[:4]]
    got = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None, None)))(*stacked, *args[4:])
    for i in range(2):
        ref = body(*(s[i] for s in stacked), *args[4:])
        assert err_ratio(ref[0], got[0][i]) < 1e-6 and err_ratio(ref[1], got[1][i]) < 1e-6


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("set_mesh", [True, False], ids=["set_mesh", "inputs_only"])
def test_explicit_batch_sharding_without_initial_state(set_mesh):
    """GDN on the xla backend with B split over an Explicit mesh and no initial state (its scans start from
    zeros the backend makes: they once failed shard_map's varying-axes check), with `jax.set_mesh` or with
    only the inputs' types carrying the mesh: the unsharded values, o split like q."""
    import contextlib

    case = Case("gated_delta_rule", 8, 100, 2, 16, 8, l2norm=True)
    diff, _ = make_inputs(case, 4)
    fwd, grad = _fns(case)
    want = (jax.jit(fwd)(diff), jax.jit(grad)(diff))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        sdiff = {n: jax.device_put(x, NamedSharding(mesh, P("data"))) for n, x in diff.items()}
        got = (jax.jit(fwd)(sdiff), jax.jit(grad)(sdiff))
    _compare(case, got, want)
    assert _spec(got[0][0])[0] == "data"
