"""The tilelang backend: the built extension, its export for CUDA (CPU, wherever it is built) and
its numerics on a Hopper GPU (`gpu` marker)."""

from __future__ import annotations

import dataclasses

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fla_jax
from cases import DELTA_BWD_MODES, delta_bwd_config, GATE_SCAN_EXPERIMENTS, OPS, Case, forward_outputs, loss_and_outputs, make_inputs, static_kwargs
from check import err_ratio, errors_against_float64, reference_grads
import kernel_emulator
from test_robustness import TAKES
from fla_jax import _problem, tilelang_backend
from fla_jax._tilelang import common, plan, runtime
from fla_jax.tilelang_backend import Config
from fla_jax import _variants as variants

pytestmark = pytest.mark.skipif(not tilelang_backend.registered(), reason="the TileLang extension is not built (python build.py)")
on_hopper = pytest.mark.skipif(not fla_jax.backends()["tilelang"].usable, reason=str(fla_jax.backends()["tilelang"]))


def test_every_variant_is_registered():
    """Every dispatched program is registered; anything else registered is a declared experiment
    (`build.py --experiments`)."""
    from fla_jax._variants import VARIANTS

    dispatched = {v.target(p) for v in VARIANTS for p in v.programs}
    experiments = {v.target(p) for v in VARIANTS for p in v.experiments}
    registered = set(tilelang_backend.registered())
    assert dispatched <= registered, sorted(dispatched - registered)[:5]
    assert registered - dispatched <= experiments, sorted(registered - dispatched - experiments)[:5]


# the configuration where a test calls programs itself (`_call`): every output starts as NaN
POISONED = tilelang_backend.configured(_problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype="bfloat16"),
                                       Config(poison_outputs=True))


def _call(target: str, results, args, attrs=None):
    """Program `target` on `args` given in the order of its inputs, NaN-poisoned outputs: the built interface names
    them (`runtime.interfaces`, the build's record of the prim_func), as `runtime.call` takes them."""
    return runtime.call(POISONED, target, results, **runtime.interfaces()[target].bind(args), **(attrs or {}))


def _skip_unless_built(*names: str) -> None:
    """Skips a test that runs experimental programs where the build left them out (the default build
    holds the dispatched programs alone; `python build.py --experiments` builds them too)."""
    built = {t.rsplit("_c64_", 1)[1] for t in tilelang_backend.registered()}
    missing = sorted(set(names) - built)
    if missing:
        pytest.skip(f"experiments {missing} are not built (python build.py --experiments)")


def test_dispatched_programs_keep_their_registers():
    """No dispatched program spills registers to local memory or has its tensor-core products
    serialized by ptxas (what build.py records of each cubin): the state passes' warpgroups all
    compile to the launch's register share, and a branch around the initial state's load once
    put the state in local memory in every one of them (768 bytes a thread; simple GLA's forward
    1.7x slower on an H100)."""
    import json

    import build

    # (but where a program holds itself to fewer registers on purpose, `min_blocks`: `inv_l2` at K = 64 spills 32
    # bytes at eight programs an SM and measured faster so)
    reports = {v.target(p): json.loads(build.generated(v.target(p), "json").read_text()).get("ptxas") for v in variants.VARIANTS
               for p in v.programs if not p.of and not dict(p.config).get("min_blocks")}
    assert all(reports.values()), [t for t, r in reports.items() if not r]  # (built before build.py recorded it)
    bad = {t: r for t, r in reports.items() if r["spill_stores"] or r["spill_loads"] or r["serialized"]}
    assert not bad, bad


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_export_for_cuda_has_the_custom_calls(K, dtype):
    """Lowered for CUDA on any machine: the forward is one kernel; under value_and_grad the forward
    also stores the chunk states and the backward is two kernels (state gradients, fused
    consumer); nothing silently falls back."""
    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype=dtype)
    B, T, H = 2, 100, 2
    x = jnp.zeros((B, T, H, K), dtype)
    g, h0 = jnp.zeros((B, T, H), jnp.float32), jnp.zeros((B, H, K, K), jnp.float32)
    f = lambda q, k, v, g, h0: tilelang_backend.run(p, q, k, v, g, None, h0, None, scale=0.5)
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    fwd_names = [f"fla_simple_gla_fwd_{short}_k{K}_v{K}_c64_{n}" for n in ("fused", "fused_h")]
    bwd_names = [f"fla_simple_gla_bwd_{short}_k{K}_v{K}_c64_{n}" for n in ("dh", "dqkvg")]
    fwd, both = _cuda_custom_calls(f, (x, x, x, g, h0), fwd_names + bwd_names)
    assert fwd == fwd_names[:1]
    assert sorted(both) == sorted(fwd_names[1:] + bwd_names)


def test_experiment_overrides_replace_the_program():
    """`Config.experiments` (benchmarks/bench.py --experiments) puts a built experiment in a
    program's place where the variant has it (bf16, K = 128) and leaves the others (fp16)."""
    cfg = Config(experiments=((("simple_gla", "fwd", "fused_h"), "x_fused_h_3wg"),))
    B, T, H, K = 2, 100, 2, 128
    g, h0 = jnp.zeros((B, T, H), jnp.float32), jnp.zeros((B, H, K, K), jnp.float32)
    for dtype, short, name in (("bfloat16", "bf16", "x_fused_h_3wg"), ("float16", "fp16", "fused_h")):
        p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype=dtype)
        x = jnp.zeros((B, T, H, K), dtype)
        f = lambda q, k, v, g, h0, p=p: tilelang_backend.run(p, q, k, v, g, None, h0, None, scale=0.5, config=cfg)
        want = f"fla_simple_gla_fwd_{short}_k{K}_v{K}_c64_{name}"
        _, step = _cuda_custom_calls(f, (x, x, x, g, h0), [want, f"fla_simple_gla_fwd_{short}_k{K}_v{K}_c64_fused",
                                                           *(f"fla_simple_gla_bwd_{short}_k{K}_v{K}_c64_{n}" for n in ("dh", "dqkvg"))])
        assert step[0] == want, step


def _cuda_custom_calls(f, args, allowed):
    """The custom calls (in order) of `f` and of `value_and_grad` of a loss of its outputs
    (`f -> (o, ht)`), exported for CUDA; `allowed` names the kernels export may reference."""
    return tuple(re.findall(r"custom_call @(\w+)", m) for m in _cuda_modules(f, args, allowed))


def _cuda_modules(f, args, allowed):
    """The StableHLO text of `f` and of `value_and_grad` of a loss of its outputs, exported for CUDA."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in allowed]

    def loss(*a):
        o, ht = f(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
    return tuple(jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module() for fn in (f, grad))


GPU_CASES = [
    Case("simple_gla", 2, 1000, 4, 128, 128, dtype="bfloat16", h0=True),  # K split in the state-gradient pass
    Case("simple_gla", 4, 200, 20, 128, 128, dtype="bfloat16", norm=0.1),  # 160 programs: K whole
    Case("simple_gla", 1, 4096, 2, 64, 64, dtype="bfloat16", norm=0.1),
    Case("simple_gla", 2, 63, 2, 256, 256, dtype="float16", h0=True, norm=10.0),
    Case("simple_gla", 1, 300, 3, 128, 128, dtype="bfloat16", gate="g_gamma"),
    Case("simple_gla", 2, 200, 2, 64, 64, dtype="float16", gate="none"),
    Case("simple_gla", 1, 1000, 4, 128, 128, dtype="bfloat16", cu=(0, 0, 300, 301, 640, 1000), h0=True),
    Case("simple_gla", 1, 700, 2, 256, 256, dtype="float16", cu=(0, 64, 64, 700), norm=0.1),
    # fp16 with real gates at K = 64 and 128 (`fused` with G's rows; its gate-scan config, x_fused_scan, against it in
    # test_experimental_programs_match_the_dispatched_ones)
    Case("simple_gla", 2, 500, 3, 128, 128, dtype="float16", h0=True, norm=0.1),
    Case("simple_gla", 1, 700, 2, 64, 64, dtype="float16", cu=(0, 100, 700)),
    # GLA: gates per key channel, strong (0.1), plain and weak (10) decay
    Case("gla", 2, 1000, 4, 128, 128, dtype="bfloat16", h0=True),
    Case("gla", 1, 2048, 2, 128, 128, dtype="bfloat16", norm=0.1),
    Case("gla", 1, 1000, 2, 64, 64, dtype="float16", h0=True, norm=10.0),
    Case("gla", 2, 130, 2, 256, 256, dtype="bfloat16", h0=True, norm=0.1),
    Case("gla", 1, 1000, 4, 128, 128, dtype="bfloat16", cu=(0, 0, 300, 301, 640, 1000), h0=True),
    Case("gla", 1, 700, 2, 256, 256, dtype="float16", cu=(0, 64, 64, 700), norm=10.0),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_tilelang_matches_float64(case):
    errs = errors_against_float64(case, 11, backend=Config(poison_outputs=True))  # (unwritten outputs stay NaN)  # (o, ht also with no gradient: the forward's own programs)
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= (0.004 if n[0] in "oh" else 0.005)}
    assert not bad, bad


SPLIT_GPU_CASES = [
    Case("simple_gla", 1, 4096, 2, 128, 128, dtype="bfloat16", h0=True),  # 4 programs: 8 pieces of 8 chunks
    Case("simple_gla", 2, 2000, 3, 64, 64, dtype="float16", gate="g_gamma"),  # 6 programs: 4 pieces
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_GPU_CASES, ids=str)
def test_tilelang_simple_gla_forward_split(case):
    """Simple GLA's forward with no gradient in pieces (`Config.split_programs`) against float64 and
    against the unsplit pass, NaN-poisoned outputs."""
    diff, cot = make_inputs(case, 13)
    _, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    outs = {}
    for programs in (132, 0):
        outs[programs] = forward_outputs(case, Config(poison_outputs=True, split_programs=programs))(diff)
    (o, ht), (o1, ht1) = outs[132], outs[0]
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht), "o unsplit": err_ratio(ref_o, o1),
            "o vs unsplit": err_ratio(np.asarray(o1.astype(jnp.float32)), o), "ht vs unsplit": err_ratio(ht1, ht)}
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e <= 0.004 for e in errs.values()), errs


# few programs: each sequence walked in pieces by every state pass (`plan.pieces`); varlen with a long sequence, short
# and empty ones
PIECE_GPU_CASES = [
    Case("simple_gla", 1, 4096, 2, 128, 128, dtype="bfloat16", h0=True),
    Case("gla", 1, 3000, 2, 64, 64, dtype="bfloat16", h0=True, norm=10.0),
    Case("gated_delta_rule", 1, 4059, 2, 128, 128, HV=4, dtype="bfloat16", h0=True, l2norm=True),
    Case("delta_rule", 1, 2048, 2, 64, 64, dtype="float16"),
    Case("gated_delta_rule", 1, 5000, 2, 128, 128, dtype="bfloat16", cu=(0, 0, 4000, 4100, 5000), h0=True, l2norm=True),
    Case("simple_gla", 1, 5000, 2, 64, 64, dtype="float16", cu=(0, 3000, 3000, 5000), norm=0.1),
    Case("gla", 1, 5000, 1, 128, 128, dtype="bfloat16", cu=(0, 100, 5000)),
    Case("gated_delta_rule", 1, 3000, 1, 64, 256, HV=2, dtype="bfloat16", h0=True, l2norm=True),  # V on the forward's grid
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", PIECE_GPU_CASES, ids=str)
def test_tilelang_state_passes_in_pieces(case):
    """Every op with its state passes walking each sequence in pieces (the default where programs are few) against
    float64 under NaN-poisoned outputs, outputs and every gradient, and with the passes walking whole sequences
    (`split_programs=0`); the delta rules at K <= 128 also with the forward's pieces from `carry_t`."""
    N = case.B if case.cu is None else len(case.cu) - 1
    nt = (case.T + N * 63) // 64 // N
    assert plan.pieces(_problem.Problem(op=case.op, delta=False, chunk_size=64, dtype=case.dtype), N, case.HV or case.H, case.V, nt) > 1
    delta = case.op in ("delta_rule", "gated_delta_rule")
    limit = lambda n: (0.006 if n in ("o", "ht") else 0.02 if n in ("dbeta", "dg") else 0.008) if delta else 0.004 if n[0] in "oh" else 0.005
    configs = [Config(poison_outputs=True, split_programs=programs) for programs in (132, 0)]
    configs += [Config(poison_outputs=True, delta_carry_t=True)] if delta and case.K <= 128 else []  # (the pieces' states from `carry_t`)
    for cfg in configs:
        errs = errors_against_float64(case, 19, backend=cfg)
        print(case, cfg.split_programs, cfg.delta_carry_t, {n: f"{e:.1e}" for n, e in errs.items()})
        bad = {n: e for n, e in errs.items() if not e <= limit(n.split()[0])}
        assert not bad, (cfg, bad)


