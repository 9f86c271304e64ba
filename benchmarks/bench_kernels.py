"""Times each TileLang program of the simple GLA pipeline on its own (jit of one custom call,
median of repeated back-to-back calls), so the op-level numbers of bench.py can be split by kernel.

    python benchmarks/bench_kernels.py --shapes 4x4096x16x128,8x2048x16x64
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import _jax_time
from fla_jax import tilelang_backend as tb
from fla_jax._problem import Problem


def programs(B, T, H, D, dtype="bfloat16"):
    """(name, jitted call, args) for every program of the simple GLA forward and backward variants
    (experimental configs included), on the flat chunk layout the backend hands them (B sequences
    of T tokens)."""
    NT = B * T // 64
    rng = np.random.default_rng(0)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    q, k, v, do = (x(B * T, H, D) for _ in range(4))
    G = jnp.cumsum(jnp.asarray(-np.abs(rng.standard_normal((NT, 64, H))) * 0.1, jnp.float32), 1).reshape(B * T, H)
    h0 = jnp.zeros((B, H, D, D), jnp.float32)
    cstart, ccount = jnp.arange(B, dtype=jnp.int32) * (T // 64), jnp.full((B,), T // 64, jnp.int32)
    state = jax.ShapeDtypeStruct((NT, H, D, D), dtype)
    final = jax.ShapeDtypeStruct(h0.shape, jnp.float32)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    s = np.float32(D**-0.5)
    fused_h = tb._targets(Problem(op="simple_gla", delta=False, chunk_size=64, dtype=dtype), "fwd", D, D)["fused_h"]
    h = jax.jit(lambda *a: tb._call(fused_h, (like(v), state, final), *a, scale=s))(q, k, v, G, h0, cstart, ccount)[1]
    calls = {  # program kind: (results, args, attrs)
        "fused_h": ((like(v), state, final), (q, k, v, G, h0, cstart, ccount), {"scale": s}),
        "fused": ((like(v), final), (q, k, v, G, h0, cstart, ccount), {"scale": s}),
        "dh": ((state, final), (q, do, G, h0, cstart, ccount), {"scale": s}),
        "dqkvg": ((like(q), like(k), like(v), like(G)), (q, k, v, G, h, do, h), {"scale": s}),
    }
    for direction in ("fwd", "bwd"):
        variant = tb._find_variant("simple_gla", direction, dtype, D, D)
        for prog in variant.programs:
            kind = next(k for k in calls if prog.name.removeprefix("x_").startswith(k))
            results, args, attrs = calls[kind]
            fn = jax.jit(lambda *a, t=variant.target(prog), r=results, kw=attrs: tb._call(t, r, *a, **kw))
            yield f"{direction}:{prog.name}", fn, args


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x4096x16x128,2x8192x16x128,4x4096x8x256,8x2048x16x64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        B, T, H, D = (int(n) for n in shape.split("x"))
        for name, fn, a in programs(B, T, H, D):
            try:
                rows.append({"shape": shape, "program": name, "ms": round(_jax_time(fn, a), 4)})
            except Exception as e:  # noqa: BLE001  (a refused launch is a row, not the end of the run)
                rows.append({"shape": shape, "program": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
