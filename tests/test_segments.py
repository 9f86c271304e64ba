"""`segment_ids [B, T]` (JAX's packed rows): every op and backend against each segment run alone by the
float64 recurrence (outputs, final states, every gradient), the recurrent ops and the layers likewise, and a
B-sharded packed batch with no activation-sized collective."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax
from cases import OPS, Case, make_inputs, static_kwargs
from check import err_ratio
from ref64 import naive

# row 0: segments of 1, 40, 1, 70 (across the chunk boundary) and 38 tokens, ids coming back (0, 1, 0, ...);
# row 1: one segment of 149 tokens and a last one of 1
T = 150
ROWS = [[1, 40, 1, 70, 38], [149, 1]]


def segment_ids() -> jnp.ndarray:
    rows = [np.concatenate([np.full(n, i % 2 + 3 * r) for i, n in enumerate(lens)]) for r, lens in enumerate(ROWS)]
    return jnp.asarray(np.stack(rows), jnp.int32)


def _segment_reference(case: Case, d: dict):
    """`(o, ht)` in float64: each segment alone from a zero state, but each row's first from its initial state;
    the final state the row's last segment's."""
    o, finals = [], []
    g = d.get("g")
    if "g_gamma" in d:
        g = jnp.broadcast_to(d["g_gamma"], (case.B, T, case.H))
    for r, lens in enumerate(ROWS):
        start, row = 0, []
        h = None if "initial_state" not in d else d["initial_state"][r : r + 1]
        for n in lens:
            sl = lambda x: None if x is None else x[r : r + 1, start : start + n]
            ob, h = naive(case.op, sl(d["q"]), sl(d["k"]), sl(d["v"]), sl(g), sl(d.get("beta")), scale=case.scale, h0=h,
                          l2norm=case.l2norm)
            row.append(ob)
            start += n
            h = None if start < T else h
        o.append(jnp.concatenate(row, axis=1))
        finals.append(h[0])
    return jnp.concatenate(o, axis=0), jnp.stack(finals)


def _errors_against_each_segment_alone(case: Case, backend) -> dict[str, float]:
    """`err_ratio` of o, the final states and every gradient of a loss of both, the packed call on `backend`
    against `_segment_reference`."""
    diff, cot = make_inputs(case, 5)
    seg = segment_ids()
    kw = static_kwargs(case)

    def loss(f):
        def value(d):
            o, ht = f(d)
            return jnp.sum(o.astype(jnp.float64) * cot["do"]) + jnp.sum(ht.astype(jnp.float64) * cot["dht"][: case.B]), (o, ht)
        return value

    got = jax.jit(jax.grad(loss(lambda d: OPS[case.op](**d, **kw, segment_ids=seg, backend=backend)), has_aux=True))
    want = jax.grad(loss(lambda d: _segment_reference(case, d)), has_aux=True)
    (g1, (o1, h1)), (g0, (o0, h0)) = got(diff), want({n: jnp.asarray(x, jnp.float64) for n, x in diff.items()})
    return {"o": err_ratio(o0, o1), "ht": err_ratio(h0, h1)} | {"d" + n: err_ratio(g0[n], g1[n]) for n in diff}


CASES = [
    Case("simple_gla", 2, T, 2, 16, 8, h0=True),
    Case("simple_gla", 2, T, 2, 16, 8, gate="g_gamma", norm=0.1),
    Case("simple_gla", 2, T, 2, 16, 8, gate="none", h0=True),
    Case("gla", 2, T, 2, 16, 8, h0=True),
    Case("delta_rule", 2, T, 2, 16, 8, h0=True, l2norm=True),
    Case("gated_delta_rule", 2, T, 1, 16, 8, HV=2, h0=True, l2norm=True),
]


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_segments_equal_each_segment_alone(case, backend):
    errs = _errors_against_each_segment_alone(case, backend)
    print(case, backend, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < 1e-4 for e in errs.values()), errs


GPU_CASES = [
    Case("simple_gla", 2, T, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("gla", 2, T, 2, 64, 64, dtype="bfloat16", h0=True),
    Case("delta_rule", 2, T, 2, 64, 64, dtype="bfloat16", h0=True, l2norm=True),
    Case("gated_delta_rule", 2, T, 1, 128, 128, HV=2, dtype="bfloat16", h0=True, l2norm=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_segments_on_the_kernels(case):
    """The same on the TileLang kernels (bf16, NaN-poisoned outputs), with the GPU suite's float64 limits."""
    if not fla_jax.backends()["tilelang"].usable:
        pytest.skip(str(fla_jax.backends()["tilelang"]))
    errs = _errors_against_each_segment_alone(case, fla_jax.TileLangConfig(poison_outputs=True))
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    delta = case.op in ("delta_rule", "gated_delta_rule")
    limit = lambda n: (0.006 if delta else 0.004) if n in ("o", "ht") else 0.02 if delta and n in ("dbeta", "dg") else 0.008 if delta else 0.005
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


