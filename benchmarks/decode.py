"""Times one decode step of the recurrent ops (T = 1, the state carried, donated so it updates in place)
against the bytes the step must move: the float32 state read and written once, `2 B H K V 4` bytes, plus
q, k, v and the gates; against jla 0.1.0's step (`jla.ops.linear_attention` at T = 1 with the state, what
its layers' `step` runs): our step program (`backend="tilelang"`) and our XLA step (`backend="xla"`, what "auto"
runs), in one process, interleaved rounds, medians. A step is timed inside one jitted
loop of `--steps` steps (as generation runs it: no host dispatch a token). Prints ms a step and the
achieved bandwidth.

    python benchmarks/decode.py --ops gdn,simple_gla --batches 1,8,64 --dims 16x128x128,8x256x512
    python build.py --experiments x_step_mb && python benchmarks/decode.py --ops gla --alt x_step_mb --dims 16x128x128
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import fla_jax

OPS = {"gdn": "gated_delta_rule", "delta": "delta_rule", "simple_gla": "simple_gla", "gla": "gla"}


def loop(step, n: int):
    """`n` steps of `step` in one jitted loop, the state carried (donated), o summed so that it is computed."""
    def f(state, q, k, v, g, beta):
        def body(_, c):
            state, acc = c
            o, state = step(state, q, k, v, g, beta)
            return state, acc + o.astype(jnp.float32)
        return jax.lax.fori_loop(0, n, body, (state, jnp.zeros(v.shape, jnp.float32)))[::-1]
    return jax.jit(f, donate_argnums=0)


def step_fn(op: str, backend: str = "auto"):
    """`(state, q, k, v, g, beta) -> (o, state)` of one op's decode step on `backend` ("tilelang": the step
    program; "auto" and "xla": XLA's step)."""
    def f(state, q, k, v, g, beta):
        kw = dict(initial_state=state, output_final_state=True, backend=backend)
        if op == "gated_delta_rule":
            o, s = fla_jax.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, use_qk_l2norm_in_kernel=True, **kw)
        elif op == "delta_rule":
            o, s = fla_jax.fused_recurrent_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True, **kw)
        elif op == "simple_gla":
            o, s = fla_jax.fused_recurrent_simple_gla(q, k, v, g, **kw)
        else:
            o, s = fla_jax.fused_recurrent_gla(q, k, v, jnp.broadcast_to(g[..., None], q.shape), **kw)
        return o, s
    return f


def jla_step_fn(op: str):
    """jla's step of the same op (its `auto` implementation), or None where jla is not installed."""
    try:
        from jla import ops
    except ImportError:
        return None
    kind = {"gated_delta_rule": "gated_deltanet", "delta_rule": "deltanet", "simple_gla": "simple_gla", "gla": "gla"}[op]

    def f(state, q, k, v, g, beta):
        kw = {"g": g} if op in ("gated_delta_rule", "simple_gla") else {"g": jnp.broadcast_to(g[..., None], q.shape)} if op == "gla" else {}
        if op in ("gated_delta_rule", "delta_rule"):
            kw.update(beta=beta, use_qk_l2norm=True)
        return ops.linear_attention(kind, q, k, v, initial_state=state, output_final_state=True, **kw)
    return f


def bench(op: str, B: int, H: int, K: int, V: int, steps: int, reps: int = 7, alts: tuple[str, ...] = ()) -> dict[str, float]:
    """{implementation: median ms a step}, the implementations timed in interleaved rounds; `alts`: built experiments
    of the step program (`build.py --experiments NAME`), each as one more implementation `tilelang@NAME`."""
    rng = np.random.default_rng(0)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = bf(B, 1, H, K), bf(B, 1, H, K), bf(B, 1, H, V)
    g = jnp.asarray(-rng.uniform(0, 0.1, (B, 1, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, 1, H)), jnp.float32)
    fns = {"fla_jax:tilelang": step_fn(op, "tilelang"), "fla_jax:xla": step_fn(op, "xla"), "jla": jla_step_fn(op)}
    key = "delta" if op.endswith("delta_rule") else op
    for name in alts:
        fns[f"tilelang@{name}"] = step_fn(op, fla_jax.TileLangConfig(experiments=(((key, "fwd", "step"), name),)))
    fns = {name: loop(f, steps) for name, f in fns.items() if f is not None}
    states = {name: jnp.zeros((B, H, K, V), jnp.float32) for name in fns}
    for name, f in fns.items():
        for _ in range(2):
            _, states[name] = f(states[name], q, k, v, g, beta)
        jax.block_until_ready(states[name])
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            _, states[name] = f(states[name], q, k, v, g, beta)
            jax.block_until_ready(states[name])
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def moved_bytes(B: int, H: int, K: int, V: int) -> int:
    """What a step must move: the float32 state read and written, q, k, v in and o out (bf16), the gates."""
    return 2 * B * H * K * V * 4 + 2 * (2 * B * H * K + 2 * B * H * V) + 8 * B * H


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gdn,simple_gla")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dims", default="16x128x128,8x256x512", help="HxKxV[,...]")
    ap.add_argument("--steps", type=int, default=256, help="steps in the timed loop")
    ap.add_argument("--alt", default="", help="built experiments of the step program (NAME[,NAME]), timed beside it")
    args = ap.parse_args()
    alts = tuple(a for a in args.alt.split(",") if a)
    print(f"device: {jax.devices()[0].device_kind}")
    print("| op | B | H,K,V | bytes a step | step program ms (GB/s) | XLA ms (GB/s) | jla ms (GB/s) | program vs jla | vs XLA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in args.ops.split(","):
        for dims in args.dims.split(","):
            H, K, V = map(int, dims.split("x"))
            for B in map(int, args.batches.split(",")):
                ms = bench(OPS[op], B, H, K, V, args.steps, alts=alts)
                moved = moved_bytes(B, H, K, V)
                cell = lambda n: f"{ms[n]:.4f} ({moved / (ms[n] * 1e-3) / 1e9:.0f})" if n in ms else "-"
                ratio = lambda n: f"{ms[n] / ms['fla_jax:tilelang']:.2f}x" if n in ms else "-"
                print(f"| {op} | {B} | {H},{K},{V} | {moved / 1e6:.1f} MB | {cell('fla_jax:tilelang')} | {cell('fla_jax:xla')} | {cell('jla')} | "
                      f"{ratio('jla')} | {ratio('fla_jax:xla')} |" + "".join(f" {n}: {cell(n)} |" for n in ms if "@" in n), flush=True)


if __name__ == "__main__":
    main()
