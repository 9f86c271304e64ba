"""The tilelang backend: the built extension, its export for CUDA (CPU, wherever it is built) and
its numerics on a Hopper GPU (`gpu` marker)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax
from cases import Case, loss_and_outputs, make_inputs
from check import err_ratio, reference_grads
from fla_jax import _problem, tilelang_backend

pytestmark = pytest.mark.skipif(not tilelang_backend.registered(), reason="the TileLang extension is not built (python build.py)")
on_hopper = pytest.mark.skipif(not fla_jax.backends()["tilelang"].usable, reason=str(fla_jax.backends()["tilelang"]))


def test_every_variant_is_registered():
    from kernels.variants import VARIANTS

    want = sorted(v.target(p) for v in VARIANTS for p in v.programs)
    assert tilelang_backend.registered() == want


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_for_cuda_has_the_custom_calls(K, dtype):
    """Lowered for CUDA on any machine: the forward is the two kernels, nothing silently falls back."""
    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype=dtype)
    B, T, H = 2, 100, 2
    x = jnp.zeros((B, T, H, K), dtype)
    g, h0 = jnp.zeros((B, T, H), jnp.float32), jnp.zeros((B, H, K, K), jnp.float32)
    f = lambda q, k, v, g, h0: tilelang_backend.run(p, q, k, v, g, None, h0, None, scale=0.5)
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    fwd_names = [f"fla_simple_gla_fwd_{short}_k{K}_v{K}_c64_{n}" for n in ("h", "o")]
    bwd_names = [f"fla_simple_gla_bwd_{short}_k{K}_v{K}_c64_{n}" for n in ("dh", "dqkvg")]
    checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in fwd_names + bwd_names]
    fwd = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(x, x, x, g, h0)
    assert sorted(set(re.findall(r"custom_call @(\w+)", fwd.mlir_module()))) == fwd_names
    def loss(*a):
        o, ht = f(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    both = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))), platforms=["cuda"], disabled_checks=checks)
    calls = re.findall(r"custom_call @(\w+)", both(x, x, x, g, h0).mlir_module())
    # forward: states + output; backward: states recomputed, state gradients, fused consumer
    assert sorted(calls) == sorted(fwd_names + bwd_names + fwd_names[:1])


GPU_CASES = [
    Case("simple_gla", 2, 1000, 4, 128, 128, dtype="bfloat16", h0=True),
    Case("simple_gla", 1, 4096, 2, 64, 64, dtype="bfloat16", norm=0.1),
    Case("simple_gla", 2, 63, 2, 256, 256, dtype="float16", h0=True, norm=10.0),
    Case("simple_gla", 1, 300, 3, 128, 128, dtype="bfloat16", gate="g_gamma"),
    Case("simple_gla", 2, 200, 2, 64, 64, dtype="float16", gate="none"),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_tilelang_matches_float64(case, monkeypatch):
    monkeypatch.setattr(tilelang_backend, "POISON_OUTPUTS", True)  # unwritten outputs stay NaN
    diff, cot = make_inputs(case, 11)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, "tilelang")(diff, cot)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
    errs.update({"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff})
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= (0.004 if n in ("o", "ht") else 0.005)}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
def test_tilelang_long_sequence_has_no_index_overflow():
    """2^20 + 37 tokens in one call, against the xla backend."""
    T = (1 << 20) + 37
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, 2, 64)), jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(-np.abs(rng.standard_normal((1, T, 2))) * 0.05, jnp.float32)
    o1, h1 = jax.jit(lambda *a: fla_jax.chunk_simple_gla(*a, output_final_state=True, backend="tilelang"))(q, k, v, g)
    o2, h2 = jax.jit(lambda *a: fla_jax.chunk_simple_gla(*a, output_final_state=True, backend="xla"))(q, k, v, g)
    assert err_ratio(o2, o1) < 0.01 and err_ratio(h2, h1) < 0.01
    assert bool(jnp.all(jnp.isfinite(o1[:, -64:].astype(jnp.float32))))


@on_hopper
@pytest.mark.gpu
def test_tilelang_bad_shape_is_a_python_error():
    x = jnp.zeros((1, 64, 2, 96), jnp.bfloat16)
    with pytest.raises(fla_jax.BackendUnavailableError, match="K = 96"):
        fla_jax.chunk_simple_gla(x, x, x, backend="tilelang")


def test_build_outputs_for_every_program():
    """build.py left a cubin for sm_90 and a generated, marked handler for every program."""
    from pathlib import Path

    from kernels.variants import VARIANTS

    gen = Path(__file__).resolve().parent.parent / "build" / "gen"
    for v in VARIANTS:
        for p in v.programs:
            cubin = (gen / f"{v.target(p)}.cubin").read_bytes()
            assert cubin[:4] == b"\x7fELF", v.target(p)
            assert (gen / f"{v.target(p)}.cc").read_text().startswith("// generated by build.py from kernels/")


def test_unsupported_calls_say_why(monkeypatch):
    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype="bfloat16")
    call = dict(K=128, V=128, varlen=False, grouped=False, l2norm=False)
    assert tilelang_backend.unsupported(p, **call) is None
    assert "K = 96" in tilelang_backend.unsupported(p, **dict(call, K=96, V=96))
    assert "cu_seqlens" in tilelang_backend.unsupported(p, **dict(call, varlen=True))
    assert "gla" in tilelang_backend.unsupported(_problem.Problem(op="gla", delta=False, chunk_size=64, dtype="bfloat16"), **call)
    monkeypatch.setattr(tilelang_backend, "registered", lambda: [])  # an extension built before these kernels
    assert "rebuild" in tilelang_backend.unsupported(p, **call)
