"""Argument checks shared by the public ops. Every message names the argument, what it got and
what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

INPUT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def array(name: str, x, *, rank: int | None = None, floating: bool = True) -> jax.Array:
    if isinstance(x, (int, float, bool)) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array, got {type(x).__name__}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"`{name}` must have rank {rank}, got shape {tuple(x.shape)}")
    if floating and jnp.dtype(x.dtype).name not in INPUT_DTYPES:
        raise TypeError(f"`{name}` must have a floating dtype in {INPUT_DTYPES}, got {jnp.dtype(x.dtype).name}")
    return jnp.asarray(x)


def shape(name: str, x: jax.Array, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"`{name}` must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def qkv(q, k, v, *, grouped: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checks `q, k [B, T, H, K]` and `v [B, T, HV, V]` (HV == H unless `grouped`)."""
    q = array("q", q, rank=4)
    k = array("k", k, rank=4)
    v = array("v", v, rank=4)
    B, T, H, K = q.shape
    shape("k", k, q.shape, "[B, T, H, K] like q")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"`q`, `k` and `v` must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if T < 1:
        raise ValueError(f"the sequence length T must be >= 1, got q of shape {tuple(q.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"`v` must have shape [B, T, HV, V] with B, T = {(B, T)} from q, got {tuple(v.shape)}")
    HV = v.shape[2]
    if grouped:
        if HV % H:
            raise ValueError(f"`v` heads HV = {HV} must be a multiple of the q/k heads H = {H}")
    elif HV != H:
        raise ValueError(f"`v` must have H = {H} heads like q, got shape {tuple(v.shape)}")
    if K < 1 or v.shape[3] < 1:
        raise ValueError(f"head dims must be >= 1, got K = {K}, V = {v.shape[3]}")
    return q, k, v


def gate(name: str, x, expected: tuple[int, ...], what: str) -> jax.Array:
    x = array(name, x, rank=len(expected))
    shape(name, x, expected, what)
    return x


def scalar_gate(g, g_gamma, B: int, T: int, H: int) -> jax.Array | None:
    """Simple GLA's decay as `[B, T, H]` (or None): `g [B, T, H]`, or `g_gamma [H]` broadcast over B and T;
    at most one of them."""
    if g is not None and g_gamma is not None:
        raise ValueError("pass at most one of `g` ([B, T, H]) and `g_gamma` ([H]), got both")
    if g is not None:
        return gate("g", g, (B, T, H), "[B, T, H]")
    if g_gamma is not None:
        g_gamma = gate("g_gamma", g_gamma, (H,), "[H]")
        return jnp.broadcast_to(g_gamma.astype(jnp.promote_types(g_gamma.dtype, jnp.float32)), (B, T, H))
    return None


def scale(scale, K: int) -> float:
    if scale is None:
        return K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"`scale` must be a Python float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"`scale` must be finite, got {scale}")
    return scale


def cu_seqlens(cu, B: int, T: int) -> tuple[jax.Array | None, jax.Array | None]:
    """Checks `cu_seqlens [N + 1]`: `(cu as int32, valid)`.

    Concrete values are checked here (a ValueError names them). Traced values cannot be: then
    `valid` (`cu_seqlens_valid`) is a traced bool scalar, the table returned is the user's where it
    is valid and otherwise one that no kernel can read out of bounds with (a single sequence of all T
    tokens, the others empty), and the op makes every output NaN where `valid` is False.
    (`fla_jax.check_cu_seqlens` reports an invalid table as an error under checkify, where a user asks:
    a check inside every op would make its jaxpr effectful, which `jax.export` cannot serialize.)"""
    if cu is None:
        return None, None
    cu = array("cu_seqlens", cu, rank=1, floating=False)
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"`cu_seqlens` must have an integer dtype, got {cu.dtype}")
    if cu.shape[0] < 2:
        raise ValueError(f"`cu_seqlens` must have shape [N + 1] with N >= 1, got {tuple(cu.shape)}")
    if B != 1:
        raise ValueError(f"with `cu_seqlens` the batch size B must be 1 (sequences packed along T), got B = {B}")
    if _concrete(cu) is not None:
        check_cu_seqlens(cu, T)
        return cu.astype(jnp.int32), None
    valid = cu_seqlens_valid(cu, T)
    fallback = jnp.full(cu.shape, T, jnp.int32).at[0].set(0)
    return jnp.where(valid, cu.astype(jnp.int32), fallback), valid


def cu_seqlens_valid(cu, T: int):
    """Whether `cu` starts at 0, ends at T and never decreases: a bool for NumPy values (NumPy's own ops:
    jnp's would be staged inside a trace), else a bool scalar array; compared in its own dtype (a cast to
    int32 first could wrap an out-of-range value into range)."""
    xp = np if isinstance(cu, np.ndarray) else jnp
    return (cu[0] == 0) & (cu[-1] == T) & xp.all(cu[1:] >= cu[:-1])


def check_cu_seqlens(cu_seqlens, T: int) -> None:
    """Checks a `cu_seqlens` table for a packed row of `T` tokens: a ValueError where its values are
    concrete and invalid; where they are traced, a `jax.experimental.checkify.check` (call it inside a
    function that `checkify.checkify` transforms). The ops themselves answer an invalid traced table
    with NaN outputs and no error."""
    cu = array("cu_seqlens", cu_seqlens, rank=1, floating=False)
    what = f"`cu_seqlens` must start at 0, end at T = {T} and not decrease"
    values = _concrete(cu)
    if values is None:
        checkify.check(cu_seqlens_valid(cu, T), what)
    elif not bool(cu_seqlens_valid(values, T)):
        raise ValueError(f"{what}, got {values.tolist()}")


def _concrete(x) -> np.ndarray | None:
    """`x`'s values, or None where they are traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def initial_state(h0, N: int, H: int, K: int, V: int, what: str) -> jax.Array | None:
    if h0 is None:
        return None
    h0 = array("initial_state", h0, rank=4)
    shape("initial_state", h0, (N, H, K, V), what)
    return h0


def flag(name: str, x) -> bool:
    """A Python or NumPy bool (static: it decides what the op computes)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool, got {type(x).__name__}")
    return bool(x)


def chunk_size(c) -> int:
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c not in (16, 32, 64, 128):
        raise ValueError(f"`chunk_size` must be one of (16, 32, 64, 128), got {c!r}")
    return int(c)
