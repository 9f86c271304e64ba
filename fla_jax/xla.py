"""The `xla` backend: chunk-parallel pure JAX, the chunked math fla uses.

Tokens are cut into chunks of C (64 by default). Within chunk n, with in-chunk cumulative log
gates `G` (`G_i = g_1 + ... + g_i`, per head or per key channel) and `h_n` the state before it:

Gated family (simple GLA, GLA)::

    o     = (q * exp(G)) h_n + A v,          A_ij = sum_k q_ik k_jk exp(G_ik - G_jk),  j <= i
    h_n+1 = Diag(exp(G_C)) h_n + (k * exp(G_C - G))^T v

Delta family (delta rule, GDN; scalar gate)::

    A     = tril(Diag(beta) (K K^T * Gamma), -1),  Gamma_ij = exp(G_i - G_j),  T = (I + A)^-1
    w     = T (k * beta * exp(G)),   u = T (v * beta)
    v'    = u - w h_n
    o     = (q * exp(G)) h_n + tril(Q K^T * Gamma) v'
    h_n+1 = exp(G_C) h_n + (k * exp(G_C - G))^T v'

Every exponent is a difference `G_i - G_j` with `i >= j` (masked before `exp`), so nothing grows.
For GLA the intra-chunk matrix uses sub-chunks of 16: off-diagonal blocks are products of factors
referenced to the row block's first gate, diagonal blocks are summed elementwise, so no factor
exponentiates more than 16 steps of gate range in either direction.

The state recurrence between chunks is linear: the gated family runs it as a segmented
associative scan (log depth), the delta family as a sequential `lax.scan` (its transition is a
K x K matrix). Sequence starts (varlen) reset the state; see `fla_jax._layout`.

Gradients come from `jax.custom_vjp`: the forward keeps the inputs and, for the delta family, the
solved chunk matrix T; the backward recomputes the chunk states and differentiates through them,
and turns dT into dA with `dA = -T^T dT T^T`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fla_jax import _layout, _nonfinite
from fla_jax._problem import Problem

_SUB = 16  # GLA sub-chunk

# Gates below this are taken as it (a decay of exp(-110) < 1e-47, zero in float32): a gate of -inf (what
# `log(sigmoid(x))` gives in float32 for x below about -104) or -1e8 is a legal decay of zero, but in-chunk
# sums of such values give -inf - -inf = NaN, or lose every small gate after them to rounding.
GATE_FLOOR = -110.0


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens):
    """Runs one op on the chunked pure-JAX path; arguments as `fla_jax._problem` describes.

    Non-finite inputs keep the recurrence's causality (`fla_jax._nonfinite`: the offending steps zeroed,
    what follows them poisoned, around every call)."""
    T = q.shape[1]
    cdt = p.compute_dtype
    (q, k, v, g, beta), bad_q, bad = _nonfinite.guard(*(None if x is None else x.astype(cdt) for x in (q, k, v, g, beta)))
    if g is not None:
        g = jnp.maximum(g, GATE_FLOOR)
    layout = _layout.make_layout(T, cu_seqlens, p.chunk_size)
    q, k, v, g, beta = (_layout.pack(x, layout) for x in (q, k, v, g, beta))
    table = _layout.state_table(h0.astype(cdt), layout)
    if p.delta:
        o, ht = _delta_core(p, q, k, v, g, beta, table, layout.seg)
    else:
        o, ht = _gated_core(p, q, k, v, g, table, layout.seg)
    seqs = () if cu_seqlens is None else _nonfinite.token_sequences(cu_seqlens, T)
    return _nonfinite.poison(_layout.unpack(o, layout, T), _layout.final_states(ht, layout), bad_q, bad, *seqs)


# ----------------------------------------------------------------------------- layout helpers


def _chunks(x, C):
    """`[B, L, H, ...]` -> `[B, H, L / C, C, ...]`."""
    B, L, H = x.shape[:3]
    x = x.reshape(B, L // C, C, H, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _unchunk(x):
    """`[B, H, NT, C, ...]` -> `[B, NT * C, H, ...]`."""
    B, H, N, C = x.shape[:4]
    return jnp.moveaxis(x, 1, 3).reshape(B, N * C, H, *x.shape[4:])


def _gates(g, shape, C, dtype):
    """In-chunk cumulative log gates `[B, H, NT, C]` (or `[..., K]`); zeros when ungated."""
    if g is None:
        return jnp.zeros(shape, dtype)
    return jnp.cumsum(_chunks(g, C), axis=3)


def _masked_exp(d, mask):
    """`exp(d)` where `mask`, exactly 0 elsewhere (the masked values are never exponentiated)."""
    return jnp.exp(jnp.where(mask, d, -jnp.inf))


def _tril(C, k=0):
    return jnp.tril(jnp.ones((C, C), bool), k)


def _chunk_initial_states(table, seq):
    """`[B, H, NT, K, V]`: the initial state of each chunk's sequence."""
    return jnp.moveaxis(table[:, seq], 2, 1)


