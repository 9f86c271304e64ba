"""How a call's head dims K and V map onto the kernels' programs, which are built per key head dim
(D in `HEAD_DIMS`), and the exact reshapes that do it.

The gated ops' programs (simple GLA, GLA: `GRID_V`) take V on their grid: V is read off the buffers, any
multiple of the programs' V block, so a call runs as it is, K padded to D and V to a multiple of `V_TILE`.

The delta rules' programs are square (K = V = D), D = K padded (their recurrence is not separable along K:
`S^T k` mixes the key channels). Their recurrence is separable along V (each value column of the state evolves
on its own given q, k, the gates and beta), so V is split into `v_parts` blocks of D, each block one more value
head: GDN's grouped value heads (value head `j * v_parts + i` reads q/k head `j // (HV / H)`, as before).

A K or V that is no multiple of its tile is padded with zeros, which change nothing (zero key channels write and
read no state; zero value columns stay zero). The planner `tiling` is pure; `fold` / `unfold` are the reshapes
around the kernels. They are plain XLA ops outside the kernels' custom VJP, so JAX differentiates them (the
copies' gradients are summed, the padding's dropped).
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
    grid, V padded to a multiple of `V_TILE`; else they are square, V padded to `v_parts * D` and run as
    `v_parts` value heads. (`identity`: nothing to do.)"""

    K: int
    V: int
    D: int
    v_parts: int = 1
    v_grid: bool = False

    @property
    def Vp(self) -> int:
        """V as the programs see it (padded; `v_parts` heads of D where they are square)."""
        return cdiv(self.V, V_TILE) * V_TILE if self.v_grid else self.v_parts * self.D

    @property
    def identity(self) -> bool:
        return self.K == self.D and self.V == self.Vp and self.v_parts == 1

    def __str__(self) -> str:
        pad = [f"{n} {x} padded to {p}" for n, x, p in (("K", self.K, self.D), ("V", self.V, self.Vp)) if x != p]
        if self.v_grid:
            where = f"K = {self.K}, V = {self.V} on the K = {self.D} programs, V on their grid"
        elif self.K == self.V == self.D:
            return f"K = V = {self.D}"
        else:
            where = f"K = {self.K}, V = {self.V} on the K = V = {self.D} programs"
            pad = ([f"V in {self.v_parts} parts as value heads"] if self.v_parts > 1 else []) + pad
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
    """The call's arrays as the programs of head dim `t.D` take them (see the module's docstring).
    q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g None / `[B, T, HV]` / GLA's `[B, T, H, K]`, beta None or
    `[B, T, HV]`, h0 None or `[N, HV, K, V]`."""
    if t.identity:
        return q, k, v, g, beta, h0
    pad = lambda x, axis, n: x if x.shape[axis] == n else jnp.pad(x, [(0, n - x.shape[axis]) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])
    q, k = pad(q, -1, t.D), pad(k, -1, t.D)
    g = pad(g, -1, t.D) if g is not None and g.ndim == 4 else g  # (GLA's per-channel gates)
    v = pad(v, -1, t.Vp)
    h0 = None if h0 is None else pad(pad(h0, -2, t.D), -1, t.Vp)
    if t.v_parts > 1:  # each block of value columns a value head; q and k stay, the per-value-head gates follow v
        m = t.v_parts
        v = v.reshape(*v.shape[:2], v.shape[2] * m, t.D)  # [B, T, HV, m D] -> [B, T, HV m, D]
        g = None if g is None else _copies(g, m)
        beta = _copies(beta, m)
        if h0 is not None:  # [N, HV, K, m D] -> [N, HV m, K, D]
            N, HV = h0.shape[:2]
            h0 = h0.reshape(N, HV, t.D, m, t.D).transpose(0, 1, 3, 2, 4).reshape(N, HV * m, t.D, t.D)
    return q, k, v, g, beta, h0


def unfold(t: Tiling, o, ht):
    """The programs' `o [B, T, HV', V']` (in the input dtype) and `ht [N, HV', K', V']` (float32) as the
    call's `[B, T, HV, V]` and `[N, HV, K, V]`."""
    if t.identity:
        return o, ht
    if t.v_parts > 1:
        m, D = t.v_parts, t.D
        B, T, N = o.shape[0], o.shape[1], ht.shape[0]
        o = o.reshape(B, T, -1, m * D)
        ht = ht.reshape(N, -1, m, D, D).transpose(0, 1, 3, 2, 4).reshape(N, -1, D, m * D)
    return o[..., : t.V], ht[..., : t.K, : t.V]
