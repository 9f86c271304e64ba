"""A training step (value_and_grad of sum(o * do), bf16) of each op at B = 1, H = 16, K = V = 128 and very long T on one
GPU: its temp memory (`memory_analysis().temp_size_in_bytes`, which must grow linearly in T), that it runs, and its
time. Inputs drawn on the device (bench.py's NumPy inputs would take minutes at 2^20 tokens).

    python benchmarks/long_memory.py --ops gdn,delta_rule,simple_gla,gla --logt 18,19,20
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from bench import ALIASES, _jax_fns


def step_of(impl: str, op: str, T: int, H: int = 16, D: int = 128):
    """(jitted training step, its inputs) of `impl` for `op` at B = 1, T, H, K = V = D."""
    keys = jax.random.split(jax.random.key(0), 6)
    bf = lambda key, *s: jax.random.normal(key, s, jnp.bfloat16)
    q, k, v, do = (bf(keys[i], 1, T, H, D) for i in range(4))
    g = beta = None
    if op == "gla":
        g = jax.nn.log_sigmoid(jax.random.normal(keys[4], (1, T, H, D), jnp.float32)) / 16
    elif op in ("simple_gla", "gated_delta_rule"):
        g = jax.nn.log_sigmoid(jax.random.normal(keys[4], (1, T, H), jnp.float32))
    if op in ("delta_rule", "gated_delta_rule"):
        beta = jax.nn.sigmoid(jax.random.normal(keys[5], (1, T, H), jnp.float32))
    call = _jax_fns(impl, op, None, None)
    argnums = (0, 1, 2) + ((3,) if g is not None else ()) + ((4,) if beta is not None else ())
    step = jax.jit(jax.value_and_grad(lambda q, k, v, g, beta: jnp.sum(call(q, k, v, g, beta).astype(jnp.float32) * do), argnums=argnums))
    return step, (q, k, v, g, beta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gdn,delta_rule,simple_gla,gla")
    ap.add_argument("--logt", default="18,19,20")
    ap.add_argument("--impl", default="fla_jax:tilelang")
    args = ap.parse_args()
    print("| op | T | temp MB | MB per 2^18 tokens | step ms |\n|---|---|---|---|---|")
    for op in args.ops.split(","):
        op = ALIASES.get(op, op)
        for logt in (int(n) for n in args.logt.split(",")):
            T = 2**logt
            step, xs = step_of(args.impl, op, T)
            compiled = step.lower(*xs).compile()  # (run as compiled: the jitted function would compile again)
            temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
            jax.block_until_ready(compiled(*xs))  # (that it runs)
            t0 = time.perf_counter()
            for _ in range(3):
                out = compiled(*xs)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t0) / 3 * 1e3
            print(f"| {op} | 2^{logt} | {temp:.0f} | {temp / 2 ** (logt - 18):.0f} | {ms:.1f} |", flush=True)
            del step, compiled, xs, out


if __name__ == "__main__":
    main()
