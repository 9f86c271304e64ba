"""Times fwd and fwd+bwd of fla_jax's backends beside fla's Triton kernels and
jax-linear-attention's kernels, in one process, and prints a table (JSON with --json).

    python benchmarks/bench.py --ops simple_gla,gdn --shapes 4x4096x16x128 --impls fla_jax:xla,jla:mosaic_gpu,fla

(`fla_jax:tilelang+options`: GDN with fla's gate options, g raw and beta as logits, A_log and dt_bias fixed.)

Inputs: bf16 q/k/v, float32 gates, K = V = D, no initial state; the delta rules take
`use_qk_l2norm_in_kernel=True` (jla's `use_qk_l2norm=True`) in every library. JAX timings: the
median over 10 repetitions of (10 back-to-back calls, then `block_until_ready`) / 10, after
warm-up, fwd+bwd = `jax.value_and_grad` of `sum(o * do)`; torch timings: `triton.testing.do_bench` median.
With `--rounds R` the JAX implementations of an op and shape are compiled first, then timed in turn R
times (so a drift of the GPU's clock falls on all alike): each the median of all its samples, and beside
it the median over rounds of its time divided by the first implementation's in the same round. fla's gated backward is refused on
Triton < 3.7.1 on Hopper (its issue #640); `--lift-fla-check` lifts that for timing only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import numpy as np

OPS = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
ALIASES = {"gdn": "gated_delta_rule", "delta": "delta_rule"}
ISSUE_SHAPES = ((4, 4096, 16, 128), (2, 8192, 16, 128), (4, 4096, 8, 256), (8, 2048, 16, 64))


def parse_shape(text: str) -> tuple[int, ...]:
    """`BxTxHxD` (K = V = D), `BxTxHxKxV`, or `BxTxHxKxVxHV` (HV value heads, GDN's grouped heads)."""
    shape = tuple(int(n) for n in text.split("x"))
    if len(shape) not in (4, 5, 6):
        raise ValueError(f"a shape is BxTxHxD, BxTxHxKxV or BxTxHxKxVxHV, got {text!r}")
    return shape


def dims(shape) -> tuple[int, int, int, int, int, int]:
    """`(B, T, H, K, V, HV)` of a benchmark shape."""
    B, T, H, K, *rest = shape
    V = rest[0] if rest else K
    return B, T, H, K, V, rest[1] if len(rest) > 1 else H


def make_inputs(op, *shape, seed=0):
    B, T, H, K, V, HV = dims(shape)
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((B, T, H, K), np.float32),
        "k": rng.standard_normal((B, T, H, K), np.float32),
        "v": rng.standard_normal((B, T, HV, V), np.float32),
        "do": rng.standard_normal((B, T, HV, V), np.float32),
    }
    logsig = lambda a: -np.logaddexp(0, -a)
    if op == "gla":
        x["g"] = (logsig(rng.standard_normal((B, T, H, K))) / 16).astype(np.float32)
    elif op in ("simple_gla", "gated_delta_rule"):
        x["g"] = logsig(rng.standard_normal((B, T, HV))).astype(np.float32)
    if op in ("delta_rule", "gated_delta_rule"):
        x["beta"] = (1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))).astype(np.float32)
    return x


# ----------------------------------------------------------------------------- JAX side


def _jax_samples(fn, args, reps=10, inner=10):
    """`reps` samples (ms a call) of `inner` back-to-back calls, after two warm-up calls."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return times


def _jax_time(fn, args, reps=10, inner=10):
    return statistics.median(_jax_samples(fn, args, reps, inner))


def _jax_fns(impl, op, config=None, segment_ids=None):
    """`(call(q, k, v, g, beta) -> o, names of differentiable gates)` for one JAX implementation; `config`:
    fla_jax's tilelang backend so configured (a `fla_jax.TileLangConfig`); `segment_ids`: packed rows."""
    seg = {} if segment_ids is None else {"segment_ids": segment_ids}

    lib, _, backend = impl.partition(":")
    backend, _, options = backend.partition("+")
    if lib == "fla_jax" and backend == "tilelang" and config is not None:
        backend = config
    if lib == "fla_jax" and options == "options":  # GDN with fla's gate options (`g` raw, `beta` logits)
        import fla_jax
        import jax.numpy as jnp

        if op != "gated_delta_rule":
            raise ValueError(f"{impl}: the gate options are GDN's")

        def gdn(q, k, v, g, beta):
            HV = v.shape[2]
            A_log, dt_bias = jnp.log(jnp.linspace(1.0, 16.0, HV)), jnp.linspace(-1.0, 1.0, HV)
            return fla_jax.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend,
                                                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                                  use_beta_sigmoid_in_kernel=True)[0]

        return gdn
    if lib == "fla_jax":
        import fla_jax

        f = {
            "simple_gla": lambda q, k, v, g, beta: fla_jax.chunk_simple_gla(q, k, v, g, backend=backend, **seg),
            "gla": lambda q, k, v, g, beta: fla_jax.chunk_gla(q, k, v, g, backend=backend, **seg),
            "delta_rule": lambda q, k, v, g, beta: fla_jax.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True, backend=backend,
                                                                            **seg),
            "gated_delta_rule": lambda q, k, v, g, beta: fla_jax.chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend, **seg
            ),
        }[op]
        return lambda *a: f(*a)[0]
    if lib == "jla":
        from jla import ops

        kind = {"simple_gla": "simple_gla", "gla": "gla", "delta_rule": "deltanet", "gated_delta_rule": "gated_deltanet"}[op]

        def f(q, k, v, g, beta):
            kw = dict(seg)
            if g is not None:
                kw["g"] = g
            if beta is not None:
                kw["beta"] = beta
                kw["use_qk_l2norm"] = True
            return ops.linear_attention(kind, q, k, v, impl=backend, **kw)[0]

        return f
    raise ValueError(f"unknown JAX implementation {impl!r}")


