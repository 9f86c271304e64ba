"""GLA on the kernels (`kernels/gla/`): a decay per key channel, head and step.

Forward: `a` forms the intra-chunk matrix A (chunk-wide on the tensor cores where the chunk's gate range
allows, else by sub-chunks), the gates' in-chunk sums G, q exp(G) and k exp(G_C - G); then the state
pass (`fused`, under a gradient `fused_h`). Under a gradient A, G and q exp(G) are kept for the
backward, which is simple GLA's (reverse pass, one consumer) with gates per channel: its consumer
takes the reverse cumulative sum of dg itself.
"""

from __future__ import annotations

import jax

from fla_jax._tilelang import common, runtime, simple_gla

TOKENS = ("bthk", "bthk", "bthv", "bthk")
# the intra-chunk matrix A (per chunk), the in-chunk sums G and q exp(G) (per token)
STORED = ("bchkv", "bthk", "bthk")


def forward(c: common.Chunks):
    """`(o, ht)`, or under a gradient `(o, h, A, G, q exp(G), ht)`."""
    qf, kf, vf, Gf = c.flat
    like = common.like
    a, G, qg, kg = runtime.call(c.p, c.targets()["a"], (jax.ShapeDtypeStruct((c.NT, c.HV, c.C, c.C), qf.dtype), like(Gf), like(qf), like(kf)),
                                q=qf, k=kf, g=Gf, scale=c.scale_f32)
    stored = (a.reshape(c.B, c.NT // c.B, *a.shape[1:]), G.reshape(c.B, c.Lr, *G.shape[1:]), qg.reshape(c.B, c.Lr, *qg.shape[1:])) \
        if c.store_h else ()
    ins = dict(qg=qg, kg=kg, v=vf, g=G, a=a)
    o, *h, ht = common.state_pass(c, ins, light=("fused", ins) if c.store_h else None, totals=simple_gla.chunk_sums(G, c.C))
    return (c.unflat(o), *h, *stored, ht)


def backward(b: common.Reverse, stored):
    """As simple GLA's, from the stored A, G and q exp(G)."""
    a, G, qg = stored
    return simple_gla.backward(b, G=G, q=qg, stored={"a": a})
