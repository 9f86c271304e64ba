"""`custom_partitioning` for ops made of custom calls (the TileLang kernels).

A bare custom call makes XLA gather its operands and run the whole problem on every device. The
wrapper here gives such a function a Shardy sharding rule and a `partition` callback: the batch (b)
and head (h) axes keep the sharding the operands arrive with, every other axis (time t, head dims
k and v) is made whole first — so an operand sharded along T, K or V is resharded by XLA (correct,
slower), never silently computed on a slice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P


@functools.lru_cache(maxsize=None)
def batch_head_partitioned(fn: Callable, ins: tuple[str, ...], outs: tuple[str, ...]) -> Callable:
    """`fn(*arrays) -> tuple` partitioned along b and h. `ins`/`outs` label each array's axes,
    e.g. `"bthk"`; the first input's b and h shardings are imposed on every array."""

    def shardings(mesh, arg_shapes):
        first = arg_shapes[0]
        spec = tuple(first.sharding.spec) + (None,) * (len(first.shape) - len(first.sharding.spec))
        b, h = spec[ins[0].index("b")], spec[ins[0].index("h")]
        make = lambda layout: NamedSharding(mesh, P(*(b if c == "b" else h if c == "h" else None for c in layout)))
        return tuple(make(l) for l in ins), tuple(make(l) for l in outs)

    def partition(mesh, arg_shapes, result_shape):
        args, results = shardings(mesh, arg_shapes)
        return mesh, fn, results, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    wrapped = custom_partitioning(fn)
    rule = ", ".join(" ".join(l) for l in ins) + " -> " + ", ".join(" ".join(l) for l in outs)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=tuple(c for c in "tkv" if c in rule),
    )
    return wrapped
