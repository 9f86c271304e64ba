"""`fla_jax.explain`: which backend and which kernel programs a call takes, and why not the kernels."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from fla_jax import _backends, _layout, ops, tilelang_backend
from fla_jax._tilelang import plan as _planner


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What one call of an op runs.

    Attributes:
      op: the op's name (`chunk_gla`, ...).
      backend: the backend the call resolves to here.
      kernels_take_it: whether the TileLang kernels take this call (shapes, dtype, options), on any device.
      reason: why the call does not run on the kernels here (None where it does): the call's own
        reason (e.g. no kernel for this K and V), or the machine's (no Hopper GPU, not built).
      forward: the kernel programs (FFI targets) of the forward with no gradient, where the kernels take
        the call: what runs on a Hopper GPU with the extension built.
      training: those of `value_and_grad` (the forward storing what the backward needs, and the backward).
      tiling: how the call's K and V map onto the programs, which are built for K = V (`fla_jax._tiling`):
        e.g. V in parts as more value heads; None where the kernels do not take the call.
      plan: the planner's choices (`fla_jax._tilelang.plan`): the programs by kind and the pieces each
        sequence's state passes walk, with no gradient and under one; None where the kernels do not take it.
    """

    op: str
    backend: str
    kernels_take_it: bool
    reason: str | None
    forward: tuple[str, ...]
    training: tuple[str, ...]
    tiling: str | None = None
    plan: _planner.Plan | None = None

    def __str__(self) -> str:
        lines = [f"{self.op}: backend {self.backend}" + (f" (not the TileLang kernels: {self.reason})" if self.reason else "")]
        if self.kernels_take_it:
            where = "" if self.backend == "tilelang" else " on a Hopper GPU with the extension built"
            lines.append(f"  head dims: {self.tiling}")
            if self.plan is not None:
                lines.append(f"  planner: {self.plan}")
            lines.append(f"  kernels{where}: forward {', '.join(self.forward)}")
            lines.append(f"  kernels{where}: training step {', '.join(self.training)}")
        return "\n".join(lines)


def explain(fn, *args, **kwargs) -> Explanation:
    """Says which backend `fn(*args, **kwargs)` runs on and, where the kernels take it, which kernel
    programs its forward and its training step launch; where it falls to XLA, why.

    `fn` is one of the public ops (the chunk ops and the recurrent ops); arguments as for it (arrays or
    `jax.ShapeDtypeStruct`s). Nothing is computed: the call is traced, and lowered for CUDA where the kernels
    take it.

    >>> print(fla_jax.explain(fla_jax.chunk_gated_delta_rule, q, k, v, g, beta, use_qk_l2norm_in_kernel=True))
    """
    plans = []
    arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape") and hasattr(x, "dtype")}  # (traced, like args)
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    token = ops.PLANS.set(plans)
    try:
        jax.eval_shape(lambda a, kw: fn(*a, **kw, **static), args, arrays)
    finally:
        ops.PLANS.reset(token)
    if len(plans) != 1:
        raise ValueError(f"`fn` must be one of fla_jax's ops (one op call), got {getattr(fn, '__name__', fn)!r}")
    plan = plans[0]
    if "recurrent" in plan:
        return _recurrent(plan)
    problem, call = plan["problem"], plan["call"]
    coverage = tilelang_backend.unsupported(problem, **call, installed=False)
    _, here = tilelang_backend.status()
    here = here or tilelang_backend.unsupported(problem, **call)  # (this install's extension lacking a program)
    if plan["backend"] == "tilelang":
        reason = None
    elif not isinstance(plan["asked"], str) or plan["asked"] != "auto":
        reason = f"backend {plan['asked']!r} was asked for"
    else:
        reason = coverage or here
    forward = training = ()
    tiling = chosen = None
    if coverage is None:
        forward, training = _kernel_programs(plan)
        tiling = str(tilelang_backend.tiling(problem, call["K"], call["V"]))
        chosen = planned(plan)
    return Explanation(getattr(fn, "__name__", str(fn)), plan["backend"], coverage is None, reason, forward, training, tiling, chosen)


def _recurrent(plan) -> Explanation:
    """A recurrent op's call (`fla_jax.fused_recurrent_*`): the step program, or XLA's scan and why."""
    asked = plan["asked"]
    if plan["backend"] == "tilelang":
        reason = None
    elif not isinstance(asked, str) or asked != "auto":
        reason = f"backend {asked!r} was asked for"
    else:
        reason = plan["here"]
    take = plan["coverage"] is None
    programs = (plan["target"],) if take else ()
    return Explanation(plan["recurrent"], plan["backend"], take, reason, programs, programs,
                       "K and V as they are (the step program takes V on its grid; its gradient is XLA's)" if take else None)


def planned(plan) -> _planner.Plan:
    """The planner's choices for a call the kernels take, from its shapes as the op records them."""
    problem, call, shapes = plan["problem"], plan["call"], plan["args"]
    config = plan["asked"] if isinstance(plan["asked"], tilelang_backend.Config) else None
    p = tilelang_backend.configured(problem, config)
    t = tilelang_backend.tiling(p, call["K"], call["V"])
    B, T = shapes["q"].shape[:2]
    HV = shapes["v"].shape[2] * t.v_parts  # (the parts run as more value heads)
    cu = shapes.get("cu_seqlens")
    N, C = (B, p.chunk_size) if cu is None else (cu.shape[0] - 1, p.chunk_size)
    NT = B * _layout.cdiv(T, C) if cu is None else _layout.packed_chunks(T, N, C)
    return _planner.plan(p, K=t.D, V=t.Vp if t.v_grid else t.D, N=N, HV=HV, nt=NT // N, l2norm=call["l2norm"], varlen=cu is not None)


def _kernel_programs(plan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The custom calls of the call's forward and of `value_and_grad` of a loss of its outputs on the
    tilelang backend, lowered for CUDA (any machine can: nothing runs)."""
    shapes = {n: x for n, x in plan["args"].items() if x is not None}
    config = plan["asked"] if isinstance(plan["asked"], tilelang_backend.Config) else tilelang_backend.DEFAULT
    config = dataclasses.replace(config, nonfinite_guard=False)  # (the guard's second run is for non-finite input alone)
    compute = lambda a: ops._compute(_backends.tilelang(config), plan["problem"], plan["scale"], plan["call"]["l2norm"],
                                     **{n: a.get(n) for n in plan["args"]})
    diff = {n: x for n, x in shapes.items() if n != "cu_seqlens"}

    def loss(d, rest):
        o, ht = compute(d | rest)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    rest = {n: x for n, x in shapes.items() if n == "cu_seqlens"}
    found = []
    for f, a in ((lambda a: compute(a), (shapes,)), (jax.value_and_grad(loss), (diff, rest))):
        text = jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        found.append(tuple(re.findall(r"custom_call @(fla_\w+?)(?:_aliased)?[(\s]", text)))
    return found[0], found[1]
