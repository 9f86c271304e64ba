"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA (`kernels/simple_gla/`): forward (one pass, states kept on chip) and
backward (states recomputed, reverse state-gradient pass, one fused dq/dk/dv/dg consumer), bf16/fp16
inputs, K = V in {64, 128, 256}, dense batches and `cu_seqlens`. The delta rules
(`kernels/delta/`: the sequential passes as kernels, the chunk-parallel parts in XLA) are built but
switched off (`DELTA_ENABLED`) until they pass on a GPU. Everything else answers `unsupported(...)` with the
reason, and "auto" falls back to `xla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _layout, _partition
from fla_jax._problem import Problem

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

    Tokens are laid out in chunk rows as for the xla backend (`fla_jax._layout`: every sequence
    starts at a chunk boundary, zeros in padding slots); the in-chunk gate cumulative sum is taken
    here, so its gradient (a reverse cumulative sum) is JAX's."""
    if p.delta:
        return run_delta(p, q, k, v, g, beta, h0, cu_seqlens, scale=scale, l2norm=l2norm)
    T = q.shape[1]
    C = p.chunk_size
    layout = _layout.make_layout(T, cu_seqlens, C)
    g32 = jnp.zeros(q.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    q, k, v, g32 = (_layout.pack(x, layout) for x in (q, k, v, g32))
    G = jnp.cumsum(g32.reshape(*g32.shape[:1], -1, C, g32.shape[2]), axis=2).reshape(g32.shape)
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    o, ht = _simple_gla(p, float(scale), q, k, v, G, h0.astype(jnp.float32), *tables)
    return _layout.unpack(o, layout, T), ht


def _targets(p: Problem, direction: str, K: int, V: int) -> dict[str, str]:
    """{program name: FFI target} of one variant."""
    variant = _find_variant(p.op, direction, p.dtype, K, V)
    return {prog.name: variant.target(prog) for prog in variant.programs}


def _flat(C, q, k, v, G, tables):
    """Chunk rows `[B, NT * C, H, .]` -> one flat row, and the (first chunk, chunk count) of
    each sequence: the dense rows' own, or the varlen tables."""
    B, Lr = q.shape[:2]
    if not tables:
        nt = Lr // C
        tables = (jnp.arange(B, dtype=jnp.int32) * nt, jnp.full((B,), nt, jnp.int32))
    flat = lambda x: x.reshape(B * Lr, *x.shape[2:])
    return (flat(q), flat(k), flat(v), flat(G)), tables


def _forward(p: Problem, scale: float, store_h: bool, q, k, v, G, h0, *tables):
    """`(o, ht)`, or `(o, h, ht)` with `store_h` (h: `[B, NT, H, K, V]`, the state before each
    chunk, for the backward)."""
    B, Lr, H, K = q.shape
    V = v.shape[-1]
    (qf, kf, vf, Gf), (cstart, ccount) = _flat(p.chunk_size, q, k, v, G, tables)
    o = jax.ShapeDtypeStruct(vf.shape, q.dtype)
    ht = jax.ShapeDtypeStruct(h0.shape, jnp.float32)
    NT = qf.shape[0] // p.chunk_size
    h = (jax.ShapeDtypeStruct((NT, H, K, V), q.dtype),) if store_h else ()
    out = _call(
        _targets(p, "fwd", K, V)["fused_h" if store_h else "fused"],
        (o, *h, ht), qf, kf, vf, Gf, h0, cstart, ccount, scale=np.float32(scale),
    )
    return (out[0].reshape(B, Lr, H, V), *(x.reshape(B, NT // B, H, K, V) for x in out[1:-1]), out[-1])


def _backward(p: Problem, scale: float, q, k, v, G, h, *rest):
    B, Lr, H, K = q.shape
    V = v.shape[-1]
    tables, (do, dht) = rest[:-2], rest[-2:]
    (qf, kf, vf, Gf), (cstart, ccount) = _flat(p.chunk_size, q, k, v, G, tables)
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    bwd = _targets(p, "bwd", K, V)
    s = np.float32(scale)
    dh, dh0 = _call(bwd["dh"], (_like(hf), _like(dht, jnp.float32)), qf, dof, Gf, dht.astype(jnp.float32), cstart, ccount, scale=s)
    dq, dk, dv, dG = _call(bwd["dqkvg"], (_like(qf), _like(kf), _like(vf), _like(Gf)), qf, kf, vf, Gf, hf, dof, dh, scale=s)
    unflat = lambda x: x.reshape(B, Lr, *x.shape[1:])
    return unflat(dq), unflat(dk), unflat(dv), unflat(dG), dh0


def _like(x, dtype=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)


@functools.lru_cache(maxsize=None)
def _partitioned(p: Problem, scale: float, direction: str, varlen: bool):
    """The forward (`fwd`, `fwd_h`: with stored states) or backward as one custom-partitioned
    function: split along batch and heads like its operands, T, K and V whole on every device
    (see `fla_jax._partition`). Varlen calls (one row) carry the per-sequence tables and initial
    states whole."""
    state, tables = ("nhkv", ("n", "n")) if varlen else ("bhkv", ())
    ins = ("bthk", "bthk", "bthv", "bth", state) + tables
    if direction == "fwd":
        fn, outs = functools.partial(_forward, p, scale, False), ("bthv", state)
    elif direction == "fwd_h":
        fn, outs = functools.partial(_forward, p, scale, True), ("bthv", "bchkv", state)
    else:
        fn = functools.partial(_backward, p, scale)
        ins = ("bthk", "bthk", "bthv", "bth", "bchkv") + tables + ("bthv", state)
        outs = ("bthk", "bthk", "bthv", "bth", state)
    return _partition.batch_head_partitioned(fn, ins, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _simple_gla(p, scale, q, k, v, G, h0, *tables):
    return _partitioned(p, scale, "fwd", bool(tables))(q, k, v, G, h0, *tables)


def _simple_gla_fwd(p, scale, q, k, v, G, h0, *tables):
    o, h, ht = _partitioned(p, scale, "fwd_h", bool(tables))(q, k, v, G, h0, *tables)
    return (o, ht), (q, k, v, G, h, tables)


def _simple_gla_bwd(p, scale, res, ct):
    q, k, v, G, h, tables = res
    do, dht = ct
    grads = _partitioned(p, scale, "bwd", bool(tables))(q, k, v, G, h, *tables, do.astype(q.dtype), dht)
    return (*grads, *(None for _ in tables))


_simple_gla.defvjp(_simple_gla_fwd, _simple_gla_bwd)


# ----------------------------------------------------------------------------- delta rules
# chunk_delta_rule / chunk_gated_delta_rule: WY preparation and the per-chunk VJPs in XLA, the
# sequential passes in `kernels/delta/`. Switched off by DELTA_ENABLED until they pass on a GPU.


def _delta_prepare(C: int, k, v, G, beta):
    """WY preparation on the flat chunk layout, float32 throughout (no TF32): per chunk
    `T = (I + tril(Diag(beta)(K K^T * Gamma), -1))^{-1}`, `w = T (k beta exp(G))`, `u = T (v beta)`.
    k `[L, H, K]` (expanded to the HV value heads here), v `[L, HV, V]`, G and beta `[L, HV]`."""
    L, H, K = k.shape
    HV = v.shape[1]
    NT = L // C
    hi = jax.lax.Precision.HIGHEST
    kc = jnp.repeat(k.astype(jnp.float32), HV // H, axis=1).reshape(NT, C, HV, K)
    vc = v.astype(jnp.float32).reshape(NT, C, HV, -1)
    Gc, bc = G.reshape(NT, C, HV), beta.astype(jnp.float32).reshape(NT, C, HV)
    kk = jnp.einsum("nihk,njhk->nhij", kc, kc, precision=hi)
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    decay = jnp.exp(jnp.where(i > j, jnp.moveaxis(Gc, 1, 2)[..., :, None] - jnp.moveaxis(Gc, 1, 2)[..., None, :], -jnp.inf))
    A = jnp.moveaxis(bc, 1, 2)[..., :, None] * kk * decay  # [NT, HV, C, C], zero on and above the diagonal
    eye = jnp.eye(C, dtype=jnp.float32)
    Tm = jax.lax.linalg.triangular_solve(eye + A, jnp.broadcast_to(eye, A.shape), left_side=True, lower=True, unit_diagonal=True)
    w = jnp.einsum("nhij,njhk->nihk", Tm, kc * (bc * jnp.exp(Gc))[..., None], precision=hi)
    u = jnp.einsum("nhij,njhv->nihv", Tm, vc * bc[..., None], precision=hi)
    return w.reshape(L, HV, K), u.reshape(L, HV, -1), Tm


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


def _delta_targets(p: Problem, K: int, V: int) -> tuple[dict, dict]:
    return (
        {pr.name: v.target(pr) for v in [_find_variant("delta", "fwd", p.dtype, K, V)] for pr in v.programs},
        {pr.name: v.target(pr) for v in [_find_variant("delta", "bwd", p.dtype, K, V)] for pr in v.programs},
    )


def _delta_kernel_fwd(p: Problem, scale: float, store_h: bool, q, k, v, G, beta, h0, *tables):
    """Forward on chunk rows `[B, Lr, .]`: `(o, ht)`, or `(o, h, ht)` with `store_h`."""
    C = p.chunk_size
    B, Lr = q.shape[:2]
    K, V = q.shape[-1], v.shape[-1]
    (qf, kf, vf, Gf), (cstart, ccount) = _flat(C, q, k, v, G, tables)
    w, u, _ = _delta_prepare(C, kf, vf, Gf, beta.reshape(Gf.shape))
    NT = qf.shape[0] // C
    fwd, _ = _delta_targets(p, K, V)
    h = (jax.ShapeDtypeStruct((NT, *vf.shape[1:2], K, V), q.dtype),) if store_h else ()
    out = _call(
        fwd["fused_h" if store_h else "fused"], (_like(vf), _like(vf), *h, _like(h0, jnp.float32)),
        qf, kf, w.astype(q.dtype), u.astype(q.dtype), Gf, h0, cstart, ccount, scale=np.float32(scale),
    )
    o = out[0].reshape(B, Lr, *vf.shape[1:])
    return (o, *(x.reshape(B, NT // B, *x.shape[1:]) for x in out[2:-1]), out[-1])


def _delta_kernel_bwd(p: Problem, scale: float, q, k, v, G, beta, h, *rest):
    """Backward: the reverse state-gradient pass in the kernel, then JAX's VJP of the per-chunk
    forward (`_delta_local`) and of the WY preparation, both parallel over chunks."""
    C = p.chunk_size
    B, Lr = q.shape[:2]
    K, V = q.shape[-1], v.shape[-1]
    tables, (do, dht) = rest[:-2], rest[-2:]
    (qf, kf, vf, Gf), (cstart, ccount) = _flat(C, q, k, v, G, tables)
    betaf = beta.reshape(Gf.shape)
    (w, u, _), prep_vjp = jax.vjp(lambda k_, v_, G_, b_: _delta_prepare(C, k_, v_, G_, b_), kf, vf, Gf, betaf)
    wd, ud = w.astype(q.dtype), u.astype(q.dtype)
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    _, bwd = _delta_targets(p, K, V)
    dh, dh0 = _call(bwd["dh"], (_like(hf), _like(dht, jnp.float32)), qf, kf, wd, dof, Gf,
                    dht.astype(jnp.float32), cstart, ccount, scale=np.float32(scale))
    # the VJP in float32 (inputs as the kernels saw them, rounded to the input dtype)
    f32 = lambda x: x.astype(jnp.float32)
    _, local_vjp = jax.vjp(lambda *a: _delta_local(C, scale, *a), f32(qf), f32(kf), f32(wd), f32(ud), Gf, hf)
    dq, dk, dw, du, dG, _ = local_vjp((f32(dof), f32(dh)))
    dk2, dv, dG2, dbeta = prep_vjp((dw, du, jnp.zeros((qf.shape[0] // C, vf.shape[1], C, C), jnp.float32)))
    rows = lambda x, dt: x.reshape(B, Lr, *x.shape[1:]).astype(dt)
    return (rows(dq, q.dtype), rows(dk + dk2, k.dtype), rows(dv, v.dtype), rows(dG + dG2, jnp.float32),
            rows(dbeta, jnp.float32), dh0)


@functools.lru_cache(maxsize=None)
def _delta_partitioned(p: Problem, scale: float, direction: str, varlen: bool):
    """As `_partitioned`, for the delta rules (v, G and beta carry the value heads)."""
    state, tables = ("nhkv", ("n", "n")) if varlen else ("bhkv", ())
    ins = ("bthk", "bthk", "bthv", "bth", "bth", state) + tables
    if direction == "fwd":
        fn, outs = functools.partial(_delta_kernel_fwd, p, scale, False), ("bthv", state)
    elif direction == "fwd_h":
        fn, outs = functools.partial(_delta_kernel_fwd, p, scale, True), ("bthv", "bchkv", state)
    else:
        fn = functools.partial(_delta_kernel_bwd, p, scale)
        ins = ("bthk", "bthk", "bthv", "bth", "bth", "bchkv") + tables + ("bthv", state)
        outs = ("bthk", "bthk", "bthv", "bth", "bth", state)
    return _partition.batch_head_partitioned(fn, ins, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _delta(p, scale, q, k, v, G, beta, h0, *tables):
    return _delta_partitioned(p, scale, "fwd", bool(tables))(q, k, v, G, beta, h0, *tables)


def _delta_fwd_rule(p, scale, q, k, v, G, beta, h0, *tables):
    o, h, ht = _delta_partitioned(p, scale, "fwd_h", bool(tables))(q, k, v, G, beta, h0, *tables)
    return (o, ht), (q, k, v, G, beta, h, tables)


def _delta_bwd_rule(p, scale, res, ct):
    q, k, v, G, beta, h, tables = res
    do, dht = ct
    grads = _delta_partitioned(p, scale, "bwd", bool(tables))(q, k, v, G, beta, h, *tables, do.astype(q.dtype), dht)
    return (*grads, *(None for _ in tables))


_delta.defvjp(_delta_fwd_rule, _delta_bwd_rule)


def run_delta(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float, l2norm: bool):
    """The delta rules on raw inputs: l2 normalisation (JAX, differentiated by JAX), chunk layout,
    in-chunk gate cumsum, then the kernels."""
    T_ = q.shape[1]
    C = p.chunk_size
    if l2norm:
        nrm = lambda x: (x * jax.lax.rsqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)).astype(x.dtype)
        q, k = nrm(q), nrm(k)
    layout = _layout.make_layout(T_, cu_seqlens, C)
    g32 = jnp.zeros(beta.shape, jnp.float32) if g is None else g.astype(jnp.float32)
    q, k, v, g32, b32 = (_layout.pack(x, layout) for x in (q, k, v, g32, beta.astype(jnp.float32)))
    G = jnp.cumsum(g32.reshape(g32.shape[0], -1, C, g32.shape[2]), axis=2).reshape(g32.shape)
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    o, ht = _delta(p, float(scale), q, k, v, G, b32, h0.astype(jnp.float32), *tables)
    return _layout.unpack(o, layout, T_), ht
