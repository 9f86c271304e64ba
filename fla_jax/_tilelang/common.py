"""What the ops' glue shares: the chunk-row layouts the programs take (`flat`, `gate_rows`, `gates_for`,
`steps_for`), the gates' in-chunk sums, the state passes (in pieces where the planner says so), and the
backward's consumer whose key-channel parts are summed (`consumer`). Which programs run: `plan`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _pieces
from fla_jax._problem import Problem
from fla_jax._tilelang import config, plan, runtime


def in_chunk_cumsum(p: Problem, g, C: int, reverse: bool = False):
    """The cumulative sum of the per-step gates within each chunk of `C` rows (axis 1 of chunk rows
    `[B, NT * C, H]`, or axis 0 of flat ones `[NT * C, H]`); `reverse`: from each chunk's end (the
    sum's VJP). Under `Config.gate_sum_dot` a matrix product (`in_chunk_rows`)."""
    if config.of(p).gate_sum_dot:
        return jnp.swapaxes(in_chunk_rows(g, C, reverse), -1, -2).reshape(g.shape)
    axis = 1 if g.ndim == 3 else 0
    x = g.reshape(*g.shape[:axis], -1, C, *g.shape[axis + 1 :])
    if reverse:
        return jnp.flip(jnp.cumsum(jnp.flip(x, axis + 1), axis=axis + 1), axis + 1).reshape(g.shape)
    return jnp.cumsum(x, axis=axis + 1).reshape(g.shape)


