"""Where the time of one op's fwd+bwd (or, with `--fwd`, its forward) goes on the GPU: runs the
jitted training step (or forward) as bench.py times it under the JAX profiler and sums the device
time of each kernel by name, per step.

    python benchmarks/profile_op.py --op gated_delta_rule --shape 4x4096x16x128 --impl fla_jax:tilelang

The TileLang programs' kernels all show as `main_kernel` (their count per step is the number of
custom calls); everything else is XLA's own (fusions, copies, reductions): the glue. Where the
profile has an "XLA Ops" line (HLO op names), it is summed too.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import tempfile

import jax
from bench import ALIASES, _compiled_step, add_alternatives


def device_events(path: pathlib.Path):
    """(kind, name, duration in us) of every event on the GPU planes of a profile: "kernel" for
    the stream lines' kernels, "op" for the HLO ops of an "XLA Ops" line."""
    xspace = next(path.rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(xspace))
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        print(plane.name, "lines:", [line.name for line in plane.lines])
        for line in plane.lines:
            kind = "op" if "xla ops" in line.name.lower() else "kernel" if "stream" in line.name.lower() else None
            if kind:
                for ev in line.events:
                    yield kind, ev.name, ev.duration_ns / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="gated_delta_rule")
    ap.add_argument("--shape", default="4x4096x16x128")
    ap.add_argument("--impl", default="fla_jax:tilelang")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fwd", action="store_true", help="the forward alone (default: the training step)")
    ap.add_argument("--order", action="store_true", help="also every kernel of the last step in order, with its time")
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=SPEC",
                    help="as bench.py's: tilelang configured otherwise, profiled as --impl fla_jax:tilelang@NAME")
    args = ap.parse_args()
    add_alternatives(args.alt)
    shape = tuple(int(n) for n in args.shape.split("x"))
    # (bench.py's names too: gdn, delta; `fla_jax:tilelang@NAME` traced as --alt NAME=SPEC configures it)
    fwd, step, a = _compiled_step(args.impl, ALIASES.get(args.op, args.op), shape)
    f = fwd if args.fwd else step
    for _ in range(3):
        jax.block_until_ready(f(*a))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(args.steps):
                jax.block_until_ready(f(*a))
        events = list(device_events(pathlib.Path(tmp)))
    if args.order:  # (the last step's kernels: its share of the events, in order)
        kernels = [(name, us) for k, name, us in events if k == "kernel"]
        print(f"{args.op} {args.shape} {args.impl}: the last step's kernels in order (us)")
        for name, us in kernels[-len(kernels) // args.steps:]:
            print(f"{us:9.1f}  {name[:100]}")
    for kind in ("op", "kernel"):
        total = collections.defaultdict(float)
        count = collections.Counter()
        for k, name, us in events:
            if k == kind:
                total[name] += us
                count[name] += 1
        print(f"{args.op} {args.shape} {args.impl} {'fwd' if args.fwd else 'fwd+bwd'}, by {'HLO op' if kind == 'op' else 'kernel'}:")
        print(f"{'us/step':>9} {'calls/step':>10}  name")
        for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"{us / args.steps:9.1f} {count[name] / args.steps:10.1f}  {name[:150]}")
        print(f"{sum(total.values()) / args.steps:9.1f} in all, per step")


if __name__ == "__main__":
    main()
