"""How a call's head dims K and V map onto the kernels' programs, which are built for square heads
(K = V = D, D in `HEAD_DIMS`), and the exact reshapes that do it.

Every op's recurrence is separable along V: each value column of the state evolves on its own given
q, k and the gates (the delta rules too: `S^T k` and the update are per column). So V is split into
`v_parts` blocks of D, each block one more value head: GDN's grouped value heads for the delta rules
(value head `j * v_parts + i` reads q/k head `j // (HV / H)`, as before), copies of the q/k head for
the gated ops. The gated ops are also separable along K as a sum (`o_t = sum over the key channels`),
so where V is the smaller, K is split into `k_parts` blocks of D, each block a head that sees all of
v, and the blocks' outputs are summed. The delta rules are not separable along K (`S^T k` mixes the
channels): their D is K. A K or V that is no multiple of D is padded with zeros, which change nothing
(zero key channels write and read no state; zero value columns stay zero).

The planner `tiling` is pure; `fold` / `unfold` are the reshapes around the kernels. The reshapes are
plain XLA ops outside the kernels' custom VJP, so JAX differentiates them (the copies' gradients are
summed, the padding's dropped).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fla_jax._layout import cdiv


@dataclasses.dataclass(frozen=True, slots=True)
class Tiling:
    """The call's K, V on programs of head dim D: K padded to `k_parts * D` (the delta rules:
    `k_parts == 1`), V padded to `v_parts * D`; at most one of the two parts is above 1. (`identity`:
    nothing to do.)"""

    K: int
    V: int
    D: int
    k_parts: int = 1
    v_parts: int = 1

    @property
    def identity(self) -> bool:
        return self.K == self.V == self.D

    def __str__(self) -> str:
        if self.identity:
            return f"K = V = {self.D}"
        how = []
        if self.k_parts > 1:
            how.append(f"K in {self.k_parts} parts as heads, their outputs summed")
        if self.v_parts > 1:
            how.append(f"V in {self.v_parts} parts as value heads")
        pad = [f"{n} {x} padded to {p}" for n, x, p in (("K", self.K, self.k_parts * self.D), ("V", self.V, self.v_parts * self.D)) if x != p]
        return f"K = {self.K}, V = {self.V} on the K = V = {self.D} programs" + (f" ({'; '.join(how + pad)})" if how or pad else "")


def tiling(op: str, K: int, V: int, head_dims: tuple[int, ...]) -> Tiling | str:
    """The tiling of a call of `op` with head dims K and V on programs of the (ascending) `head_dims`,
    or why there is none. Least padding first, then the least repeated work: the largest D that the
    split leaves whole. GLA at V = 2K pads K to V instead: its intra-chunk work per head (sub-chunk
    products with per-channel gates) would run twice over, while one K = V = 2K head costs less than
    two K = V = K heads (measured in benchmarks/RESULTS.md)."""
    fits = [d for d in head_dims if d >= K]
    if not fits:
        return f"K = {K} is above the largest head dim the kernels take ({head_dims[-1]})"
    Kp = fits[0]
    if op == "gla" and V == 2 * Kp and V in head_dims:
        return Tiling(K, V, V)
    if op in ("delta_rule", "gated_delta_rule") or V >= Kp:  # V in blocks of D = K (padded)
        return Tiling(K, V, Kp, v_parts=cdiv(V, Kp))
    D = next(d for d in head_dims if d >= V)  # (<= Kp, and a divisor of it: the head dims are powers of two)
    return Tiling(K, V, D, k_parts=Kp // D)


def _copies(x, n: int):
    """`x [B, T, H, ...]` with each head repeated `n` times in a row (head `h n + j` is copy j of head h).
    XLA's broadcast for it is no bandwidth-bound copy (~4x slower), yet a concatenation of the copies measured
    slower still in the op (benchmarks/RESULTS.md); the kernels reading q/k head `h // n` would need none."""
    return x if n == 1 else jnp.repeat(x, n, axis=2)


def fold(t: Tiling, *, delta: bool, q, k, v, g, beta, h0):
    """The call's arrays as the programs of head dim `t.D` take them (see the module's docstring).
    q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g None / `[B, T, HV]` / GLA's `[B, T, H, K]`, beta None or
    `[B, T, HV]`, h0 None or `[N, HV, K, V]`."""
    if t.identity:
        return q, k, v, g, beta, h0
    Kp, Vp = t.k_parts * t.D, t.v_parts * t.D
    pad = lambda x, axis, n: x if x.shape[axis] == n else jnp.pad(x, [(0, n - x.shape[axis]) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])
    per_channel = g is not None and g.ndim == 4
    q, k = pad(q, -1, Kp), pad(k, -1, Kp)
    g = pad(g, -1, Kp) if per_channel else g
    v = pad(v, -1, Vp)
    h0 = None if h0 is None else pad(pad(h0, -2, Kp), -1, Vp)
    heads = lambda x, n: x.reshape(*x.shape[:2], x.shape[2] * n, x.shape[3] // n)  # [B, T, H, n D] -> [B, T, H n, D]
    if t.k_parts > 1:  # (gated ops) each block of key channels a head that sees all of v
        s = t.k_parts
        q, k = heads(q, s), heads(k, s)
        g = heads(g, s) if per_channel else None if g is None else _copies(g, s)
        v = _copies(v, s)
        if h0 is not None:  # [N, H, s D, D] -> [N, H s, D, D]
            h0 = h0.reshape(h0.shape[0], -1, t.D, t.D)
    if t.v_parts > 1:  # each block of value columns a value head
        m = t.v_parts
        v = heads(v, m)
        if delta:  # grouped value heads: q and k stay, the per-value-head gates follow v
            g = None if g is None else _copies(g, m)
            beta = _copies(beta, m)
        else:
            q, k = _copies(q, m), _copies(k, m)
            g = None if g is None else _copies(g, m)
        if h0 is not None:  # [N, HV, K, m D] -> [N, HV m, K, D]
            N, HV = h0.shape[:2]
            h0 = h0.reshape(N, HV, t.D, m, t.D).transpose(0, 1, 3, 2, 4).reshape(N, HV * m, t.D, t.D)
    return q, k, v, g, beta, h0


def unfold(t: Tiling, o, ht):
    """The programs' `o [B, T, HV', D]` (in the input dtype) and `ht [N, HV', D, D]` (float32) as the
    call's `[B, T, HV, V]` and `[N, HV, K, V]`."""
    if t.identity:
        return o, ht
    B, T, N = o.shape[0], o.shape[1], ht.shape[0]
    D = t.D
    if t.k_parts > 1:
        s = t.k_parts
        o = o.reshape(B, T, -1, s, D).astype(jnp.float32).sum(axis=3).astype(o.dtype)
        ht = ht.reshape(N, -1, s * D, D)
    if t.v_parts > 1:
        m = t.v_parts
        o = o.reshape(B, T, -1, m * D)
        ht = ht.reshape(N, -1, m, D, D).transpose(0, 1, 3, 2, 4).reshape(N, -1, D, m * D)
    return o[..., : t.V], ht[..., : t.K, : t.V]