def in_chunk_rows(g, C: int, reverse: bool = False):
    """`in_chunk_cumsum` of `g` (`[..., NT * C, H]`) as per-chunk rows `[..., NT, H, C]` (`gate_rows`'s
    layout): one float32 product with a triangle of ones, whose result has that layout."""
    x = g.reshape(*g.shape[:-2], -1, C, g.shape[-1])
    j, i = jnp.arange(C, dtype=jnp.int32)[:, None], jnp.arange(C, dtype=jnp.int32)[None]  # (iota: custom partitioning takes no constants)
    tri = ((j >= i) if reverse else (j <= i)).astype(jnp.float32)  # [j, i]: whether step j counts towards the sum at step i
    return jnp.einsum("...ch,ci->...hi", x.astype(jnp.float32), tri, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def gate_rows(G, C: int):
    """The in-chunk cumulative gates `G [L, H]` as per-chunk rows `[NT, H, C]` (an XLA transpose)."""
    return G.reshape(-1, C, G.shape[-1]).transpose(0, 2, 1)


def gates_for(p: Problem, direction: str, K: int, name: str, G, C: int, rows=None):
    """`G [L, H]` as program `name` takes it: as it is, or where it loads it by TMA (`g_rows`) as
    per-chunk rows `[NT, H, C]`: `rows` where already formed, else `gate_rows`."""
    if not plan.program_config(p, direction, K, name).get("g_rows"):
        return G
    return gate_rows(G, C) if rows is None else rows


def steps_for(p: Problem, direction: str, K: int, name: str, C: int, *xs):
    """Per-step `[L, H]` arrays beside G (beta, `1 / |x|`) as program `name` takes them: as they
    are, or per-chunk rows `[NT, H, C]` where it loads G's by TMA (`g_rows`, `gates_for`)."""
    return tuple(gate_rows(x, C) for x in xs) if plan.program_config(p, direction, K, name).get("g_rows") else xs


def consumer(p: Problem, target: str, results, **named):
    """The backward's consumer `(dq, dk, dv, dg)` (the delta rules' `(dq, dk, dg)`: their reverse
    pass stores dv, `no_dv`), summing the parts of dv (and dg) where it splits the key channels
    (`value_parts`); `results` as the unsplit program writes them, `named` its inputs."""
    parts = plan.value_parts(p, named["q"].shape[-1], named["v"].shape[-1])
    if parts > 1:
        split = lambda r: jax.ShapeDtypeStruct((parts, *r.shape), jnp.float32)
        results = (*results[:2], *(split(r) for r in results[2:-1]), results[-1] if p.op == "gla" else split(results[-1]))
    out = runtime.call(p, target, results, **named)
    if parts > 1:  # dv rounded once, as the unsplit program writes it
        out = (*out[:2], *(x.sum(axis=0).astype(r.dtype) for x, r in zip(out[2:-1], results[2:-1])),
               out[-1] if p.op == "gla" else out[-1].sum(axis=0))
    return out


def flat(C, q, *rest, tables):
    """Chunk rows `[B, NT * C, H, .]` -> one flat row, and the (first chunk, chunk count) of
    each sequence: the dense rows' own, or the varlen tables."""
    B, Lr = q.shape[:2]
    if not tables:
        nt = Lr // C
        tables = (jnp.arange(B, dtype=jnp.int32) * nt, jnp.full((B,), nt, jnp.int32))
    row = lambda x: x.reshape(B * Lr, *x.shape[2:])
    return tuple(row(x) for x in (q, *rest)), tables


def like(x, dtype=None, heads=None) -> jax.ShapeDtypeStruct:
    """The shape of `x` (with `heads` in axis 1 if given), in `dtype` or its own."""
    shape = x.shape if heads is None else (x.shape[0], heads, *x.shape[2:])
    return jax.ShapeDtypeStruct(shape, dtype or x.dtype)


# ----------------------------------------------------------------------------- the forward's frame
# What every op's forward works on (`Chunks`), its gates' in-chunk sums, and the state pass that ends it.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunks:
    """One forward's arrays as the programs take them. `tokens`: the token arrays in chunk rows `[B, NT_b * C,
    H, .]` (q, k, v, the gates per step; the delta rules' beta); `flat`: the same as one flat row each `[L, H,
    .]`; `h0` `[N, HV, K, V]` (no rows: the passes start from zeros); `cstart`, `ccount`: each sequence's first
    chunk and chunk count; `tables`: the varlen tables (none for dense rows). `store_h`: under a gradient
    (the forward stores h and what the backward reads); `store_rows`: G's per-chunk rows among what it
    stores (`plan.stores_gate_rows`); `l2norm`: q and k raw, normalised by the kernels."""

    p: Problem
    scale: float
    store_h: bool
    l2norm: bool
    store_rows: bool
    tokens: tuple
    flat: tuple
    h0: jax.Array
    cstart: jax.Array
    ccount: jax.Array
    tables: tuple

    @property
    def C(self) -> int:
        return self.p.chunk_size

    @property
    def B(self) -> int:
        return self.tokens[0].shape[0]

    @property
    def Lr(self) -> int:
        return self.tokens[0].shape[1]

    @property
    def K(self) -> int:
        return self.flat[0].shape[-1]

    @property
    def HV(self) -> int:
        return self.flat[2].shape[1]

    @property
    def V(self) -> int:
        return self.flat[2].shape[-1]

    @property
    def NT(self) -> int:
        return self.flat[0].shape[0] // self.C

    @property
    def state(self) -> jax.ShapeDtypeStruct:
        """ht's shape `[N, HV, K, V]`."""
        return jax.ShapeDtypeStruct((self.cstart.shape[0], self.HV, self.K, self.V), jnp.float32)

    @property
    def scale_f32(self) -> np.float32:
        return np.float32(self.scale)

    def targets(self) -> dict[str, str]:
        return plan.targets(self.p, "fwd", self.K, self.V)

    def unflat(self, x):
        """A flat per-token result `[L, HV, .]` in chunk rows `[B, NT_b * C, HV, .]`."""
        return x.reshape(self.B, self.Lr, *x.shape[1:])

    def takes(self, name: str, key: str):
        """Program `name`'s config entry `key` (`g_rows`, `g_scan`, ...)."""
        return plan.program_config(self.p, "fwd", self.K, name).get(key)


def chunks(p: Problem, scale: float, store_h: bool, l2norm: bool, store_rows: bool, tokens, h0, tables) -> Chunks:
    """The forward's `Chunks` from the token arrays, h0 (None: no initial state) and the varlen tables."""
    flat_tokens, (cstart, ccount) = flat(p.chunk_size, *tokens, tables=tables)
    if h0 is None:  # no rows: the kernels start from zero states (`kernels.common.initial_state`)
        q, v = flat_tokens[0], flat_tokens[2]
        h0 = jnp.zeros((0 if config.of(p).zero_row_h0 else cstart.shape[0], v.shape[1], q.shape[-1], v.shape[-1]), jnp.float32)
    return Chunks(p=p, scale=scale, store_h=store_h, l2norm=l2norm, store_rows=store_rows, tokens=tuple(tokens), flat=flat_tokens,
                  h0=h0, cstart=cstart, ccount=ccount, tables=tuple(tables))


def gate_sums(c: Chunks):
    """`(G, rows)`: the in-chunk sums of the scalar gates per step by XLA, and G's per-chunk rows where XLA's
    product forms them at once (`Config.gate_sum_dot`; else None: `gate_rows` transposes G where needed)."""
    graw = c.flat[3]
    G = in_chunk_cumsum(c.p, graw, c.C)
    return G, in_chunk_rows(graw, c.C) if config.of(c.p).gate_sum_dot else None


def state_pass(c: Chunks, ins: dict, extra: int = 0, *, name: str | None = None, light=None, totals=None, values: str | None = None,
               carry=None):
    """The forward state pass (`fused`, or under a gradient `fused_h`, storing h): `(o, *extra, *h, ht)` with
    o as the pass writes it (`Chunks.unflat` puts it back in chunk rows), h `[B, NT_b, HV, K, V]` and
    `extra` per-token results like v beside o (the delta rules' v_new). `ins`: its token inputs by name, as it takes them.

    Where its programs would leave SMs idle (`pieces`), each sequence is walked in pieces at once
    (`split_pass`); the pieces' transitions are the gates' decays, `totals` (each chunk's sum of the gates
    `[NT, HV(, K)]`), or for the delta rules the pass's own map of an identity state (`values`: the name of the
    values among `light`'s inputs). `light`: `(name, inputs)` of a pass writing no h (`fused`) for the
    pieces' other passes, under a gradient. `carry`: `(name, inputs)` of a program that gives both the pieces' states
    from zeros and their maps in one launch (the delta rules' forward from the inverse, `plan.delta_carry_t`).
    `name`: the program (`fused` / `fused_h` where None)."""
    name = name or ("fused_h" if c.store_h else "fused")
    light = light or (name, ins)
    targets_ = c.targets()

    def run(prog, inputs, states, first, count, V=c.V):
        vf = c.flat[2]
        token = jax.ShapeDtypeStruct((*vf.shape[:2], V), vf.dtype)
        h = (jax.ShapeDtypeStruct((c.NT, c.HV, c.K, V), vf.dtype),) if prog == "fused_h" else ()
        ends = jax.ShapeDtypeStruct((first.shape[0], c.HV, c.K, V), jnp.float32)
        return runtime.call(c.p, targets_[prog], (token, *(token,) * extra, *h, ends), **inputs, h0=states, cstart=first, ccount=count,
                            scale=c.scale_f32)

    P = plan.pieces(c.p, c.cstart.shape[0], c.HV, c.V, c.NT // c.cstart.shape[0]) if totals is not None or values is not None else 1
    if P == 1:
        out = run(name, ins, c.h0, c.cstart, c.ccount)
    else:
        def transition(first, count):
            if totals is not None:
                return piece_decays(totals, first, count), True
            prog, inputs = light
            vf = c.flat[2]
            zero = jnp.zeros((*vf.shape[:2], c.K), vf.dtype)  # (the values gone: the map of S alone)
            inputs = {**inputs, values: zero}
            eye = jnp.broadcast_to(jnp.eye(c.K, dtype=jnp.float32), (first.shape[0], c.HV, c.K, c.K))
            return run(prog, inputs, eye, first, count, V=c.K)[-1], False

        def maps(first, count):  # (A, diagonal, b)
            if carry is not None:
                f32 = lambda *shape: jax.ShapeDtypeStruct((first.shape[0], c.HV, *shape), jnp.float32)
                b, A = runtime.call(c.p, targets_[carry[0]], (f32(c.K, c.V), f32(c.K, c.K)), **carry[1], cstart=first, ccount=count)
                return A, False, b
            return (*transition(first, count), run(light[0], light[1], _no_states(c.h0), first, count)[-1])

        out = split_pass(lambda states, first, count: run(name, ins, states, first, count), maps, c.cstart, c.ccount, c.h0, P)
    n = 1 + extra
    h = tuple(x.reshape(c.B, c.NT // c.B, *x.shape[1:]) for x in out[n:-1])
    return (out[0], *out[1:n], *h, out[-1])


# ----------------------------------------------------------------------------- pieces of a sequence
# A state pass walks each sequence's chunks one after another, one program per V block, sequence and value
# head. Where those programs leave SMs idle (one long sequence, few heads) each sequence is cut into P pieces
# of whole chunks walked at once, as context parallelism cuts it into shards (`fla_jax._sharding`): every pass
# maps the state entering a piece to the state leaving it affinely, `S_out = A S_in + b` (A acts on the key axis:
# the gates' decay, diagonal, or for the delta rules `[K, K]`). A first pass over the pieces from zero states
# gives each piece's b; A comes from the gates, or from the pass over an identity state with the values zeroed;
# a short fold over the P pieces gives the state entering each; the pass runs again from those. Exact up to
# rounding; two passes' work (three for the delta rules) spread over P times the programs.


def piece_tables(cstart, ccount, P: int):
    """`(first chunk, chunk count)` `[N * P]` of P pieces of each sequence (`[N]` tables): pieces of
    ceil(count / P) chunks, the last ones shorter or empty (traced counts: varlen tables)."""
    m = (ccount + P - 1) // P
    j = jnp.arange(P, dtype=jnp.int32)[None]
    first = cstart[:, None] + j * m[:, None]
    count = jnp.clip(ccount[:, None] - j * m[:, None], 0, m[:, None])
    return first.reshape(-1), count.reshape(-1)


def piece_decays(totals, first, count):
    """Each piece's decay `exp(sum of its chunks' gate sums)` `[pieces, HV(, K)]` from `totals [NT, HV(, K)]`."""
    c = jnp.arange(totals.shape[0], dtype=jnp.int32)[None]
    inside = ((c >= first[:, None]) & (c < (first + count)[:, None])).astype(jnp.float32)  # [pieces, NT]
    return jnp.exp(jnp.einsum("pc,c...->p...", inside, totals.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))


def split_pass(run, maps, cstart, ccount, s0, P: int, reverse: bool = False):
    """A state pass over P pieces of every sequence: `maps(first, count)` each piece's map of the state
    `(A, diagonal, b)` (b: the state at its far end from a zero state), then `run(states, first, count)`
    from the states entering the pieces (`reverse`: the cotangents at their ends); its results but the
    last, then that per sequence `[N, ...]` (the far piece's, as the pass wrote it). `s0`: the first
    piece's state, no rows where there is none (zeros)."""
    N = cstart.shape[0]
    first, count = piece_tables(cstart, ccount, P)
    per_seq = lambda x: x.reshape(N, P, *x.shape[1:])
    A, diag, b = maps(first, count)
    into, _ = _pieces.fold(per_seq(A), per_seq(b), s0 if s0.shape[0] else None, diag, reverse)
    out = run(into.reshape(N * P, *into.shape[2:]), first, count)
    return (*out[:-1], per_seq(out[-1])[:, 0 if reverse else -1])


def _no_states(s0):
    """A state table with no rows (the passes start from zeros, `kernels.common.initial_state`), like `s0`."""
    return jnp.zeros((0, *s0.shape[1:]), jnp.float32)


def stored_sums(c: Chunks, G, rows):
    """What a forward under a gradient hands the backward of the scalar gates: G, and G's per-chunk rows
    `[B, NT_b, HV, C]` where `store_rows`."""
    if not c.store_h:
        return ()
    return (G.reshape(c.B, c.Lr, c.HV),) + ((rows.reshape(c.B, c.NT // c.B, c.HV, c.C),) if c.store_rows else ())


# ----------------------------------------------------------------------------- the backward's frame


def reverse_states(p: Problem, N: int, state, has_h0: bool, dht):
    """The reverse passes' `dht` (the final state's cotangent in float32; where the loss takes no final state,
    zeros, or with `Config.zero_row_dht` no rows: the passes start from zeros) and `dh0`'s shape (no rows
    where there is no h0 either: the passes write none, `kernels.common.final_state`)."""
    zero_rows = config.of(p).zero_row_dht
    dht = dht[0].astype(jnp.float32) if dht else jnp.zeros((0 if zero_rows else N, *state), jnp.float32)
    return dht, jax.ShapeDtypeStruct((0 if zero_rows and not has_h0 else N, *state), jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reverse:
    """One backward's arrays as the programs take them: `flat` the token arrays as flat rows (the gates'
    in-chunk sums G in place of the gates per step, but GLA's), `hf` the stored states `[NT, HV, K, V]`, `dof`
    o's cotangent like v, `dht` and `dh0_like` as `reverse_states` makes them, `grows` G's per-chunk rows
    `[NT, HV, C]` where the forward kept them, `norms` the norms' `1 / |x|` where q and k were normalised,
    `bwd` the variant's targets."""

    p: Problem
    scale: float
    has_h0: bool
    tokens: tuple
    flat: tuple
    hf: jax.Array
    dof: jax.Array
    dht: jax.Array
    dh0_like: jax.ShapeDtypeStruct
    cstart: jax.Array
    ccount: jax.Array
    grows: jax.Array | None
    norms: tuple
    bwd: dict

    @property
    def C(self) -> int:
        return self.p.chunk_size

    @property
    def K(self) -> int:
        return self.flat[0].shape[-1]

    @property
    def s(self) -> np.float32:
        return np.float32(self.scale)

    def rows(self, x, dtype):
        """A flat result `[L, H, .]` back in chunk rows `[B, NT_b * C, H, .]`, in `dtype`."""
        B, Lr = self.tokens[0].shape[:2]
        return x.reshape(B, Lr, *x.shape[1:]).astype(dtype)


def reverse(p: Problem, scale: float, has_h0: bool, tokens, h, stored, norms, rows, tables, do, dht):
    """The backward's `Reverse` and what the forward stored for it (its module's STORED), from the fields of the
    residuals (`tilelang_backend.Residuals`): `norms` the norms' `1 / |x|` where q and k were normalised, `rows`
    G's per-chunk rows where the forward kept them."""
    grows = rows[0].reshape(-1, *rows[0].shape[2:]) if rows else None
    flat_tokens, (cstart, ccount) = flat(p.chunk_size, *tokens, tables=tables)
    vf = flat_tokens[2]
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    bwd = plan.targets(p, "bwd", flat_tokens[0].shape[-1], vf.shape[-1])
    dht, dh0_like = reverse_states(p, cstart.shape[0], hf.shape[1:], has_h0, dht)
    return Reverse(p=p, scale=scale, has_h0=has_h0, tokens=tuple(tokens), flat=flat_tokens, hf=hf, dof=dof, dht=dht, dh0_like=dh0_like,
                   cstart=cstart, ccount=ccount, grows=grows, norms=tuple(norms), bwd=bwd), tuple(stored)


def reverse_pass(b: Reverse, ins, extra: int = 0, *, totals=None, transition=None):
    """The reverse state-gradient pass (`dh`) from its token inputs `ins` (by name, as it takes them): `(dh, dh0,
    *extra)`, `extra` per-token results like v (the delta rules' du). In pieces where its programs would
    leave SMs idle (`pieces`, `split_pass`): the pieces' transitions are the gates' decays (`totals`, as for
    `state_pass`) or `transition(first, count)` (the delta rules': the forward's map `[pieces, HV, K, K]`,
    which the fold applies transposed)."""
    vf = b.flat[2]
    target = b.bwd[plan.v_twin(b.bwd, "dh", b.flat[0].shape[-1], vf.shape[-1])]  # (the gated ops' twin at V != K)

    def run(states, first, count):
        dh0 = jax.ShapeDtypeStruct((first.shape[0], *b.hf.shape[1:]), jnp.float32)
        out = runtime.call(b.p, target, (like(b.hf), dh0, *(like(vf),) * extra), **ins, dht=states, cstart=first, ccount=count, scale=b.s)
        return (out[0], *out[2:], out[1])  # (the piece states last, as `split_pass` takes them)

    N = b.cstart.shape[0]
    P = plan.pieces(b.p, N, vf.shape[1], vf.shape[-1], b.hf.shape[0] // N)
    if P == 1:
        return runtime.call(b.p, target, (like(b.hf), b.dh0_like, *(like(vf),) * extra), **ins, dht=b.dht, cstart=b.cstart,
                            ccount=b.ccount, scale=b.s)
    def maps(first, count):  # (A, diagonal, b)
        A = piece_decays(totals, first, count) if totals is not None else transition(first, count)
        return A, totals is not None, run(_no_states(b.dht), first, count)[-1]

    dh, *rest, dh0 = split_pass(run, maps, b.cstart, b.ccount, b.dht, P, reverse=True)
    return (dh, dh0 if b.dh0_like.shape[0] else dh0[:0], *rest)
