"""What the ops' glue shares: which program of a variant runs (`targets`, `Config.experiments`), the chunk-row
layouts the programs take (`flat`, `gate_rows`, `gates_for`, `steps_for`), the gates' in-chunk sums, and the
backward's consumer whose key-channel parts are summed (`consumer`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax._problem import Problem
from fla_jax._tilelang import config, runtime
from fla_jax._variants import find as find_variant


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


def targets(p: Problem, direction: str, K: int, V: int) -> dict[str, str]:
    """{program name: FFI target} of one variant, each kind's the program that runs (`program`):
    also a kind that only an experiment put in place by `Config.experiments` provides there."""
    variant = find_variant("delta" if p.delta else p.op, direction, p.dtype, K, V)
    kinds = [prog.name for prog in variant.programs]
    kinds += [prog.of for prog in variant.experiments if prog.of not in kinds and chosen(p, direction, prog)]
    return {prog.name: variant.target(prog) for prog in variant.experiments} | {
        kind: variant.target(program(p, direction, K, kind)) for kind in kinds}


def chosen(p: Problem, direction: str, prog) -> bool:
    """Whether `Config.experiments` puts experiment `prog` in its kind's place."""
    return config.of(p).overrides().get(("delta" if p.delta else p.op, direction, prog.of)) == prog.name


def program(p: Problem, direction: str, K: int, name: str):
    """The `fla_jax._variants.Program` of one kind that runs: the dispatched one, or the experiment
    that `Config.experiments` puts in its place (its config decides how its inputs are laid out)."""
    variant = find_variant("delta" if p.delta else p.op, direction, p.dtype, K, K)
    picked = next((prog for prog in variant.experiments if prog.of == name and chosen(p, direction, prog)), None)
    return picked or next(prog for prog in variant.programs if prog.name == name)


def program_config(p: Problem, direction: str, K: int, name: str) -> dict:
    """The config of the program of one kind that runs (`program`)."""
    return dict(program(p, direction, K, name).config)


def gate_rows(G, C: int):
    """The in-chunk cumulative gates `G [L, H]` as per-chunk rows `[NT, H, C]` (an XLA transpose)."""
    return G.reshape(-1, C, G.shape[-1]).transpose(0, 2, 1)


def gates_for(p: Problem, direction: str, K: int, name: str, G, C: int, rows=None):
    """`G [L, H]` as program `name` takes it: as it is, or where it loads it by TMA (`g_rows`) as
    per-chunk rows `[NT, H, C]`: `rows` where already formed, else `gate_rows`."""
    if not program_config(p, direction, K, name).get("g_rows"):
        return G
    return gate_rows(G, C) if rows is None else rows


def steps_for(p: Problem, direction: str, K: int, name: str, C: int, *xs):
    """Per-step `[L, H]` arrays beside G (beta, `1 / |x|`) as program `name` takes them: as they
    are, or per-chunk rows `[NT, H, C]` where it loads G's by TMA (`g_rows`, `gates_for`)."""
    return tuple(gate_rows(x, C) for x in xs) if program_config(p, direction, K, name).get("g_rows") else xs


def value_parts(p: Problem, K: int, V: int) -> int:
    """In how many float32 parts the backward's consumer writes what sums over the key channels:
    1 (dv in the input dtype), or K / BK where it splits the key channels over programs (dv as
    `[parts, L, HV, V]`, and but for GLA, whose dg is per channel, dg as `[parts, L, HV]`)."""
    del V  # (variants have K = V)
    return K // program_config(p, "bwd", K, "dqkvg").get("BK", K)


def consumer(p: Problem, target: str, results, *args, scale):
    """The backward's consumer `(dq, dk, dv, dg)` (the delta rules' `(dq, dk, dg)`: their reverse
    pass stores dv, `no_dv`), summing the parts of dv (and dg) where it splits the key channels
    (`value_parts`); `results` as the unsplit program writes them."""
    parts = value_parts(p, args[0].shape[-1], args[2].shape[-1])
    if parts > 1:
        split = lambda r: jax.ShapeDtypeStruct((parts, *r.shape), jnp.float32)
        results = (*results[:2], *(split(r) for r in results[2:-1]), results[-1] if p.op == "gla" else split(results[-1]))
    out = runtime.call(p, target, results, *args, scale=scale)
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