def _shift_states(s_after, h0c, reset):
    """States before each chunk: the previous chunk's final state, or an initial state at resets."""
    prev = jnp.concatenate([jnp.zeros_like(s_after[:, :, :1]), s_after[:, :, :-1]], axis=2)
    return jnp.where(reset[:, None, None], h0c, prev)


def _final(s_after, table, last, nonempty):
    """`[B, S, H, K, V]` final states; an empty sequence keeps its initial state."""
    S = last.shape[0]
    ht = jnp.moveaxis(s_after[:, :, last], 2, 1)
    return jnp.where(nonempty[:, None, None, None], ht, table[:, :S])


# ----------------------------------------------------------------------------- gated family


def _intra_scalar(q, k, G):
    s = jnp.einsum("bhnik,bhnjk->bhnij", q, k)
    return s * _masked_exp(G[..., :, None] - G[..., None, :], _tril(q.shape[-2]))


def _intra_channel(q, k, G):
    """Intra-chunk GLA matrix with 16-token sub-chunks (see the module docstring)."""
    *lead, C, K = q.shape
    n, s = C // _SUB, _SUB
    q4, k4, G4 = (x.reshape(*lead, n, s, K) for x in (q, k, G))
    ref = G4[..., :, :1, :]  # first gate of each row block
    qf = q4 * jnp.exp(G4 - ref)
    below = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [I, J]: J < I
    kf = k4[..., None, :, :, :] * _masked_exp(ref[..., :, None, :, :] - G4[..., None, :, :, :], below[:, :, None, None])
    a_off = jnp.einsum("...Iik,...IJjk->...IiJj", qf, kf)
    a_diag = _intra_diag(q4, k4, G4)
    eye = jnp.eye(n, dtype=q.dtype)[:, None, :, None]
    a = a_off + eye * a_diag[..., :, :, None, :]
    return a.reshape(*lead, C, C)


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
def _intra_diag(q4, k4, G4):
    """Diagonal sub-blocks elementwise, `[..., n, s, s]`; rematerialised so that differentiating it
    never stores the `[..., s, s, K]` decay tensor."""
    dd = G4[..., :, :, None, :] - G4[..., :, None, :, :]
    return jnp.sum(q4[..., :, None, :] * k4[..., None, :, :] * _masked_exp(dd, _tril(q4.shape[-2])[..., None]), axis=-1)


def _gated_states(a, U, h0c, reset):
    """Segmented associative scan of `S <- exp(a) S + U` over chunks (axis 2)."""
    r = reset[:, None]  # broadcasts against a [B, H, N, K|1]
    U = U + jnp.where(r[..., None], jnp.exp(a)[..., None] * h0c, 0)

    def combine(x, y):
        ax, ux, rx = x
        ay, uy, ry = y
        return (
            jnp.where(ry, ay, ax + ay),
            jnp.where(ry[..., None], uy, jnp.exp(ay)[..., None] * ux + uy),
            rx | ry,
        )

    rr = jnp.broadcast_to(r, a.shape[:2] + r.shape)
    _, s_after, _ = lax.associative_scan(combine, (a, U, rr), axis=2)
    return s_after


