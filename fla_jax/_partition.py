"""`custom_partitioning` for ops made of custom calls (the TileLang kernels).

A bare custom call makes XLA gather its operands and run the whole problem on every device. The
wrapper here gives such a function a Shardy sharding rule and a `partition` callback: the batch (b)
and head (h) axes keep the sharding the operands arrive with, every other axis (time t, head dims
k and v) is made whole first — so an operand sharded along T, K or V is resharded by XLA (correct,
slower), never silently computed on a slice; arrays without b or h (per-sequence tables) are
whole everywhere. `custom_partitioning` has no batching rule, so the wrapper also carries a
`custom_vmap` rule: it folds a vmapped axis into the batch axis where every layout starts with b,
and maps over it one slice at a time otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from fla_jax._sharding import layout_spec


@functools.lru_cache(maxsize=None)
def batch_head_partitioned(fn: Callable, ins: tuple[str, ...], outs: tuple[str, ...]) -> Callable:
    """`fn(*arrays) -> tuple` partitioned along b and h. `ins`/`outs` label each array's axes,
    e.g. `"bthk"`; the first input's b and h shardings are imposed on every array."""

    def shardings(mesh, arg_shapes):
        first = arg_shapes[0]
        spec = tuple(first.sharding.spec) + (None,) * (len(first.shape) - len(first.sharding.spec))
        b, h = spec[ins[0].index("b")], spec[ins[0].index("h")]
        make = lambda layout: NamedSharding(mesh, layout_spec(layout, batch=b, heads=h))
        return tuple(make(l) for l in ins), tuple(make(l) for l in outs)

    def partition(mesh, arg_shapes, result_shape):
        args, results = shardings(mesh, arg_shapes)
        return mesh, fn, results, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    foldable = all(layout.startswith("b") for layout in ins + outs)
    partitioned = custom_partitioning(fn)
    rule = ", ".join(" ".join(l) for l in ins) + " -> " + ", ".join(" ".join(l) for l in outs)
    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=tuple(dict.fromkeys(c for c in rule if c.isalpha() and c not in "bh")),  # in rule order
    )

    @custom_batching.custom_vmap
    def wrapped(*args):
        return partitioned(*args)

    @wrapped.def_vmap
    def _batch(axis_size, in_batched, *args):  # fold into b, or map slice by slice
        if not foldable:
            one = lambda xs: wrapped(*(x if b else a for x, a, b in zip(xs, args, in_batched)))
            mapped = tuple(x if b else jnp.zeros((axis_size,), jnp.int8) for x, b in zip(args, in_batched))
            return jax.lax.map(one, mapped), (True,) * len(outs)
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        res = wrapped(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
        res = tuple(r.reshape(axis_size, r.shape[0] // axis_size, *r.shape[1:]) for r in res)
        return res, (True,) * len(res)

    return wrapped