SUM_DOT_GPU_CASES = [GPU_CASES[6], GPU_CASES[8], SPLIT_GPU_CASES[0]]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", SUM_DOT_GPU_CASES, ids=str)
def test_tilelang_gates_summed_by_a_product(case):
    """`Config.gate_sum_dot` (the gates' in-chunk sums and their VJP as XLA float32 products with a triangle of
    ones, G's per-chunk rows straight from the forward's) against float64 under NaN-poisoned outputs,
    simple GLA here (the delta rules' in test_tilelang_delta_gates_summed_by_a_product): with TF32 in the
    product strong decay (G of tens) would miss by percents."""
    errs = errors_against_float64(case, 17, backend=Config(poison_outputs=True, gate_sum_dot=True))
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= (0.004 if n[0] in "oh" else 0.005)}
    assert not bad, bad


DELTA_GPU_CASES = [
    Case("gated_delta_rule", 2, 1000, 4, 128, 128, dtype="bfloat16", h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 1000, 2, 128, 128, HV=4, dtype="bfloat16", cu=(0, 0, 300, 301, 640, 1000), h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 700, 2, 64, 64, dtype="float16", norm=0.1),
    Case("gated_delta_rule", 2, 130, 2, 256, 256, dtype="bfloat16", l2norm=True, h0=True),
    # K = 256 over ten chunks (the state passes' stages and single buffers wrap), grouped, an empty sequence
    Case("gated_delta_rule", 1, 700, 2, 256, 256, HV=4, dtype="float16", cu=(0, 64, 64, 700), l2norm=True),
    Case("delta_rule", 2, 500, 2, 128, 128, dtype="bfloat16", h0=True),  # gates off
    Case("delta_rule", 1, 300, 2, 64, 64, dtype="float16", l2norm=True, cu=(0, 64, 64, 300)),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("mode", DELTA_BWD_MODES)
@pytest.mark.parametrize("case", DELTA_GPU_CASES, ids=str)
def test_tilelang_delta_matches_float64(case, mode):
    """The delta-rule kernels against float64 under NaN-poisoned outputs, with fla's ratios (o
    0.006, gradients 0.008, dbeta/dg 0.02); the backward's parallel parts in XLA, or by the
    consumer kernel (`Config.delta_fused_bwd`), and the WY VJP kernel too (`Config.delta_wy_bwd_kernel`; the default)."""
    diff, cot = make_inputs(case, 13)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, delta_bwd_config(mode, poison_outputs=True))(diff, cot)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)}
    errs.update({"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff})
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    limit = lambda n: 0.006 if n in ("o", "ht") else 0.02 if n in ("dbeta", "dg") else 0.008
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", [DELTA_GPU_CASES[i] for i in (1, 2, 4, 5)], ids=str)
def test_tilelang_delta_gates_summed_by_a_product(case):
    """The delta rules under `Config.gate_sum_dot` (see test_tilelang_gates_summed_by_a_product) against float64,
    NaN-poisoned, fla's ratios: o and ht with a gradient and without, every gradient."""
    errs = errors_against_float64(case, 19, backend=Config(poison_outputs=True, gate_sum_dot=True))
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    limit = lambda n: 0.006 if n[0] in "oh" else 0.02 if n in ("dbeta", "dg") else 0.008
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in DELTA_GPU_CASES if c.l2norm], ids=str)
def test_tilelang_delta_l2norm_gradient_passes(case):
    """The normalisation's gradient by a `norm_bwd` pass per tensor (`Config.delta_l2norm_fused` off)
    rather than in the consumer and WY VJP, against float64 under NaN-poisoned outputs with
    fla's ratios, and against the default (folded) path (dq, dk within 0.6 %: each is rounded to
    the input dtype once, from float32 values that differ in their last bits)."""
    diff, cot = make_inputs(case, 19)
    ref_g, _ = reference_grads(case, diff, cot)
    grads = {}
    for norm_fused in (True, False):
        grads[norm_fused], _ = loss_and_outputs(case, Config(poison_outputs=True, delta_l2norm_fused=norm_fused))(diff, cot)
    errs = {"d" + n: err_ratio(ref_g[n], grads[False][n]) for n in diff}
    same = {"d" + n + "_folded": err_ratio(grads[False][n], grads[True][n]) for n in ("q", "k")}
    print(case, {n: f"{e:.1e}" for n, e in (errs | same).items()})
    limit = lambda n: 0.006 if n.endswith("_folded") else 0.02 if n in ("dbeta", "dg") else 0.008
    bad = {n: e for n, e in (errs | same).items() if not e <= limit(n)}
    assert not bad, bad


# V != K: the forward from the inverse with V on its state pass's grid (V blocks of 32 and of 64), the WY path in parts
INVERSE_GPU_CASES = [*DELTA_GPU_CASES, Case("gated_delta_rule", 2, 1000, 4, 128, 256, dtype="bfloat16", h0=True, l2norm=True),
                     Case("gated_delta_rule", 1, 300, 2, 64, 256, HV=4, dtype="float16", cu=(0, 64, 64, 300), h0=True),
                     Case("gated_delta_rule", 1, 700, 2, 256, 512, dtype="bfloat16", h0=True, l2norm=True, norm=0.1)]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", INVERSE_GPU_CASES, ids=str)
def test_tilelang_delta_forward_from_the_inverse(case):
    """Both forwards with no gradient, `Config.delta_fwd_inverse` (the default: the gate-free inverse `inv`,
    then `fused_t`; with l2 normalisation `inv_l2` and `fused_t_l2`, which normalise q
    and k themselves, and also the two after XLA's normalisation; the state pass with V blocks of
    32 for these few sequences and heads, `Config.delta_narrow_programs`, and of 64) and without it (the WY
    kernel, then the state pass on w and u), against float64 under NaN-poisoned outputs with fla's
    ratio (o and ht 0.006)."""
    diff, cot = make_inputs(case, 17)
    _, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    errs = {}
    # (with l2 normalisation also the inverse's path with XLA's normalisation before it, not the kernels')
    paths = [(True, True, 132, "_v32"), (True, True, 0, ""), (False, True, 0, "_wy"), (True, False, 132, "_xla_norm_v32"),
             (True, False, 0, "_xla_norm")]
    for inverse, folded, narrow, tag in paths if case.l2norm else paths[:3]:
        cfg = Config(poison_outputs=True, delta_fwd_inverse=variants.HEAD_DIMS if inverse else (), delta_l2norm_fused=folded,
                     delta_narrow_programs=narrow)
        o, ht = jax.jit(lambda d: OPS[case.op](**d, **static_kwargs(case), backend=cfg))(diff)
        errs |= {f"o{tag}": err_ratio(ref_o, o), f"ht{tag}": err_ratio(ref_ht, ht)}
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= 0.006}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in DELTA_GPU_CASES if c.K <= 128 and c.dtype == "bfloat16"], ids=str)
def test_tilelang_delta_hi_only_wy_vjp_against_float64(case):
    """The WY VJP taking T's and dT's hi halves alone (`x_wy_bwd_hi`, `x_wy_bwd_l2_hi`: the input
    dtype's rounding of T, as fla's bf16 A) in place of the dispatched program, against float64
    under NaN-poisoned outputs with fla's ratios, beside the dispatched program's errors."""
    _skip_unless_built("x_wy_bwd_hi", "x_wy_bwd_l2_hi")
    diff, cot = make_inputs(case, 13)
    ref_g, _ = reference_grads(case, diff, cot)
    errs = {}
    for tag, overrides in (("", {}), ("_hi", {(case.op, "bwd", "wy_bwd"): "x_wy_bwd_hi", (case.op, "bwd", "wy_bwd_l2"): "x_wy_bwd_l2_hi"})):
        grads, _ = loss_and_outputs(case, Config(poison_outputs=True, experiments=tuple(overrides.items())))(diff, cot)
        errs.update({"d" + n + tag: err_ratio(ref_g[n], grads[n]) for n in diff})
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    limit = lambda n: 0.02 if n.startswith(("dbeta", "dg")) else 0.008
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


