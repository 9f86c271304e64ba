"""The canonical call every backend receives.

The public ops check their arguments and reduce themselves to one of two families:

* gated (`delta=False`): simple GLA (`g [B, T, H]`, scalar gate per head) and GLA
  (`g [B, T, H, K]`, a gate per key channel);
* delta (`delta=True`): the delta rule (`g` None) and GDN (`g [B, T, H]`), with `beta [B, T, H]`.

Backends then receive `q, k [B, T, H, K]` (q already multiplied by the scale, grouped heads already
expanded, l2 normalisation already applied), `v [B, T, H, V]`, `g` (None, `[B, T, H]` or
`[B, T, H, K]`), `beta` (`[B, T, H]` or None), `h0 [N, H, K, V]` and `cu_seqlens` (None or
`[N + 1]`), and return `o [B, T, H, V]` in the compute dtype and `ht [N, H, K, V]`.
Backends marked `raw` (`fla_jax._backends.Backend`, the TileLang kernels) get q, k, v as the
user passed them and the scale as a keyword, and do that preparation themselves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def l2_normalise(x):
    """`use_qk_l2norm_in_kernel`: `x / sqrt(sum(x^2) + 1e-6)` over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """Static description of one call (hashable: it is the custom_vjp's non-diff argument)."""

    op: str
    delta: bool
    chunk_size: int
    dtype: str  # name of the inputs' dtype; the compute dtype is float32 or float64

    @property
    def compute_dtype(self) -> np.dtype:
        return jnp.promote_types(jnp.dtype(self.dtype), jnp.float32)
