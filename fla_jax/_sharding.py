"""How the ops partition themselves across devices.

The recurrence runs along T and contracts over K and V, so only the batch (B) and head (H) axes
can be split without communication. Two cases:

* A mesh with Explicit axes is set (`jax.set_mesh`): the input types carry their shardings. The
  op reads them, rejects a sharded K or V axis with a ValueError naming the argument, and runs
  the whole op under `shard_map` over the B and H mesh axes: each device computes its own
  sequences and heads, nothing is gathered, and the outputs come back sharded the same way.
  A sharded T is context parallelism (`_context_parallel`): each device holds a piece of every
  sequence, and only states travel between devices.
* Otherwise (Auto axes, or no mesh): the pure-JAX backends are ordinary XLA programs that the
  SPMD partitioner splits along B and H with no collectives (the tests check the compiled HLO);
  an input sharded along T, K or V is gathered by XLA, which is slower but correct.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from fla_jax import _layout, _pieces

# Layout letters per argument: b batch, t time, h heads, k/v head dims, n sequences.
_DIMS = {
    "q": "bthk",
    "k": "bthk",
    "v": "bthv",
    "beta": "bth",
    "initial_state": "nhkv",
}


def layout_spec(layout: str, *, batch=None, heads=None, seqs=None, time=None) -> P:
    """The PartitionSpec of an array whose axes `layout` labels (b, h, n, t sharded as given; k and
    v whole)."""
    return P(*({"b": batch, "h": heads, "n": seqs, "t": time}.get(c) for c in layout))


def _explicit_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return mesh


def _spec(x) -> tuple:
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _input_mesh(args: dict):
    """The mesh of the first input whose type carries Explicit mesh axes (arrays placed on such a mesh and
    passed to `jit` without `jax.set_mesh`), or None."""
    for x in args.values():
        mesh = None if x is None else getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types):
            return mesh.abstract_mesh if hasattr(mesh, "abstract_mesh") else mesh
    return None


def apply(compute: Callable, args: dict, *, varlen: bool):
    """Runs `compute(**args) -> (o, ht)`, under `shard_map` when an explicit mesh is set (or the inputs' types
    carry one)."""
    mesh = _explicit_mesh()
    if mesh is None:
        mesh = _input_mesh(args)
        if mesh is None:
            return compute(**args)
        with jax.sharding.use_abstract_mesh(mesh):
            return apply(compute, args, varlen=varlen)
    dims = dict(_DIMS)
    g = args.get("g")
    if g is not None:
        dims["g"] = "bthk"[: g.ndim]
    batch, heads = _spec(args["v"])[0], _spec(args["v"])[2]
    time = None  # the mesh axes T is split over (context parallelism): those of the first token array split so
    for name, x in args.items():
        if x is None or name == "cu_seqlens":
            continue
        for letter, axes in zip(dims[name], _spec(x)):
            if axes is not None and letter in "kv":
                raise ValueError(
                    f"`{name}` is sharded along {letter.upper()} (mesh axes {axes!r}); fla_jax ops shard the batch, "
                    f"head and time axes: reshard `{name}` so that K and V are whole on every device"
                )
            if axes is not None and letter == "t" and time is None:
                time = axes
    if varlen and batch is not None:
        raise ValueError(f"with `cu_seqlens` the batch axis has size 1 and cannot be sharded, got mesh axes {batch!r}")
    axes = {"batch": batch, "heads": heads, "seqs": None if varlen else batch, "time": time}
    dims["cu_seqlens"] = ""  # replicated
    names = [n for n in args if args[n] is not None]
    in_specs = tuple(layout_spec(dims[n], **axes) for n in names)
    values = tuple(jax.sharding.reshard(args[n], s) for n, s in zip(names, in_specs))

    def local(*xs):
        local_args = {**{n: None for n in args}, **dict(zip(names, xs))}
        return compute(**local_args) if time is None else _context_parallel(compute, local_args, time)

    out_specs = (layout_spec("bthv", **axes), layout_spec("nhkv", **dict(axes, time=None)))
    # (context parallelism: the final state is folded from gathered states on every device alike, which the
    # varying-axes check cannot infer)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=time is None)(*values)


def _context_parallel(compute: Callable, args: dict, time):
    """The op on one device's piece of T (inside `shard_map`, `time` the mesh axes T is split over).

    Each op maps the state entering a piece to the state leaving it affinely, `S_out = A S_in + B` (per
    sequence and head; A acts on the key axis). Every device computes its piece's B (the op from a zero state)
    and A: for the gated ops the piece's decay itself, `exp(sum g)` per head (and key channel: GLA), diagonal;
    for the delta rules `prod (I - beta k k^T)` (decayed), `[K, K]`, by the op with v = 0 from the identity
    (read as K value columns). It gathers every piece's A and B (the only collective: states, never q, k, v
    or o), folds them from the initial state into the state entering its own piece and the final one, and
    runs its piece from there. Exact; two passes of the op's work (three for the delta rules).

    With `cu_seqlens` (one packed row) each device holds a piece of every sequence, empty for those outside it:
    it runs its tokens as their own packed row (the table clipped to its piece). A sequence's empty pieces map
    its state to itself (A = I, B = 0), so the fold carries each sequence's initial state unchanged to the
    device where it starts, and its final state on from where it ends."""
    q, v = args["q"], args["v"]
    HV, K = v.shape[2], q.shape[3]
    f32 = jnp.float32
    cu = args.get("cu_seqlens")
    if cu is not None:  # (B = 1) the table of this device's tokens
        T_local = q.shape[1]
        args = dict(args, cu_seqlens=jnp.clip(cu.astype(jnp.int32) - jax.lax.axis_index(time) * T_local, 0, T_local))
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    _, B_piece = compute(**dict(args, initial_state=None))
    g = args.get("g")
    diag = args.get("beta") is None
    if diag:  # gated: A = Diag(exp(sum of the piece's gates)), [N, HV, K]
        if g is None:
            total = jnp.zeros((N, HV), f32)
        elif cu is None:
            total = jnp.sum(g.astype(f32), axis=1)
        else:  # per sequence of the packed row
            ids = _layout.token_sequences(args["cu_seqlens"], q.shape[1])
            total = jax.ops.segment_sum(g[0].astype(f32), ids, num_segments=N)
        A_piece = jnp.broadcast_to(jnp.exp(total if total.ndim == 3 else total[..., None]), (N, HV, K))
    else:
        eye = jnp.broadcast_to(jnp.eye(K, dtype=f32), (N, HV, K, K))
        _, A_piece = compute(**dict(args, v=jnp.zeros((*v.shape[:3], K), v.dtype), initial_state=eye))
    # every piece's A and B, [N, P, HV, K, .] (the one collective), folded as the pieces inside one GPU are
    A_all, B_all = (jnp.moveaxis(jax.lax.all_gather(x.astype(f32), time), 0, 1) for x in (A_piece, B_piece))
    into, S = _pieces.fold(A_all, B_all, args["initial_state"], diag)
    entering = jax.lax.dynamic_index_in_dim(into, jax.lax.axis_index(time), axis=1, keepdims=False)
    o, _ = compute(**dict(args, initial_state=entering.astype(B_piece.dtype)))
    return o, S.astype(B_piece.dtype)
