"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into `fla_jax._ext`,
called through XLA FFI custom calls.

One module per op in `fla_jax._tilelang` (`simple_gla`, `gla`, `delta`: the delta rule and GDN), each with
its forward and backward; what they share there (`plan`: every choice of programs and pieces; `common`: layouts, the state pass;
`runtime`: the extension; `config`: `Config`). This module is the backend's face: which calls the kernels
take (`unsupported`, with the reason; `tiling` for K != V), `run`, and the custom VJP around the ops'
forward and backward, each partitioned along batch and heads (`fla_jax._partition`). bf16/fp16, K up to
256 and any V (`fla_jax._tiling`: the gated ops' programs take V on their grid, the delta rules' forward with no
gradient too; their gradient's programs are square, V in parts as value heads), dense
batches and `cu_seqlens`; "auto"
falls back to `xla` for anything else, and says so (`fla_jax.explain`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fla_jax import _layout, _nonfinite, _partition, _tiling, xla
from fla_jax._problem import Problem, l2_normalise
from fla_jax._tilelang import common, delta, gla, plan, simple_gla
from fla_jax._tilelang.config import DEFAULT, Config, Configured, configured, of as config_of
from fla_jax._tilelang.runtime import IMPORT_ERROR, registered, status
from fla_jax._variants import HEAD_DIMS, find as _find_variant

__all__ = ["DEFAULT", "IMPORT_ERROR", "Config", "Configured", "configured", "registered", "run", "status", "tiling", "unsupported"]


def _module(p: Problem):
    """The op's module: its token layouts, what its forward stores, its forward and backward."""
    return delta if p.delta else gla if p.op == "gla" else simple_gla


def unsupported(p: Problem, *, K: int, V: int, varlen: bool, grouped: bool, l2norm: bool, installed: bool = True) -> str | None:
    """Why the kernels cannot take this call, or None when they can (`cu_seqlens` is supported).
    `installed`: also where this install's extension lacks a program the call needs."""
    del varlen, grouped, l2norm  # grouped heads and l2 normalisation exist only for the delta rules
    if p.chunk_size != 64:
        return f"the kernels use chunk_size 64, got {p.chunk_size}"
    t = _tiling.tiling(p.op, K, V, HEAD_DIMS)
    if isinstance(t, str):
        return t
    op = "delta" if p.delta else p.op
    variants = [_find_variant(op, d, p.dtype, t.D, t.D) for d in ("fwd", "bwd")]
    if None in variants:
        return f"no kernel built for dtype {p.dtype} (built: bfloat16 and float16)"
    missing = sorted({v.target(prog) for v in variants for prog in v.programs} - set(registered())) if installed else ()
    if missing:
        return f"the built extension lacks {missing[0]} (and {len(missing) - 1} more): rebuild with `python build.py`"
    return None


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float, l2norm: bool = False, config: Config | None = None):
    """`config`: how the kernels run it (`Config`; the default where None). Raw inputs (q, k, v in their
    dtype, not scaled, not normalised), as `_compute` hands them to this backend; `h0` None where the call has no initial state (the kernels then start from
    zero states, and XLA writes none for them).

    q and k are l2-normalised inside the op when asked (delta rules; `_op`). Tokens are laid
    out in chunk rows as for the xla backend (`fla_jax._layout`: every sequence starts at a chunk
    boundary, zeros in padding slots). The gates go in per step: the in-chunk cumulative sum is
    taken inside the op (`_op`), by XLA or by the kernel that reads them (`g_scan`). Non-finite inputs keep
    the recurrence's causality within a chunk where `Config.nonfinite_guard` asks (`_forward`)."""
    p = configured(p, config)
    T = q.shape[1]
    C = p.chunk_size
    t = tiling(p, q.shape[-1], v.shape[-1])
    q, k, v, g, beta, h0 = _tiling.fold(t, q=q, k=k, v=v, g=g, beta=beta, h0=h0)
    layout = _layout.make_layout(T, cu_seqlens, C)
    g32 = jnp.zeros(v.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)  # GLA: [B, T, H, K]
    if g32.ndim == 3:  # (a decay of zero, g = -inf, as the xla backend takes it: `xla.GATE_FLOOR`; fused into XLA's
        g32 = jnp.maximum(g32, xla.GATE_FLOOR)  # in-chunk sums. GLA's kernel clamps its per-channel gates itself)
    beta = beta.astype(jnp.float32) if p.delta else None
    q, k, v, g32, beta = (_layout.pack(x, layout) for x in (q, k, v, g32, beta))
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    tokens = (q, k, v, g32) + ((beta,) if p.delta else ())
    state = () if h0 is None else (h0.astype(jnp.float32),)
    o, ht = _op(p, float(scale), l2norm, h0 is not None, t.v_parts, *tokens, *state, *tables)
    return _tiling.unfold(t, _layout.unpack(o, layout, T), ht)


def tiling(p: Problem, K: int, V: int) -> _tiling.Tiling:
    """How a call with head dims K and V runs on the programs (`fla_jax._tiling`); only for a
    call that `unsupported` takes."""
    t = _tiling.tiling(p.op, K, V, HEAD_DIMS)
    assert not isinstance(t, str), t
    return t


TABLES = ("n", "n")  # the varlen tables' layouts: each sequence's first chunk and chunk count


class Stored(NamedTuple):
    """The forward's results under a gradient (`fwd_h`), in the order its partitioned function returns them: each
    field a tuple of arrays (`h`, `ht` of one). Declared once as layouts (`_stored_layouts`), which
    `_partitioned_with` and `_op_fwd` both read."""

    o: tuple  # [B, T, HV, V]
    h: tuple  # the state before each chunk [B, NT_b, HV, K, V]
    stored: tuple  # what the op's backward reads (its module's STORED)
    normed: tuple  # q, k normalised and their 1 / |x|, where the forward's WY kernel normalised them (`l2norm`)
    sums: tuple  # the gates' in-chunk sums G (but for GLA, whose are among `stored`)
    rows: tuple  # G's per-chunk rows [B, NT_b, HV, C] where `store_rows`
    ht: tuple  # the final states


class Residuals(NamedTuple):
    """What the forward keeps for the backward (`_op_fwd` to `_op_bwd`), in the order the backward's partitioned
    function takes them, before o's and the final state's cotangents. Declared once as layouts
    (`_residual_layouts`), which `_partitioned_with` and `_backward` both read."""

    tokens: tuple  # the token arrays: G in place of the gates per step (but GLA's), q and k normalised under l2norm
    h: tuple  # as `Stored.h`
    stored: tuple  # as `Stored.stored`
    norms: tuple  # 1 / |q|, 1 / |k| [B, T, H] under l2norm (the gradients are then the raw q's and k's)
    rows: tuple  # as `Stored.rows`
    tables: tuple  # the varlen tables


def _stored_layouts(p: Problem, l2norm: bool, store_rows: bool, state: str) -> Stored:
    """Each `Stored` field's partitioning layouts (`fla_jax._partition`)."""
    return Stored(o=("bthv",), h=("bchkv",), stored=_module(p).STORED, normed=("bthk", "bthk", "bth", "bth") if l2norm else (),
                  sums=() if p.op == "gla" else ("bth",), rows=("bchr",) if store_rows else (), ht=(state,))


def _residual_layouts(p: Problem, l2norm: bool, store_rows: bool, varlen: bool) -> Residuals:
    """Each `Residuals` field's partitioning layouts."""
    return Residuals(tokens=_module(p).TOKENS, h=("bchkv",), stored=_module(p).STORED, norms=("bth", "bth") if l2norm else (),
                     rows=("bchr",) if store_rows else (), tables=TABLES if varlen else ())


def _flat(layouts: tuple) -> tuple[str, ...]:
    """The items of a named tuple of tuples (layouts, or arrays), in order."""
    return tuple(x for field in layouts for x in field)


def _split(layouts: NamedTuple, arrays):
    """`arrays` (flat, in `layouts`' order) as the named tuple of `layouts`' type, and the arrays after them."""
    fields, i = [], 0
    for field in layouts:
        fields.append(tuple(arrays[i : i + len(field)]))
        i += len(field)
    return type(layouts)(*fields), tuple(arrays[i:])


def _forward(p: Problem, scale: float, store_h: bool, l2norm: bool, has_h0: bool, store_rows: bool, *arrays):
    """The op's forward (`_module(p).forward`) on (token arrays, h0 where `has_h0`, varlen tables): `(o, ht)`,
    or with `store_h` the fields of `Stored` in order. `l2norm`: q and k raw, normalised by the kernels."""
    n = len(_module(p).TOKENS)
    tokens, h0, tables = arrays[:n], arrays[n] if has_h0 else None, arrays[n + has_h0 :]
    c = common.chunks(p, scale, store_h, l2norm, store_rows, tokens, h0, tables)
    outs = _module(p).forward(c)
    if not config_of(p).nonfinite_guard:
        return outs
    # Non-finite inputs keep the recurrence's causality (`fla_jax._nonfinite`): where the final states come out
    # non-finite, o and ht again from the forward with no gradient on guarded tokens, poisoned (on each device
    # by itself: no collective decides it); what the forward keeps for the backward stays as it came.
    again = functools.partial(_forward_again, p, scale, l2norm, h0, tables)
    seqs = _nonfinite.row_sequences(c.cstart, tokens[0].shape[1], c.C) if tables else ()
    tokens = tuple(tokens) + (None,) * (5 - n)  # (q, k, v, g, beta: no beta for the gated ops)
    o, ht = _nonfinite.keep_causal(outs[0], outs[-1], again, tokens, *seqs)
    return (o, *outs[1:-1], ht)


def _forward_again(p: Problem, scale: float, l2norm: bool, h0, tables, tokens):
    """`(o, ht)` of the forward with no gradient (`_forward`'s guard) on the token arrays `(q, k, v, g, beta)`,
    q and k raw under `l2norm`."""
    tokens = tokens[: len(_module(p).TOKENS)]
    folded = l2norm and plan.folds_l2norm(p, tokens[0].shape[-1])
    if l2norm and not folded:
        tokens = (*(l2_normalise(x.astype(jnp.float32)).astype(x.dtype) for x in tokens[:2]), *tokens[2:])
    return _module(p).forward(common.chunks(p, scale, False, folded, False, tokens, h0, tables))


def _backward(p: Problem, scale: float, l2norm: bool, has_h0: bool, store_rows: bool, varlen: bool, has_dht: bool, *arrays):
    """Gradients of the token arrays (the gates' per step) and of h0 where `has_h0`, from the `Residuals`' arrays,
    then do, then dht where `has_dht` (none where the loss takes no final state)."""
    res, (do, *dht) = _split(_residual_layouts(p, l2norm, store_rows, varlen), arrays)
    b, stored = common.reverse(p, scale, has_h0, res.tokens, res.h[0], res.stored, res.norms, res.rows, res.tables, do, dht)
    if p.delta:
        return delta.backward(b, stored, l2norm)
    return gla.backward(b, stored) if p.op == "gla" else simple_gla.backward(b)


def _partitioned(p: Problem, scale: float, direction: str, varlen: bool, l2norm: bool = False, has_h0: bool = True,
                 store_rows: bool = False, has_dht: bool = True):
    """The forward (`fwd`, `fwd_h`: with stored states) or backward as one custom-partitioned
    function: split along batch and heads like its operands, T, K and V whole on every device
    (see `fla_jax._partition`). Varlen calls (one row) carry the per-sequence tables and initial
    states whole. `p` carries the call's `Config` (a key of the cache).
    `l2norm`: the backward takes the norms' reciprocals and returns the raw q's and k's gradients;
    the forward (`fwd`, where `plan.folds_l2norm`) takes the raw q and k and normalises them itself.
    `has_h0`: initial states among the arrays (and their gradient among the backward's results).
    `store_rows` (`fwd_h`, `bwd`): G's per-chunk rows among the forward's results and the
    backward's arrays (`plan.stores_gate_rows`). `has_dht` (`bwd`): the final state's cotangent among
    the arrays (none where the loss takes no final state)."""
    return _partitioned_with(p, scale, direction, varlen, l2norm, has_h0, store_rows, has_dht)


@functools.cache
def _partitioned_with(p: Problem, scale: float, direction: str, varlen: bool, l2norm: bool, has_h0: bool, store_rows: bool,
                      has_dht: bool):
    state = "nhkv" if varlen else "bhkv"
    m = _module(p)
    if direction == "bwd":
        ins = _flat(_residual_layouts(p, l2norm, store_rows, varlen)) + ("bthv",) + (state,) * has_dht
        outs = m.TOKENS + (state,) * has_h0
        fn = functools.partial(_backward, p, scale, l2norm, has_h0, store_rows, varlen, has_dht)
    else:
        ins = m.TOKENS + (state,) * has_h0 + (TABLES if varlen else ())
        outs = _flat(_stored_layouts(p, l2norm, store_rows, state)) if direction == "fwd_h" else ("bthv", state)
        fn = functools.partial(_forward, p, scale, direction == "fwd_h", l2norm, has_h0, store_rows)
    return _partition.batch_head_partitioned(fn, ins, outs)


def _in_parts(parts: int, has_h0: bool, arrays: tuple) -> tuple:
    """The delta rules' arrays with V in `parts` parts as value heads (`_tiling.split_parts`); as they are at 1."""
    if parts == 1:
        return arrays
    q, k, v, g, beta, *rest = arrays
    h0, tables = (rest[0], rest[1:]) if has_h0 else (None, rest)
    v, g, beta, h0 = _tiling.split_parts(parts, v=v, g=g, beta=beta, h0=h0)
    return (q, k, v, g, beta, *((h0,) if has_h0 else ()), *tables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _op(p, scale, l2norm, has_h0, parts, *arrays):
    """`(o, ht)` from (token arrays, h0 where `has_h0`, varlen tables); gradients by the backward
    kernels. The gates per step (their in-chunk sums are taken inside the forward and backward,
    `_forward` / `_backward`: by XLA, or by the kernel that reads them). With `l2norm` q and k (the first two arrays) are l2-normalised first:
    by the kernels where `plan.folds_l2norm`, else by XLA. `parts`: the delta rules' V blocks of K (`fla_jax._tiling`),
    on the grid of the forward from the inverse, else (and under a gradient) in parts as value heads."""
    if parts > 1 and not plan.delta_forward_from_inverse(p, arrays[0].shape[-1], False):
        return _tiling.join_parts(parts, *_forward_call(p, scale, l2norm, has_h0, _in_parts(parts, has_h0, arrays)))
    return _forward_call(p, scale, l2norm, has_h0, arrays)


def _forward_call(p, scale, l2norm, has_h0, arrays):
    """`_op`'s forward with no gradient on its arrays as they come."""
    n = len(_module(p).TOKENS)
    folded = l2norm and plan.folds_l2norm(p, arrays[0].shape[-1])
    if l2norm and not folded:
        arrays = (*(l2_normalise(x.astype(jnp.float32)).astype(x.dtype) for x in arrays[:2]), *arrays[2:])
    return _partitioned(p, scale, "fwd", len(arrays) > n + has_h0, folded, has_h0)(*arrays)


def _op_fwd(p, scale, l2norm, has_h0, parts, *arrays):
    arrays = _in_parts(parts, has_h0, tuple(a.value for a in arrays))  # (`symbolic_zeros`: each a `CustomVJPPrimal`)
    n = len(_module(p).TOKENS)
    norms = ()
    folded = l2norm and plan.folds_l2norm_h(p, arrays[0].shape[-1])
    if l2norm and not folded:  # the normalised q, k in place of the raw ones, and 1 / |q|, 1 / |k| for the backward
        qn, kn, *norms = delta.norm_partitioned(p)(*arrays[:2])
        arrays = (qn, kn, *arrays[2:])
    store_rows = plan.stores_gate_rows(p, arrays[0].shape[-1])
    tokens, tables = arrays[:n], arrays[n + has_h0 :]
    outs = _partitioned(p, scale, "fwd_h", bool(tables), folded, has_h0, store_rows)(*arrays)
    st, _ = _split(_stored_layouts(p, folded, store_rows, ""), outs)
    if p.op != "gla":  # the in-chunk sums G in place of the gates per step (GLA's are among `stored`)
        tokens = (*tokens[:3], *st.sums, *tokens[4:])
    if folded:  # (the WY kernel normalised them)
        qn, kn, *norms = st.normed
        tokens = (qn, kn, *tokens[2:])
    res = Residuals(tokens=tokens, h=st.h, stored=st.stored, norms=tuple(norms), rows=st.rows, tables=tables)
    return _tiling.join_parts(parts, st.o[0], st.ht[0]), res


def _op_bwd(p, scale, l2norm, has_h0, parts, res: Residuals, ct):
    do, dht = ct  # (`symbolic_zeros`: a `SymbolicZero` for an output the loss does not take)
    zero = lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)
    do = jnp.zeros(do.aval.shape, res.tokens[0].dtype) if zero(do) else do.astype(res.tokens[0].dtype)
    do, dht = _tiling.split_cotangents(parts, do, None if zero(dht) else dht)
    dht = () if dht is None else (dht,)  # (then the reverse passes start from zeros themselves)
    grads = _partitioned(p, scale, "bwd", bool(res.tables), l2norm, has_h0, bool(res.rows), bool(dht))(*_flat(res), do, *dht)
    if parts > 1:  # (the delta rules: dq, dk, dv, dg, dbeta, dh0)
        dv, dg, dbeta, dh0 = _tiling.join_grads(parts, *grads[2:5], grads[5] if has_h0 else None)
        grads = (*grads[:2], dv, dg, dbeta, *((dh0,) if has_h0 else ()))
    return (*grads, *(None for _ in res.tables))


# `symbolic_zeros`: the backward learns which outputs the loss takes (most training losses take o alone)
_op.defvjp(_op_fwd, _op_bwd, symbolic_zeros=True)