def _gated_forward(p: Problem, q, k, v, g, table, seg):
    reset, seq, last, nonempty = seg
    C = p.chunk_size
    q, k, v = (_chunks(x, C) for x in (q, k, v))
    G = _gates(g, q.shape[:4], C, q.dtype)
    channel = G.ndim == 5
    Gk = G if channel else G[..., None]
    a = Gk[..., -1, :]  # [B, H, N, K|1]
    A = _intra_channel(q, k, G) if channel else _intra_scalar(q, k, G)
    U = jnp.einsum("bhnck,bhncv->bhnkv", k * jnp.exp(a[..., None, :] - Gk), v)
    h0c = _chunk_initial_states(table, seq)
    s_after = _gated_states(a, U, h0c, reset)
    h = _shift_states(s_after, h0c, reset)
    o = jnp.einsum("bhnij,bhnjv->bhniv", A, v) + jnp.einsum("bhnck,bhnkv->bhncv", q * jnp.exp(Gk), h)
    return _unchunk(o), _final(s_after, table, last, nonempty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_core(p, q, k, v, g, table, seg):
    return _gated_forward(p, q, k, v, g, table, seg)


def _gated_fwd(p, q, k, v, g, table, seg):
    return _gated_forward(p, q, k, v, g, table, seg), (q, k, v, g, table, seg)


def _gated_bwd(p, res, ct):
    *diff, seg = res
    _, vjp = jax.vjp(lambda *a: _gated_forward(p, *a, seg), *diff)
    return (*vjp(ct), None)


_gated_core.defvjp(_gated_fwd, _gated_bwd)


# ----------------------------------------------------------------------------- delta family


def _delta_A(p: Problem, k, g, beta):
    """`tril(Diag(beta) (K K^T * Gamma), -1)` per chunk, `[B, H, NT, C, C]`."""
    C = p.chunk_size
    k, beta = _chunks(k, C), _chunks(beta, C)
    return wy_matrix(k, _gates(g, k.shape[:4], C, k.dtype), beta)


def wy_matrix(k, G, beta):
    """The WY chunk matrix `tril(Diag(beta) (K K^T * Gamma), -1)` from chunked `k [..., C, K]`,
    in-chunk cumulative gates `G [..., C]` and `beta [..., C]`."""
    kk = jnp.einsum("...ik,...jk->...ij", k, k, precision=lax.Precision.HIGHEST)
    return beta[..., :, None] * kk * _masked_exp(G[..., :, None] - G[..., None, :], _tril(k.shape[-2], -1))


def wy_apply(Tm, k, v, G, beta, precision=None):
    """`w = T (k beta exp(G))`, `u = T (v beta)` per chunk, `T = (I + A)^{-1}` (`[..., C, C]`)."""
    w = jnp.einsum("...ij,...jk->...ik", Tm, k * (beta * jnp.exp(G))[..., None], precision=precision)
    u = jnp.einsum("...ij,...jv->...iv", Tm, v * beta[..., None], precision=precision)
    return w, u


def delta_solve(A):
    eye = jnp.eye(A.shape[-1], dtype=A.dtype)
    return lax.linalg.triangular_solve(eye + A, jnp.broadcast_to(eye, A.shape), left_side=True, lower=True, unit_diagonal=True)


def _delta_forward(p: Problem, q, k, v, g, beta, table, seg, Tm):
    reset, seq, last, nonempty = seg
    C = p.chunk_size
    q, k, v, beta = (_chunks(x, C) for x in (q, k, v, beta))
    G = _gates(g, q.shape[:4], C, q.dtype)
    gamma = jnp.exp(G)
    w, u = wy_apply(Tm, k, v, G, beta)
    kd = k * jnp.exp(G[..., -1:] - G)[..., None]
    glast = gamma[..., -1]

    def step(h, x):
        u_n, w_n, kd_n, gl_n, r_n, s_n = x
        h = jnp.where(r_n, table[:, s_n], h)
        vn = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, h)
        h = gl_n[..., None, None] * h + jnp.einsum("bhck,bhcv->bhkv", kd_n, vn)
        return h, (vn, h)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, kd, glast)) + (reset, seq)
    h_init = jnp.zeros_like(table[:, 0])
    _, (vn, s_after) = lax.scan(step, h_init, xs)
    vn, s_after = jnp.moveaxis(vn, 0, 2), jnp.moveaxis(s_after, 0, 2)
    h = _shift_states(s_after, _chunk_initial_states(table, seq), reset)
    attn = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * _masked_exp(G[..., :, None] - G[..., None, :], _tril(C))
    o = jnp.einsum("bhnij,bhnjv->bhniv", attn, vn) + jnp.einsum("bhnck,bhnkv->bhncv", q * gamma[..., None], h)
    return _unchunk(o), _final(s_after, table, last, nonempty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_core(p, q, k, v, g, beta, table, seg):
    Tm = delta_solve(_delta_A(p, k, g, beta))
    return _delta_forward(p, q, k, v, g, beta, table, seg, Tm)


def _delta_fwd(p, q, k, v, g, beta, table, seg):
    Tm = delta_solve(_delta_A(p, k, g, beta))
    return _delta_forward(p, q, k, v, g, beta, table, seg, Tm), (q, k, v, g, beta, table, seg, Tm)


def _delta_bwd(p, res, ct):
    q, k, v, g, beta, table, seg, Tm = res
    _, vjp = jax.vjp(lambda q, k, v, g, beta, table, Tm: _delta_forward(p, q, k, v, g, beta, table, seg, Tm), q, k, v, g, beta, table, Tm)
    dq, dk, dv, dg, dbeta, dtable, dT = vjp(ct)
    Tt = jnp.swapaxes(Tm, -1, -2)
    dA = -Tt @ dT @ Tt
    _, vjp_a = jax.vjp(lambda k, g, beta: _delta_A(p, k, g, beta), k, g, beta)
    dk2, dg2, dbeta2 = vjp_a(dA)
    dg = None if g is None else dg + dg2
    return dq, dk + dk2, dv, dg, dbeta + dbeta2, dtable, None


_delta_core.defvjp(_delta_fwd, _delta_bwd)
