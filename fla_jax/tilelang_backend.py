"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into `fla_jax._ext`,
called through XLA FFI custom calls.

One module per op in `fla_jax._tilelang` (`simple_gla`, `gla`, `delta`: the delta rule and GDN), each with
its forward and backward; what they share there (`common`: program lookup, layouts, the state pass;
`runtime`: the extension; `config`: `Config`). This module is the backend's face: which calls the kernels
take (`unsupported`, with the reason; `tiling` for K != V), `run`, and the custom VJP around the ops'
forward and backward, each partitioned along batch and heads (`fla_jax._partition`). bf16/fp16, K and V
up to 256 and 512 on the square programs (`fla_jax._tiling`), dense batches and `cu_seqlens`; "auto"
falls back to `xla` for anything else, and says so (`fla_jax.explain`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fla_jax import _layout, _partition, _tiling, xla
from fla_jax._problem import Problem, l2_normalise
from fla_jax._tilelang import common, delta, gla, simple_gla
from fla_jax._tilelang.config import DEFAULT, Config, Configured, configured
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
    taken inside the op (`_op`), by XLA or by the kernel that reads them (`g_scan`)."""
    p = configured(p, config)
    T = q.shape[1]
    C = p.chunk_size
    t = tiling(p, q.shape[-1], v.shape[-1])
    q, k, v, g, beta, h0 = _tiling.fold(t, delta=p.delta, q=q, k=k, v=v, g=g, beta=beta, h0=h0)
    layout = _layout.make_layout(T, cu_seqlens, C)
    g32 = jnp.zeros(v.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)  # GLA: [B, T, H, K]
    if g32.ndim == 3:  # (a decay of zero, g = -inf, as the xla backend takes it: `xla.GATE_FLOOR`; fused into XLA's
        g32 = jnp.maximum(g32, xla.GATE_FLOOR)  # in-chunk sums. GLA's kernel clamps its per-channel gates itself)
    beta = beta.astype(jnp.float32) if p.delta else None
    q, k, v, g32, beta = (_layout.pack(x, layout) for x in (q, k, v, g32, beta))
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    tokens = (q, k, v, g32) + ((beta,) if p.delta else ())
    state = () if h0 is None else (h0.astype(jnp.float32),)
    o, ht = _op(p, float(scale), l2norm, h0 is not None, *tokens, *state, *tables)
    return _tiling.unfold(t, _layout.unpack(o, layout, T), ht)


def tiling(p: Problem, K: int, V: int) -> _tiling.Tiling:
    """How a call with head dims K and V runs on the square programs (`fla_jax._tiling`); only for a
    call that `unsupported` takes."""
    t = _tiling.tiling(p.op, K, V, HEAD_DIMS)
    assert not isinstance(t, str), t
    return t


def _forward(p: Problem, scale: float, store_h: bool, l2norm: bool, has_h0: bool, store_rows: bool, *arrays):
    """The op's forward (`_module(p).forward`) on (token arrays, h0 where `has_h0`, varlen tables): `(o, ht)`,
    or with `store_h` `(o, h, *stored, ht)`, h `[B, NT, HV, K, V]` the state before each chunk and `stored` what
    the op's backward reads (its module's `STORED`, then for the delta rules the normalised q, k and their
    `1 / |x|` where its WY kernel normalised them (`l2norm`), then but for GLA the in-chunk sums G and, where
    `store_rows` (`common.stores_gate_rows`), their per-chunk rows `[B, NT_b, HV, C]`). `l2norm`: q and k
    raw, normalised by the kernels."""
    n = len(_module(p).TOKENS)
    tokens, h0, tables = arrays[:n], arrays[n] if has_h0 else None, arrays[n + has_h0 :]
    return _module(p).forward(common.chunks(p, scale, store_h, l2norm, store_rows, tokens, h0, tables))


def _backward(p: Problem, scale: float, l2norm: bool, has_h0: bool, store_rows: bool, has_dht: bool, *arrays):
    """Gradients of the token arrays (the gates' per step) and of h0 where `has_h0`, from (token arrays, h,
    *stored, *norms, G's rows where `store_rows`, tables, do, dht where `has_dht`: none where the loss takes
    no final state); stored as `_forward` keeps it, the token arrays with the gates' in-chunk sums G in place
    of the gates (but GLA's); with `l2norm` they hold the normalised q and k, `norms` their `1 / |x|`
    (`[B, T, H]` float32), and the gradients are the raw q's and k's."""
    m = _module(p)
    n = len(m.TOKENS)
    end = n + 1 + len(m.STORED) + (2 if l2norm else 0) + store_rows
    ct = 1 + has_dht  # (do, and dht where the loss takes the final state)
    tokens, h, stored, tables, (do, *dht) = arrays[:n], arrays[n], arrays[n + 1 : end], arrays[end:-ct], arrays[-ct:]
    b, stored = common.reverse(p, scale, l2norm, has_h0, store_rows, tokens, h, stored, tables, do, dht)
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
    the forward (`fwd`, where `delta.folds_l2norm`) takes the raw q and k and normalises them itself.
    `has_h0`: initial states among the arrays (and their gradient among the backward's results).
    `store_rows` (`fwd_h`, `bwd`): G's per-chunk rows among the forward's results and the
    backward's arrays (`common.stores_gate_rows`). `has_dht` (`bwd`): the final state's cotangent among
    the arrays (none where the loss takes no final state)."""
    return _partitioned_with(p, scale, direction, varlen, l2norm, has_h0, store_rows, has_dht)


@functools.cache
def _partitioned_with(p: Problem, scale: float, direction: str, varlen: bool, l2norm: bool, has_h0: bool, store_rows: bool,
                      has_dht: bool):
    state, tables = ("nhkv", ("n", "n")) if varlen else ("bhkv", ())
    m = _module(p)
    rows = ("bchr",) if store_rows else ()  # G's per-chunk rows [B, NT_b, HV, C]
    if direction == "bwd":
        norms = ("bth", "bth") if l2norm else ()
        ins = m.TOKENS + ("bchkv",) + m.STORED + norms + rows + tables + ("bthv",) + (state,) * has_dht
        outs = m.TOKENS + (state,) * has_h0
        fn = functools.partial(_backward, p, scale, l2norm, has_h0, store_rows, has_dht)
    else:
        ins = m.TOKENS + (state,) * has_h0 + tables
        norms = ("bthk", "bthk", "bth", "bth") if l2norm else ()  # (fwd_h from the raw q, k: their y and 1 / |x|)
        sums = () if p.op == "gla" else ("bth",) + rows  # (fwd_h: G, and its rows)
        outs = ("bthv", "bchkv") + m.STORED + norms + sums + (state,) if direction == "fwd_h" else ("bthv", state)
        fn = functools.partial(_forward, p, scale, direction == "fwd_h", l2norm, has_h0, store_rows)
    return _partition.batch_head_partitioned(fn, ins, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _op(p, scale, l2norm, has_h0, *arrays):
    """`(o, ht)` from (token arrays, h0 where `has_h0`, varlen tables); gradients by the backward
    kernels. The gates per step (their in-chunk sums are taken inside the forward and backward,
    `_forward` / `_backward`: by XLA, or by the kernel that reads them). With `l2norm` q and k (the first two arrays) are l2-normalised first:
    by the kernels where `delta.folds_l2norm`, else by XLA."""
    n = len(_module(p).TOKENS)
    folded = l2norm and delta.folds_l2norm(p, arrays[0].shape[-1])
    if l2norm and not folded:
        arrays = (*(l2_normalise(x.astype(jnp.float32)).astype(x.dtype) for x in arrays[:2]), *arrays[2:])
    return _partitioned(p, scale, "fwd", len(arrays) > n + has_h0, folded, has_h0)(*arrays)


def _op_fwd(p, scale, l2norm, has_h0, *arrays):
    arrays = tuple(a.value for a in arrays)  # (`symbolic_zeros`: each a `CustomVJPPrimal`)
    n = len(_module(p).TOKENS)
    norms = ()
    folded = l2norm and delta.folds_l2norm_h(p, arrays[0].shape[-1])
    if l2norm and not folded:  # the normalised q, k in place of the raw ones, and 1 / |q|, 1 / |k| for the backward
        qn, kn, *norms = delta.norm_partitioned(p)(*arrays[:2])
        arrays = (qn, kn, *arrays[2:])
    store_rows = common.stores_gate_rows(p, arrays[0].shape[-1])
    o, h, *wy, ht = _partitioned(p, scale, "fwd_h", len(arrays) > n + has_h0, folded, has_h0, store_rows)(*arrays)
    rows = (wy.pop(),) if store_rows else ()
    if p.op != "gla":  # the in-chunk sums G in place of the gates per step (GLA's are among wy)
        arrays = (*arrays[:3], wy.pop(), *arrays[4:])
    if folded:  # (the WY kernel normalised them)
        *wy, qn, kn, rq, rk = wy
        arrays, norms = (qn, kn, *arrays[2:]), (rq, rk)
    return (o, ht), (arrays[:n], h, (*wy, *norms, *rows), arrays[n + has_h0 :])


def _op_bwd(p, scale, l2norm, has_h0, res, ct):
    tokens, h, wy, tables = res
    do, dht = ct  # (`symbolic_zeros`: a `SymbolicZero` for an output the loss does not take)
    zero = lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)
    do = jnp.zeros(do.aval.shape, tokens[0].dtype) if zero(do) else do.astype(tokens[0].dtype)
    dht = () if zero(dht) else (dht,)  # (then the reverse passes start from zeros themselves)
    store_rows = common.stores_gate_rows(p, tokens[0].shape[-1])  # (as `_op_fwd` decided it)
    grads = _partitioned(p, scale, "bwd", bool(tables), l2norm, has_h0, store_rows, bool(dht))(*tokens, h, *wy, *tables, do, *dht)
    return (*grads, *(None for _ in tables))


# `symbolic_zeros`: the backward learns which outputs the loss takes (most training losses take o alone)
_op.defvjp(_op_fwd, _op_bwd, symbolic_zeros=True)
