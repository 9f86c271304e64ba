"""Pure-JAX stand-ins for the TileLang programs (kernels/simple_gla/*.py, kernels/gla/*.py, kernels/delta/*.py),
with the same inputs and outputs, including NaN where a kernel writes nothing (chunks past the
last sequence): they let CPU tests drive the tilelang backend's Python glue (chunk layout and
tables, cumulative gates, WY preparation, custom_vjp, partitioning). Written independently of
fla_jax/xla.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

C = 64
f32 = jnp.float32


def _chunks(x):
    """Flat `[L, H, .]` -> `[1, NT, C, H, .]` (one row: the formulas below carry a row axis)."""
    return x.reshape(1, x.shape[0] // C, C, *x.shape[1:]).astype(f32)


def _unwritten(x, cstart, ccount, per_token):
    """NaN where the kernels write nothing: chunks past the last sequence (varlen padding), which
    no sequence program walks. `x` is per chunk `[NT, ...]` or, with `per_token`, `[NT * C, ...]`."""
    NT = x.shape[0] // C if per_token else x.shape[0]
    c = jnp.arange(NT)
    owned = jnp.any((c[None] >= cstart[:, None]) & (c[None] < (cstart + ccount)[:, None]), axis=0)
    if per_token:
        owned = jnp.repeat(owned, C)
    return jnp.where(owned.reshape(-1, *(1,) * (x.ndim - 1)), x, jnp.nan).astype(x.dtype)


def _sequence_ends(per_chunk, chunk, ccount, fallback):
    """Each sequence's value at one of its chunks (`chunk [N]`), or `fallback` for empty ones."""
    return jnp.where((ccount > 0)[:, None, None, None], per_chunk[jnp.maximum(chunk, 0)], fallback)


def _initial_states(h0, cstart):
    """`h0 [N, H, K, V]`, or zeros where the call had none (no rows: `kernels.common.initial_state`;
    so for the reverse passes' `dht`)."""
    return h0 if h0.shape[0] else jnp.zeros((cstart.shape[0], *h0.shape[1:]), h0.dtype)


def _ownership(NT, cstart, ccount):
    """Per chunk: its sequence, and whether it is that sequence's first / last chunk."""
    c = jnp.arange(NT)
    own = (c[None] >= cstart[:, None]) & (c[None] < (cstart + ccount)[:, None])  # [N, NT]
    seq = jnp.argmax(own, axis=0)
    valid = jnp.any(own, axis=0)
    return seq, valid & (c == cstart[seq]), valid & (c == cstart[seq] + ccount[seq] - 1)


def _scan_states(a, b, G, s0, cstart, ccount, reverse=False, scale=1.0, decayed=False):
    """Forward (a = k, b = v): states before each chunk and after each sequence; reverse (a = q,
    b = do, s0 = dht): state gradients after each chunk and before each sequence. `decayed`: `a`
    is `k exp(G_C - G)` (forward) or `q exp(G)` (reverse) already (GLA's state passes)."""
    s0 = _initial_states(s0, cstart)
    ac, bc, Gc = _chunks(a)[0], _chunks(b)[0], _chunks(G)[0]  # [NT, C, H, .]
    NT = ac.shape[0]
    per_channel = Gc.ndim == 4  # GLA: G [NT, C, H, K]
    col = (lambda e: e) if per_channel else (lambda e: e[..., None])
    seq, first, last = _ownership(NT, cstart, ccount)
    enter = last if reverse else first

    def step(S, n):
        g = Gc[n]  # [C, H]
        glast = g[-1]
        S = jnp.where(enter[n], s0[seq[n]].astype(f32), S)
        if reverse:
            upd = scale * jnp.einsum("chk,chv->hkv", ac[n] if decayed else ac[n] * col(jnp.exp(g)), bc[n])
        else:
            upd = jnp.einsum("chk,chv->hkv", ac[n] if decayed else ac[n] * col(jnp.exp(glast[None] - g)), bc[n])
        out = (jnp.exp(glast)[..., None] if per_channel else jnp.exp(glast)[:, None, None]) * S + upd
        return out, (S, out)

    order = jnp.arange(NT)[::-1] if reverse else jnp.arange(NT)
    _, (seen, after) = jax.lax.scan(step, jnp.zeros(s0.shape[1:], f32), order)
    if reverse:
        seen, after = seen[::-1], after[::-1]
    final = _sequence_ends(after, cstart if reverse else cstart + ccount - 1, ccount, s0)
    return seen, final


def _fwd_o(q, k, v, G, h, *, scale):
    qc, kc, vc, Gc = _chunks(q), _chunks(k), _chunks(v), _chunks(G)
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    decay = jnp.where(mask, jnp.exp(Gc[:, :, :, None] - Gc[:, :, None, :]), 0.0)  # [1, N, i, j, H]
    A = jnp.einsum("bnihk,bnjhk->bnijh", qc, kc) * decay * scale
    o = jnp.einsum("bnijh,bnjhv->bnihv", A, vc)
    o += scale * jnp.einsum("bnihk,nhkv->bnihv", qc * jnp.exp(Gc)[..., None], h.astype(f32))
    return o.reshape(q.shape[0], *o.shape[3:]).astype(q.dtype)


def _gate_columns(G):
    """G as `[L, H]` columns, from per-chunk rows `[NT, H, C]` where a program takes them so (`g_rows`)."""
    return _rows_to_columns(G) if G.ndim == 3 else G


