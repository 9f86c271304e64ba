"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA (`kernels/simple_gla/`): forward (one pass, states kept on chip) and
backward (states recomputed, reverse state-gradient pass, one fused dq/dk/dv/dg consumer), bf16/fp16
inputs, K = V in {64, 128, 256}, dense batches and `cu_seqlens`. Everything else answers `unsupported(...)` with the
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
    del varlen
    if p.op != "simple_gla":
        return f"no TileLang kernels for {p.op} yet"
    if grouped or l2norm:
        return "grouped heads and in-kernel l2 normalisation are not supported by the TileLang kernels yet"
    if p.chunk_size != 64:
        return f"the kernels use chunk_size 64, got {p.chunk_size}"
    variants = [None if _find_variant is None else _find_variant(p.op, d, p.dtype, K, V) for d in ("fwd", "bwd")]
    if None in variants:
        return f"no kernel built for dtype {p.dtype}, K = {K}, V = {V} (built: bf16/fp16 with K = V in 64, 128, 256)"
    missing = sorted({v.target(prog) for v in variants for prog in v.programs} - set(registered()))
    if missing:
        return f"the built extension lacks {missing[0]} (and {len(missing) - 1} more): rebuild with `python build.py`"
    return None


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float):
    """Raw inputs (q, k, v in their dtype, not scaled), as `_compute` hands them to this backend.

    Tokens are laid out in chunk rows as for the xla backend (`fla_jax._layout`: every sequence
    starts at a chunk boundary, zeros in padding slots); the in-chunk gate cumulative sum is taken
    here, so its gradient (a reverse cumulative sum) is JAX's."""
    del beta  # simple GLA
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