def _compiled_step(impl, op, shape):
    """`jax_step` of `impl` (`fla_jax:tilelang@NAME`: configured as `--alt NAME=SPEC` says), its
    forward and training step traced and compiled under that configuration (later calls reuse them)."""
    base, _, alt = impl.partition("@")
    fwd, fwdbwd, args = jax_step(base, op, shape, _alternative(ALTERNATIVES.get(alt, "")))
    _jax_samples(fwd, args, reps=1, inner=1)
    _jax_samples(fwdbwd, args, reps=1, inner=1)
    return fwd, fwdbwd, args


def bench_jax(impl, op, shape):
    fwd, fwdbwd, args = _compiled_step(impl, op, shape)
    return _jax_time(fwd, args), _jax_time(fwdbwd, args)


def temp_mb(fn, args) -> float:
    """The scratch memory XLA plans for a jitted function (`memory_analysis().temp_size_in_bytes`), MB."""
    return round(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e6, 1)


def bench_jax_rounds(impls, op, shape, rounds):
    """Rows for JAX implementations `impls` of one op and shape timed in turn `rounds` times
    (`--rounds`), each compiled first under its configuration: `fwd_ms` / `fwdbwd_ms` the median of
    all its samples, `fwd_ratio` / `fwdbwd_ratio` the median over rounds of its round median divided by
    the first implementation's."""
    steps, rows = {}, {}
    for impl in impls:
        try:
            steps[impl] = _compiled_step(impl, op, shape)
        except Exception as e:  # noqa: BLE001  (an unsupported combination is a row, not a crash)
            traceback.print_exc(limit=2)
            rows[impl] = {"impl": impl, "op": op, "shape": shape, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    samples = {impl: ([], []) for impl in steps}
    per_round = {impl: ([], []) for impl in steps}
    for _ in range(rounds):
        for impl, (fwd, fwdbwd, args) in steps.items():
            for d, fn in enumerate((fwd, fwdbwd)):
                ms = _jax_samples(fn, args)
                samples[impl][d].extend(ms)
                per_round[impl][d].append(statistics.median(ms))
    first = next(iter(steps), None)
    for impl in steps:
        ratio = lambda d, impl=impl: statistics.median(a / b for a, b in zip(per_round[impl][d], per_round[first][d]))
        rows[impl] = {"impl": impl, "op": op, "shape": shape, "fwd_ms": round(statistics.median(samples[impl][0]), 4),
                      "fwdbwd_ms": round(statistics.median(samples[impl][1]), 4), "fwd_ratio": round(ratio(0), 4),
                      "fwdbwd_ratio": round(ratio(1), 4), "rounds": rounds, "step_temp_mb": temp_mb(steps[impl][1], steps[impl][2])}
    return [rows[impl] for impl in impls]


# `--alt NAME=SPEC`: the tilelang backend configured otherwise, timed in the same process as `fla_jax:tilelang@NAME`
ALTERNATIVES: dict[str, str] = {}


def add_alternatives(alts):
    """`ALTERNATIVES` from `--alt NAME=SPEC` arguments (bench.py's, profile_op.py's)."""
    for alt in alts:
        name, _, spec = alt.partition("=")
        ALTERNATIVES[name] = spec


def _override(item: str, option: str):
    """`(op, direction, program), experiment` of an `op.direction.program=experiment` entry of `option`."""
    where, _, name = item.partition("=")
    if len(where.split(".")) != 3 or not name:
        raise ValueError(f"{option}: {item!r} is not op.direction.program=experiment")
    return tuple(where.split(".")), name


# The tilelang configuration that bench.py's flags (--experiments, --xla-zeros, ...) set, before any `--alt`.
BASE_CONFIG = None


def _alternative(spec: str):
    """The tilelang backend's `TileLangConfig` as `spec` changes `BASE_CONFIG`: comma-separated `xla-zeros`
    (zero_row_h0, zero_row_dht off), `+field` / `-field` (a boolean field on or off, or one of head dims at
    all or none, e.g. `-delta_grads_kernel`), `field=N` (an integer field, e.g. `split_programs=0`) and
    `op.direction.program=experiment` entries."""
    if not spec:
        return BASE_CONFIG
    import dataclasses

    from fla_jax import TileLangConfig
    from fla_jax import _variants as variants

    cfg = BASE_CONFIG or TileLangConfig()
    for item in filter(None, spec.split(",")):
        if item == "xla-zeros":
            cfg = dataclasses.replace(cfg, zero_row_h0=False, zero_row_dht=False)
        elif item[0] in "+-":  # (a switch of head dims: all of them, or none)
            name = item[1:].lower()
            value = getattr(cfg, name, None)
            if not isinstance(value, (bool, tuple)):
                raise ValueError(f"--alt: {item[1:]!r} is not a boolean or head-dims field of fla_jax.TileLangConfig")
            on = item[0] == "+"
            cfg = dataclasses.replace(cfg, **{name: on if isinstance(value, bool) else tuple(variants.HEAD_DIMS) if on else ()})
        elif "." not in item.partition("=")[0]:
            name, _, value = item.partition("=")
            if not isinstance(getattr(cfg, name, None), int) or isinstance(getattr(cfg, name), bool):
                raise ValueError(f"--alt: {name!r} is not an integer field of fla_jax.TileLangConfig")
            cfg = dataclasses.replace(cfg, **{name: int(value)})
        else:
            key, name = _override(item, "--alt (or xla-zeros)")
            cfg = dataclasses.replace(cfg, experiments=(*cfg.experiments, (key, name)))
    return cfg


def jax_step(impl, op, shape, config=None):
    """`(fwd, fwdbwd, args)`: the jitted forward and training step (loss and gradients) of one
    JAX implementation on the benchmark's inputs; `IMPL~segN` (`fla_jax:tilelang~seg8`, `jla:mosaic_gpu~seg8`):
    each row packed as N equal segments (`segment_ids`)."""
    import jax
    import jax.numpy as jnp

    impl, _, nseg = impl.partition("~seg")
    segment_ids = None
    if nseg:
        B, T = shape[0], shape[1]
        segment_ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) * int(nseg) // T, (B, T))
    x = make_inputs(op, *shape)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    q, k, v, do = bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["do"])
    g = None if "g" not in x else jnp.asarray(x["g"])
    beta = None if "beta" not in x else jnp.asarray(x["beta"])
    call = _jax_fns(impl, op, config, segment_ids)
    fwd = jax.jit(call)
    argnums = (0, 1, 2) + ((3,) if g is not None else ()) + ((4,) if beta is not None else ())
    # value_and_grad: a training step needs the loss, so the forward output is computed too (with
    # grad alone XLA may drop a forward kernel whose output only feeds the loss)
    fwdbwd = jax.jit(
        jax.value_and_grad(lambda q, k, v, g, beta: jnp.sum(call(q, k, v, g, beta).astype(jnp.float32) * do), argnums=argnums)
    )
    return fwd, fwdbwd, (q, k, v, g, beta)


