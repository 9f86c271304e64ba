"""Simple GLA on the kernels (`kernels/simple_gla/`): a scalar decay per head and step.

Forward: one state pass (`fused`; under a gradient `fused_h`, which also stores the state before each
chunk), on dense input with no gradient in pieces of each sequence at once where its programs would
leave SMs idle (`Config.split_programs`: `fused`, then `enter`). Backward: the reverse state-gradient
pass (`dh`), then one consumer (`dqkvg`) for dq, dk, dv and dg. The gates go in as their in-chunk sums
G (XLA's), as columns or per-chunk rows (`g_rows`), or per step where a program sums them (`g_scan`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _pieces
from fla_jax._tilelang import common, plan, runtime

# The token arrays (q, k, v, the gates per step) and what the forward stores for the backward besides h
# and G, with the axis letters of `fla_jax._partition`.
TOKENS = ("bthk", "bthk", "bthv", "bth")
STORED = ()


def forward(c: common.Chunks):
    """`(o, ht)`, or under a gradient `(o, h, G, [G's rows,] ht)`."""
    qf, kf, vf, graw = c.flat
    G, grows = common.gate_sums(c)
    rows0 = grows
    gate_rows = lambda: common.gate_rows(G, c.C) if rows0 is None else rows0
    name = "fused_h" if c.store_h else "fused"
    scan = not c.store_h and c.takes(name, "g_scan")  # (the pass sums the gates per step itself)
    if c.store_rows:  # (for this pass and the backward's)
        grows = gate_rows()
    ins = dict(q=qf, k=kf, v=vf, g=graw if scan else common.gates_for(c.p, "fwd", c.K, name, G, c.C, grows))
    pieces = plan.forward_split_pieces(c.p, gradient=c.store_h, varlen=bool(c.tables), B=c.B, H=c.HV, K=c.K, V=c.V, nt=c.NT // c.B)
    if pieces > 1:
        return split_forward(c.p, pieces, c.scale, c.targets(), ins, c.h0, gate_rows(), c.B, c.C)
    light = None
    if c.store_h:  # (the pieces' other passes, where it walks them: `fused`, storing no h)
        light = ("fused", dict(ins, g=graw if c.takes("fused", "g_scan") else common.gates_for(c.p, "fwd", c.K, "fused", G, c.C, grows)))
    o, *h, ht = common.state_pass(c, ins, light=light, totals=chunk_sums(G, c.C))
    sums = common.stored_sums(c, G, grows)
    return (c.unflat(o), *h, *sums, ht)


def chunk_sums(G, C: int):
    """Each chunk's sum of the gates `[NT, H(, K)]` from their in-chunk sums G `[L, H(, K)]` (its last row)."""
    return G.reshape(-1, C, *G.shape[1:])[:, -1]


def split_forward(p: Problem, pieces: int, scale: float, targets: dict, ins, h0, rows, B: int, C: int):
    """Simple GLA's `(o, ht)` (dense, no gradient) with each sequence's chunks walked in `pieces`
    pieces at once by the state pass (`fused`, as `pieces * B` sequences, the first piece from h0,
    the others from zero states); then `enter` adds what the states entering the later pieces
    contribute to their output. `ins`: the pass's token inputs by name (q, k, v and the gates as it takes
    them), `h0` with no rows where there is none, `rows` the in-chunk sums as per-chunk rows `[NT, H, C]`."""
    q = ins["q"]
    L, H, K = q.shape
    V = ins["v"].shape[-1]
    nt = L // (B * C)
    m = nt // pieces  # chunks a piece
    ar = lambda n: jnp.arange(n, dtype=jnp.int32)  # (iota, not constants: custom partitioning takes none)
    first = (ar(B)[:, None] * nt + ar(pieces)[None] * m).reshape(-1)
    h0s = h0 if not h0.shape[0] else jnp.zeros((B, pieces, *h0.shape[1:]), jnp.float32).at[:, 0].set(h0).reshape(-1, *h0.shape[1:])
    s = np.float32(scale)
    o, ht = runtime.call(p, targets["fused"], (jax.ShapeDtypeStruct((L, H, V), q.dtype), jax.ShapeDtypeStruct((B * pieces, H, K, V), jnp.float32)),
                         **ins, h0=h0s, cstart=first, ccount=jnp.full_like(first, m), scale=s)
    chunk = rows[:, :, -1].reshape(B, pieces, m, H)  # a chunk's whole decay
    # the state entering each piece (piece 0's, h0, is in its o and ht already)
    enter, S = _pieces.fold(jnp.exp(chunk.sum(2)), ht.reshape(B, pieces, H, K, V), None, diag=True)
    enter = enter[:, 1:].reshape(-1, H, K, V).astype(q.dtype)  # [B (P - 1), H, K, V], as the pass takes S
    d = (jnp.cumsum(chunk[:, 1:], axis=2) - chunk[:, 1:]).reshape(-1, m, H)  # decay of the piece's chunks before
    o = runtime.call(p, targets["enter"], common.like(o), q=q, g=rows, d=d, s=enter, first=first.reshape(B, pieces)[:, 1:].reshape(-1),
                     scale=s, init=(o,))
    return o.reshape(B, nt * C, H, V), S


def backward(b: common.Reverse, G=None, q=None, stored=None):
    """The gradients of q, k, v, the gates per step (and h0 where the call has one) from the reverse pass and
    the consumer. GLA's backward is this one with its own stored `G` (per channel), `q` (q exp(G), for the
    reverse pass) and `stored` (A, by the consumer's name for it); simple GLA's G comes in the tokens, its gradient
    summed back to the steps."""
    stored = stored or {}
    p, C, K = b.p, b.C, b.K
    qf, kf, vf, Gf = b.flat[:4]
    gla = G is not None
    if gla:
        Gf, qd = G.reshape(Gf.shape), q.reshape(qf.shape)
    else:
        qd = qf
    V = vf.shape[-1]
    gates = Gf if gla else common.gates_for(p, "bwd", K, plan.v_twin(b.bwd, "dh", K, V), Gf, C, b.grows)  # (as the reverse pass takes them)
    dh, dh0 = common.reverse_pass(b, dict(q=qd, do=b.dof, g=gates), totals=chunk_sums(Gf, C))
    a = {n: x.reshape(-1, *x.shape[2:]) for n, x in stored.items()}
    name = plan.v_twin(b.bwd, "dqkvg", K, V)
    if not gla:  # (G as the consumer takes it)
        gates = common.gates_for(p, "bwd", K, name, Gf, C, b.grows)
    like = common.like
    grads = common.consumer(p, b.bwd[name], (like(qf), like(kf), like(vf), like(Gf)), q=qf, k=kf, v=vf, g=gates, **a, h=b.hf,
                            do=b.dof, dh=dh, scale=b.s)
    if not gla:  # G's gradient -> the gates' per step
        grads = (*grads[:3], common.in_chunk_cumsum(p, grads[3], C, reverse=True))
    return (*(b.rows(g, g.dtype) for g in grads), *((dh0,) if b.has_h0 else ()))
