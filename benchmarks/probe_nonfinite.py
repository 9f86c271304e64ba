"""Where a non-finite input reaches on a backend: NaN (or inf) in one step's q, k, v, gate or beta (head 0,
step 40 of the first chunk), and whether outputs before it, or of the other head, change.

    python benchmarks/probe_nonfinite.py [--backend tilelang] [--value nan] [--guard]

Prints one line per op and input: `causal` (nothing before the bad step or in the other head changed;
the steps from it NaN, or for q that step alone) or what leaked. The xla backend's answer is tested
(tests/test_robustness.py); this measures the kernels' (`--guard`: with `TileLangConfig(nonfinite_guard=True)`,
tested in tests/test_tilelang.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cases import OPS, Case, make_inputs, static_kwargs  # noqa: E402

TAKES = {"simple_gla": "qkvg", "gla": "qkvg", "delta_rule": ("q", "k", "v", "beta"), "gated_delta_rule": ("q", "k", "v", "g", "beta")}


def probe(op: str, name: str, backend, value: float, dtype: str) -> str:
    case = Case(op, 1, 130, 2, 64, 64, dtype=dtype, h0=True)
    diff, _ = make_inputs(case, 0)
    run = jax.jit(lambda d: OPS[op](**d, **static_kwargs(case), backend=backend))
    o0, ht0 = (np.asarray(x, np.float32) for x in run(diff))
    bad = dict(diff)
    x = np.asarray(diff[name]).copy()
    x[0, 40, 0] = value
    bad[name] = jnp.asarray(x, diff[name].dtype)
    o, ht = (np.asarray(x, np.float32) for x in run(bad))
    leaks = []
    if not np.array_equal(o[0, :40], o0[0, :40]):
        leaks.append(f"steps before it changed ({int(np.isnan(o[0, :40]).any(axis=-1).sum())} (step, head) rows NaN)")
    if not np.array_equal(o[0, :, 1], o0[0, :, 1]):
        leaks.append("the other head changed")
    after = o[0, 40:, 0] if name != "q" else o[0, 40:41, 0]
    if not np.isnan(after).all():
        leaks.append("not NaN from it on")
    return "causal" if not leaks else "; ".join(leaks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--value", type=float, default=float("nan"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--guard", action="store_true", help="the tilelang backend with nonfinite_guard=True")
    args = ap.parse_args()
    if args.guard:
        import fla_jax

        args.backend = fla_jax.TileLangConfig(nonfinite_guard=True)
    for op, names in TAKES.items():
        for name in names:
            print(f"{'tilelang+guard' if args.guard else args.backend} {op:17s} {name:5s} {args.value}: {probe(op, name, args.backend, args.value, args.dtype)}", flush=True)


if __name__ == "__main__":
    main()