def fwd_fused_h(q, k, v, g, h0, cstart, ccount, *, scale):
    """kernels/simple_gla/fwd.py: o, h, ht; G `[L, H]`, or with `g_rows` per-chunk rows `[NT, H, C]`."""
    G = g
    G = _gate_columns(G)
    h, ht = _scan_states(k, v, G, h0, cstart, ccount)
    h = _unwritten(h.astype(q.dtype), cstart, ccount, False)
    return _unwritten(_fwd_o(q, k, v, G, h, scale=scale), cstart, ccount, True), h, ht


def fwd_fused(q, k, v, g, h0, cstart, ccount, *, scale):
    G = g
    o, _, ht = fwd_fused_h(q, k, v, G, h0, cstart, ccount, scale=scale)
    return o, ht


def bwd_dh(q, do, g, dht, cstart, ccount, *, scale):
    """kernels/simple_gla/bwd.py `chunk_bwd_dh`; G `[L, H]`, or with `g_rows` per-chunk rows `[NT, H, C]`."""
    G = g
    dh, dh0 = _scan_states(q, do, _gate_columns(G), dht, cstart, ccount, reverse=True, scale=scale)
    return _unwritten(dh.astype(q.dtype), cstart, ccount, False), dh0


def bwd_dqkvg(q, k, v, g, h, do, dh, *, scale, parts=1):
    """kernels/simple_gla/bwd.py `chunk_bwd_dqkvg`. With the key channels split over `parts`
    programs, each is this on its channels, and dv, dG come as float32 parts `[parts, L, H, .]`.
    G `[L, H]`, or with `g_rows` per-chunk rows `[NT, H, C]`."""
    G = g
    G = _gate_columns(G)
    if parts > 1:
        BK = q.shape[-1] // parts
        cut = lambda x, i, ax=-1: jax.lax.slice_in_dim(x, i * BK, (i + 1) * BK, axis=ax)
        outs = [_bwd_dqkvg(cut(q, i), cut(k, i), v, G, cut(h, i, -2), do, cut(dh, i, -2), scale=scale, dv_dtype=f32) for i in range(parts)]
        return (jnp.concatenate([o[0] for o in outs], -1), jnp.concatenate([o[1] for o in outs], -1),
                jnp.stack([o[2] for o in outs]), jnp.stack([o[3] for o in outs]))
    return _bwd_dqkvg(q, k, v, G, h, do, dh, scale=scale, dv_dtype=v.dtype)


def _bwd_dqkvg(q, k, v, G, h, do, dh, *, scale, dv_dtype):
    qc, kc, vc, Gc, doc = (_chunks(x) for x in (q, k, v, G, do))
    h, dh = h.astype(f32)[None], dh.astype(f32)[None]
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    decay = jnp.where(mask, jnp.exp(Gc[:, :, :, None] - Gc[:, :, None, :]), 0.0)
    A = jnp.einsum("bnihk,bnjhk->bnijh", qc, kc) * decay * scale
    glast = Gc[:, :, -1:]  # [B, N, 1, H]
    kd = kc * jnp.exp(glast - Gc)[..., None]
    dv = jnp.einsum("bnchk,bnhkv->bnchv", kd, dh) + jnp.einsum("bnijh,bnihv->bnjhv", A, doc)
    dS = jnp.einsum("bnihv,bnjhv->bnijh", doc, vc) * decay * scale
    dq_inter = scale * jnp.exp(Gc)[..., None] * jnp.einsum("bnihv,bnhkv->bnihk", doc, h)
    dk_inter = jnp.exp(glast - Gc)[..., None] * jnp.einsum("bnihv,bnhkv->bnihk", vc, dh)
    dq = dq_inter + jnp.einsum("bnijh,bnjhk->bnihk", dS, kc)
    dk = dk_inter + jnp.einsum("bnijh,bnihk->bnjhk", dS, qc)
    dG = jnp.sum(qc * dq - kc * dk, -1)
    last = jnp.exp(glast[:, :, 0]) * jnp.sum(h * dh, (-1, -2)) + jnp.sum(kc * dk_inter, (2, 4))
    dG = dG.at[:, :, -1].add(last)
    flat = lambda x, dt: x.reshape(q.shape[0], *x.shape[3:]).astype(dt)
    return flat(dq, q.dtype), flat(dk, k.dtype), flat(dv, dv_dtype), flat(dG, f32)


def fwd_enter(q, g, d, s, first, o, *, scale):
    """kernels/simple_gla/fwd.py `chunk_fwd_enter`: chunk i of piece p (from chunk `first[p]`)
    plus `scale exp(d[p, i] + G) (q s[p])`, the other chunks as they were (G as per-chunk rows)."""
    M = d.shape[1]
    rows = (first[:, None, None] + jnp.arange(M)[None, :, None]) * C + jnp.arange(C)[None, None]  # [NS, M, C]
    G = _rows_to_columns(g)[rows]  # [NS, M, C, H]
    qs = jnp.einsum("pmchk,phkv->pmchv", q[rows].astype(f32), s.astype(f32))
    add = scale * jnp.exp(d[:, :, None, :] + G)[..., None] * qs
    return o.at[rows].set((o[rows].astype(f32) + add).astype(o.dtype))