# no initial state: simple GLA dense (split in pieces with no gradient) and varlen, GLA, GDN at K = 128, 64 and 256 (there the training WY kernel normalising q and k, with the experiments), the delta rule
NO_H0_GPU_CASES = [
    Case("simple_gla", 1, 4096, 2, 128, 128, dtype="bfloat16"),
    Case("simple_gla", 2, 1000, 4, 128, 128, dtype="bfloat16", norm=0.1),
    Case("simple_gla", 1, 1000, 4, 64, 64, dtype="float16", cu=(0, 0, 300, 301, 640, 1000)),
    Case("gla", 2, 500, 2, 128, 128, dtype="bfloat16"),
    Case("gated_delta_rule", 2, 1000, 4, 128, 128, dtype="bfloat16", l2norm=True),
    Case("gated_delta_rule", 1, 700, 2, 64, 64, dtype="bfloat16", cu=(0, 64, 64, 700), l2norm=True),
    Case("gated_delta_rule", 2, 300, 2, 128, 128, dtype="bfloat16"),
    Case("gated_delta_rule", 2, 300, 2, 256, 256, dtype="bfloat16", l2norm=True),
    Case("delta_rule", 2, 500, 2, 128, 128, dtype="bfloat16"),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("scan", [False, True], ids=["steps_by_xla", "steps_by_kernel"])
@pytest.mark.parametrize("case", NO_H0_GPU_CASES, ids=str)
def test_tilelang_without_initial_state(case, scan):
    """`Config.zero_row_h0` (calls with no initial state give the state passes `h0` with no rows; they start
    from zeros), `Config.zero_row_dht` (the reverse passes write no dh0 then, and under a loss of o alone,
    with `scan`, get `dht` with no rows and start from zeros) and, with `scan`, the programs that
    sum the gates per step and the WY VJP that sums their gradient back (the GATE_SCAN_EXPERIMENTS
    put in place) against float64 under NaN-poisoned outputs: o and ht with and without a gradient,
    every gradient (simple GLA and GLA 0.004 / 0.005, the delta rules 0.006 / 0.008, dbeta and dg
    0.02)."""
    cfg = Config(poison_outputs=True, zero_row_h0=True, zero_row_dht=True)
    if scan:  # (where built: bf16, K = 64, 128; the WY VJP's experiment stands in for the program of two, not of one)
        _skip_unless_built(*GATE_SCAN_EXPERIMENTS.values())
        cfg = dataclasses.replace(cfg, delta_grads_kernel=(), experiments=tuple(GATE_SCAN_EXPERIMENTS.items()))
    errs = errors_against_float64(case, 23, backend=cfg, terms=("o",) if scan else ("o", "ht"))
    print(case, scan, {n: f"{e:.1e}" for n, e in errs.items()})
    delta = case.op in ("delta_rule", "gated_delta_rule")
    limit = lambda n: (0.006 if delta else 0.004) if n[0] in "oh" else 0.02 if delta and n in ("dbeta", "dg") else 0.008 if delta else 0.005
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


def _program_inputs(op: str, name: str, dtype: str, D: int, cfg: Config | None = None):
    """(results, args, attrs) for one program kind on 2 sequences of 192 and 320 tokens, as the
    program of that kind that runs (`plan.program`: an experiment where
    `Config.experiments` puts one in its place) takes them: the gates summed in chunks (columns,
    or per-chunk rows), or per step where it sums them itself."""
    rng = np.random.default_rng(5)
    L, H, NT = 512, 3, 8
    x = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    unit = lambda a: (a / jnp.linalg.norm(a.astype(jnp.float32), axis=-1, keepdims=True)).astype(dtype)  # delta rules' k rows
    steps = jnp.asarray(-np.abs(rng.standard_normal((NT, 64, H))) * 0.1, jnp.float32)
    G = jnp.cumsum(steps, 1).reshape(L, H)
    cstart, ccount = jnp.asarray([0, 3], jnp.int32), jnp.asarray([3, 5], jnp.int32)
    like = lambda a, dt=None: jax.ShapeDtypeStruct(a.shape, dt or a.dtype)
    per_chunk = lambda a: jnp.moveaxis(a.reshape(NT, 64, H), 1, 2)  # [L, H] -> rows [NT, H, 64]
    prob = tilelang_backend.configured(_problem.Problem(op={"delta": "delta_rule"}.get(op, op), delta=op == "delta", chunk_size=64, dtype=dtype), cfg)
    gates_for = lambda direction: common.gates_for(prob, direction, D, name, G, 64)  # G as program `name` takes it
    # the forward's program `name` takes the gates per step (and sums them itself)
    takes_steps = lambda: plan.program_config(prob, "fwd", D, name).get("g_scan")
    if name == "step":  # the recurrent step program: 2 rows of 5 tokens, grouped value heads, V = 2K
        B, T_, HV, V = 2, 5, 2 * H, 2 * D
        q, k, v = x(B, T_, H, D), unit(x(B, T_, H, D)), x(B, T_, HV, V)
        g = jnp.asarray(-np.abs(rng.standard_normal((B, T_, HV, D) if op == "gla" else (B, T_, HV))) * 0.1, jnp.float32)
        beta = (jnp.asarray(rng.uniform(0, 1, (B, T_, HV)), jnp.float32),) if op == "delta" else ()
        h0 = jnp.asarray(rng.standard_normal((B, HV, D, V)), jnp.float32)
        attrs = {"scale": np.float32(D**-0.5), "l2norm": np.int32(op == "delta")}
        return (like(v), like(h0)), (q, k, v, g, *beta, h0), attrs
    if (op, name) == ("simple_gla", "dh"):
        q, do, dht = x(L, H, D), x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
        return (jax.ShapeDtypeStruct((NT, H, D, D), dtype), like(dht)), (q, do, gates_for("bwd"), dht, cstart, ccount), {"scale": np.float32(D**-0.5)}
    if op == "gla":  # per-step gates -|N(0, 1)| with chunks 1-2 at -|N(0, 6)|: most chunks bounded, these not
        q, k = x(L, H, D), x(L, H, D)
        steps = -np.abs(rng.standard_normal((NT, 64, H, D))) * np.where(np.isin(np.arange(NT), (1, 2)), 6.0, 1.0)[:, None, None, None]
        Gk = jnp.cumsum(jnp.asarray(steps, jnp.float32), 1).reshape(L, H, D)
        scale = {"scale": np.float32(D**-0.5)}
        if name == "a":  # from the per-step gates; A, G, q exp(G), k exp(G_C - G)
            gk = jnp.asarray(steps, jnp.float32).reshape(L, H, D)
            return (jax.ShapeDtypeStruct((NT, H, 64, 64), dtype), like(gk), like(q), like(k)), (q, k, gk), scale
        if name == "dh":
            do, dht = x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
            return (jax.ShapeDtypeStruct((NT, H, D, D), dtype), like(dht)), (q, do, Gk, dht, cstart, ccount), scale
        a = jnp.tril(x(NT, H, 64, 64).astype(jnp.float32) * 0.1).astype(dtype)
        if name == "dqkvg":
            v, do, h, dh = x(L, H, D), x(L, H, D), x(NT, H, D, D), x(NT, H, D, D)
            return (like(q), like(k), like(v), like(Gk)), (q, k, v, Gk, a, h, do, dh), scale
        if name in ("fused", "fused_h"):  # the state pass, 2 sequences
            v, h0 = x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
            h = (jax.ShapeDtypeStruct((NT, H, D, D), dtype),) if name == "fused_h" else ()
            return (like(v), *h, like(h0)), (q, k, v, Gk, a, h0, cstart, ccount), scale
    if op in ("simple_gla", "delta") and name in ("fused", "fused_h", "fused_s"):  # the state pass, 2 sequences
        q, k, v, h0 = x(L, H, D), x(L, H, D), x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
        h = (jax.ShapeDtypeStruct((NT, H, D, D), dtype),) if name == "fused_h" else ()
        scale = {"scale": np.float32(D**-0.5)}
        if op == "simple_gla":  # (G summed, or the gates per step where the program sums them, `g_scan`)
            return (like(v), *h, like(h0)), (q, k, v, steps.reshape(L, H) if takes_steps() else gates_for("fwd"), h0, cstart, ccount), scale
        k = unit(k)
        w = (k.astype(jnp.float32) * 0.5).astype(dtype)  # w, u: T (k beta e^G) and T (v beta) in scale
        return (like(v), like(v), *h, like(h0)), (q, k, w, v, gates_for("fwd"), h0, cstart, ccount), scale
    if (op, name) == ("delta", "fused_t"):  # the forward from T0: a unit lower triangular T0 in scale
        q, k, v, h0 = x(L, H, D), unit(x(L, H, D)), x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
        t = (jnp.tril(jnp.asarray(rng.standard_normal((NT, H, 64, 64)) * 0.1, jnp.float32), -1) + jnp.eye(64)).astype(dtype)
        beta = jnp.asarray(rng.uniform(size=(L, H)), jnp.float32)
        gr = jnp.stack([per_chunk(a) for a in (G, beta)], axis=2)  # G and beta as rows [NT, H, 2, 64]
        return (like(v), like(h0)), (q, k, v, t, gr, h0, cstart, ccount), {"scale": np.float32(D**-0.5)}
    if (op, name) == ("delta", "dh"):  # the reverse pass, 2 sequences; k unit rows, w as T (k beta e^G) in scale
        q, k, do, dht = x(L, H, D), x(L, H, D), x(L, H, D), jnp.asarray(rng.standard_normal((2, H, D, D)), jnp.float32)
        k = unit(k)
        w = (k.astype(jnp.float32) * 0.5).astype(dtype)
        return (jax.ShapeDtypeStruct((NT, H, D, D), dtype), like(dht), like(do)), (q, k, w, do, gates_for("bwd"), dht, cstart, ccount), {"scale": np.float32(D**-0.5)}
    if op == "delta" and name in ("wy", "wy_t"):
        k = unit(x(L, H, D))
        v, beta = x(L, H, D), jnp.asarray(rng.uniform(size=(L, H)), jnp.float32)
        t = (jax.ShapeDtypeStruct((NT, H, 64, 64), jnp.float32),) if name == "wy_t" else ()
        return (like(k), like(v), *t), (k, v, G, beta), {}
    if op == "delta" and name in ("inv", "inv_l2", "wy_t_l2"):  # the inverse alone (gr: G, beta (, 1 / |q|, 1 / |k|) as rows),
        # and the training forward's WY kernel, from the raw q and k where they normalise them
        q, v, beta = x(L, H, D), x(L, H, D), jnp.asarray(rng.uniform(size=(L, H)), jnp.float32)
        k = unit(x(L, H, D)) if name == "inv" else x(L, H, D)
        t0, r = jax.ShapeDtypeStruct((NT, H, 64, 64), dtype), jax.ShapeDtypeStruct((L, H), jnp.float32)
        gates = steps.reshape(L, H) if takes_steps() else G
        if name == "inv":
            return (t0, jax.ShapeDtypeStruct((NT, H, 2, 64), jnp.float32)), (k, gates, beta), {}
        if name == "inv_l2":
            return (t0, jax.ShapeDtypeStruct((NT, H, 4, 64), jnp.float32)), (q, k, gates, beta), {}
        tm = jax.ShapeDtypeStruct((NT, H, 64, 64), jnp.float32)
        sums = (like(G), jax.ShapeDtypeStruct((NT, H, 64), jnp.float32)) if takes_steps() else ()  # (and G, its rows)
        if not takes_steps():  # (G and beta as per-chunk rows where it loads them so)
            gates, beta = gates_for("fwd"), *common.steps_for(prob, "fwd", D, name, 64, beta)
        return (like(k), like(v), tm, like(q), like(k), r, r, *sums), (q, k, v, gates, beta), {}
    if op in ("simple_gla", "delta") and name in ("dqkvg", "dqkvg_l2"):  # the consumer (the delta rules': on v_new, k unit rows)
        q, k, v, do, h, dh = x(L, H, D), x(L, H, D), x(L, H, D), x(L, H, D), x(NT, H, D, D), x(NT, H, D, D)
        k = unit(k) if op == "delta" else k
        dv = () if op == "delta" else (like(v),)  # (the delta rules' reverse pass stores it)
        rq = (jnp.asarray(rng.uniform(0.5, 2.0, (L, H)), jnp.float32),) if name == "dqkvg_l2" else ()  # (q the normalised y)
        rq = common.steps_for(prob, "bwd", D, name, 64, *rq)  # (G and r as per-chunk rows where it loads them so)
        return (like(q), like(k), *dv, like(G)), (q, k, v, gates_for("bwd"), h, do, dh, *rq), {"scale": np.float32(D**-0.5)}
    if op == "delta" and name in ("wy_bwd", "wy_bwd_l2"):  # T from the forward's program on its inputs, as the backward gets it
        wy_results, (k, v, G, beta), _ = _program_inputs(op, "wy_t", dtype, D)
        p = _problem.Problem(op="delta_rule", delta=True, chunk_size=64, dtype=dtype)
        t = jax.jit(lambda *a: _call(plan.targets(p, "fwd", D, D)["wy_t"], wy_results, a))(k, v, G, beta)[2]
        h, du, dk0 = x(NT, H, D, D), x(L, H, D), x(L, H, D)
        rk = (jnp.asarray(rng.uniform(0.5, 2.0, (L, H)), jnp.float32),) if name == "wy_bwd_l2" else ()  # (k the normalised y)
        # (G, beta and r as per-chunk rows where it loads them so)
        sums, rk = (gates_for("bwd"), *common.steps_for(prob, "bwd", D, name, 64, beta)), common.steps_for(prob, "bwd", D, name, 64, *rk)
        return (like(k), like(v), like(G), like(G)), (k, v, *sums, t, h, du, dk0, *rk), {}
    if op == "delta" and name in ("grads", "grads_l2"):  # the consumer and the WY VJP in one program: both's inputs
        wy_results, (k, v, G, beta), _ = _program_inputs(op, "wy_t", dtype, D)
        p = _problem.Problem(op="delta_rule", delta=True, chunk_size=64, dtype=dtype)
        t = jax.jit(lambda *a: _call(plan.targets(p, "fwd", D, D)["wy_t"], wy_results, a))(k, v, G, beta)[2]
        q, vn, do, du, h, dh = x(L, H, D), x(L, H, D), x(L, H, D), x(L, H, D), x(NT, H, D, D), x(NT, H, D, D)
        rs = tuple(jnp.asarray(rng.uniform(0.5, 2.0, (L, H)), jnp.float32) for _ in range(2 if name == "grads_l2" else 0))
        sums, rs = (gates_for("bwd"), *common.steps_for(prob, "bwd", D, name, 64, beta)), common.steps_for(prob, "bwd", D, name, 64, *rs)
        return (like(q), like(k), like(v), like(G), like(G)), (q, k, v, vn, *sums, t, h, do, dh, du, *rs), {"scale": np.float32(D**-0.5)}
    raise NotImplementedError(f"no inputs for {op} {name}: add them here")


EXPERIMENTS = [(key, prog) for key, progs in variants.EXPERIMENTS.items() for prog in progs]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("key,prog", EXPERIMENTS, ids=[f"{k[0]}-{p.name}" for k, p in EXPERIMENTS])
def test_experimental_programs_match_the_dispatched_ones(key, prog):
    """Each alternative kernel config (kernels/variants.py EXPERIMENTS) computes what the
    dispatched program of its kind computes, NaN-poisoned outputs, before any dispatch may use it."""
    _skip_unless_built(prog.name)
    op, direction, dt, K = key
    variant = variants.find(op, direction, variants.DTYPES[dt], K, K)
    main = next((p for p in variant.programs if p.name == prog.kind), None)
    if main is None:  # (its kind is dispatched at other head dims only: the ops' float64 tests with it in place cover it)
        pytest.skip(f"no dispatched {prog.kind} at K = {K}: test_tilelang_without_initial_state runs {prog.name}")
    results, args, attrs = _program_inputs(op, main.name, variants.DTYPES[dt], K)
    # the same inputs as the experiment takes them (the gates per step where it sums them, or as rows: the inputs
    # formed with it in its kind's place; the training WY kernel summing the gates also writes G and its rows)
    results2, args2 = _program_inputs(op, main.name, variants.DTYPES[dt], K, Config(experiments=(((op, direction, prog.kind), prog.name),)))[:2]
    run = lambda p, r, a: jax.jit(lambda *a: _call(variant.target(p), r, a, attrs))(*a)
    want = run(main, results, args)
    if len(results2) > len(results):  # G (the main program's input, as columns) and its rows [NT, H, 64]
        G = kernel_emulator._gate_columns(args[3])
        want = (*want, G, jnp.moveaxis(G.reshape(-1, 64, G.shape[1]), 1, 2))
    if dict(prog.config).get("dg_sum"):  # the WY VJP adding the consumer's dG (after dk0) and summing to the end of the chunk
        dg0 = jnp.asarray(np.random.default_rng(7).standard_normal(args2[2].shape), jnp.float32)  # ([L, HV]: it takes G's columns)
        args2 = (*args2[:8], dg0, *args2[8:])
        dG = (want[2] + dg0).reshape(-1, 64, dg0.shape[1])
        want = (*want[:2], jnp.flip(jnp.cumsum(jnp.flip(dG, 1), axis=1), 1).reshape(dg0.shape), want[3])
    got = run(prog, results2, args2)
    errs = [err_ratio(np.asarray(w.astype(jnp.float32)), g) for w, g in zip(want, got)]
    print(prog.name, "vs", main.name, [f"{e:.1e}" for e in errs])
    # GLA's intra-chunk parts, exact against chunk-wide: terms move between the float32 elementwise
    # path and GEMMs of bf16-rounded operands, so the two agree to the input dtype's rounding; so do
    # the state passes of one warpgroup and the warp-specialized ones (v exp(G_C - G) is rounded
    # where k exp(G_C - G) was, do exp(G) where q exp(G) was; the forward from T0 the other way round)
    # (the WY VJP from T's hi halves alone rounds T as fla does, not as the dispatched program: against float64 in
    # test_tilelang_delta_hi_only_wy_vjp_against_float64)
    limit = 2e-2 if dict(prog.config).get("lo") is False else 5e-3 if prog.kind in ("a", "fused", "fused_h", "dh", "fused_t") else \
        1e-2 if prog.kind == "dqkvg" else 2e-3
    assert all(e <= limit for e in errs), errs


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "l2"])
@pytest.mark.parametrize("K", [64, 128])
def test_delta_grads_program_matches_the_two_it_fuses(K, l2norm, dtype):
    """`grads` (`grads_l2`), the delta rules' consumer and WY VJP in one program, against the two
    programs run in turn on the same inputs (the consumer's dk handed on as the WY VJP's dk0),
    NaN-poisoned outputs: dq, dv, dbeta the same sums; dG the two parts' sum; dk to the input
    dtype's rounding (the two programs round the consumer's part once more)."""
    name = "grads_l2" if l2norm else "grads"
    results, args, attrs = _program_inputs("delta", name, dtype, K)
    q, k, v, vn, g, beta, t, h, do, dh, du, *rs = args
    p = _problem.Problem(op="delta_rule", delta=True, chunk_size=64, dtype=dtype)
    bwd = plan.targets(p, "bwd", K, K)
    call = lambda target, res, *a, **kw: jax.jit(lambda *a: _call(target, res, a, kw))(*a)
    got = call(bwd[name], results, *args, **attrs)
    consumer, wy = ("dqkvg_l2", "wy_bwd_l2") if l2norm else ("dqkvg", "wy_bwd")
    assert all(plan.program_config(p, "bwd", K, n).get("g_rows") for n in (consumer, wy)), "G and beta as rows for all three"
    dq, dk0, dg0 = call(bwd[consumer], results[:2] + results[3:4], q, k, vn, g, h, do, dh, *rs[:1], **attrs)
    dk, dv, dg1, dbeta = call(bwd[wy], results[1:], k, v, g, beta, t, h, du, dk0, *rs[1:])
    want = (dq, dk, dv, dg0 + dg1, dbeta)
    errs = {n: err_ratio(np.asarray(w.astype(jnp.float32)), o) for n, w, o in zip(("dq", "dk", "dv", "dg", "dbeta"), want, got)}
    print(name, K, dtype, {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= (1e-2 if n == "dk" else 2e-3)}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("K", [64, 128])
def test_delta_states_only_pass_matches_the_full_pass(K, dtype):
    """`fused_s`, the delta rules' state pass with the chain alone (the pieces' passes that carry states), against
    `fused` on the same inputs (2 sequences, an initial state), NaN-poisoned outputs: the same final states; o and
    v_new left unwritten (NaN), since no caller reads them."""
    p = _problem.Problem(op="delta_rule", delta=True, chunk_size=64, dtype=dtype)
    fwd = plan.targets(p, "fwd", K, K)

    def run(name):  # (the same draws for both: G as each program takes it)
        results, args, attrs = _program_inputs("delta", name, dtype, K)
        return jax.jit(lambda *a: _call(fwd[name], results, a, attrs))(*args)

    want, got = run("fused"), run("fused_s")
    assert all(np.isnan(np.asarray(x.astype(jnp.float32))).all() for x in got[:2]), "o and v_new written"
    err = err_ratio(np.asarray(want[-1]), got[-1])
    print("fused_s", K, dtype, f"{err:.1e}")
    assert err <= 5e-3, err


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("K,l2", [(64, False), (128, True)])
def test_delta_carry_pass_matches_two_state_passes(K, l2):
    """`carry_t` (the forward from the inverse walking pieces: the pieces' states from zeros and their maps of the
    state in one launch) against `fused_t` run twice on the same T0 and rows: from zero states (`ht`), and from
    identity states with the values zeroed (the map `at`); 2 sequences, grouped value heads, V = 2K on the grid,
    NaN-poisoned outputs. The same chain: equal up to float32 noise."""
    p = _problem.Problem(op="gated_delta_rule", delta=True, chunk_size=64, dtype="bfloat16")
    fwd = plan.targets(p, "fwd", K, K)
    rng = np.random.default_rng(7)
    L, H, HV, V, NT = 512, 2, 4, 2 * K, 8
    x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = x(L, H, K), x(L, H, K), x(L, HV, V)
    if not l2:  # (unit rows, as the delta rules take k)
        q, k = ((a / jnp.linalg.norm(a.astype(jnp.float32), axis=-1, keepdims=True)).astype(jnp.bfloat16) for a in (q, k))
    G = jnp.cumsum(jnp.asarray(-np.abs(rng.standard_normal((NT, 64, HV))) * 0.1, jnp.float32), 1).reshape(L, HV)
    beta = jnp.asarray(rng.uniform(0, 1, (L, HV)), jnp.float32)
    cstart, ccount = jnp.asarray([0, 3], jnp.int32), jnp.asarray([3, 5], jnp.int32)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    inv = "inv_l2" if l2 else "inv"
    t, gr = jax.jit(lambda *a: _call(fwd[inv], (jax.ShapeDtypeStruct((NT, HV, 64, 64), jnp.bfloat16), f32(NT, HV, 4 if l2 else 2, 64)),
                                     a))(*((q,) if l2 else ()), k, G, beta)
    state_pass = fwd["fused_t_l2" if l2 else "fused_t"]
    scale = {"scale": np.float32(K**-0.5)}
    ht = jax.jit(lambda *a: _call(state_pass, (jax.ShapeDtypeStruct(v.shape, v.dtype), f32(2, HV, K, V)), a, scale))(
        q, k, v, t, gr, jnp.zeros((0, HV, K, V), jnp.float32), cstart, ccount)[1]
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (2, HV, K, K))
    zero = jnp.zeros((L, HV, K), jnp.bfloat16)
    at = jax.jit(lambda *a: _call(state_pass, (jax.ShapeDtypeStruct(zero.shape, zero.dtype), f32(2, HV, K, K)), a, scale))(
        q, k, zero, t, gr, eye, cstart, ccount)[1]
    got = jax.jit(lambda *a: _call(fwd["carry_t_l2" if l2 else "carry_t"], (f32(2, HV, K, V), f32(2, HV, K, K)), a))(k, v, t, gr, cstart, ccount)
    errs = {"ht": err_ratio(np.asarray(ht), got[0]), "at": err_ratio(np.asarray(at), got[1])}
    print("carry_t", K, l2, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e <= 1e-5 for e in errs.values()), errs


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128, 256])
def test_delta_wy_inverse_against_float64(K):
    """The WY preparation's stored `T = (I + A)^{-1}` (float32; at K <= 128 merged from 16 x 16
    blocks on the tensor cores through bf16 hi/lo halves) against the float64 inverse of the
    same A, on 512 chunks with strong and weak betas, NaN-poisoned outputs: it must stay at
    float32-like accuracy (1e-4 of the largest entry; a single bf16 pass gives ~3e-3)."""
    rng = np.random.default_rng(K)
    L, H, NT = 512 * 64, 2, 512
    k = rng.standard_normal((L, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((L, H, K)), jnp.bfloat16)
    beta = jnp.asarray(rng.uniform(0.0, 2.0, (L, H)), jnp.float32)  # beta up to 2: (I + A) far from I
    G = jnp.cumsum(jnp.asarray(-np.abs(rng.standard_normal((NT, 64, H))) * 0.05, jnp.float32), 1).reshape(L, H)
    p = _problem.Problem(op="delta_rule", delta=True, chunk_size=64, dtype="bfloat16")
    like = lambda a, dt=None: jax.ShapeDtypeStruct(a.shape, dt or a.dtype)
    results = (like(k), like(v), jax.ShapeDtypeStruct((NT, H, 64, 64), jnp.float32))
    _, _, t = jax.jit(lambda *a: _call(plan.targets(p, "fwd", K, K)["wy_t"], results, a))(k, v, G, beta)
    kc = np.asarray(k, np.float64).reshape(NT, 64, H, K).transpose(0, 2, 1, 3)
    g = np.asarray(G, np.float64).reshape(NT, 64, H).transpose(0, 2, 1)
    b = np.asarray(beta, np.float64).reshape(NT, 64, H).transpose(0, 2, 1)
    a = np.tril(b[..., :, None] * (kc @ kc.transpose(0, 1, 3, 2)) * np.exp(g[..., :, None] - g[..., None, :]), -1)
    want = np.linalg.inv(np.eye(64) + a)
    got = np.asarray(t, np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"K={K} T error {err:.1e}, largest entry {np.abs(want).max():.1f}")
    assert np.isfinite(got).all() and err < 1e-4, err


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_tilelang_hostile_traced_cu_seqlens(op):
    """Traced `cu_seqlens` that are no valid table, on the kernels (forward and training step): NaN
    outputs and final states as on the xla backend, no fault or hang; a valid traced table gives the
    concrete table's outputs. (The kernels get a safe table: tests/test_tilelang_glue.py checks the
    tables every program gets.)"""
    from test_robustness import HOSTILE_CU, VALID_CU, T

    case = Case(op, 1, T, 2, 64, 64, dtype="bfloat16", cu=VALID_CU, h0=True, l2norm=op.endswith("delta_rule"))
    diff, cot = make_inputs(case, 5)
    fwd = jax.jit(lambda d, cu: OPS[op](**d, **(static_kwargs(case) | {"cu_seqlens": cu}), backend="tilelang"))

    def loss(d, cu):
        o, ht = OPS[op](**d, **(static_kwargs(case) | {"cu_seqlens": cu}), backend="tilelang")
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(ht * cot["dht"])

    step = jax.jit(jax.value_and_grad(loss))
    for name, cu in HOSTILE_CU.items():
        o, ht = fwd(diff, jnp.asarray(cu, jnp.int32))
        l, grads = step(diff, jnp.asarray(cu, jnp.int32))
        assert bool(jnp.all(jnp.isnan(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isnan(ht))) and bool(jnp.isnan(l)), name
        jax.block_until_ready(grads)
    o, ht = fwd(diff, jnp.asarray(VALID_CU, jnp.int32))
    o2, ht2 = forward_outputs(case, "tilelang")(diff)
    assert err_ratio(o2, o) == 0.0 and err_ratio(ht2, ht) == 0.0


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["simple_gla", "gla", "gated_delta_rule"])
@pytest.mark.parametrize("floor", [-np.inf, -1e8, -300.0])
def test_tilelang_gates_of_zero_decay(op, floor):
    """A decay of zero (g = -inf) or a very negative gate at a few steps amid ordinary ones in the same
    chunks, on the kernels: o, ht and every gradient finite and against float64 as ordinary gates are
    (NaN-poisoned outputs)."""
    case = Case(op, 2, 200, 2, 64, 64, dtype="bfloat16", h0=True, l2norm=op == "gated_delta_rule")
    diff, cot = make_inputs(case, 9)
    g = np.asarray(diff["g"]).copy()
    g[:, (3, 40, 41, 130)] = floor
    diff["g"] = jnp.asarray(g)
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, cot)
    grads, (o, ht) = loss_and_outputs(case, Config(poison_outputs=True))(diff, cot)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht)} | {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff if n != "g"}
    print(case, floor, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(grads)), "non-finite gradient"
    bad = {n: e for n, e in errs.items() if not e <= (0.01 if n[0] in "oh" else 0.02)}
    assert not bad, bad


