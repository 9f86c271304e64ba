"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA (`kernels/simple_gla/`): forward (chunk states, then the output) and
backward (states recomputed, reverse state-gradient pass, one fused dq/dk/dv/dg consumer), bf16/fp16
inputs, K = V in {64, 128, 256}, dense batches. Everything else answers `unsupported(...)` with the
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
    """Why the kernels cannot take this call, or None when they can."""
    if p.op != "simple_gla":
        return f"no TileLang kernels for {p.op} yet"
    if grouped or l2norm:
        return "grouped heads and in-kernel l2 normalisation are not supported by the TileLang kernels yet"
    if varlen:
        return "cu_seqlens is not supported by the TileLang kernels yet"
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
    """Raw inputs (q, k, v in their dtype, not scaled), as `_compute` hands them to this backend."""
    del beta, cu_seqlens  # simple GLA, dense only (see `unsupported`)
    g32 = jnp.zeros(q.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    return _simple_gla(p, float(scale), q, k, v, g32, h0.astype(jnp.float32))


def _targets(p: Problem, direction: str, K: int, V: int) -> tuple:
    variant = _find_variant(p.op, direction, p.dtype, K, V)
    return variant.chunk, tuple(variant.target(prog) for prog in variant.programs)


def _chunked(x, C):
    """Zero-pads the time axis to whole chunks (zero k, v and gates change no state)."""
    Tp = _layout.cdiv(x.shape[1], C) * C
    return jnp.pad(x, [(0, 0), (0, Tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _chunk_cumsum(g, C):
    B, Tp, H = g.shape
    return jnp.cumsum(g.reshape(B, Tp // C, C, H), axis=2).reshape(B, Tp, H)


def _forward(p: Problem, scale: float, q, k, v, g, h0):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, (h_target, o_target) = _targets(p, "fwd", K, V)
    q, k, v, g = (_chunked(x, C) for x in (q, k, v, g))
    NT = q.shape[1] // C
    G = _chunk_cumsum(g, C)
    h, ht = _call(
        h_target, (jax.ShapeDtypeStruct((B, NT, H, K, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)),
        k, v, G, h0,
    )
    o = _call(o_target, jax.ShapeDtypeStruct(q.shape, q.dtype), q, k, v, G, h, scale=np.float32(scale))
    return o[:, :T], ht


def _backward(p: Problem, scale: float, q, k, v, g, h0, do, dht):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, (h_target, _) = _targets(p, "fwd", K, V)
    _, (dh_target, dqkvg_target) = _targets(p, "bwd", K, V)
    q, k, v, g, do = (_chunked(x, C) for x in (q, k, v, g, do))
    Tp = q.shape[1]
    NT = Tp // C
    G = _chunk_cumsum(g, C)
    state = lambda dt: jax.ShapeDtypeStruct((B, NT, H, K, V), dt)
    final = jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)
    h, _ = _call(h_target, (state(q.dtype), final), k, v, G, h0)
    dh, dh0 = _call(dh_target, (state(q.dtype), final), q, do, G, dht.astype(jnp.float32), scale=np.float32(scale))
    like = lambda x, dt=None: jax.ShapeDtypeStruct(x.shape, dt or x.dtype)
    dq, dk, dv, dG = _call(
        dqkvg_target, (like(q), like(k), like(v), like(g, jnp.float32)), q, k, v, G, h, do, dh, scale=np.float32(scale)
    )
    dg = jnp.flip(jnp.cumsum(jnp.flip(dG.reshape(B, NT, C, H), 2), axis=2), 2).reshape(B, Tp, H)
    return dq[:, :T], dk[:, :T], dv[:, :T], dg[:, :T], dh0


@functools.lru_cache(maxsize=None)
def _partitioned(p: Problem, scale: float, direction: str):
    """The forward or backward as one custom-partitioned function: split along batch and heads
    like its operands, T, K and V whole on every device (see `fla_jax._partition`)."""
    if direction == "fwd":
        fn, ins, outs = _forward, ("bthk", "bthk", "bthv", "bth", "bhkv"), ("bthv", "bhkv")
    else:
        fn = _backward
        ins = ("bthk", "bthk", "bthv", "bth", "bhkv", "bthv", "bhkv")
        outs = ("bthk", "bthk", "bthv", "bth", "bhkv")
    return _partition.batch_head_partitioned(functools.partial(fn, p, scale), ins, outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _simple_gla(p, scale, q, k, v, g, h0):
    return _partitioned(p, scale, "fwd")(q, k, v, g, h0)


def _simple_gla_fwd(p, scale, q, k, v, g, h0):
    return _partitioned(p, scale, "fwd")(q, k, v, g, h0), (q, k, v, g, h0)


def _simple_gla_bwd(p, scale, res, ct):
    do, dht = ct
    return _partitioned(p, scale, "bwd")(*res, do.astype(res[0].dtype), dht)


_simple_gla.defvjp(_simple_gla_fwd, _simple_gla_bwd)
