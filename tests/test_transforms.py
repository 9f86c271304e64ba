"""jit, grad, vmap, grad-of-vmap, checkpoint, traced cu_seqlens and finite differences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.test_util import check_grads

import fla_jax
from cases import OPS, Case, make_inputs, static_kwargs
from check import err_ratio
from ref64 import naive

SMALL = [
    Case("simple_gla", 1, 9, 2, 4, 3, dtype="float64", h0=True),
    Case("gla", 1, 9, 2, 4, 3, dtype="float64", h0=True),
    Case("delta_rule", 1, 9, 2, 4, 3, dtype="float64", h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 9, 1, 4, 3, dtype="float64", HV=2, h0=True),
]


def _f64(diff):
    return {n: jnp.asarray(a, jnp.float64) for n, a in diff.items()}


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("case", SMALL, ids=str)
def test_check_grads_float64(case, backend):
    """Finite differences against the custom_vjp (xla) and autodiff (reference), in float64."""
    diff = _f64(make_inputs(case, 0)[0])
    names = list(diff)
    op = OPS[case.op]
    kw = dict(static_kwargs(case), backend=backend)
    kw.pop("chunk_size", None)
    if case.op == "simple_gla":
        kw["chunk_size"] = 16

    def f(*args):
        o, ht = op(**dict(zip(names, args)), **kw)
        return jnp.sum(jnp.sin(o)) + jnp.sum(ht**2)

    check_grads(f, tuple(diff[n] for n in names), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", SMALL, ids=str)
def test_vmap_and_grad_of_vmap(case):
    """vmap over a leading axis equals a loop; grad of the vmapped op equals the looped grads."""
    op = OPS[case.op]
    kw = static_kwargs(case)
    stacks = [_f64(make_inputs(case, s)[0]) for s in range(3)]
    batched = {n: jnp.stack([d[n] for d in stacks]) for n in stacks[0]}

    def loss(d):
        o, ht = op(**d, **kw)
        return jnp.sum(o**2) + jnp.sum(ht)

    o_v, ht_v = jax.vmap(lambda d: op(**d, **kw))(batched)
    g_v = jax.grad(lambda d: jnp.sum(jax.vmap(loss)(d)))(batched)
    for i, d in enumerate(stacks):
        o, ht = op(**d, **kw)
        assert err_ratio(o, o_v[i]) < 1e-12 and err_ratio(ht, ht_v[i]) < 1e-12
        g = jax.grad(loss)(d)
        for n in d:
            assert err_ratio(g[n], g_v[n][i]) < 1e-12, n


@pytest.mark.parametrize("case", SMALL, ids=str)
def test_checkpoint_and_jit(case):
    op = OPS[case.op]
    kw = static_kwargs(case)
    diff = _f64(make_inputs(case, 1)[0])

    def loss(d):
        o, ht = op(**d, **kw)
        return jnp.sum(o**2) + jnp.sum(ht)

    plain = jax.grad(loss)(diff)
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(diff)
    remat_policy = jax.jit(jax.grad(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)))(diff)
    for n in diff:
        assert err_ratio(plain[n], remat[n]) < 1e-12 and err_ratio(plain[n], remat_policy[n]) < 1e-12, n


@pytest.mark.parametrize("op_name", list(OPS))
def test_traced_cu_seqlens_does_not_recompile(op_name):
    """One jitted function serves packed batches with different boundaries (same N)."""
    case = Case(op_name, 1, 150, 2, 16, 8, h0=True, cu=(0, 50, 100, 150), HV=2 if op_name == "gated_delta_rule" else None)
    if op_name == "gated_delta_rule":
        case = Case(op_name, 1, 150, 1, 16, 8, h0=True, cu=(0, 50, 100, 150), HV=2)
    op = OPS[op_name]
    diff, _ = make_inputs(case, 2)
    traces = []

    @jax.jit
    def f(d, cu):
        traces.append(1)
        return op(**d, cu_seqlens=cu, output_final_state=True)

    for cu in ([0, 50, 100, 150], [0, 0, 149, 150], [0, 7, 7, 150]):
        o, ht = f(diff, jnp.asarray(cu, jnp.int32))
        d64 = _f64(diff)
        g = d64.get("g")
        ro, rht = naive(op_name, d64["q"], d64["k"], d64["v"], g, d64.get("beta"), h0=d64["initial_state"], cu=cu)
        assert err_ratio(ro, o) < 5e-5 and err_ratio(rht, ht) < 5e-5, cu
    assert len(traces) == 1


def test_final_state_none_unless_asked():
    case = Case("simple_gla", 1, 10, 1, 8, 8)
    diff, _ = make_inputs(case, 0)
    o, ht = fla_jax.chunk_simple_gla(**diff)
    assert ht is None and o.shape == (1, 10, 1, 8)


def test_backends_report():
    status = fla_jax.backends()
    assert set(status) == {"reference", "xla", "tilelang"}
    assert status["reference"].usable and status["xla"].usable
    for s in status.values():
        assert s.usable or s.reason


def test_tilelang_unavailable_says_why():
    status = fla_jax.backends()["tilelang"]
    if status.usable:
        pytest.skip("the tilelang backend is usable here")
    diff, _ = make_inputs(Case("simple_gla", 1, 10, 1, 8, 8), 0)
    with pytest.raises(fla_jax.BackendUnavailableError, match="tilelang"):
        fla_jax.chunk_simple_gla(**diff, backend="tilelang")
