"""Times one decode step of the recurrent ops (T = 1, the state carried, donated so it updates in place)
against the bytes the step must move: the float32 state read and written once, `2 B H K V 4` bytes, plus
q, k, v and the gates. Prints ms a step and the achieved bandwidth.

    python benchmarks/decode.py --ops gdn,simple_gla --batches 1,8,64 --dims 16x128x128,8x256x512
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


def step_fn(op: str):
    """`(state, q, k, v, g, beta) -> (o, state)` of one op's decode step."""
    def f(state, q, k, v, g, beta):
        if op == "gated_delta_rule":
            o, s = fla_jax.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True)
        elif op == "delta_rule":
            o, s = fla_jax.fused_recurrent_delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        elif op == "simple_gla":
            o, s = fla_jax.fused_recurrent_simple_gla(q, k, v, g, initial_state=state, output_final_state=True)
        else:
            o, s = fla_jax.fused_recurrent_gla(q, k, v, jnp.broadcast_to(g[..., None], q.shape), initial_state=state, output_final_state=True)
        return o, s
    return jax.jit(f, donate_argnums=0)


def bench(op: str, B: int, H: int, K: int, V: int, reps: int = 20, inner: int = 50) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = bf(B, 1, H, K), bf(B, 1, H, K), bf(B, 1, H, V)
    g = jnp.asarray(-rng.uniform(0, 0.1, (B, 1, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, 1, H)), jnp.float32)
    state = jnp.zeros((B, H, K, V), jnp.float32)
    f = step_fn(op)
    for _ in range(3):
        _, state = f(state, q, k, v, g, beta)
    jax.block_until_ready(state)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            o, state = f(state, q, k, v, g, beta)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / inner)
    ms = statistics.median(times) * 1e3
    moved = 2 * B * H * K * V * 4 + 2 * (2 * B * H * K + 2 * B * H * V) + 8 * B * H
    return ms, moved / (ms * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gdn,simple_gla")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dims", default="16x128x128,8x256x512", help="HxKxV[,...]")
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}")
    print("| op | B | H,K,V | ms / step | state bytes moved | GB/s |")
    print("|---|---|---|---|---|---|")
    for op in args.ops.split(","):
        for dims in args.dims.split(","):
            H, K, V = map(int, dims.split("x"))
            for B in map(int, args.batches.split(",")):
                ms, gbs = bench(OPS[op], B, H, K, V)
                print(f"| {op} | {B} | {H},{K},{V} | {ms:.4f} | {2 * B * H * K * V * 4 / 1e6:.1f} MB | {gbs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
