"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA's forward (`kernels/simple_gla/fwd.py`: chunk states, then the output),
bf16/fp16 inputs, K = V in {64, 128, 256}, dense batches. Its backward is still the `xla`
backend's (recompute, then differentiate the chunked math); the fused backward kernel is open
work. Everything else answers `unsupported(...)` with the reason, and "auto" falls back to `xla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _layout, xla
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


def registered() -> list[str]:
    """The FFI targets this install registered."""
    return [] if _ext is None else sorted(_ext.registrations())


def status() -> tuple[bool, str | None]:
    """Whether the backend can run here, and why not."""
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


def unsupported(p: Problem, K: int, V: int, varlen: bool) -> str | None:
    """Why the kernels cannot take this call, or None when they can."""
    if p.op != "simple_gla":
        return f"no TileLang kernels for {p.op} yet"
    if varlen:
        return "cu_seqlens is not supported by the TileLang kernels yet"
    if p.chunk_size != 64:
        return f"the kernels use chunk_size 64, got {p.chunk_size}"
    if _find_variant is None or _find_variant(p.op, "fwd", p.dtype, K, V) is None:
        return f"no kernel built for dtype {p.dtype}, K = {K}, V = {V} (built: bf16/fp16 with K = V in 64, 128, 256)"
    return None


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float):
    """Raw inputs (q, k, v in their dtype, not scaled), as `_compute` hands them to this backend."""
    del beta, cu_seqlens  # simple GLA, dense only (see `unsupported`)
    g32 = jnp.zeros(q.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    return _simple_gla(p, float(scale), q, k, v, g32, h0.astype(jnp.float32))


def _forward(p: Problem, scale: float, q, k, v, g, h0):
    B, T, H, K = q.shape
    V = v.shape[-1]
    variant = _find_variant(p.op, "fwd", p.dtype, K, V)
    C = variant.chunk
    Tp = _layout.cdiv(T, C) * C
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g = map(pad, (q, k, v, g))
    NT = Tp // C
    G = jnp.cumsum(g.reshape(B, NT, C, H), axis=2).reshape(B, Tp, H)
    h_target, o_target = (variant.target(prog) for prog in variant.programs)
    h, ht = jax.ffi.ffi_call(
        h_target,
        (jax.ShapeDtypeStruct((B, NT, H, K, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)),
        vmap_method="sequential",
    )(k, v, G, h0)
    o = jax.ffi.ffi_call(o_target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, k, v, G, h, scale=np.float32(scale)
    )
    return o[:, :T], ht


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _simple_gla(p, scale, q, k, v, g, h0):
    return _forward(p, scale, q, k, v, g, h0)


def _simple_gla_fwd(p, scale, q, k, v, g, h0):
    return _forward(p, scale, q, k, v, g, h0), (q, k, v, g, h0)


def _simple_gla_bwd(p, scale, res, ct):
    def chunked(q, k, v, g, h0):
        cdt = p.compute_dtype
        o, ht = xla.run(p, q.astype(cdt) * scale, k.astype(cdt), v.astype(cdt), g, None, h0, None)
        return o.astype(q.dtype), ht

    _, vjp = jax.vjp(chunked, *res)
    return vjp(ct)


_simple_gla.defvjp(_simple_gla_fwd, _simple_gla_bwd)