PROGRAMS = {"_fused": fwd_fused, "_fused_h": fwd_fused_h, "_dh": bwd_dh, "_dqkvg": bwd_dqkvg, "_dqkvg_v": bwd_dqkvg, "_dh_v": bwd_dh,
            "_enter": fwd_enter}


def _gla_decay(Gc):
    """`exp(G_i - G_j)` for `j <= i`, 0 above: `[B, N, i, j, H, K]`."""
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None, None]
    diff = Gc[:, :, :, None] - Gc[:, :, None, :]
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def gla_a(q, k, g, *, scale):
    """kernels/gla/fwd.py `chunk_gla_a`: `A [NT, H, C, C]` in the input dtype, `G` (the in-chunk
    cumulative sums of the per-step gates `g`), and the state pass's `q exp(G)`, `k exp(G_C - G)`
    in the input dtype."""
    qc, kc, Gc = _chunks(q), _chunks(k), jnp.cumsum(_chunks(g), axis=2)
    A = scale * jnp.einsum("bnihk,bnjhk,bnijhk->bnhij", qc, kc, _gla_decay(Gc))
    qg, kg = qc * jnp.exp(Gc), kc * jnp.exp(Gc[:, :, -1:] - Gc)
    return A[0].astype(q.dtype), Gc.reshape(g.shape), qg.reshape(q.shape).astype(q.dtype), kg.reshape(k.shape).astype(k.dtype)


def gla_fwd_fused_h(qg, kg, v, g, a, h0, cstart, ccount, *, scale):
    """kernels/gla/fwd.py `chunk_gla_fwd`, from `q exp(G)` and `k exp(G_C - G)`."""
    G = g
    h, ht = _scan_states(kg, v, G, h0, cstart, ccount, decayed=True)
    h = _unwritten(h.astype(qg.dtype), cstart, ccount, False)
    o = scale * jnp.einsum("bnihk,nhkv->bnihv", _chunks(qg), h.astype(f32))
    o += jnp.einsum("nhij,bnjhv->bnihv", a.astype(f32), _chunks(v))
    o = o.reshape(qg.shape[0], *o.shape[3:]).astype(qg.dtype)
    return _unwritten(o, cstart, ccount, True), h, ht


def gla_fwd_fused(qg, kg, v, g, a, h0, cstart, ccount, *, scale):
    G = g
    o, _, ht = gla_fwd_fused_h(qg, kg, v, G, a, h0, cstart, ccount, scale=scale)
    return o, ht


def gla_bwd_dqkvg(q, k, v, g, a, h, do, dh, *, scale, parts=1):
    """kernels/gla/bwd.py `chunk_gla_bwd_dqkvg`: dq, dk, dv and the per-step gates' dg (the
    reverse in-chunk cumulative sum of the per-channel dG). With the key channels split over
    `parts` programs, dv is `[parts, L, H, V]` float32: each part the sum over its channels (the
    first adds `A^T do`)."""
    G = g
    qc, kc, vc, Gc, doc = (_chunks(x) for x in (q, k, v, G, do))
    h, dh, A = h.astype(f32)[None], dh.astype(f32)[None], a.astype(f32)[None]
    glast = Gc[:, :, -1:]  # [B, N, 1, H, K]
    decay = _gla_decay(Gc)
    kd = kc * jnp.exp(glast - Gc)
    BK = q.shape[-1] // parts
    dvs = [jnp.einsum("bnchk,bnhkv->bnchv", kd[..., i * BK : (i + 1) * BK], dh[..., i * BK : (i + 1) * BK, :]) for i in range(parts)]
    dvs[0] += jnp.einsum("bnhij,bnihv->bnjhv", A, doc)
    dv = dvs[0] if parts == 1 else jnp.stack(dvs)
    mask = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    dA = jnp.where(mask, scale * jnp.einsum("bnihv,bnjhv->bnijh", doc, vc), 0.0)
    dq_inter = scale * jnp.exp(Gc) * jnp.einsum("bnihv,bnhkv->bnihk", doc, h)
    dk_inter = jnp.exp(glast - Gc) * jnp.einsum("bnihv,bnhkv->bnihk", vc, dh)
    dq = dq_inter + jnp.einsum("bnijh,bnjhk,bnijhk->bnihk", dA, kc, decay)
    dk = dk_inter + jnp.einsum("bnijh,bnihk,bnijhk->bnjhk", dA, qc, decay)
    dG = qc * dq - kc * dk
    last = jnp.exp(glast[:, :, 0]) * jnp.sum(h * dh, -1) + jnp.sum(kc * dk_inter, 2)
    dG = dG.at[:, :, -1].add(last)
    dG = jnp.flip(jnp.cumsum(jnp.flip(dG, 2), axis=2), 2)
    flat = lambda x, dt: x.reshape(q.shape[0], *x.shape[3:]).astype(dt)
    dv = flat(dv, v.dtype) if parts == 1 else dv.reshape(parts, q.shape[0], *dv.shape[4:])
    return flat(dq, q.dtype), flat(dk, k.dtype), dv, flat(dG, f32)


