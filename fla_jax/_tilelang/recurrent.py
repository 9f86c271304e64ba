"""The recurrent ops' token steps on the kernels (`kernels/recurrent/step.py`, program `step` of each op's forward
variant): a dense batch walked token by token, each state read and written once (a decode step is T = 1).
The gradient is XLA's (the VJP of the recurrent ops' scan, `fla_jax.recurrent`): what a decode loop runs
is the forward; a short input under a gradient stays correct."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _partition
from fla_jax._problem import Problem
from fla_jax._tilelang import plan, runtime
from fla_jax._tilelang.config import Config, configured
from fla_jax._variants import HEAD_DIMS, find

V_BLOCK = 32  # the program's V block: V must be a multiple of it


def program(op: str, dtype: str, K: int, config: Config | None = None) -> str | None:
    """The FFI target of the step program that runs for `op` ("simple_gla": a scalar gate, "gla": a gate per key
    channel, "delta": the delta rules with a scalar gate) under `config`: the dispatched one, or the experiment
    `Config.experiments` puts in its place (`plan.targets`); None where none is built."""
    if find(op, "fwd", dtype, K, K) is None:
        return None
    p = configured(Problem(op=op, delta=op == "delta", chunk_size=64, dtype=dtype), config)
    return plan.targets(p, "fwd", K, K).get("step")


def unsupported(op: str, *, dtype: str, K: int, V: int, varlen: bool, reverse: bool, gv: bool, gate_rows: bool) -> str | None:
    """Why the step program cannot take this call, on any machine (None where it can). `reverse` only where it
    matters (T > 1)."""
    if dtype not in ("bfloat16", "float16"):
        return f"the step program is built for bfloat16 and float16 inputs, got {dtype}"
    if K not in HEAD_DIMS:
        return f"the step program is built for K in {HEAD_DIMS}, got K = {K}"
    if V % V_BLOCK:
        return f"the step program takes V in blocks of {V_BLOCK}, got V = {V}"
    if varlen:
        return "the step program walks dense rows, not cu_seqlens (segment_ids it takes)"
    if reverse:
        return "the step program walks the tokens forwards (reverse runs on XLA where T > 1)"
    if gv:
        return "the step program has no value-channel gate gv"
    if gate_rows and op != "gla":
        return "the delta rules' step program takes a scalar gate g, not a gate per key channel gk"
    return None


def missing(op: str, dtype: str, K: int, registered: list[str]) -> str | None:
    """Why this install cannot run a call that `unsupported` takes: its extension lacks the program."""
    target = program(op, dtype, K)
    if target is None or target not in registered:
        return f"the built extension lacks the {op} step program (K = {K}): rebuild with `python build.py`"
    return None


def _launch(p: Problem, target: str, scale: float, l2norm: bool, q, k, v, g, beta, h0):
    B, T, HV, V = v.shape
    named = dict(q=q, k=k, v=v, g=g, h0=h0, scale=np.float32(scale), l2norm=np.int32(l2norm))
    if beta is not None:
        named["beta"] = beta
    # ht in h0's buffer: a decode loop carrying the state then moves it once a step, not again in a copy
    return runtime.call(p, target, (jax.ShapeDtypeStruct((B, T, HV, V), v.dtype), jax.ShapeDtypeStruct(h0.shape, jnp.float32)),
                        in_place={"ht": "h0"}, **named)


@functools.lru_cache(maxsize=None)
def _partitioned(p: Problem, target: str, scale: float, l2norm: bool, gate_rows: bool, delta: bool):
    """The program split along batch and heads like its operands (`fla_jax._partition`)."""
    ins = ("bthk", "bthk", "bthv", "bthk" if gate_rows else "bth") + (("bth",) if delta else ()) + ("bhkv",)

    def fn(q, k, v, g, *rest):
        beta, h0 = rest if delta else (None, *rest)
        return _launch(p, target, scale, l2norm, q, k, v, g, beta, h0)

    return _partition.batch_head_partitioned(fn, ins, ("bthv", "bhkv"))


def run(op: str, fallback, q, k, v, g, beta, h0, *, scale: float, l2norm: bool, config: Config | None = None):
    """`(o [B, T, HV, V], ht [B, HV, K, V] float32)` by the step program from raw q, k `[B, T, H, K]` (not scaled,
    normalised or repeated for grouped heads), v, g float32 `[B, T, HV]` (`[B, T, H, K]` for GLA), beta float32
    `[B, T, HV]` (delta rules) or None, h0 float32 `[B, HV, K, V]`. `fallback(q, k, v, g, beta, h0)` is the same
    function in XLA: its VJP is the gradient."""
    p = configured(Problem(op=op, delta=op == "delta", chunk_size=64, dtype=str(q.dtype)), config)
    target = program(op, p.dtype, q.shape[-1], config)
    part = _partitioned(p, target, float(scale), bool(l2norm), g.ndim == 4, beta is not None)

    @jax.custom_vjp
    def step(q, k, v, g, beta, h0):
        return tuple(part(q, k, v, g, *(() if beta is None else (beta,)), h0))

    def fwd(*args):
        return step(*args), args

    def bwd(args, ct):
        return jax.vjp(fallback, *args)[1](ct)

    step.defvjp(fwd, bwd)
    return step(q, k, v, g, beta, h0)
