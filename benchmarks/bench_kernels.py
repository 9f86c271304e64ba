"""Times each TileLang program of the simple GLA and delta-rule pipelines on its own (jit of one custom call,
median of repeated back-to-back calls), so the op-level numbers of bench.py can be split by kernel.

    python benchmarks/bench_kernels.py --shapes 4x4096x16x128,8x2048x16x64 --ops simple_gla,delta
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import _jax_time
from fla_jax import tilelang_backend as tb
from fla_jax._tilelang import common, delta, plan, runtime
from fla_jax._problem import Problem


def programs(B, T, H, D, dtype="bfloat16", op="simple_gla", xla=True):
    """(name, jitted call, args) for every program of the simple GLA (`op="simple_gla"`), GLA
    (`"gla"`) or delta rule (`op="delta"`) forward and backward variants (experimental configs included), on the flat
    chunk layout the backend hands them (B sequences of T tokens); for the delta rule also the two
    XLA parts of its backward (the per-chunk VJP and the WY VJP) unless `xla` is false."""
    NT = B * T // 64
    rng = np.random.default_rng(0)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    q, k, v, do = (x(B * T, H, D) for _ in range(4))
    steps = jnp.asarray(-np.abs(rng.standard_normal((NT, 64, H))) * 0.1, jnp.float32)  # the gates per step
    G = jnp.cumsum(steps, 1).reshape(B * T, H)
    h0 = jnp.zeros((B, H, D, D), jnp.float32)
    cstart, ccount = jnp.arange(B, dtype=jnp.int32) * (T // 64), jnp.full((B,), T // 64, jnp.int32)
    state = jax.ShapeDtypeStruct((NT, H, D, D), dtype)
    final = jax.ShapeDtypeStruct(h0.shape, jnp.float32)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    s = np.float32(D**-0.5)
    p = Problem(op={"delta": "delta_rule"}.get(op, op), delta=op == "delta", chunk_size=64, dtype=dtype)
    run = lambda direction, name, results, *a, **kw: _kernel(p, plan.targets(p, direction, D, D)[name], results, kw)(*a)
    # the consumer's dv (and but for GLA dg): whole, or in float32 parts where it splits the key channels
    parts = plan.value_parts(p, D, D)
    split = lambda a: like(a) if parts == 1 else jax.ShapeDtypeStruct((parts, *a.shape), jnp.float32)
    gates = lambda direction, name: common.gates_for(p, direction, D, name, G, 64)  # columns, or per-chunk rows (`g_rows`)
    r = jnp.ones(G.shape, jnp.float32)  # 1 / |x| of rows already normalised
    if op == "simple_gla":
        h = run("fwd", "fused_h", (like(v), state, final), q, k, v, gates("fwd", "fused_h"), h0, cstart, ccount, scale=s)[1]
        # `enter`: each sequence's second half as a later piece (`simple_gla.split_forward`), o updated in place
        NS, M = B, T // 128
        first = jnp.arange(B, dtype=jnp.int32) * (T // 64) + M
        enter = (jnp.zeros((NS, M, H), jnp.float32), jnp.asarray(rng.standard_normal((NS, H, D, D)) * 0.1, dtype))
        calls = {  # program kind: (results, args, attrs)
            "fused_h": ((like(v), state, final), (q, k, v, gates("fwd", "fused_h"), h0, cstart, ccount), {"scale": s}),
            "fused": ((like(v), final), (q, k, v, gates("fwd", "fused"), h0, cstart, ccount), {"scale": s}),
            "enter": (like(v), (q, common.gate_rows(G, 64), *enter, first), {"scale": s, "init": (jnp.zeros_like(v),)}),
            "dh": ((state, final), (q, do, gates("bwd", "dh"), h0, cstart, ccount), {"scale": s}),
            "dqkvg": ((like(q), like(k), split(v), split(G)), (q, k, v, G, h, do, h), {"scale": s}),
        }

    elif op == "gla":  # gates per key channel
        gk = jnp.asarray(-np.abs(rng.standard_normal((B * T, H, D))) * 0.1, jnp.float32)  # per step
        am = (jax.ShapeDtypeStruct((NT, H, 64, 64), dtype), like(gk), like(q), like(k))
        a, Gk, qg, kg = run("fwd", "a", am, q, k, gk, scale=s)
        h = run("fwd", "fused_h", (like(v), state, final), qg, kg, v, Gk, a, h0, cstart, ccount, scale=s)[1]
        calls = {
            "a": (am, (q, k, gk), {"scale": s}),
            "fused_h": ((like(v), state, final), (qg, kg, v, Gk, a, h0, cstart, ccount), {"scale": s}),
            "fused": ((like(v), final), (qg, kg, v, Gk, a, h0, cstart, ccount), {"scale": s}),
            "dh": ((state, final), (q, do, Gk, h0, cstart, ccount), {"scale": s}),
            "dqkvg": ((like(q), like(k), split(v), like(Gk)), (q, k, v, Gk, a, h, do, h), {"scale": s}),
        }
    else:
        beta = jnp.asarray(rng.uniform(size=(B * T, H)), jnp.float32)
        k = k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True).astype(dtype)
        tm = jax.ShapeDtypeStruct((NT, H, 64, 64), jnp.float32)
        col32 = jax.ShapeDtypeStruct(G.shape, jnp.float32)
        w, u, Tm = run("fwd", "wy_t", (like(k), like(v), tm), k, v, G, beta)
        h = run("fwd", "fused_h", (like(v), like(v), state, final), q, k, w, u, gates("fwd", "fused_h"), h0, cstart, ccount, scale=s)[2]
        # the forward from the gate-free inverse: T0 (input dtype) and, where the programs take them so, the
        # chunk's G, beta (and 1 / |q|, 1 / |k|) as rows `gr [NT, H, R, 64]`
        t0 = jax.ShapeDtypeStruct((NT, H, 64, 64), dtype)
        rows = lambda R: jax.ShapeDtypeStruct((NT, H, R, 64), jnp.float32)
        t, gr = run("fwd", "inv", (t0, rows(2)), k, G, beta)
        t_l2, gr_l2 = run("fwd", "inv_l2", (t0, rows(4)), q, k, G, beta)
        calls = {
            "wy_t": ((like(k), like(v), tm), (k, v, G, beta), {}),
            "wy": ((like(k), like(v)), (k, v, G, beta), {}),
            "fused_h": ((like(v), like(v), state, final), (q, k, w, u, gates("fwd", "fused_h"), h0, cstart, ccount), {"scale": s}),
            "fused": ((like(v), like(v), final), (q, k, w, u, gates("fwd", "fused"), h0, cstart, ccount), {"scale": s}),
            "inv": ((t0, rows(2)), (k, G, beta), {}),
            "fused_t": ((like(v), final), (q, k, v, t, gr, h0, cstart, ccount), {"scale": s}),
            # use_qk_l2norm_in_kernel folded into the kernels (q and k here are already unit rows or near)
            "inv_l2": ((t0, rows(4)), (q, k, G, beta), {}),
            "fused_t_l2": ((like(v), final), (q, k, v, t_l2, gr_l2, h0, cstart, ccount), {"scale": s}),
            "dh": ((state, final, like(v)), (q, k, w, do, gates("bwd", "dh"), h0, cstart, ccount), {"scale": s}),
            "dqkvg": ((like(q), like(k), split(G)), (q, k, v, G, h, do, h), {"scale": s}),  # v standing in for v_new (no dv)
            "norm": ((like(q), col32), (q,), {}),
            "norm_bwd": (like(q), (q, G, do), {}),
            "wy_bwd": ((like(k), like(v), col32, col32), (k, v, G, beta, Tm, h, u, k), {}),
        }
        # the training forward's WY kernel (dispatched at K <= 128; an experiment at 256) and the consumer, where built
        calls["wy_t_l2"] = ((like(k), like(v), tm, like(q), like(k), col32, col32), (q, k, v, G, beta), {})
        if D <= 128:  # (and the passes carrying states alone: under a gradient, and from the inverse with their maps)
            calls["fused_s"] = ((like(v), like(v), final), (q, k, w, u, gates("fwd", "fused_s"), h0, cstart, ccount), {"scale": s})
            maps = (final, jax.ShapeDtypeStruct((B, H, D, D), jnp.float32))
            calls["carry_t"] = (maps, (k, v, t, gr, cstart, ccount), {})
            calls["carry_t_l2"] = (maps, (k, v, t_l2, gr_l2, cstart, ccount), {})
            calls["dqkvg_l2"] = ((like(q), like(k), split(G)), (q, k, v, G, h, do, h, r), {"scale": s})
        calls["wy_bwd_l2"] = ((like(k), like(v), col32, col32), (k, v, G, beta, Tm, h, u, k, r), {})
        if D <= 128:  # the consumer and the WY VJP in one program (G, beta and r as per-chunk rows; u standing in for du)
            grads = (like(q), like(k), like(v), col32, col32)
            rows_of = lambda *a: tuple(common.gate_rows(x, 64) for x in a)
            calls["grads"] = (grads, (q, k, v, v, *rows_of(G, beta), Tm, h, do, h, u), {"scale": s})
            calls["grads_l2"] = (grads, (q, k, v, v, *rows_of(G, beta), Tm, h, do, h, u, *rows_of(r, r)), {"scale": s})
        # the state passes from the inverse in V blocks of 32 take their V-64 twins' inputs
        calls |= {f"{n}_v32": calls[n] for n in ("fused_t", "fused_t_l2") if n in calls}
        f32 = lambda a: a.astype(jnp.float32)
        at = lambda prec: tb.configured(p, tb.Config(vjp_precision=prec))
        local = lambda prec: jax.jit(lambda *a: jax.vjp(lambda *b: delta.chunk_local(at(prec), 64, float(s), *b), *a[:6])[1](a[6:]))
        dw, du = (jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (w, u))
        presets = jax.lax.DotAlgorithmPreset
        for prec in (tb.DEFAULT.vjp_precision, jax.lax.Precision.HIGHEST, presets.BF16_BF16_F32_X6, presets.BF16_BF16_F32)[: 4 * xla]:
            name = getattr(prec, "name", str(prec))
            yield f"xla:local_vjp:{name}", local(prec), (f32(q), f32(k), f32(w), f32(u), G, h, f32(do), f32(h))
            yield f"xla:wy_vjp:{name}", jax.jit(lambda *a, prec=prec: delta.wy_vjp(at(prec), 64, *a)), (Tm, k, v, G, beta, dw, du)
    calls |= {f"{n}_v": calls[n] for n in ("dh", "dqkvg")}  # (the twins taking V on their grid: here at V = K)
    # the recurrent ops' step program: the rows walked token by token, inputs `[B, T, H, .]`, gates per step
    rows = lambda a: a.reshape(B, T, *a.shape[1:])
    step_in = (rows(q), rows(k), rows(v), rows(gk if op == "gla" else steps.reshape(B * T, H)), *((rows(beta),) if op == "delta" else ()), h0)
    calls["step"] = ((like(rows(v)), final), step_in, {"scale": s, "l2norm": np.int32(op == "delta")})
    for direction in ("fwd", "bwd"):
        variant = tb._find_variant(op, direction, dtype, D, D)
        for prog in variant.declared:
            if variant.target(prog) not in tb.registered():  # (experiments: built by `build.py --experiments` only)
                continue
            results, args, attrs = calls[prog.kind]
            config = dict(prog.config)
            if config.get("dg_sum"):  # (the WY VJP adding the consumer's dG, after dk0: G stands in for it)
                args = (*args[:8], G, *args[8:])
            named = interface(variant, prog).bind(args)
            if op != "gla" and "g" in named:  # the scalar gates as this program takes them: per step (`g_scan`), as
                # per-chunk rows (`g_rows`), or as its kind takes them
                named["g"] = steps.reshape(B * T, H) if config.get("g_scan") else common.gate_rows(G, 64) if config.get("g_rows") else named["g"]
            if config.get("g_rows"):  # (and beta, 1 / |x| beside them)
                named |= {n: common.gate_rows(named[n], 64) for n in ("beta", "rq", "rk") if n in named and named[n].ndim == 2}
            args = tuple(named.values())
            if config.get("g_scan") and prog.kind.startswith("wy_t"):  # (the WY kernel summing the gates also writes G, its rows)
                results = (*results, jax.ShapeDtypeStruct((B * T, H), jnp.float32), jax.ShapeDtypeStruct((B * T // 64, H, 64), jnp.float32))
            yield f"{direction}:{prog.name}", _kernel(p, variant.target(prog), results, attrs, interface(variant, prog)), args
    if op == "gla":  # gates strong enough that every chunk takes the exact (sub-chunk) path, and none (every chunk wide)
        for label, factor in (("strong", 100.0), ("zero", 0.0)):
            a_x, G_x = run("fwd", "a", am, q, k, gk * factor, scale=s)[:2]
            for direction, name, args in (("fwd", "a", (q, k, gk * factor)), ("bwd", "dqkvg", (q, k, v, G_x, a_x, h, do, h))):
                results, _, attrs = calls[name]
                yield f"{direction}:{name}@{label}", _kernel(p, plan.targets(p, direction, D, D)[name], results, attrs), args


def interface(variant, prog) -> runtime.Interface:
    """Program `prog`'s interface as the build recorded it (`runtime.interfaces`); for an experiment this install did
    not build (the emulated tests run them), that of a built program of its kind (at any head dim: the names do not
    depend on it), with the consumer's `dg0` after `dk0` where it adds that (`dg_sum`)."""
    interfaces = runtime.interfaces()
    found = interfaces.get(variant.target(prog))
    if found is not None:
        return found
    found = next(i for t, i in interfaces.items() if t.startswith(f"fla_{variant.op}_{variant.direction}_")
                 and t.rsplit("_c64_", 1)[1] == prog.kind)
    names = [q.name for q in found.inputs]
    if dict(prog.config).get("dg_sum") and "dg0" not in names:
        at = names.index("dk0") + 1
        found = found._replace(inputs=(*found.inputs[:at], runtime.Param("dg0", "float32", ()), *found.inputs[at:]))
    return found


def _kernel(p, target, results, attrs, interface=None):
    """One program of call `p` as a jitted call of its inputs, given in the order of its interface (the built one
    where None)."""
    bind = (interface or runtime.interfaces()[target]).bind
    return jax.jit(lambda *a: runtime.call(p, target, results, **bind(a), **attrs))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x4096x16x128,2x8192x16x128,4x4096x8x256,8x2048x16x64")
    ap.add_argument("--ops", default="simple_gla", help="comma-separated: simple_gla, gla, delta")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-xla", action="store_true", help="delta: skip the XLA parts of the backward")
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        B, T, H, D = (int(n) for n in shape.split("x"))
        for op in args.ops.split(","):
            for name, fn, a in programs(B, T, H, D, op=op, xla=not args.no_xla):
                row = {"shape": shape, "op": op, "program": name}
                try:
                    row["ms"] = round(_jax_time(fn, a), 4)
                except Exception as e:  # noqa: BLE001  (a refused launch is a row, not the end of the run)
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
