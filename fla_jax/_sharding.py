"""How the ops partition themselves across devices.

The recurrence runs along T and contracts over K and V, so only the batch (B) and head (H) axes
can be split without communication. Two cases:

* A mesh with Explicit axes is set (`jax.set_mesh`): the input types carry their shardings. The
  op reads them, rejects a sharded T, K or V axis with a ValueError naming the argument, and runs
  the whole op under `shard_map` over the B and H mesh axes: each device computes its own
  sequences and heads, nothing is gathered, and the outputs come back sharded the same way.
* Otherwise (Auto axes, or no mesh): the pure-JAX backends are ordinary XLA programs that the
  SPMD partitioner splits along B and H with no collectives (the tests check the compiled HLO);
  an input sharded along T, K or V is gathered by XLA, which is slower but correct.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AxisType, PartitionSpec as P

# Layout letters per argument: b batch, t time, h heads, k/v head dims, n sequences.
_DIMS = {
    "q": "bthk",
    "k": "bthk",
    "v": "bthv",
    "beta": "bth",
    "initial_state": "nhkv",
}


def layout_spec(layout: str, *, batch=None, heads=None, seqs=None) -> P:
    """The PartitionSpec of an array whose axes `layout` labels (b, h, n sharded as given; t, k and
    v whole)."""
    return P(*({"b": batch, "h": heads, "n": seqs}.get(c) for c in layout))


def _explicit_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return mesh


def _spec(x) -> tuple:
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def apply(compute: Callable, args: dict, *, varlen: bool):
    """Runs `compute(**args) -> (o, ht)`, under `shard_map` when an explicit mesh is set."""
    mesh = _explicit_mesh()
    if mesh is None:
        return compute(**args)
    dims = dict(_DIMS)
    g = args.get("g")
    if g is not None:
        dims["g"] = "bthk"[: g.ndim]
    batch, heads = _spec(args["v"])[0], _spec(args["v"])[2]
    for name, x in args.items():
        if x is None or name == "cu_seqlens":
            continue
        for letter, axes in zip(dims[name], _spec(x)):
            if axes is not None and letter in "tkv":
                raise ValueError(
                    f"`{name}` is sharded along {letter.upper()} (mesh axes {axes!r}); fla_jax ops shard only the "
                    f"batch and head axes: reshard `{name}` so that T, K and V are whole on every device"
                )
    if varlen and batch is not None:
        raise ValueError(f"with `cu_seqlens` the batch axis has size 1 and cannot be sharded, got mesh axes {batch!r}")
    axes = {"batch": batch, "heads": heads, "seqs": None if varlen else batch}
    dims["cu_seqlens"] = ""  # replicated
    names = [n for n in args if args[n] is not None]
    in_specs = tuple(layout_spec(dims[n], **axes) for n in names)
    values = tuple(jax.sharding.reshard(args[n], s) for n, s in zip(names, in_specs))

    def local(*xs):
        return compute(**{**{n: None for n in args}, **dict(zip(names, xs))})

    out_specs = (layout_spec("bthv", **axes), layout_spec("nhkv", **axes))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*values)
