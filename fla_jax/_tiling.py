"""How a call's head dims K and V map onto the kernels' programs, which are built per key head dim
(D in `HEAD_DIMS`), and the exact reshapes that do it.

The gated ops' programs (simple GLA, GLA: `GRID_V`) take V on their grid: V is read off the buffers, any
multiple of the programs' V block, so a call runs as it is, K padded to D and V to a multiple of `V_TILE`.

The delta rules' programs are built per D = K padded (their recurrence is not separable along K: `S^T k` mixes
the key channels). Their recurrence is separable along V (each value column of the state evolves on its own
given q, k, the gates and beta), so V is padded to `v_parts` blocks of D. The forward with no gradient takes V on
its grid (one inverse per value head for all of V); under a gradient, whose programs are square (K = V = D), the
backend splits V into its `v_parts` blocks (`split_parts`), each block one more value head: GDN's grouped value
heads (value head `j * v_parts + i` reads q/k head `j // (HV / H)`, as before), and joins them after
(`join_parts`, `join_grads`).

A K or V that is no multiple of its tile is padded with zeros, which change nothing (zero key channels write and
read no state; zero value columns stay zero). The planner `tiling` is pure; `fold` / `unfold` are the padding
around the kernels, plain XLA ops outside the kernels' custom VJP, so JAX differentiates them (the padding's
gradients dropped). The split into parts is inside the custom VJP (the forward with no gradient takes V whole), so
its gradients are joined by hand: the copies' summed (`join_grads`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fla_jax._layout import cdiv

# The ops whose programs take V on their grid (any multiple of `V_TILE`), not only V = K.
GRID_V = frozenset({"simple_gla", "gla"})
V_TILE = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Tiling:
    """The call's K, V on programs of key head dim D (K padded to D). `v_grid`: the programs take V on their
    grid, V padded to a multiple of `V_TILE`; else V is padded to `v_parts * D` (the delta rules: on the grid of the
    forward with no gradient, as `v_parts` value heads under a gradient). (`identity`: nothing to pad.)"""

    K: int
    V: int
    D: int
    v_parts: int = 1
    v_grid: bool = False

    @property
    def Vp(self) -> int:
        """V padded (to a multiple of `V_TILE`, or to `v_parts` blocks of D)."""
        return cdiv(self.V, V_TILE) * V_TILE if self.v_grid else self.v_parts * self.D

    @property
    def identity(self) -> bool:
        return self.K == self.D and self.V == self.Vp

    def __str__(self) -> str:
        pad = [f"{n} {x} padded to {p}" for n, x, p in (("K", self.K, self.D), ("V", self.V, self.Vp)) if x != p]
        if self.v_grid:
            where = f"K = {self.K}, V = {self.V} on the K = {self.D} programs, V on their grid"
        elif self.K == self.V == self.D:
            return f"K = V = {self.D}"
        else:
            where = f"K = {self.K}, V = {self.V} on the K = V = {self.D} programs"
            pad = ([f"V on the forward's grid, in {self.v_parts} parts as value heads under a gradient"] if self.v_parts > 1 else []) + pad
        return where + (f" ({'; '.join(pad)})" if pad else "")


def tiling(op: str, K: int, V: int, head_dims: tuple[int, ...]) -> Tiling | str:
    """The tiling of a call of `op` with head dims K and V on programs of the (ascending) `head_dims`,
    or why there is none: D the least head dim at least K."""
    fits = [d for d in head_dims if d >= K]
    if not fits:
        return f"K = {K} is above the largest head dim the kernels take ({head_dims[-1]})"
    D = fits[0]
    if op in GRID_V:
        return Tiling(K, V, D, v_grid=True)
    return Tiling(K, V, D, v_parts=cdiv(V, D))


def _copies(x, n: int):
    """`x [B, T, HV]` with each head repeated `n` times in a row (head `h n + j` is copy j of head h)."""
    return x if n == 1 else jnp.repeat(x, n, axis=2)


def fold(t: Tiling, *, q, k, v, g, beta, h0):
    """The call's arrays padded as the programs of head dim `t.D` take them (see the module's docstring).
    q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g None / `[B, T, HV]` / GLA's `[B, T, H, K]`, beta None or
    `[B, T, HV]`, h0 None or `[N, HV, K, V]`."""
    if t.identity:
        return q, k, v, g, beta, h0
    pad = lambda x, axis, n: x if x.shape[axis] == n else jnp.pad(x, [(0, n - x.shape[axis]) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])
    q, k = pad(q, -1, t.D), pad(k, -1, t.D)
    g = pad(g, -1, t.D) if g is not None and g.ndim == 4 else g  # (GLA's per-channel gates)
    v = pad(v, -1, t.Vp)
    h0 = None if h0 is None else pad(pad(h0, -2, t.D), -1, t.Vp)
    return q, k, v, g, beta, h0


def unfold(t: Tiling, o, ht):
    """The programs' `o [B, T, HV, V']` (in the input dtype) and `ht [N, HV, K', V']` (float32) as the
    call's `[B, T, HV, V]` and `[N, HV, K, V]`."""
    if t.identity:
        return o, ht
    return o[..., : t.V], ht[..., : t.K, : t.V]


# ----------------------------------------------------------------------------- V in parts as value heads
# The delta rules under a gradient: `m` blocks of D value columns, block i of value head j as value head `j m + i`.


def _heads(x, m: int):
    """`[B, T, HV, m D]` -> `[B, T, HV m, D]` (a reshape)."""
    return x.reshape(*x.shape[:2], x.shape[2] * m, x.shape[3] // m)


def _heads_join(x, m: int):
    """`[B, T, HV m, D]` -> `[B, T, HV, m D]` (`_heads`' inverse, a reshape)."""
    return x.reshape(*x.shape[:2], x.shape[2] // m, x.shape[3] * m)


def _state_parts(s, m: int):
    """States `[N, HV, K, m D]` -> `[N, HV m, K, D]`."""
    N, HV, K, V = s.shape
    return s.reshape(N, HV, K, m, V // m).transpose(0, 1, 3, 2, 4).reshape(N, HV * m, K, V // m)


def _state_join(s, m: int):
    """States `[N, HV m, K, D]` -> `[N, HV, K, m D]` (`_state_parts`' inverse)."""
    N, HVm, K, D = s.shape
    return s.reshape(N, HVm // m, m, K, D).transpose(0, 1, 3, 2, 4).reshape(N, HVm // m, K, m * D)


def split_parts(m: int, *, v, g, beta, h0):
    """v, the per-value-head g and beta (`[B, T, HV]`, copied per part) and h0 (or None) with V in m parts."""
    if m == 1:
        return v, g, beta, h0
    return _heads(v, m), _copies(g, m), _copies(beta, m), None if h0 is None else _state_parts(h0, m)


def join_parts(m: int, o, ht):
    """Outputs `o [B, T, HV m, D]`, states `ht [N, HV m, K, D]` (or `h0`'s cotangent) as `[B, T, HV, m D]`,
    `[N, HV, K, m D]`."""
    if m == 1:
        return o, ht
    return _heads_join(o, m), _state_join(ht, m)


def split_cotangents(m: int, do, dht):
    """The cotangents of `join_parts`' outputs (`dht` None where the loss takes no final state) in parts."""
    return (do, dht) if m == 1 else (_heads(do, m), None if dht is None else _state_parts(dht, m))


def join_grads(m: int, dv, dg, dbeta, dh0):
    """The gradients of `split_parts`' results as those of its arguments: the copies' summed."""
    if m == 1:
        return dv, dg, dbeta, dh0
    total = lambda x: x.reshape(*x.shape[:2], x.shape[2] // m, m).sum(-1)
    return _heads_join(dv, m), total(dg), total(dbeta), None if dh0 is None else _state_join(dh0, m)