# ----------------------------------------------------------------------------- torch side


def bench_fla(op, shape, lift):
    import torch
    import triton

    if lift:
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    x = make_inputs(op, *shape)
    dev = "cuda"
    t = lambda a, dt=torch.bfloat16: torch.tensor(a, device=dev, dtype=dt).requires_grad_(True)
    q, k, v = t(x["q"]), t(x["k"]), t(x["v"])
    do = torch.tensor(x["do"], device=dev, dtype=torch.bfloat16)
    g = t(x["g"], torch.float32) if "g" in x else None
    beta = t(x["beta"], torch.float32) if "beta" in x else None
    call = {
        "simple_gla": lambda: chunk_simple_gla(q, k, v, g),
        "gla": lambda: chunk_gla(q, k, v, g),
        "delta_rule": lambda: chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True),
        "gated_delta_rule": lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True),
    }[op]
    leaves = [a for a in (q, k, v, g, beta) if a is not None]

    def fwd():
        with torch.no_grad():
            call()

    def fwdbwd():
        o, _ = call()
        o.backward(do)

    ms_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    ms_b = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    return ms_f, ms_b


# ----------------------------------------------------------------------------- driver


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--shapes", default="issue", help="'issue' or BxTxHxD[,...] (also BxTxHxKxV, BxTxHxKxVxHV)")
    ap.add_argument("--impls", default="fla_jax:xla,jla:mosaic_gpu,fla")
    ap.add_argument("--lift-fla-check", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--delta-xla-vjps", action="store_true",
                    help="tilelang delta rules: the backward's parallel parts as XLA VJPs (delta_fused_bwd, delta_wy_bwd_kernel off)")
    ap.add_argument("--delta-fwd-wy", action="store_true",
                    help="tilelang delta rules: the forward with no gradient through the WY kernel's w and u (delta_fwd_inverse off)")
    ap.add_argument("--delta-fwd-inverse", default=None, metavar="K,K",
                    help="tilelang delta rules: the head dims whose forward with no gradient is the inverse's (delta_fwd_inverse)")
    ap.add_argument("--xla-zeros", action="store_true",
                    help="tilelang: XLA's zero states for the passes where a call has no initial state or the loss takes no final "
                         "state (zero_row_h0, zero_row_dht off; by default the passes get no rows and start from zeros)")
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=SPEC",
                    help="tilelang configured otherwise (comma-separated xla-zeros, +SWITCH / -SWITCH, op.direction.program=experiment), timed "
                         "in the same process as the implementation fla_jax:tilelang@NAME (name it in --impls)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: the JAX implementations of each op and shape timed in turn this many times (fla apart)")
    ap.add_argument("--experiments", default="",
                    help="tilelang: op.direction.program=experiment[,...] runs a built experiment in that program's place")
    args = ap.parse_args(argv)
    add_alternatives(args.alt)

    global BASE_CONFIG
    base = {}
    try:
        if args.experiments:
            base["experiments"] = tuple(_override(item, "--experiments") for item in filter(None, args.experiments.split(",")))
    except ValueError as e:
        ap.error(str(e))
    if args.xla_zeros:
        base |= {"zero_row_h0": False, "zero_row_dht": False}
    if args.delta_xla_vjps:
        base |= {"delta_fused_bwd": False, "delta_wy_bwd_kernel": False}
    if args.delta_fwd_inverse is not None:
        base["delta_fwd_inverse"] = tuple(int(d) for d in filter(None, args.delta_fwd_inverse.split(",")))
    if args.delta_fwd_wy:
        base["delta_fwd_inverse"] = ()
    if base:  # (none given: `backend="tilelang"` as a string, which an older build of fla_jax takes too)
        from fla_jax import TileLangConfig

        BASE_CONFIG = TileLangConfig(**base)
    ops = [ALIASES.get(o, o) for o in args.ops.split(",")]
    shapes = ISSUE_SHAPES if args.shapes == "issue" else [parse_shape(s) for s in args.shapes.split(",")]
    impls = args.impls.split(",")
    rows = []

    def add(*new_rows):  # printed, and the JSON rewritten as each op and shape is done (a run cut short keeps them)
        for row in new_rows:
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)

    if args.rounds > 1:  # interleaved: the JAX implementations per op and shape, fla after them as before
        for op in ops:
            for shape in shapes:
                add(*bench_jax_rounds([i for i in impls if i != "fla"], op, shape, args.rounds))
    for impl in impls if args.rounds == 1 else [i for i in impls if i == "fla"]:  # fla last: its autotuning is slow
        for op in ops:
            for shape in shapes:
                try:
                    f, b = bench_fla(op, shape, args.lift_fla_check) if impl == "fla" else bench_jax(impl, op, shape)
                    row = {"impl": impl, "op": op, "shape": shape, "fwd_ms": round(f, 4), "fwdbwd_ms": round(b, 4)}
                except Exception as e:  # noqa: BLE001  (an unsupported combination is a row, not a crash)
                    traceback.print_exc(limit=2)
                    row = {"impl": impl, "op": op, "shape": shape, "error": f"{type(e).__name__}: {str(e)[:160]}"}
                add(row)
    print("\n| op | B,T,H,D | " + " | ".join(f"{i} fwd | {i} fwd+bwd" for i in impls) + " |")
    print("|---|---|" + "---|---|" * len(impls))
    for op in ops:
        for shape in shapes:
            cells = []
            for impl in impls:
                r = next(r for r in rows if r["impl"] == impl and r["op"] == op and r["shape"] == shape)
                if "error" in r:
                    cells += ["-", "-"]
                elif "fwd_ratio" in r and impl != impls[0]:  # (--rounds: and the paired ratio to the first)
                    cells += [f"{r['fwd_ms']:.3f} ({r['fwd_ratio']:.3f}x)", f"{r['fwdbwd_ms']:.3f} ({r['fwdbwd_ratio']:.3f}x)"]
                else:
                    cells += [f"{r['fwd_ms']:.3f}", f"{r['fwdbwd_ms']:.3f}"]
                if "step_temp_mb" in r:  # (--rounds: the training step's scratch memory)
                    cells[-1] += f" [{r['step_temp_mb']:.0f} MB]"
            print(f"| {op} | {','.join(map(str, shape))} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