def test_segments_are_checked_by_name():
    case = CASES[0]
    diff, _ = make_inputs(case, 5)
    f = lambda **kw: OPS[case.op](**diff, **kw)
    with pytest.raises(ValueError, match="`segment_ids` must have shape"):
        f(segment_ids=jnp.zeros((2, T - 1), jnp.int32))
    with pytest.raises(TypeError, match="`segment_ids` must have an integer dtype"):
        f(segment_ids=jnp.zeros((2, T), jnp.float32))
    with pytest.raises(ValueError, match="not both"):
        fla_jax.chunk_simple_gla(*(diff[n][:1] for n in ("q", "k", "v", "g")), segment_ids=jnp.zeros((1, T), jnp.int32),
                                 cu_seqlens=jnp.asarray([0, T], jnp.int32))


@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])
def test_recurrent_segments_equal_the_chunk_op(op):
    """The recurrent ops with `segment_ids` give the chunk op's outputs and final states; reversed (simple GLA),
    each segment walked from its last token: the forward op on the reversed segments."""
    case = next(c for c in CASES if c.op == op)
    diff, _ = make_inputs(case, 7)
    seg = segment_ids()
    kw = {n: x for n, x in static_kwargs(case).items() if n != "chunk_size"}
    rec = {"simple_gla": fla_jax.fused_recurrent_simple_gla, "gated_delta_rule": fla_jax.fused_recurrent_gated_delta_rule}[op]
    o, ht = rec(**diff, **kw, segment_ids=seg)
    o2, ht2 = OPS[op](**diff, **static_kwargs(case), segment_ids=seg, backend="xla")
    assert err_ratio(o2, o) < 1e-5 and err_ratio(ht2, ht) < 1e-5
    if op == "simple_gla":  # reverse: each row's segments reversed in time, so is the walk
        flip = lambda x: jnp.flip(x, 1)
        d = {n: (flip(x) if n != "initial_state" else x) for n, x in diff.items()}
        o3, ht3 = rec(**d, **kw, segment_ids=flip(seg), reverse=True)
        assert err_ratio(flip(o), o3) < 1e-5 and err_ratio(ht, ht3) < 1e-5


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_segments_sharded_on_batch_gather_nothing():
    """A packed batch with B sharded over 8 devices (the data-parallel layout) compiles with no collective but
    the loss's scalar sum, forward and gradient, and gives the unsharded values."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    case = Case("gated_delta_rule", 8, T, 2, 16, 8, l2norm=True)
    diff, _ = make_inputs(case, 3)
    seg = jnp.tile(segment_ids(), (4, 1))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    loss = lambda d, s: jnp.sum(OPS[case.op](**d, **static_kwargs(case), segment_ids=s, backend="xla")[0] ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    want = step(diff, seg)
    d, s = jax.tree.map(put, diff), put(seg)
    hlo = step.lower(d, s).compile().as_text()
    found = re.findall(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo)
    assert found and all(kind == "all-reduce" and shape.startswith("f32[]") for shape, kind in found), found
    got = step(d, s)
    assert err_ratio(want[0], got[0]) < 1e-6 and all(err_ratio(a, b) < 1e-6 for a, b in zip(jax.tree.leaves(want[1]), jax.tree.leaves(got[1])))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])
def test_segments_across_context_parallel_shards(op):
    """T sharded over 8 devices (context parallelism) with segments that cross the shards' boundaries: the
    unsharded values (outputs, final state, every gradient)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    case = Case(op, 2, 256, 2, 16, 8, h0=True, l2norm=op == "gated_delta_rule")
    diff, cot = make_inputs(case, 9)
    lens = [[3, 50, 1, 100, 102], [256]]  # (shards of 32 tokens: segments start and end inside them)
    seg = jnp.asarray([np.concatenate([np.full(n, i) for i, n in enumerate(r)]) for r in lens], jnp.int32)
    kw = static_kwargs(case)
    loss = lambda d, s: (lambda o, ht: jnp.sum(o * cot["do"]) + jnp.sum(ht * cot["dht"]))(
        *OPS[op](**d, **kw, segment_ids=s, backend="xla"))
    fwd = jax.jit(lambda d, s: OPS[op](**d, **kw, segment_ids=s, backend="xla"))
    grad = jax.jit(jax.grad(loss))
    want = (fwd(diff, seg), grad(diff, seg))
    mesh = jax.make_mesh((8,), ("time",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        d = {n: put(x, P(None, None, None, None) if n == "initial_state" else P(None, "time", *([None] * (x.ndim - 2))))
             for n, x in diff.items()}
        s = put(seg, P(None, "time"))
        got = (fwd(d, s), grad(d, s))
    (o0, h0), g0 = want
    (o1, h1), g1 = got
    errs = {"o": err_ratio(o0, o1), "ht": err_ratio(h0, h1)} | {"d" + n: err_ratio(g0[n], g1[n]) for n in g0}
    assert all(e < 5e-4 for e in errs.values()), errs