def _close_by_ratio(got, want):
    """Within fla's ratio of `want` (the guard's second run is the forward with no gradient, whose programs round
    otherwise)."""
    assert err_ratio(want, got) < 5e-3, err_ratio(want, got)


NON_FINITE_CASES = [(op, name) for op, names in TAKES.items() for name in names]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("op,name", NON_FINITE_CASES)
def test_tilelang_non_finite_input_keeps_causality(op, name):
    """NaN in one step's q, k, v, gate or beta (head 0, step 40 of a 64-step chunk; inf too in v), on the kernels
    with `nonfinite_guard`, the forward alone and a training step's forward: outputs before it as with clean
    input, NaN from it on in that head (the final state too), or at that step alone for q; the other head
    untouched. Without the guard (the default) the chunked kernels let a NaN v reach steps 0..39 (so that the
    test can fail)."""
    from test_robustness import T, _bad_step, assert_causal

    case = Case(op, 1, T, 2, 64, 64, dtype="bfloat16", h0=True, l2norm=op.endswith("delta_rule"))
    diff, _ = make_inputs(case, 3)
    diff = {n: np.asarray(a) for n, a in diff.items()}
    call = lambda cfg: lambda d: OPS[op](**d, **static_kwargs(case), backend=cfg)
    f32 = lambda out: tuple(np.asarray(x, np.float32) for x in out)
    guarded = Config(nonfinite_guard=True)
    leaky = jax.jit(call(Config()))

    for run in (jax.jit(call(guarded)), jax.jit(lambda d: jax.vjp(call(guarded), d)[0])):  # (and a training step's forward)
        o0, ht0 = f32(run(diff))
        for value in (np.nan, np.inf) if name == "v" else (np.nan,):
            o, ht = f32(run({n: jnp.asarray(a) for n, a in _bad_step(diff, name, 40, value).items()}))
            assert_causal(o0, ht0, o, ht, name, _close_by_ratio)
    if name == "v":
        o, _ = f32(leaky({n: jnp.asarray(a) for n, a in _bad_step(diff, "v", 40).items()}))
        assert np.isnan(o[0, :40, 0]).any(), "the kernels alone no longer leak a NaN v: is the guard still needed?"


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k", "v", "beta"])
def test_tilelang_non_finite_input_with_grouped_heads_and_sequences(name):
    """GDN on the kernels with `nonfinite_guard`, grouped value heads (2 q/k heads, 4 value heads), K = 64, V = 128, packed
    sequences: a NaN v or beta at step 50 poisons its value head alone, a NaN k both value heads of its group,
    from that step to its sequence's end; the other sequences and heads as with clean input."""
    from test_robustness import T, _bad_step

    case = Case("gated_delta_rule", 1, T, 2, 64, 128, HV=4, dtype="bfloat16", cu=(0, 37, 37, 100, T), h0=True, l2norm=True)
    diff, _ = make_inputs(case, 4)
    diff = {n: np.asarray(a) for n, a in diff.items()}
    run = jax.jit(lambda d: OPS[case.op](**d, **static_kwargs(case), backend=Config(nonfinite_guard=True)))
    f32 = lambda out: tuple(np.asarray(x, np.float32) for x in out)
    o0, ht0 = f32(run(diff))
    o, ht = f32(run({n: jnp.asarray(a) for n, a in _bad_step(diff, name, 50).items()}))
    heads = [0, 1] if name == "k" else [0]
    others = [h for h in range(4) if h not in heads]
    _close_by_ratio(o[0, :50], o0[0, :50])
    _close_by_ratio(o[0, 100:], o0[0, 100:])
    _close_by_ratio(o[0, :, others], o0[0, :, others])
    assert np.isnan(o[0, 50:100][:, heads]).all() and np.isnan(ht[2][heads]).all()
    assert np.isfinite(np.delete(ht, 2, axis=0)).all() and np.isfinite(ht[2][others]).all()


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
@pytest.mark.parametrize("K", [64, 128, 256])
def test_gla_gates_at_scale(K):
    """GLA on a grid of thousands of programs (B, T, H = 8, 2048, 16; 8 heads at K = 256): the
    in-chunk cumulative gates `a` writes against float64, and the output against the xla
    backend. At K = 64 two threads per channel once raced in the cumulative sum, which small
    grids did not show."""
    B, T, H = 8, 2048, 16 if K < 256 else 8
    rng = np.random.default_rng(K)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16) for _ in range(3))
    g = (-np.logaddexp(0, -rng.standard_normal((B, T, H, K))) / 16).astype(np.float32)
    variant = variants.find("gla", "fwd", "bfloat16", K, K)
    prog = next(p for p in variant.programs if p.name == "a")
    flat = lambda x: jnp.asarray(x).reshape(B * T, H, K)
    results = (jax.ShapeDtypeStruct((B * T // 64, H, 64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((B * T, H, K), jnp.float32),
               jax.ShapeDtypeStruct((B * T, H, K), jnp.bfloat16), jax.ShapeDtypeStruct((B * T, H, K), jnp.bfloat16))
    run = jax.jit(lambda *a: _call(variant.target(prog), results, a, {"scale": np.float32(K**-0.5)}))
    G = np.asarray(run(flat(q), flat(k), flat(g))[1])
    ref = np.cumsum(g.astype(np.float64).reshape(-1, 64, H, K), axis=1).reshape(G.shape)
    assert np.max(np.abs(G - ref) / (1 + np.abs(ref))) < 1e-5
    o1, h1 = jax.jit(lambda *a: fla_jax.chunk_gla(*a, output_final_state=True, backend="tilelang"))(q, k, v, jnp.asarray(g))
    o2, h2 = jax.jit(lambda *a: fla_jax.chunk_gla(*a, output_final_state=True, backend="xla"))(q, k, v, jnp.asarray(g))
    assert err_ratio(o2, o1) < 0.01 and err_ratio(h2, h1) < 0.01


@on_hopper
@pytest.mark.gpu
def test_tilelang_bad_shape_is_a_python_error():
    """A head dim the kernels do not take is refused with the reason (K = 96 is padded to 128 since K != V went
    onto the kernels; the delta rules' K is not split, so K = 320 is above their largest program)."""
    x = jnp.zeros((1, 64, 2, 320), jnp.bfloat16)
    beta = jnp.ones((1, 64, 2), jnp.float32)
    with pytest.raises(fla_jax.BackendUnavailableError, match="K = 320 is above"):
        fla_jax.chunk_delta_rule(x, x, x, beta, backend="tilelang")


@on_hopper
@pytest.mark.gpu
def test_handler_refuses_a_v_off_the_programs_v_tile(monkeypatch):
    """A program that takes V on its grid assumes V is a multiple of its V block (no bound checks on its V-block
    copies): its FFI handler returns an error for any other V, with the Python check (`Interface.check`) out of
    the way, and no kernel runs; a multiple runs."""
    target = "fla_simple_gla_fwd_bf16_k64_v64_c64_fused"
    assert dict(runtime.interfaces()[target].multiple_of) == {"V": 64}
    L, H, N = 128, 2, 2
    def call(V):
        named = dict(q=jnp.ones((L, H, 64), jnp.bfloat16), k=jnp.ones((L, H, 64), jnp.bfloat16), v=jnp.ones((L, H, V), jnp.bfloat16),
                     g=jnp.zeros((L // 64, H, 64), jnp.float32), h0=jnp.zeros((0, H, 64, V), jnp.float32),
                     cstart=jnp.array([0, 1], jnp.int32), ccount=jnp.array([1, 1], jnp.int32), scale=np.float32(0.125))
        results = (jax.ShapeDtypeStruct((L, H, V), jnp.bfloat16), jax.ShapeDtypeStruct((N, H, 64, V), jnp.float32))
        return jax.block_until_ready(runtime.launch(POISONED, target, results, named, None))
    o, ht = call(192)
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(ht)))
    with pytest.raises(Exception, match="dim V = 96 must be a multiple of 64"):
        call(96)


def test_build_outputs_for_every_program():
    """build.py left a cubin for sm_90 and a generated, marked handler for every program, each
    cubin compiled from the program's current CUDA source and lowering key (an interrupted build
    once kept a stale cubin under a new description: a different kernel behind the launch)."""
    import json

    import build
    from fla_jax._variants import VARIANTS

    for v in VARIANTS:
        for p in v.programs:
            gen = lambda ext: build.generated(v.target(p), ext)  # (build/gen/<op>/: one op's generated code in one folder)
            assert gen("cubin").parent.name == v.op
            cubin = gen("cubin").read_bytes()
            assert cubin[:4] == b"\x7fELF", v.target(p)
            assert gen("cc").read_text().startswith("// generated by build.py from kernels/")
            meta = json.loads(gen("json").read_text())
            assert all(0 <= ln["smem"] <= 227 * 1024 for ln in meta["launches"]), (v.target(p), meta["launches"])
            assert build._built(meta, build.content_key(v, p)), v.target(p)


def _ncu_program():
    """benchmarks/ncu_program.py as a module (the benchmarks are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("ncu_program", Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_program.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_cubin_launcher_reads_every_program():
    """benchmarks/ncu_program.py (Nsight Compute on the built cubins, without JAX) reads every
    program's JSON: each launch argument resolved to a buffer, a TMA descriptor (its dims, strides
    and box evaluated) or a dimension, and the grid and block evaluated, for a problem of 2
    sequences of 256 tokens and 3 heads."""
    import ctypes
    from pathlib import Path

    from fla_jax._variants import VARIANTS

    root = Path(__file__).resolve().parent.parent
    tool = _ncu_program()

    class Recorder:  # the driver calls, recorded instead of made
        def upload(self, a):
            return ctypes.c_uint64(a.size)

        def function(self, cubin, smem):
            assert cubin[:4] == b"\x7fELF" and 0 <= smem <= 227 * 1024
            return "fn"

        def tensor_map(self, dtype, rank, ptr, dims, strides, box, elem, tail):
            assert len(dims) == len(strides) == len(box) == len(elem) == rank and len(tail) == 4
            assert all(d > 0 for d in dims) and all(0 < b <= 256 for b in box), (dims, box)
            return ("map", dims)

    for v in VARIANTS:
        for p in v.programs:
            for fn, grid, block, smem, params in tool.prepare(Recorder(), root / "build" / "gen", v.target(p), 2, 256, 3):
                assert fn == "fn" and all(g >= 1 for g in grid) and block[0] in (128, 256, 384, 512), (v.target(p), grid, block)
                assert all(isinstance(a, (ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, tuple)) for a in params), v.target(p)


def test_stall_summary_splits_the_warpgroups(tmp_path, capsys):
    """`ncu_program.py --stalls` sums a SASS page's stall samples per reason and per warpgroup's part
    (the code between register reallocations), and ranks the instructions."""
    tool = _ncu_program()
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_barrier"]
    sass = [("LDC R1", 1, 1, 0), ("USETMAXREG.DEALLOC.CTAPOOL 0x28", 0, 0, 0), ("UTMALDG.3D", 2, 2, 0), ("BSSY B0", 30, 0, 30),
            ("USETMAXREG.TRY_ALLOC.CTAPOOL UP1, 0xc8", 0, 0, 0), ("@!P0 BRA 0x10", 50, 50, 0), ("HGMMA.64x64x16", 7, 0, 7)]
    rows = [["Kernel Name", "main_kernel"], head] + [[hex(i), src, *map(str, c)] for i, (src, *c) in enumerate(sass)]
    path = tmp_path / "page.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in r) for r in rows))
    tool.stalls(str(path), top=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "90 stall samples"
    assert [ln.split()[0] for ln in out[1:3]] == ["long_sb", "barrier"]
    parts = [ln for ln in out if ln.startswith("  SASS lines")]
    assert [int(ln.split()[4]) for ln in parts] == [1, 32, 57], parts  # before, the loader's part, the next warpgroup's
    assert "BSSY" in parts[1] and "BRA" in parts[2]
    assert out[-2].split()[0] == "50" and out[-1].split()[0] == "30"


def test_unsupported_calls_say_why(monkeypatch):
    p = _problem.Problem(op="simple_gla", delta=False, chunk_size=64, dtype="bfloat16")
    call = dict(K=128, V=128, varlen=False, grouped=False, l2norm=False)
    assert tilelang_backend.unsupported(p, **call) is None
    assert tilelang_backend.unsupported(p, **dict(call, K=96, V=96)) is None  # (padded to 128)
    assert "K = 512" in tilelang_backend.unsupported(p, **dict(call, K=512, V=96))
    assert "dtype float32" in tilelang_backend.unsupported(dataclasses.replace(p, dtype="float32"), **call)
    assert tilelang_backend.unsupported(p, **dict(call, varlen=True)) is None
    assert tilelang_backend.unsupported(_problem.Problem(op="gla", delta=False, chunk_size=64, dtype="bfloat16"), **call) is None
    gdn = _problem.Problem(op="gated_delta_rule", delta=True, chunk_size=64, dtype="bfloat16")
    assert tilelang_backend.unsupported(gdn, **dict(call, grouped=True, l2norm=True)) is None
    monkeypatch.setattr(tilelang_backend, "registered", lambda: [])  # an extension built before these kernels
    assert "rebuild" in tilelang_backend.unsupported(p, **call)


_GRAPH_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import fla_jax

def step(q, k, v, g, h0):
    def loss(q, k, v, g, h0):
        o, ht = fla_jax.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, backend="tilelang")
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht**2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, h0)

inputs = dict(np.load(sys.argv[1]))
cast = lambda n, a: jnp.asarray(a, jnp.bfloat16 if n in "qkv" else jnp.float32)
x1, x2 = [[cast(n, inputs[f"{n}{i}"]) for n in "qkvgs"] for i in (1, 2)]
compiled = jax.jit(step).lower(*x1).compile()
outs = {}
for name, x in (("a", x1), ("b", x2), ("c", x1)):  # replays with other buffers, then the first again
    loss, grads = compiled(*x)
    for i, a in enumerate((loss, *grads)):
        outs[f"{name}{i}"] = np.asarray(jnp.asarray(a, jnp.float32))
np.savez(sys.argv[2], **outs)
import os, re
dump = sys.argv[3]
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(dump) for f in fs)
thunks = [f for f in files if "jit_step" in f and f.endswith("thunk_sequence_after_thunk_passes.txt")]
print("STEP_THUNK_FILES", [os.path.basename(f) for f in thunks])
print("COMMAND_BUFFER_IN_STEP", any(re.search(r"command.?buffer", open(f).read(), re.I) for f in thunks))
"""


@on_hopper
@pytest.mark.gpu
def test_tilelang_under_cuda_graph_replay(tmp_path):
    """The step runs inside an XLA command buffer (CUDA graph) and replays correctly with new inputs."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(5)
    B, T, H, D = 2, 300, 2, 64
    arrays = {}
    for i in (1, 2):
        for n in "qkv":
            arrays[f"{n}{i}"] = rng.standard_normal((B, T, H, D)).astype(np.float32)
        arrays[f"g{i}"] = (-np.abs(rng.standard_normal((B, T, H))) * 0.1).astype(np.float32)
        arrays[f"s{i}"] = rng.standard_normal((B, H, D, D)).astype(np.float32)
    for n in list(arrays):
        if n[0] in "qkv":  # values exactly representable in bf16
            arrays[n] = np.asarray(jnp.asarray(arrays[n], jnp.bfloat16), np.float32)
    np.savez(tmp_path / "in.npz", **arrays)
    flags = f"--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 --xla_dump_to={tmp_path / 'dump'}"
    r = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), str(tmp_path / "dump")],
                       env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    # the step's thunk sequence, as XLA dumps it after its thunk passes, holds a command buffer
    # (the flags alone would not show up there; XLA's debug-options dump does echo them)
    assert "COMMAND_BUFFER_IN_STEP True" in r.stdout, r.stdout
    out = np.load(tmp_path / "out.npz")
    for i in range(6):
        np.testing.assert_array_equal(out[f"a{i}"], out[f"c{i}"])  # replay of the same inputs: bitwise
    for name, i in (("a", 1), ("b", 2)):  # each replay against the xla backend on the same inputs
        x = [jnp.asarray(arrays[f"{n}{i}"], jnp.bfloat16 if n in "qkv" else jnp.float32) for n in "qkvgs"]

        def loss(q, k, v, g, h0):
            o, ht = fla_jax.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, backend="xla")
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht**2)

        with jax.default_matmul_precision("highest"):
            want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(*x)
        for j, w in enumerate((want[0], *want[1])):
            assert err_ratio(w, out[f"{name}{j}"]) < 0.01, (name, j)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["g", "g_gamma"])
def test_tilelang_matches_fla_triton(gate):
    """Against fla 0.6.0's Triton chunk_simple_gla (torch) on the same random inputs. fla's gated
    backward is refused on Triton < 3.7.1 (its issue #640); where it refuses, the gradients are
    compared with the float64 reference only (test_tilelang_matches_float64)."""
    torch = pytest.importorskip("torch")
    fla_simple = pytest.importorskip("fla.ops.simple_gla")
    rng = np.random.default_rng(9)
    B, T, H, D = 2, 1000, 4, 128
    x = {n: rng.standard_normal((B, T, H, D)).astype(np.float32) for n in ("q", "k", "v", "do")}
    g = -np.logaddexp(0, -rng.standard_normal((B, T, H))).astype(np.float32)
    gamma = -np.abs(rng.standard_normal(H)).astype(np.float32) * 0.1
    h0 = rng.standard_normal((B, H, D, D)).astype(np.float32)
    bf = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    gate_kw = {"g": jnp.asarray(g)} if gate == "g" else {"g_gamma": jnp.asarray(gamma)}
    o, ht = fla_jax.chunk_simple_gla(bf["q"], bf["k"], bf["v"], **gate_kw, initial_state=jnp.asarray(h0),
                                     output_final_state=True, backend="tilelang")

    t = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(jnp.asarray(a, jnp.float32)), device="cuda", dtype=dt)
    tg = {"g": t(g, torch.float32)} if gate == "g" else {"g_gamma": t(gamma, torch.float32)}
    with torch.no_grad():
        fo, fht = fla_simple.chunk_simple_gla(t(bf["q"]), t(bf["k"]), t(bf["v"]), **tg, initial_state=t(h0, torch.float32),
                                              output_final_state=True)
    as_np = lambda a: a.float().cpu().numpy()
    errs = {"o": err_ratio(as_np(fo), o), "ht": err_ratio(as_np(fht), ht)}
    print(gate, {n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["o"] < 0.004 and errs["ht"] < 0.004, errs


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("norm", [0.1, 1.0, 10.0])
def test_tilelang_gla_matches_fla_triton(norm):
    """Against fla 0.6.0's Triton chunk_gla (torch), the forward, on the same random inputs with
    gate normaliser `norm` (fla refuses its gated backward on Triton < 3.7.1; the gradients are
    compared with the float64 reference in test_tilelang_matches_float64)."""
    torch = pytest.importorskip("torch")
    fla_gla = pytest.importorskip("fla.ops.gla")
    rng = np.random.default_rng(19)
    B, T, H, D = 2, 1000, 4, 128
    x = {n: rng.standard_normal((B, T, H, D)).astype(np.float32) for n in ("q", "k", "v")}
    g = (-np.logaddexp(0, -rng.standard_normal((B, T, H, D))) / norm).astype(np.float32)
    h0 = rng.standard_normal((B, H, D, D)).astype(np.float32)
    bf = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    o, ht = fla_jax.chunk_gla(bf["q"], bf["k"], bf["v"], jnp.asarray(g), initial_state=jnp.asarray(h0),
                              output_final_state=True, backend="tilelang")
    t = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(jnp.asarray(a, jnp.float32)), device="cuda", dtype=dt)
    with torch.no_grad():
        fo, fht = fla_gla.chunk_gla(t(bf["q"]), t(bf["k"]), t(bf["v"]), t(g, torch.float32), initial_state=t(h0, torch.float32),
                                    output_final_state=True)
    as_np = lambda a: a.float().cpu().numpy()
    errs = {"o": err_ratio(as_np(fo), o), "ht": err_ratio(as_np(fht), ht)}
    print("gla", norm, {n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["o"] < 0.004 and errs["ht"] < 0.004, errs


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["delta_rule", "gated_delta_rule"])
def test_tilelang_delta_matches_fla_triton(op):
    """Against fla 0.6.0's Triton chunk_delta_rule / chunk_gated_delta_rule (torch) on the same
    random inputs (q/k normalised in the kernel, an initial state, T not a multiple of 64): o and
    the final state with fla's ratio 0.006, and every gradient (q, k, v, beta, g, h0) with 0.008
    (dbeta, dg 0.02) where fla runs its backward; it refuses the gated one on Triton < 3.7.1 (its
    issue #640), whose gradients test_tilelang_delta_matches_float64 checks against float64."""
    torch = pytest.importorskip("torch")
    fla_mod = pytest.importorskip("fla.ops.gated_delta_rule" if op == "gated_delta_rule" else "fla.ops.delta_rule")
    rng = np.random.default_rng(29)
    B, T, H, D = 2, 1000, 4, 128
    x = {n: rng.standard_normal((B, T, H, D)).astype(np.float32) for n in ("q", "k", "v", "do")}
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    gates = {"g": -np.logaddexp(0, -rng.standard_normal((B, T, H))).astype(np.float32)} if op == "gated_delta_rule" else {}
    h0 = (0.1 * rng.standard_normal((B, H, D, D))).astype(np.float32)
    dht = rng.standard_normal((B, H, D, D)).astype(np.float32)
    bf = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    ours_fn = getattr(fla_jax, f"chunk_{op}")

    def ours(q, k, v, beta, h0, *g):
        return ours_fn(q, k, v, *g, beta, initial_state=h0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True, backend="tilelang")

    args = (bf["q"], bf["k"], bf["v"], jnp.asarray(beta), jnp.asarray(h0), *map(jnp.asarray, gates.values()))
    (o, ht), vjp = jax.vjp(ours, *args)
    grads = dict(zip(("q", "k", "v", "beta", "h0", *gates), vjp((bf["do"], jnp.asarray(dht)))))

    t = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(jnp.asarray(a, jnp.float32)), device="cuda", dtype=dt).requires_grad_()
    tin = {"q": t(bf["q"]), "k": t(bf["k"]), "v": t(bf["v"]), "beta": t(beta, torch.float32), "h0": t(h0, torch.float32),
           **{n: t(a, torch.float32) for n, a in gates.items()}}
    fo, fht = getattr(fla_mod, f"chunk_{op}")(tin["q"], tin["k"], tin["v"], *[tin[n] for n in gates], tin["beta"],
                                              initial_state=tin["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    as_np = lambda a: a.detach().float().cpu().numpy()
    errs = {"o": err_ratio(as_np(fo), o), "ht": err_ratio(as_np(fht), ht)}
    try:
        torch.autograd.backward((fo, fht), (t(bf["do"]).detach(), t(dht, torch.float32).detach()))
    except RuntimeError as e:  # fla's gated backward on Triton < 3.7.1
        print(op, "fla backward refused:", str(e)[:80])
    else:
        errs |= {f"d{n}": err_ratio(as_np(tin[n].grad), grads[n]) for n in grads}
    print(op, {n: f"{e:.1e}" for n, e in errs.items()})
    # the fla ratios: o 0.005-0.006 (two bf16 computations apart: 5.6e-3 seen on the delta rule)
    limits = {"o": 0.006, "ht": 0.006, "dbeta": 0.02, "dg": 0.02}
    assert all(e < limits.get(n, 0.008) for n, e in errs.items()), errs
    assert op == "gated_delta_rule" or "dq" in errs, "fla ran no backward for the ungated delta rule"


# K != V (`fla_jax._tiling`: the delta rules on the square programs, the gated ops with V on the grid): GDN at every
# pair of K in 64, 128, 256 and V in 64 ... 512
# (grouped heads, l2 norm in the kernels, an initial state; varlen with an empty sequence at two pairs); the
# other ops at V = 2K, V = 4K, K = 2V and a V off the head dims (padded). T not a multiple of 64.
TILED_GPU_CASES = [
    *(Case("gated_delta_rule", 1, 130, 1, K, V, HV=2, dtype="bfloat16", h0=True, l2norm=True, norm=0.1 if V == 512 else 1.0)
      for K in (64, 128, 256) for V in (64, 128, 256, 512) if K != V),
    Case("gated_delta_rule", 1, 300, 2, 128, 256, dtype="float16", cu=(0, 0, 100, 300), h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 300, 2, 256, 128, dtype="bfloat16", cu=(0, 64, 64, 300), l2norm=True),
    Case("delta_rule", 2, 130, 2, 128, 256, dtype="bfloat16", h0=True),
    Case("delta_rule", 1, 300, 2, 64, 256, dtype="float16", cu=(0, 0, 100, 300), l2norm=True),
    Case("simple_gla", 2, 130, 2, 128, 256, dtype="bfloat16", h0=True),
    Case("simple_gla", 1, 300, 2, 64, 256, dtype="bfloat16", cu=(0, 0, 100, 300), h0=True, norm=0.1),
    Case("simple_gla", 2, 130, 2, 256, 128, dtype="float16", h0=True),
    Case("simple_gla", 1, 130, 2, 128, 96, dtype="bfloat16", gate="g_gamma"),
    Case("gla", 2, 130, 2, 64, 128, dtype="bfloat16", h0=True),
    Case("gla", 1, 300, 2, 128, 512, dtype="bfloat16", cu=(0, 0, 100, 300), h0=True, norm=10.0),
    Case("gla", 2, 130, 2, 128, 64, dtype="float16", h0=True, norm=0.1),
    Case("gla", 1, 130, 2, 256, 192, dtype="bfloat16"),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", TILED_GPU_CASES, ids=str)
def test_tilelang_tiled_head_dims_match_float64(case):
    """K != V on the kernels against float64: outputs (under a gradient and without), the final state
    and every gradient, NaN-poisoned outputs; limits as the square cases'."""
    delta = case.op in ("delta_rule", "gated_delta_rule")
    call = dict(K=case.K, V=case.V, varlen=case.cu is not None, grouped=case.HV is not None, l2norm=case.l2norm)
    assert tilelang_backend.unsupported(_problem.Problem(op=case.op, delta=delta, chunk_size=64, dtype=case.dtype), **call) is None
    errs = errors_against_float64(case, 17, backend=Config(poison_outputs=True))
    print(case, {n: f"{e:.1e}" for n, e in errs.items()})
    if delta:
        limit = lambda n: 0.006 if n[0] in "oh" else 0.02 if n in ("dbeta", "dg") else 0.008
    else:
        limit = lambda n: 0.004 if n[0] in "oh" else 0.005
    bad = {n: e for n, e in errs.items() if not e <= limit(n)}
    assert not bad, bad


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("op, K, V", [("gated_delta_rule", 128, 256), ("gated_delta_rule", 256, 512), ("gla", 64, 128),
                                      ("simple_gla", 128, 256)])
def test_tilelang_tiled_matches_fla_triton(op, K, V):
    """K != V against fla 0.6.0's Triton ops (torch) on the same random inputs, the forward: o and the
    final state (fla's own backward is refused for the gated ops on Triton < 3.7.1)."""
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip({"gated_delta_rule": "fla.ops.gated_delta_rule", "gla": "fla.ops.gla",
                               "simple_gla": "fla.ops.simple_gla"}[op])
    rng = np.random.default_rng(37)
    B, T, H = 2, 1000, 4
    x = {"q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)), "v": rng.standard_normal((B, T, H, V))}
    bf = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
    logsig = lambda a: (-np.logaddexp(0, -a)).astype(np.float32)
    extra = {"gla": lambda: [logsig(rng.standard_normal((B, T, H, K)))], "simple_gla": lambda: [logsig(rng.standard_normal((B, T, H)))],
             "gated_delta_rule": lambda: [logsig(rng.standard_normal((B, T, H))),
                                          (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)]}[op]()
    h0 = (0.1 * rng.standard_normal((B, H, K, V))).astype(np.float32)
    kw = {"use_qk_l2norm_in_kernel": True} if op == "gated_delta_rule" else {}
    o, ht = getattr(fla_jax, f"chunk_{op}")(*bf.values(), *map(jnp.asarray, extra), initial_state=jnp.asarray(h0),
                                            output_final_state=True, backend="tilelang", **kw)
    t = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(jnp.asarray(a, jnp.float32)), device="cuda", dtype=dt)
    with torch.no_grad():
        fo, fht = getattr(mod, f"chunk_{op}")(*(t(a) for a in bf.values()), *(t(a, torch.float32) for a in extra),
                                              initial_state=t(h0, torch.float32), output_final_state=True, **kw)
    as_np = lambda a: a.float().cpu().numpy()
    errs = {"o": err_ratio(as_np(fo), o), "ht": err_ratio(as_np(fht), ht)}
    print(op, K, V, {n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["o"] < 0.006 and errs["ht"] < 0.006, errs


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_tilelang_gdn_gate_options_match_fla_triton(neg_eigval):
    """fla 0.6.0's `use_gate_in_kernel` (A_log, dt_bias), `use_beta_sigmoid_in_kernel` and `allow_neg_eigval`
    against fla's Triton GDN with the same options on the same inputs: o and the final state (fla's gated
    backward is refused on Triton < 3.7.1; the options' gradients are checked against float64 in test_ops)."""
    torch = pytest.importorskip("torch")
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    rng = np.random.default_rng(47)
    B, T, H, HV, D = 2, 1000, 2, 4, 128
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, HV, D)), jnp.bfloat16)
    g, b = rng.standard_normal((2, B, T, HV)).astype(np.float32)
    A_log, dt_bias = np.log(rng.uniform(1, 16, HV)).astype(np.float32), rng.standard_normal(HV).astype(np.float32)
    opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval,
                use_qk_l2norm_in_kernel=True, output_final_state=True)
    o, ht = fla_jax.chunk_gated_delta_rule(q, k, v, jnp.asarray(g), jnp.asarray(b), A_log=jnp.asarray(A_log),
                                           dt_bias=jnp.asarray(dt_bias), backend="tilelang", **opts)
    t = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(jnp.asarray(a, jnp.float32)), device="cuda", dtype=dt)
    f32 = lambda a: t(a, torch.float32)
    with torch.no_grad():
        fo, fht = fla_gdn.chunk_gated_delta_rule(t(q), t(k), t(v), f32(g), f32(b), A_log=f32(A_log), dt_bias=f32(dt_bias), **opts)
    as_np = lambda a: a.float().cpu().numpy()
    errs = {"o": err_ratio(as_np(fo), o), "ht": err_ratio(as_np(fht), ht)}
    print("gdn options", neg_eigval, {n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["o"] < 0.006 and errs["ht"] < 0.006, errs


@pytest.mark.parametrize("K", [64, 128, 256])
def test_gla_export_for_cuda_has_the_custom_calls(K, monkeypatch):
    """GLA and its gradient lower for CUDA to the kernels only: forward = A, then the state pass;
    under a gradient the state pass also stores h, and the backward is the state-gradient pass and
    the fused consumer."""
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    x = jnp.zeros((1, 100, 2, K), jnp.bfloat16)
    g = jnp.zeros((1, 100, 2, K), jnp.float32)

    def f(q, k, v, g):
        return fla_jax.chunk_gla(q, k, v, g, output_final_state=True, backend="tilelang")

    names = [f"fla_gla_{d}_bf16_k{K}_v{K}_c64_{n}" for d, n in [("fwd", "a"), ("fwd", "fused"), ("fwd", "fused_h"),
                                                                 ("bwd", "dh"), ("bwd", "dqkvg")]]
    fwd, both = _cuda_custom_calls(f, (x, x, x, g), names)
    kernels = lambda calls: [c for c in calls if c.startswith("fla_")]
    assert kernels(fwd) == names[:2]
    assert sorted(kernels(both)) == sorted([names[0]] + names[2:])


def _gdn_custom_calls(K: int, allowed, *, l2norm: bool, modules: bool = False, cfg: Config | None = None):
    """`_cuda_custom_calls` of GDN with the tilelang backend: H = 2 q/k heads, 4 value heads (with
    `modules` the exported modules' text, `_cuda_modules`)."""
    x = jnp.zeros((1, 100, 2, K), jnp.bfloat16)
    v = jnp.zeros((1, 100, 4, K), jnp.bfloat16)
    gb = jnp.zeros((1, 100, 4), jnp.float32)

    def f(q, k, v, g, beta):
        return fla_jax.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                              backend=cfg or "tilelang")

    return (_cuda_modules if modules else _cuda_custom_calls)(f, (x, x, v, gb, gb), allowed)


@pytest.mark.parametrize("scan", [False, True], ids=["xla_sums", "kernel_sums"])
@pytest.mark.parametrize("K", [64, 128, 256])
def test_gdn_training_step_forms_the_gate_sums_once(K, scan, monkeypatch):
    """GDN under value_and_grad (use_qk_l2norm_in_kernel), exported for CUDA: XLA transposes G to
    per-chunk rows once, in the forward, where the passes take rows (K <= 128: the WY kernel, the
    state pass; the backward's reverse pass, consumer and WY VJP read the rows the forward kept,
    `plan.stores_gate_rows`), and beta for the WY kernel in the forward; 1 / |q| for the consumer,
    beta and 1 / |k| for the WY VJP in the backward; with the gate-summing
    experiments in place (bf16) XLA sums nothing and transposes 1 / |q| alone: the training WY
    kernel writes G and its rows, the WY VJP returns the gates' gradient per step (and takes
    columns; at K = 256 the WY kernel then normalises q and k too, in place of the `norm` passes)."""
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    cfg = None
    if scan:  # (the experiments stand in for the WY VJP of two programs: not the one program, `delta_grads_kernel`)
        cfg = Config(delta_grads_kernel=(), experiments=tuple(GATE_SCAN_EXPERIMENTS.items()))
    allowed = [v.target(p) for v in variants.VARIANTS for p in v.declared]
    _, step = _gdn_custom_calls(K, allowed, l2norm=True, modules=True, cfg=cfg)
    kernels = re.findall(r"custom_call @fla_delta_\w+_c64_(\w+)", step)
    assert step.count("stablehlo.transpose") == (0 if K > 128 else 1 if scan else 5), kernels
    assert ("@cumsum" in step) == (not scan), kernels
    if scan:
        assert {"x_wy_t_l2_scan", "x_wy_bwd_l2_sum"} <= set(kernels) and "norm" not in kernels, kernels
    else:
        assert ("wy_t_l2" in kernels) == (K <= 128) and ("norm" in kernels) == (K > 128), kernels


@pytest.mark.parametrize("l2norm", [False, True])
def test_delta_narrow_state_pass_where_programs_leave_sms_idle(l2norm):
    """`Config.delta_narrow_programs` at the benchmark shapes: V blocks of 32 at 2,8192,16,128 (2 x 16 x 2
    programs of 64 would leave half the SMs idle) and at 4,4096,16,64 (64), of 64 where the
    programs fill the SMs (4,4096,16,128: 128; 8,2048,16,64: 128), and at K = 256, where no
    narrow pass is built; counting the pieces each sequence is walked in (1 x 32768 x 16 x 128: four pieces, 128
    programs of 64)."""
    p = _problem.Problem(op="gated_delta_rule", delta=True, chunk_size=64, dtype="bfloat16")
    wide = "fused_t_l2" if l2norm else "fused_t"
    for (N, HV, D, nt), want in (((2, 16, 128, 128), wide + "_v32"), ((4, 16, 64, 64), wide + "_v32"), ((4, 16, 128, 64), wide),
                                 ((8, 16, 64, 32), wide), ((1, 1, 256, 4), wide), ((66, 1, 64, 4), wide + "_v32"), ((67, 1, 64, 4), wide),
                                 ((1, 16, 128, 4), wide + "_v32"), ((1, 16, 128, 512), wide)):
        targets = plan.targets(p, "fwd", D, D)
        assert plan.delta_state_pass_t(p, targets, l2norm, N, HV, D, nt) == want, (N, HV, D, nt)


@pytest.mark.parametrize("K", [64, 128, 256])
def test_delta_forward_from_the_inverse_exports_its_kernels(K, monkeypatch):
    """With `Config.delta_fwd_inverse` (by default at K <= 128) the forward with no gradient lowers for CUDA to the
    inverse and the state pass that reads it, without it to the WY kernel and the state pass on w
    and u; under a gradient the forward is the WY kernel's either way (the backward reads its w,
    u and T)."""
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    names = [f"fla_delta_fwd_bf16_k{K}_v{K}_c64_{n}" for n in ("inv", "fused_t", "wy", "fused", "wy_t", "fused_h")]
    built = [vr.target(prog) for d in ("fwd", "bwd") for vr in [variants.find("delta", d, "bfloat16", K, K)] for prog in vr.programs]
    # (one sequence, four value heads: with `Config.delta_narrow_programs` the state pass in V blocks of 32 where built)
    narrow = [names[0], names[1] + "_v32" if K <= 128 else names[1]]
    for inverse, wide, want in ((True, True, names[:2]), (True, False, narrow), (False, True, names[2:4])):
        cfg = Config(delta_fwd_inverse=variants.HEAD_DIMS if inverse else (), delta_narrow_programs=0 if wide else 132)
        fwd, both = _gdn_custom_calls(K, built, l2norm=False, cfg=cfg)
        assert fwd == want
        assert [c for c in both if c.startswith("fla_delta_fwd")] == names[4:]


@pytest.mark.parametrize("norm_fused", [True, False], ids=["norm_fused", "norm_passes"])
@pytest.mark.parametrize("mode", DELTA_BWD_MODES)
@pytest.mark.parametrize("K", [64, 128, 256])
def test_delta_export_for_cuda_has_the_custom_calls(K, mode, norm_fused, monkeypatch):
    """GDN (grouped heads, l2 norm) and its gradient lower for CUDA to the kernels (forward: WY
    preparation and the state pass; under a gradient both storing what the backward reads, the
    reverse state-gradient pass and, when switched on, the consumer and WY VJP kernels, or the one
    program for both) around XLA's parallel parts."""
    fused, wy_kernel, grads = DELTA_BWD_MODES[mode]
    # (V blocks of 64 in the forward from the inverse)
    cfg = delta_bwd_config(mode, delta_l2norm_fused=norm_fused, delta_narrow_programs=0)
    monkeypatch.setattr(tilelang_backend, "status", lambda: (True, None))
    # under a gradient q and k are normalised by the WY kernel (`wy_t_l2`, where `Config.delta_l2norm_fused`
    # and K <= 128) or by a kernel each before it (XLA's pass without a gradient); their gradients
    # by the consumer (at K <= 128) and the WY VJP where `Config.delta_l2norm_fused` and both run, else by
    # a pass each
    q_norm, k_norm = norm_fused and fused and K <= 128, norm_fused and fused and wy_kernel
    if K in cfg.delta_fwd_inverse:  # (with `delta_l2norm_fused` from the raw q and k)
        programs = [("fwd", "inv_l2"), ("fwd", "fused_t_l2")] if norm_fused else [("fwd", "inv"), ("fwd", "fused_t")]
    else:
        programs = [("fwd", "wy"), ("fwd", "fused")]
    programs += [("fwd", "wy_t_l2")] if norm_fused and K <= 128 else [("fwd", "norm")] * 2 + [("fwd", "wy_t")]
    programs += [("fwd", "fused_h"), ("bwd", "dh")]
    if K in grads:  # (the consumer and the WY VJP in one program)
        programs += [("bwd", "grads_l2")] if norm_fused else [("bwd", "grads"), ("bwd", "norm_bwd"), ("bwd", "norm_bwd")]
    else:
        programs += [("bwd", "dqkvg_l2" if q_norm else "dqkvg")] * fused + [("bwd", "wy_bwd_l2" if k_norm else "wy_bwd")] * wy_kernel
        programs += [("bwd", "norm_bwd")] * (2 - q_norm - k_norm)
    names = [f"fla_delta_{d}_bf16_k{K}_v{K}_c64_{n}" for d, n in programs]
    fwd, both = _gdn_custom_calls(K, sorted(set(names)), l2norm=True, cfg=cfg)
    kernels = lambda calls: [c for c in calls if c.startswith("fla_")]
    assert kernels(fwd) == names[:2]
    assert sorted(kernels(both)) == sorted(names[2:])


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "gla"])
def test_tilelang_layers_train_as_xla_does(name, monkeypatch):
    """The Flax layers with bf16 activations on the kernels: output and every parameter's gradient
    as with the XLA backend (the same float32 parameters), NaN-poisoned outputs."""
    from flax import nnx

    from fla_jax.layers import GatedDeltaNet, GatedLinearAttention

    build = {"gdn": lambda b: GatedDeltaNet(256, 2, 128, num_v_heads=4, backend=b, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
             "gla": lambda b: GatedLinearAttention(256, 2, 128, backend=b, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}[name]
    x = jax.random.normal(jax.random.key(5), (2, 300, 256), jnp.bfloat16)
    cu = jnp.asarray([0, 100, 101, 600], jnp.int32)
    loss = lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2) + jnp.sum(m(x.reshape(1, 600, 256), cu_seqlens=cu).astype(jnp.float32) ** 2)
    res = {}
    for b in ("xla", "tilelang"):
        layer = build(Config(poison_outputs=True) if b == "tilelang" else b)
        res[b] = jax.jit(lambda m: (m(x), nnx.grad(loss)(m)))(layer)
    (y, g), (yt, gt) = res["xla"], res["tilelang"]
    errs = {"o": err_ratio(y.astype(jnp.float32), yt)}
    leaves, leaves_t = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g)), jax.tree.leaves(nnx.to_pure_dict(gt))
    errs |= {jax.tree_util.keystr(path): err_ratio(a, b) for (path, a), b in zip(leaves, leaves_t)}
    print(name, {n: f"{e:.1e}" for n, e in errs.items()})
    assert len(errs) > 8 and all(e < 2e-2 for e in errs.values()), errs


