"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA (`kernels/simple_gla/`): forward (one pass, states kept on chip; under a
gradient it also stores the state before each chunk) and backward (reverse state-gradient pass, one
fused dq/dk/dv/dg consumer), bf16/fp16 inputs, K = V in {64, 128, 256}, dense batches and
`cu_seqlens`. The delta rules (`kernels/delta/`: the sequential passes as kernels, the
chunk-parallel parts in XLA) are built but switched off (`DELTA_ENABLED`) until they pass on a GPU.
Everything else answers `unsupported(...)` with the reason, and "auto" falls back to `xla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _layout, _partition, xla
from fla_jax._problem import Problem, l2_normalise

try:
    from fla_jax import _ext
except ImportError as e:  # not built
    _ext = None
    IMPORT_ERROR: str | None = str(e)
else:
    IMPORT_ERROR = None
    for _name, _capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

try:
    from kernels.variants import find as _find_variant
except ImportError:  # an installed wheel without the kernels package: nothing is built either
    _find_variant = None


# Work in progress: the delta-rule kernels (kernels/delta/) lower and compile but have not run on a
# GPU; until they pass tests/test_tilelang.py there, the dispatch refuses the delta rules.
DELTA_ENABLED = False

# Test hook: when True, every kernel writes into NaN-filled buffers (see `_call`), so an output
# element that a kernel leaves unwritten shows up as NaN.
POISON_OUTPUTS = False


def registered() -> list[str]:
    """The FFI targets this install registered (each program also has a `_aliased` twin)."""
    return [] if _ext is None else sorted(n for n in _ext.registrations() if not n.endswith("_aliased"))


def _call(target: str, results, *args, **attrs):
    """`ffi_call` of one kernel program; with POISON_OUTPUTS its outputs start as NaN."""
    single = not isinstance(results, tuple)
    results = (results,) if single else results
    if POISON_OUTPUTS:
        poison = [jnp.full(r.shape, jnp.nan, r.dtype) for r in results]
        aliases = {len(args) + i: i for i in range(len(results))}
        out = jax.ffi.ffi_call(f"{target}_aliased", results, vmap_method="sequential", input_output_aliases=aliases)(
            *args, *poison, **attrs
        )
    else:
        out = jax.ffi.ffi_call(target, results, vmap_method="sequential")(*args, **attrs)
    return out[0] if single else tuple(out)


@functools.cache
def status() -> tuple[bool, str | None]:
    """Whether the backend can run here, and why not (devices do not change within a process)."""
    if _ext is None:
        return False, f"the TileLang CUDA kernels are not built into this install (run `python build.py`; {IMPORT_ERROR})"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return False, "no CUDA GPU is visible to JAX"
    cc = getattr(gpus[0], "compute_capability", None)
    if cc != "9.0":
        return False, f"the kernels are built for Hopper (sm_90a), this GPU has compute capability {cc}"
    return True, None


def unsupported(p: Problem, *, K: int, V: int, varlen: bool, grouped: bool, l2norm: bool) -> str | None:
    """Why the kernels cannot take this call, or None when they can (`cu_seqlens` is supported)."""
    del varlen, grouped, l2norm  # grouped heads and l2 normalisation exist only for the delta rules
    if p.op == "gla" or (p.delta and not DELTA_ENABLED):
        return f"no TileLang kernels for {p.op} yet"
    if p.chunk_size != 64:
        return f"the kernels use chunk_size 64, got {p.chunk_size}"
    op = "delta" if p.delta else p.op
    variants = [None if _find_variant is None else _find_variant(op, d, p.dtype, K, V) for d in ("fwd", "bwd")]
    if None in variants:
        return f"no kernel built for dtype {p.dtype}, K = {K}, V = {V} (built: bf16/fp16 with K = V in 64, 128, 256)"
    missing = sorted({v.target(prog) for v in variants for prog in v.programs} - set(registered()))
    if missing:
        return f"the built extension lacks {missing[0]} (and {len(missing) - 1} more): rebuild with `python build.py`"
    return None


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float, l2norm: bool = False):
    """Raw inputs (q, k, v in their dtype, not scaled, not normalised), as `_compute` hands them
    to this backend.

    q and k are l2-normalised here when asked (delta rules; differentiated by JAX). Tokens are laid
    out in chunk rows as for the xla backend (`fla_jax._layout`: every sequence starts at a chunk
    boundary, zeros in padding slots); the in-chunk gate cumulative sum is taken here, so its
    gradient (a reverse cumulative sum) is JAX's."""
    T = q.shape[1]
    C = p.chunk_size
    if l2norm:
        q, k = (l2_normalise(x.astype(jnp.float32)).astype(x.dtype) for x in (q, k))
    layout = _layout.make_layout(T, cu_seqlens, C)
    g32 = jnp.zeros(v.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    beta = beta.astype(jnp.float32) if p.delta else None
    q, k, v, g32, beta = (_layout.pack(x, layout) for x in (q, k, v, g32, beta))
    G = jnp.cumsum(g32.reshape(g32.shape[0], -1, C, g32.shape[2]), axis=2).reshape(g32.shape)
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    tokens = (q, k, v, G) + ((beta,) if p.delta else ())
    o, ht = _op(p, float(scale), *tokens, h0.astype(jnp.float32), *tables)
    return _layout.unpack(o, layout, T), ht


# Per-token arrays handed to the kernels' Python side (the delta rules add beta), with the axis
# letters of `fla_jax._partition`.
def _token_layouts(p: Problem) -> tuple[str, ...]:
    return ("bthk", "bthk", "bthv", "bth") + (("bth",) if p.delta else ())


def _targets(p: Problem, direction: str, K: int, V: int) -> dict[str, str]:
    """{program name: FFI target} of one variant."""
    variant = _find_variant("delta" if p.delta else p.op, direction, p.dtype, K, V)
    return {prog.name: variant.target(prog) for prog in variant.programs}


def _flat(C, q, *rest, tables):
    """Chunk rows `[B, NT * C, H, .]` -> one flat row, and the (first chunk, chunk count) of
    each sequence: the dense rows' own, or the varlen tables."""
    B, Lr = q.shape[:2]
    if not tables:
        nt = Lr // C
        tables = (jnp.arange(B, dtype=jnp.int32) * nt, jnp.full((B,), nt, jnp.int32))
    flat = lambda x: x.reshape(B * Lr, *x.shape[2:])
    return tuple(flat(x) for x in (q, *rest)), tables


def _like(x, dtype=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)


def _forward(p: Problem, scale: float, store_h: bool, *arrays):
    """`(o, ht)`, or `(o, h, ht)` with `store_h` (h: `[B, NT, HV, K, V]`, the state before each
    chunk, for the backward). `arrays`: the token arrays, h0, the varlen tables."""
    n = len(_token_layouts(p))
    tokens, h0, tables = arrays[:n], arrays[n], arrays[n + 1 :]
    C = p.chunk_size
    B, Lr, _, K = tokens[0].shape
    flat, (cstart, ccount) = _flat(C, *tokens, tables=tables)
    qf, kf, vf, Gf = flat[:4]
    HV, V = vf.shape[1:]
    dt = qf.dtype
    NT = qf.shape[0] // C
    if p.delta:  # WY preparation in XLA; the kernel reads w and u instead of v
        w, u = _delta_prepare(C, kf, vf, Gf, flat[4])
        ins, extra = (qf, kf, w.astype(dt), u.astype(dt)), (_like(vf),)  # extra result: v_new
    else:
        ins, extra = (qf, kf, vf), ()
    h = (jax.ShapeDtypeStruct((NT, HV, K, V), dt),) if store_h else ()
    out = _call(
        _targets(p, "fwd", K, V)["fused_h" if store_h else "fused"],
        (_like(vf), *extra, *h, _like(h0, jnp.float32)), *ins, Gf, h0, cstart, ccount, scale=np.float32(scale),
    )
    h = tuple(x.reshape(B, NT // B, *x.shape[1:]) for x in out[1 + len(extra) : -1])
    return (out[0].reshape(B, Lr, HV, V), *h, out[-1])


def _backward(p: Problem, scale: float, *arrays):
    """Gradients of the token arrays and of h0, from (token arrays, h, tables, do, dht)."""
    n = len(_token_layouts(p))
    tokens, h, tables, (do, dht) = arrays[:n], arrays[n], arrays[n + 1 : -2], arrays[-2:]
    C = p.chunk_size
    B, Lr, _, K = tokens[0].shape
    flat, (cstart, ccount) = _flat(C, *tokens, tables=tables)
    qf, kf, vf, Gf = flat[:4]
    V = vf.shape[-1]
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    s = np.float32(scale)
    bwd = _targets(p, "bwd", K, V)
    dht = dht.astype(jnp.float32)
    rows = lambda x, dt: x.reshape(B, Lr, *x.shape[1:]).astype(dt)
    if not p.delta:
        dh, dh0 = _call(bwd["dh"], (_like(hf), _like(dht)), qf, dof, Gf, dht, cstart, ccount, scale=s)
        grads = _call(bwd["dqkvg"], (_like(qf), _like(kf), _like(vf), _like(Gf)), qf, kf, vf, Gf, hf, dof, dh, scale=s)
        return (*(rows(g, g.dtype) for g in grads), dh0)
    # delta rules: the reverse state-gradient pass in the kernel, then JAX's VJP of one chunk's
    # forward given its state (`_delta_local`) and of the WY preparation, parallel over chunks
    (w, u), prep_vjp = jax.vjp(lambda *a: _delta_prepare(C, *a), kf, vf, Gf, flat[4])
    wd, ud = w.astype(qf.dtype), u.astype(qf.dtype)
    dh, dh0 = _call(bwd["dh"], (_like(hf), _like(dht)), qf, kf, wd, dof, Gf, dht, cstart, ccount, scale=s)
    f32 = lambda x: x.astype(jnp.float32)  # the VJP in float32, on the inputs as the kernels saw them
    _, local_vjp = jax.vjp(lambda *a: _delta_local(C, scale, *a), f32(qf), f32(kf), f32(wd), f32(ud), Gf, hf)
    dq, dk, dw, du, dG, _ = local_vjp((f32(dof), f32(dh)))
    dk2, dv, dG2, dbeta = prep_vjp((dw, du))
    return (rows(dq, qf.dtype), rows(dk + dk2, kf.dtype), rows(dv, vf.dtype), rows(dG + dG2, jnp.float32),
            rows(dbeta, jnp.float32), dh0)


@functools.lru_cache(maxsize=None)
def _partitioned(p: Problem, scale: float, direction: str, varlen: bool):
    """The forward (`fwd`, `fwd_h`: with stored states) or backward as one custom-partitioned
    function: split along batch and heads like its operands, T, K and V whole on every device
    (see `fla_jax._partition`). Varlen calls (one row) carry the per-sequence tables and initial
    states whole."""
    state, tables = ("nhkv", ("n", "n")) if varlen else ("bhkv", ())
    tokens = _token_layouts(p)
    if direction == "bwd":
        ins, outs = tokens + ("bchkv",) + tables + ("bthv", state), tokens + (state,)
        fn = functools.partial(_backward, p, scale)
    else:
        ins = tokens + (state,) + tables
        outs = ("bthv", "bchkv", state) if direction == "fwd_h" else ("bthv", state)
        fn = functools.partial(_forward, p, scale, direction == "fwd_h")
    return _partition.batch_head_partitioned(fn, ins, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _op(p, scale, *arrays):
    """`(o, ht)` from (token arrays, h0, varlen tables); gradients by the backward kernels."""
    n = len(_token_layouts(p))
    return _partitioned(p, scale, "fwd", len(arrays) > n + 1)(*arrays)


def _op_fwd(p, scale, *arrays):
    n = len(_token_layouts(p))
    o, h, ht = _partitioned(p, scale, "fwd_h", len(arrays) > n + 1)(*arrays)
    return (o, ht), (arrays[:n], h, arrays[n + 1 :])


def _op_bwd(p, scale, res, ct):
    tokens, h, tables = res
    do, dht = ct
    grads = _partitioned(p, scale, "bwd", bool(tables))(*tokens, h, *tables, do.astype(tokens[0].dtype), dht)
    return (*grads, *(None for _ in tables))


_op.defvjp(_op_fwd, _op_bwd)


# ----------------------------------------------------------------------------- delta rules
# chunk_delta_rule / chunk_gated_delta_rule: the WY preparation and the per-chunk VJPs in XLA, the
# sequential passes in `kernels/delta/`. Switched off by DELTA_ENABLED until they pass on a GPU.


def _delta_prepare(C: int, k, v, G, beta):
    """WY preparation on the flat chunk layout, float32 throughout (no TF32; `fla_jax.xla`'s WY
    math): `w, u` `[L, HV, .]`. k `[L, H, K]` (expanded to the HV value heads here), v `[L, HV, V]`,
    G and beta `[L, HV]`."""
    HV = v.shape[1]
    row = lambda x: xla._chunks(x.astype(jnp.float32)[None], C)  # [1, HV, NT, C, .]
    kc, vc, Gc, bc = row(jnp.repeat(k, HV // k.shape[1], axis=1)), row(v), row(G), row(beta)
    Tm = xla.delta_solve(xla.wy_matrix(kc, Gc, bc))
    w, u = xla.wy_apply(Tm, kc, vc, Gc, bc, precision=jax.lax.Precision.HIGHEST)
    return xla._unchunk(w)[0], xla._unchunk(u)[0]


def _delta_local(C: int, scale: float, q, k, w, u, G, h):
    """One chunk of the delta-rule forward, every chunk at once, given the state before it:
    `(o, state after)`. Flat layout; q, k `[L, H, K]`, w `[L, HV, K]`, u `[L, HV, V]`,
    G `[L, HV]`, h `[NT, HV, K, V]`. Differentiated by JAX for the parallel part of the backward."""
    L, H, K = q.shape
    HV, V = u.shape[1:]
    NT = L // C
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    ch = lambda x: x.astype(f32).reshape(NT, C, *x.shape[1:])
    qc, kc = (ch(jnp.repeat(x, HV // H, axis=1)) for x in (q, k))
    wc, uc, Gc, hf = ch(w), ch(u), ch(G), h.astype(f32)
    vn = uc - jnp.einsum("nchk,nhkv->nchv", wc, hf, precision=hi)
    i, j = jnp.arange(C)[:, None, None], jnp.arange(C)[None, :, None]
    decay = jnp.exp(jnp.where(i >= j, Gc[:, :, None, :] - Gc[:, None, :, :], -jnp.inf))  # [NT, i, j, HV]
    A = jnp.einsum("nihk,njhk->nijh", qc, kc, precision=hi) * decay * scale
    o = scale * jnp.einsum("nchk,nhkv->nchv", qc * jnp.exp(Gc)[..., None], hf, precision=hi)
    o = o + jnp.einsum("nijh,njhv->nihv", A, vn, precision=hi)
    glast = Gc[:, -1]  # [NT, HV]
    kd = kc * jnp.exp(glast[:, None] - Gc)[..., None]
    after = jnp.exp(glast)[..., None, None] * hf + jnp.einsum("nchk,nchv->nhkv", kd, vn, precision=hi)
    return o.reshape(L, HV, V), after