def gla_bwd_dh(q, do, g, dht, cstart, ccount, *, scale):
    """The state-gradient pass of GLA (kernels/simple_gla/bwd.py `chunk_bwd_dh(channel_gates=True)`), from `q exp(G)`."""
    qg, G = q, g  # (q exp(G), the cumulative G)
    dh, dh0 = _scan_states(qg, do, G, dht, cstart, ccount, reverse=True, scale=scale, decayed=True)
    return _unwritten(dh.astype(qg.dtype), cstart, ccount, False), dh0


GLA_PROGRAMS = {"_a": gla_a, "_fused": gla_fwd_fused, "_fused_h": gla_fwd_fused_h, "_dh": gla_bwd_dh, "_dqkvg": gla_bwd_dqkvg,
                "_dh_v": gla_bwd_dh, "_dqkvg_v": gla_bwd_dqkvg}


def _delta_states(q, k, G, h0, cstart, ccount, *, scale, v_new):
    """The delta rules' state pass (kernels/delta/fwd.py) with `v_new(n, S)` chunk n's new values
    (float32, rounded as the kernel rounds them) from its state S in the input dtype: o, v_new, h
    (input dtype) and ht. q and k have one head per q/k head."""
    HV = G.shape[1]
    h0 = _initial_states(h0, cstart)
    rep = lambda x: jnp.repeat(x, HV // x.shape[1], axis=1)
    qc, kc, Gc = (_chunks(x)[0] for x in (rep(q), rep(k), G))  # [NT, C, HV, .]
    NT = qc.shape[0]
    seq, first, _ = _ownership(NT, cstart, ccount)
    mask = jnp.tril(jnp.ones((C, C), bool))[:, :, None]
    dt = q.dtype

    def step(S, n):
        S = jnp.where(first[n], h0[seq[n]], S)
        Sd = S.astype(dt).astype(f32)
        g = Gc[n]  # [C, HV]
        vn = v_new(n, Sd)
        A = jnp.einsum("ihk,jhk->ijh", qc[n], kc[n]) * jnp.where(mask, jnp.exp(g[:, None] - g[None, :]), 0.0) * scale
        A = A.astype(dt).astype(f32)
        o = scale * jnp.einsum("chk,hkv->chv", qc[n] * jnp.exp(g)[..., None], Sd) + jnp.einsum("ijh,jhv->ihv", A, vn)
        kd = (kc[n] * jnp.exp(g[-1][None] - g)[..., None]).astype(dt).astype(f32)
        S = jnp.exp(g[-1])[:, None, None] * S + jnp.einsum("chk,chv->hkv", kd, vn)
        return S, (o, vn, Sd, S)

    _, (o, vn, h, after) = jax.lax.scan(step, jnp.zeros(h0.shape[1:], f32), jnp.arange(NT))
    ht = _sequence_ends(after, cstart + ccount - 1, ccount, h0)
    flat = lambda x: x.reshape(q.shape[0], *x.shape[2:]).astype(dt)
    un = lambda x, tok: _unwritten(x, cstart, ccount, tok)
    return un(flat(o), True), un(flat(vn), True), un(h.astype(dt), False), ht


def delta_fwd_fused_h(q, k, w, u, g, h0, cstart, ccount, *, scale):
    """kernels/delta/fwd.py `chunk_delta_fwd(store_h=True)`: o, v_new, h, ht."""
    G = g
    G = _gate_columns(G)
    wc, uc = _chunks(w)[0], _chunks(u)[0]
    v_new = lambda n, Sd: (uc[n] - jnp.einsum("chk,hkv->chv", wc[n], Sd)).astype(q.dtype).astype(f32)
    return _delta_states(q, k, G, h0, cstart, ccount, scale=scale, v_new=v_new)


def _rows_to_columns(x):
    """`[NT, HV, C]` per-chunk rows -> `[L, HV]`."""
    return jnp.moveaxis(x, 1, 2).reshape(-1, x.shape[1])


def _columns_to_rows(x):
    """`[L, HV]` -> `[NT, HV, C]` per-chunk rows."""
    return jnp.moveaxis(x.reshape(-1, C, x.shape[1]), 1, 2)


def delta_fwd_fused_t(q, k, v, t, gr, h0, cstart, ccount, *, scale):
    """kernels/delta/fwd.py `chunk_delta_fwd_t` (and `chunk_delta_fwd_t_wide`): o, ht from the
    gate-free inverse T0, with `Ag = T0 * exp(G_i - G_j) * beta_j` and `W = v - exp(G) * (k S)` in
    the input dtype, `v_new = Ag W`; G and beta as the rows of `gr [NT, HV, 2, C]`."""
    G, beta = _rows_to_columns(gr[:, :, 0]), _rows_to_columns(gr[:, :, 1])
    HV, dt = v.shape[1], q.dtype
    kc, vc, Gc, bc = (_chunks(x)[0] for x in (jnp.repeat(k, HV // k.shape[1], axis=1), v, G, beta))
    lower = jnp.tril(jnp.ones((C, C), bool))[None, :, :, None]
    E = jnp.where(lower, jnp.exp(jnp.where(lower, Gc[:, :, None] - Gc[:, None, :], 0.0)), 0.0)  # [NT, i, j, HV]
    Ag = (jnp.moveaxis(t.astype(f32), 1, 3) * E * bc[:, None]).astype(dt).astype(f32)  # [NT, i, j, HV]
    rnd = lambda x: x.astype(dt).astype(f32)

    def v_new(n, Sd):
        W = rnd(vc[n] - jnp.exp(Gc[n])[..., None] * jnp.einsum("chk,hkv->chv", kc[n], Sd))
        return rnd(jnp.einsum("ijh,jhv->ihv", Ag[n], W))

    o, _, _, ht = _delta_states(q, k, G, h0, cstart, ccount, scale=scale, v_new=v_new)
    return o, ht


def _inverse(k, beta):
    """The gate-free `T0 = (I + tril(Diag(beta) K K^T, -1))^{-1}` `[NT, HV, C, C]` in k's dtype."""
    HV = beta.shape[1]
    _, _, T0 = _wy(jnp.repeat(k, HV // k.shape[1], axis=1), jnp.zeros((*beta.shape, 1), f32), jnp.zeros(beta.shape, f32), beta)
    return T0.astype(k.dtype)


def delta_inv(k, g, beta):
    """kernels/delta/wy.py `chunk_delta_wy(inverse_only=True, gate_rows=True)`: T0, and G and beta
    as rows `gr [NT, HV, 2, C]`."""
    G = g
    return _inverse(k, beta), jnp.stack([_columns_to_rows(x) for x in (G, beta)], axis=2)


def _rsqrt_norm(x, HV):
    """1 / sqrt(|x|^2 + 1e-6) over the last axis, per value head `[L, HV]`."""
    return jax.lax.rsqrt(jnp.sum(jnp.square(jnp.repeat(x, HV // x.shape[1], axis=1).astype(f32)), axis=-1) + 1e-6)


def delta_inv_l2(q, k, g, beta):
    """`chunk_delta_wy(inverse_only=True, gate_rows=True, l2norm=True)`: T0 of the normalised k (in
    float32), and `gr [NT, HV, 4, C]`: per chunk and value head G, beta, 1 / |q|, 1 / |k|."""
    G = g
    HV = beta.shape[1]
    rq, rk = _rsqrt_norm(q, HV), _rsqrt_norm(k, HV)
    kn = jnp.repeat(k, HV // k.shape[1], axis=1).astype(f32) * rk[..., None]
    return _inverse(kn, beta).astype(k.dtype), jnp.stack([_columns_to_rows(x) for x in (G, beta, rq, rk)], axis=2)


def delta_fwd_fused_t_l2(q, k, v, t, gr, h0, cstart, ccount, *, scale):
    """`chunk_delta_fwd_t(l2norm=True)`: `chunk_delta_fwd_t` of the raw q and k
    scaled by their `1 / |x|` (rows 2 and 3 of `gr`, per value head)."""
    HV = v.shape[1]
    norm = lambda x, rx: (jnp.repeat(x, HV // x.shape[1], axis=1).astype(f32) * _rows_to_columns(rx)[..., None]).astype(x.dtype)
    return delta_fwd_fused_t(norm(q, gr[:, :, 2]), norm(k, gr[:, :, 3]), v, t, gr[:, :, :2], h0, cstart, ccount, scale=scale)


def _carry_t(fused_t):
    def carry(k, v, t, gr, cstart, ccount):
        """`chunk_delta_fwd_t(carry=True)`: each sequence's final state from zeros (`ht`, as `fused_t` from a zero
        state) and its map of the state (`at [N, HV, K, K]`: `fused_t` from identity states with the values zero)."""
        N, HV, K = cstart.shape[0], v.shape[1], k.shape[-1]
        no_states = jnp.zeros((0, HV, K, v.shape[-1]), f32)
        eye = jnp.broadcast_to(jnp.eye(K, dtype=f32), (N, HV, K, K))
        ht = fused_t(k, k, v, t, gr, no_states, cstart, ccount, scale=1.0)[1]
        at = fused_t(k, k, jnp.zeros((*v.shape[:2], K), v.dtype), t, gr, eye, cstart, ccount, scale=1.0)[1]
        return ht, at

    return carry


def delta_fwd_fused(q, k, w, u, g, h0, cstart, ccount, *, scale):
    G = g
    o, vn, _, ht = delta_fwd_fused_h(q, k, w, u, G, h0, cstart, ccount, scale=scale)
    return o, vn, ht


def delta_fwd_fused_s(q, k, w, u, g, h0, cstart, ccount, *, scale):
    """`chunk_delta_fwd(states_only=True)`: the final states alone; o and v_new unwritten (NaN here, so that a
    reader of them fails)."""
    G = g
    o, vn, ht = delta_fwd_fused(q, k, w, u, G, h0, cstart, ccount, scale=scale)
    return jnp.full_like(o, jnp.nan), jnp.full_like(vn, jnp.nan), ht


def delta_bwd_dh(q, k, w, do, g, dht, cstart, ccount, *, scale):
    """kernels/delta/bwd.py `chunk_delta_bwd_dh(store_du=True)`: dh (after each chunk), dh0 and
    du, the gradient of v_new (input dtype)."""
    G = g
    dht = _initial_states(dht, cstart)  # (zeros where it has no rows)
    G = _gate_columns(G)
    HV = do.shape[1]
    rep = lambda x: jnp.repeat(x, HV // x.shape[1], axis=1)
    qc, kc, wc, doc, Gc = (_chunks(x)[0] for x in (rep(q), rep(k), w, do, G))
    NT = qc.shape[0]
    seq, first, last = _ownership(NT, cstart, ccount)
    mask = jnp.tril(jnp.ones((C, C), bool))[:, :, None]
    dt = q.dtype
    rnd = lambda x: x.astype(dt).astype(f32)

    def step(S, n):
        S = jnp.where(last[n], dht[seq[n]], S)
        Sd = rnd(S)
        g = Gc[n]
        A = rnd(jnp.einsum("ihk,jhk->ijh", qc[n], kc[n]) * jnp.where(mask, jnp.exp(g[:, None] - g[None, :]), 0.0) * scale)
        kd = rnd(kc[n] * jnp.exp(g[-1][None] - g)[..., None])
        qd = rnd(qc[n] * jnp.exp(g)[..., None] * scale)
        dv = rnd(jnp.einsum("ijh,ihv->jhv", A, doc[n]) + jnp.einsum("chk,hkv->chv", kd, Sd))
        S_before = jnp.exp(g[-1])[:, None, None] * S + jnp.einsum("chk,chv->hkv", qd, doc[n]) - jnp.einsum("chk,chv->hkv", wc[n], dv)
        return S_before, (Sd, S_before, dv)

    _, (dh, before, du) = jax.lax.scan(step, jnp.zeros(dht.shape[1:], f32), jnp.arange(NT)[::-1])
    dh, before, du = dh[::-1], before[::-1], du[::-1].reshape(do.shape)
    dh0 = _sequence_ends(before, cstart, ccount, dht)
    return _unwritten(dh.astype(dt), cstart, ccount, False), dh0, _unwritten(du.astype(dt), cstart, ccount, True)


def _wy(k, v, G, beta):
    """w, u (flat, float32) and T of the WY preparation; k has one head per value head."""
    kc, vc, Gc, bc = (_chunks(x)[0] for x in (k, v, G, beta))  # [NT, C, HV, .]
    hi = jax.lax.Precision.HIGHEST
    lower = jnp.tril(jnp.ones((C, C), bool), -1)[None, None]
    Gh, bh = jnp.moveaxis(Gc, 1, 2), jnp.moveaxis(bc, 1, 2)  # [NT, HV, C]
    E = jnp.exp(jnp.where(lower, Gh[..., :, None] - Gh[..., None, :], -jnp.inf))
    A = bh[..., :, None] * jnp.einsum("nihk,njhk->nhij", kc, kc, precision=hi) * E
    eye = jnp.eye(C, dtype=f32)
    Tm = jax.scipy.linalg.solve_triangular(eye + A, jnp.broadcast_to(eye, A.shape), lower=True, unit_diagonal=True)
    w = jnp.einsum("nhij,njhk->nihk", Tm, kc * (bc * jnp.exp(Gc))[..., None], precision=hi)
    u = jnp.einsum("nhij,njhv->nihv", Tm, vc * bc[..., None], precision=hi)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    return flat(w), flat(u), Tm


def delta_wy_t(k, v, g, beta):
    """kernels/delta/wy.py `chunk_delta_wy(store_t=True)`: w, u (input dtype), T (float32); G and beta
    `[L, HV]`, or with `g_rows` per-chunk rows."""
    G = g
    w, u, Tm = _wy(jnp.repeat(k, v.shape[1] // k.shape[1], axis=1), v, _gate_columns(G), _gate_columns(beta))
    return w.astype(k.dtype), u.astype(k.dtype), Tm


def delta_wy_t_l2(q, k, v, g, beta):
    """`chunk_delta_wy(store_t=True, l2norm=True)`: `delta_wy_t` of the normalised k, and the
    normalised q, k (input dtype) and their `1 / |x|` (float32 `[L, H]`)."""
    G = g
    (yq, rq), (yk, rk) = l2norm_fwd(q), l2norm_fwd(k)
    return (*delta_wy_t(yk, v, G, beta), yq, yk, rq, rk)


def delta_wy(k, v, g, beta):
    G = g
    return delta_wy_t(k, v, G, beta)[:2]


def delta_bwd_dqkvg(q, k, v, g, h, do, dh, *, scale, parts=1):
    """kernels/simple_gla/bwd.py `chunk_bwd_dqkvg(delta=True, no_dv=True)`: the simple GLA consumer
    on v_new with q/k head j // (HV / H), less dv; dq, dk per value head, dg."""
    vn, G = v, g  # (v_new)
    HV = vn.shape[1]
    rep = lambda x: jnp.repeat(x, HV // x.shape[1], axis=1)
    dq, dk, _, dg = bwd_dqkvg(rep(q), rep(k), vn, G, h, do, dh, scale=scale, parts=parts)
    return dq, dk, dg


def delta_wy_bwd(k, v, g, beta, t, h, du, dk0):
    """kernels/delta/wy.py `chunk_delta_wy_bwd`: dk (per value head, plus dk0) and dv in the input
    dtype, dG, dbeta (float32), by JAX's VJP of the preparation (T recomputed), with
    `dw = -du h^T` rounded to the input dtype. G and beta `[L, HV]`, or with `g_rows` per-chunk rows."""
    G = g
    del t  # (T is recomputed)
    dk, dv, dG, dbeta = _wy_bwd(k, v, G, beta, h, du, dk0)
    return dk.astype(du.dtype), dv.astype(du.dtype), dG, dbeta


def _wy_bwd(k, v, G, beta, h, du, dk0):
    """`delta_wy_bwd` in float32, before the outputs are rounded (G and beta as the program takes them)."""
    G, beta = _gate_columns(G), _gate_columns(beta)
    NT, HV, K, V = h.shape
    dw = -jnp.einsum("nchv,nhkv->nchk", du.astype(f32).reshape(NT, C, HV, V), h.astype(f32))
    dw = dw.reshape(-1, HV, K).astype(du.dtype)
    kr = jnp.repeat(k, v.shape[1] // k.shape[1], axis=1).astype(f32)
    _, vjp = jax.vjp(lambda *a: _wy(*a)[:2], kr, v.astype(f32), G, beta)
    dk, dv, dG, dbeta = vjp((dw.astype(f32), du.astype(f32)))
    return dk + dk0.astype(f32), dv, dG, dbeta


def l2norm_fwd(x):
    """kernels/delta/norm.py `l2norm_fwd`: x / |x| (input dtype) and 1 / |x| (float32)."""
    r = jax.lax.rsqrt(jnp.sum(jnp.square(x.astype(f32)), axis=-1) + 1e-6)
    return (x.astype(f32) * r[..., None]).astype(x.dtype), r


def l2norm_bwd(y, r, dy):
    """kernels/delta/norm.py `l2norm_bwd`: r (dy - y sum(dy y)) from the normalised y, input dtype."""
    return _l2norm_grad(y, r, dy).astype(y.dtype)


def _l2norm_grad(y, r, dy):
    """The raw x's gradient (float32) from y = x / |x|, r = 1 / |x| and the gradient of y (per
    value head where y, r are per q/k head)."""
    rep = lambda a: jnp.repeat(a, dy.shape[1] // a.shape[1], axis=1)
    y, r, dy = rep(y).astype(f32), rep(r), dy.astype(f32)
    return r[..., None] * (dy - y * jnp.sum(dy * y, axis=-1, keepdims=True))


def delta_bwd_dqkvg_l2(q, k, v, g, h, do, dh, rq, *, scale):
    """`chunk_bwd_dqkvg(delta=True, l2norm=True)`: dq the raw q's gradient (q normalised, rq = 1 / |q|;
    G and rq per-chunk rows with `g_rows`)."""
    vn, G = v, g  # (v_new)
    dq, dk, dg = delta_bwd_dqkvg(q, k, vn, G, h, do, dh, scale=scale)
    return _l2norm_grad(q, _gate_columns(rq), dq).astype(dq.dtype), dk, dg


def delta_wy_bwd_l2(k, v, g, beta, t, h, du, dk0, rk):
    """`chunk_delta_wy_bwd(l2norm=True)`: dk the raw k's gradient (k normalised, rk = 1 / |k|),
    the normalisation's gradient taken of dk in float32 (G, beta and rk per-chunk rows with `g_rows`)."""
    G = g
    dk, dv, dG, dbeta = _wy_bwd(k, v, G, beta, h, du, dk0)
    return _l2norm_grad(k, _gate_columns(rk), dk).astype(du.dtype), dv.astype(du.dtype), dG, dbeta


def _grads(q, k, v, vn, G, beta, h, do, dh, du, *, scale):
    """The consumer and the WY VJP in float32, the consumer's dk (and dq) unrounded between them."""
    rep = lambda x: jnp.repeat(x, vn.shape[1] // x.shape[1], axis=1).astype(f32)
    dq, dk0, _, dG0 = _bwd_dqkvg(rep(q), rep(k), vn, _gate_columns(G), h, do, dh, scale=scale, dv_dtype=f32)
    dk, dv, dG, dbeta = _wy_bwd(k, v, G, beta, h, du, dk0)
    return dq, dk, dv, dG0 + dG, dbeta


def delta_bwd_grads(q, k, v, vn, g, beta, t, h, do, dh, du, *, scale):
    """kernels/delta/grads.py `chunk_delta_bwd_grads`: `delta_bwd_dqkvg` and `delta_wy_bwd` in one
    program, dk summed in float32 (G, beta per-chunk rows); dG the sum of both parts."""
    G = g
    del t  # (T is recomputed)
    dq, dk, dv, dG, dbeta = _grads(q, k, v, vn, G, beta, h, do, dh, du, scale=scale)
    return dq.astype(du.dtype), dk.astype(du.dtype), dv.astype(du.dtype), dG, dbeta


def delta_bwd_grads_l2(q, k, v, vn, g, beta, t, h, do, dh, du, rq, rk, *, scale):
    """`chunk_delta_bwd_grads(l2norm=True)`: dq, dk the raw q's and k's gradients."""
    G = g
    del t  # (T is recomputed)
    dq, dk, dv, dG, dbeta = _grads(q, k, v, vn, G, beta, h, do, dh, du, scale=scale)
    dq, dk = _l2norm_grad(q, _gate_columns(rq), dq), _l2norm_grad(k, _gate_columns(rk), dk)
    return dq.astype(du.dtype), dk.astype(du.dtype), dv.astype(du.dtype), dG, dbeta


DELTA_PROGRAMS = {"_inv": delta_inv, "_fused_t": delta_fwd_fused_t, "_inv_l2": delta_inv_l2, "_fused_t_l2": delta_fwd_fused_t_l2,
                  "_carry_t": _carry_t(delta_fwd_fused_t), "_carry_t_l2": _carry_t(delta_fwd_fused_t_l2),
                  "_fused_t_v32": delta_fwd_fused_t, "_fused_t_l2_v32": delta_fwd_fused_t_l2, "_norm": l2norm_fwd, "_norm_bwd": l2norm_bwd, "_fused": delta_fwd_fused, "_fused_s": delta_fwd_fused_s, "_fused_h": delta_fwd_fused_h, "_dh": delta_bwd_dh, "_wy": delta_wy,
                  "_wy_t": delta_wy_t, "_wy_t_l2": delta_wy_t_l2, "_dqkvg": delta_bwd_dqkvg, "_dqkvg_l2": delta_bwd_dqkvg_l2,
                  "_wy_bwd": delta_wy_bwd, "_wy_bwd_l2": delta_wy_bwd_l2, "_grads": delta_bwd_grads, "_grads_l2": delta_bwd_grads_l2}


def _token_steps(q, k, v, g, beta, h0, scale, l2norm):
    """The step programs (`kernels/recurrent/step.py`): rows walked token by token from `h0 [B, HV, K, V]`; g a
    scalar per (token, head) `[B, T, HV]` or per key channel `[B, T, HV, K]`; beta None (no delta rule)."""
    HV, H = v.shape[2], q.shape[2]
    q, k = q.astype(f32), k.astype(f32)
    if l2norm:
        q, k = (x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))
    q, k = jnp.repeat(q, HV // H, 2), jnp.repeat(k, HV // H, 2)

    def token(S, x):
        qt, kt, vt, gt, bt = x
        S = S * (jnp.exp(gt)[..., None] if gt.ndim == 3 else jnp.exp(gt)[..., None, None])
        u = vt if bt is None else bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * u[..., None, :]
        return S, scale * jnp.einsum("bhkv,bhk->bhv", S, qt)

    t_major = lambda x: None if x is None else jnp.moveaxis(x.astype(f32), 1, 0)
    S, o = jax.lax.scan(token, h0, tuple(map(t_major, (q, k, v, g, beta))))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


def step(q, k, v, g, h0, *, scale, l2norm):
    return _token_steps(q, k, v, g, None, h0, scale, l2norm)


def delta_step(q, k, v, g, beta, h0, *, scale, l2norm):
    return _token_steps(q, k, v, g, beta, h0, scale, l2norm)


PROGRAMS["_step"] = GLA_PROGRAMS["_step"] = step
DELTA_PROGRAMS["_step"] = delta_step


def _programs():
    """Each built program by target name: its kind (the dispatched program's name, which an
    experiment stands in for) and its config."""
    from fla_jax import _variants as variants

    return {v.target(p): (p.of or p.name, dict(p.config)) for v in variants.VARIANTS for p in v.declared}


BUILT = _programs()


def program(target):
    """The stand-in for program `target` (of its kind: an experiment computes what its kind does)."""
    return {"delta": DELTA_PROGRAMS, "gla": GLA_PROGRAMS}.get(target.split("_")[1], PROGRAMS)["_" + BUILT[target][0]]


def launch(_p, target, results, named, init=None, in_place=None):
    """Drop-in for fla_jax._tilelang.runtime.launch: the program's inputs and attributes by the names its
    prim_func gives them (`runtime.call` has checked them against the built interface, where built); `in_place`
    changes nothing here (the emulated programs are functions)."""
    named = dict(named)
    kind, config = BUILT[target]
    kind = kind.removesuffix("_v") if kind.endswith("_v") else kind  # (a twin taking V on its grid computes its kind's)
    sums = ()
    if config.get("g_scan"):  # the gates per step, summed within each chunk by the program
        G = named["g"]
        named["g"] = G = jnp.cumsum(G.reshape(-1, C, *G.shape[1:]), axis=1).reshape(G.shape)
        if kind.startswith("wy_t"):  # (the training WY kernel also writes G and its per-chunk rows)
            sums = (G, jnp.moveaxis(G.reshape(-1, C, G.shape[1]), 1, 2))
    # the WY VJP taking the consumer's gradient of G (`dg_sum`) adds it and returns the gates' per step
    dg0 = named.pop("dg0") if config.get("dg_sum") else None
    if init is not None:  # (simple GLA's `enter` adds to its output o, the one program that updates in place)
        named["o"] = init[0]
    fn = program(target)
    if "scale" in named:
        named["scale"] = float(named["scale"])
    # where the key channels are split, results[2] has a leading axis of parts: dv [parts, L, H, V], or
    # the delta rules' consumer (no dv, three results) dg [parts, L, HV]
    if kind == "dqkvg" and len(results[2].shape) == (4 if len(results) == 4 else 3):
        named["parts"] = results[2].shape[0]
    out = fn(**named)
    out = (*out, *sums) if sums else out
    if dg0 is not None:
        dG = (out[2] + dg0).reshape(-1, C, dg0.shape[1])
        out = (*out[:2], jnp.flip(jnp.cumsum(jnp.flip(dG, 1), axis=1), 1).reshape(dg0.shape), out[3])
    if kind == "dh" and results[1].shape[0] == 0:  # (no dh0 where the call has no initial state: none written)
        out = (out[0], out[1][:0], *out[2:])
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(results), (target, len(outs), len(results))
    for o, r in zip(outs, results):
        assert o.shape == r.shape and o.dtype == r.dtype, (target, o.shape, r.shape, o.dtype, r.dtype)
    return outs