def state_programs(N: int, H: int, V: int) -> int:
    """The forward state pass's programs: one per V block of 64, sequence and (value) head."""
    return N * H * max(1, V // 64)


# ----------------------------------------------------------------------------- the forward's frame
# What every op's forward works on (`Chunks`), its gates' in-chunk sums, and the state pass that ends it.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunks:
    """One forward's arrays as the programs take them. `tokens`: the token arrays in chunk rows `[B, NT_b * C,
    H, .]` (q, k, v, the gates per step; the delta rules' beta); `flat`: the same as one flat row each `[L, H,
    .]`; `h0` `[N, HV, K, V]` (no rows: the passes start from zeros); `cstart`, `ccount`: each sequence's first
    chunk and chunk count; `tables`: the varlen tables (none for dense rows). `store_h`: under a gradient
    (the forward stores h and what the backward reads); `store_rows`: G's per-chunk rows among what it
    stores (`stores_gate_rows`); `l2norm`: q and k raw, normalised by the kernels."""

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
        return targets(self.p, "fwd", self.K, self.V)

    def unflat(self, x):
        """A flat per-token result `[L, HV, .]` in chunk rows `[B, NT_b * C, HV, .]`."""
        return x.reshape(self.B, self.Lr, *x.shape[1:])

    def takes(self, name: str, key: str):
        """Program `name`'s config entry `key` (`g_rows`, `g_scan`, ...)."""
        return program_config(self.p, "fwd", self.K, name).get(key)


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


def state_pass(c: Chunks, ins, extra=()):
    """The forward state pass (`fused`, or under a gradient `fused_h`, storing h): `(o, *extra, *h, ht)` with
    o as the pass writes it (`Chunks.unflat` puts it back in chunk rows), h `[B, NT_b, HV, K, V]` and
    `extra` (results beside o, as the pass writes them). `ins`: its token inputs, as it takes them."""
    vf = c.flat[2]
    h = (jax.ShapeDtypeStruct((c.NT, c.HV, c.K, c.V), vf.dtype),) if c.store_h else ()
    out = runtime.call(c.p, c.targets()["fused_h" if c.store_h else "fused"], (like(vf), *extra, *h, c.state), *ins, c.h0, c.cstart,
                       c.ccount, scale=c.scale_f32)
    n = 1 + len(extra)
    h = tuple(x.reshape(c.B, c.NT // c.B, *x.shape[1:]) for x in out[n:-1])
    return (out[0], *out[1:n], *h, out[-1])


def stored_sums(c: Chunks, G, rows):
    """What a forward under a gradient hands the backward of the scalar gates: G, and G's per-chunk rows
    `[B, NT_b, HV, C]` where `store_rows`."""
    if not c.store_h:
        return ()
    return (G.reshape(c.B, c.Lr, c.HV),) + ((rows.reshape(c.B, c.NT // c.B, c.HV, c.C),) if c.store_rows else ())


def stores_gate_rows(p: Problem, K: int) -> bool:
    """Whether the forward under a gradient hands the backward G's per-chunk rows (`gate_rows`, as
    `[B, NT_b, HV, C]`): simple GLA's and the delta rules' where both their forward storing h and
    their reverse pass load them by TMA (`g_rows`, K <= 128), so that they are formed once (by XLA's
    transpose, or by the delta rules' WY kernel where it sums the gates, `g_scan`)."""
    return p.op != "gla" and all(program_config(p, d, K, name).get("g_rows", False) for d, name in (("fwd", "fused_h"), ("bwd", "dh")))


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


def reverse(p: Problem, scale: float, l2norm: bool, has_h0: bool, store_rows: bool, tokens, h, stored, tables, do, dht):
    """The backward's `Reverse` and what the forward stored for it (less G's rows and the norms, which it
    holds), from the arrays `_op_bwd` hands on."""
    stored, grows = (stored[:-1], stored[-1].reshape(-1, *stored[-1].shape[2:])) if store_rows else (stored, None)
    stored, norms = (stored[:-2], stored[-2:]) if l2norm else (stored, ())
    flat_tokens, (cstart, ccount) = flat(p.chunk_size, *tokens, tables=tables)
    vf = flat_tokens[2]
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    bwd = targets(p, "bwd", flat_tokens[0].shape[-1], vf.shape[-1])
    dht, dh0_like = reverse_states(p, cstart.shape[0], hf.shape[1:], has_h0, dht)
    return Reverse(p=p, scale=scale, has_h0=has_h0, tokens=tuple(tokens), flat=flat_tokens, hf=hf, dof=dof, dht=dht, dh0_like=dh0_like,
                   cstart=cstart, ccount=ccount, grows=grows, norms=tuple(norms), bwd=bwd), tuple(stored)