GPUS = [d for d in jax.devices() if d.platform == "gpu"]
SHARDED_GPU_CASES = [
    Case("simple_gla", 4, 1000, 4, 128, 128, dtype="bfloat16", h0=True),
    Case("gla", 4, 500, 4, 128, 128, dtype="bfloat16", h0=True),
    Case("delta_rule", 4, 700, 4, 128, 128, dtype="bfloat16", h0=True, l2norm=True),
    Case("gated_delta_rule", 4, 700, 4, 128, 128, HV=8, dtype="bfloat16", h0=True, l2norm=True),
    Case("gated_delta_rule", 1, 1500, 4, 128, 128, HV=8, dtype="bfloat16", h0=True, cu=(0, 400, 400, 1500)),
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs (the multi-GPU issue)")
@pytest.mark.parametrize("layout", ["batch", "heads", "both"])
@pytest.mark.parametrize("case", SHARDED_GPU_CASES, ids=str)
def test_tilelang_sharded_over_gpus(case, layout):
    """The kernels under jit over several GPUs with the batch, the heads or both split: no
    collective in the compiled forward or gradient (q, k, v never gathered), the kernels in it, the
    outputs and every gradient as on one GPU, the shardings as asked."""
    import pathlib
    import tempfile

    from jax.sharding import AxisType
    from test_sharding import _spec, _specs, jit_without_collectives

    n = len(GPUS)
    if layout == "both" and n < 4:
        pytest.skip("batch and heads both split need 4 GPUs")
    if layout == "batch" and case.cu is not None:
        pytest.skip("packed sequences (B = 1) split by heads only")
    shape = {"batch": (n, 1), "heads": (1, n), "both": (2, n // 2)}[layout]
    op, kw = OPS[case.op], static_kwargs(case)
    fwd = lambda d: op(**d, **kw, backend="tilelang")
    grad = jax.grad(lambda d: sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in fwd(d)))
    diff, _ = make_inputs(case, 17)
    one = {k: jax.device_put(x, GPUS[0]) for k, x in diff.items()}
    want = (jax.jit(fwd)(one), jax.jit(grad)(one))
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=GPUS[: shape[0] * shape[1]])
    batch = None if case.cu is not None or shape[0] == 1 else "data"
    heads = "model" if shape[1] > 1 else None
    specs = _specs(case, diff, batch, heads)
    with jax.set_mesh(mesh):
        sdiff, jf, jg = jit_without_collectives(mesh, specs, diff, fwd, grad, must_call=r'custom_call_target="fla_')
        (o, ht), g = jf(sdiff), jg(sdiff)
        with tempfile.TemporaryDirectory() as tmp:  # and in a profile of the gradient: no collective kernel ran
            with jax.profiler.trace(tmp):
                jax.block_until_ready(jg(sdiff))
            data = jax.profiler.ProfileData.from_file(str(next(pathlib.Path(tmp).rglob("*.xplane.pb"))))
        ran = {ev.name for plane in data.planes if plane.name.startswith("/device:GPU") for line in plane.lines for ev in line.events}
        assert "main_kernel" in ran and not [k for k in ran if re.search(r"nccl|all.?gather|all.?reduce|all.?to.?all|collective|reduce.?scatter", k, re.IGNORECASE)], ran
    (o0, ht0), g0 = want
    errs = {"o": err_ratio(o0.astype(jnp.float32), o), "ht": err_ratio(ht0, ht)} | {k: err_ratio(g0[k].astype(jnp.float32), g[k]) for k in g0}
    print(case, layout, {k: f"{e:.1e}" for k, e in errs.items()})
    assert all(e < 2e-3 for e in errs.values()), errs
    assert _spec(o) == (batch, None, heads, None) and _spec(ht) == (batch, heads, None, None)
    for k, gx in g.items():
        assert _spec(gx) == tuple(specs[k]) + (None,) * (gx.ndim - len(specs[k])), k
