"""The delta rule and GDN on the kernels (`kernels/delta/`): a scalar decay (GDN) and the delta update
with beta, grouped value heads, `use_qk_l2norm_in_kernel`.

Forward with no gradient (at `Config.delta_fwd_inverse`): the gate-free inverse T0 (`inv`, `inv_l2`
normalising q and k itself), then a state pass forming v_new from it on chip (`fused_t`; V blocks of 32
where few sequences and heads leave SMs idle, `Config.delta_narrow_programs`). Otherwise, and under a
gradient: the WY preparation (`wy`; under a gradient `wy_t` / `wy_t_l2`, which also writes T and, from
the raw q and k, their normalised y and 1 / |x|), then the state pass on w and u (`fused` / `fused_h`,
which also writes v_new). Backward: the reverse state-gradient pass (`dh`, which also forms dv_new),
then the consumer on v_new and the WY VJP as kernels (`dqkvg`, `wy_bwd`; or as one program, `grads`,
at `Config.delta_grads_kernel`), or JAX's VJPs of one chunk's forward (`chunk_local`) and of the WY
preparation (`wy_vjp`) where the config switches those kernels off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _partition
from fla_jax._problem import Problem
from fla_jax._tilelang import common, config, plan, runtime

# q, k, v, the gates per step, beta
TOKENS = ("bthk", "bthk", "bthv", "bth", "bth")
# the WY preparation's w, u (per token) and T (per chunk), and v_new (per token)
STORED = ("bthk", "bthv", "bchkv", "bthv")


def forward(c: common.Chunks):
    """`(o, ht)`, or under a gradient `(o, h, w, u, T, v_new, [q, k normalised, 1 / |q|, 1 / |k|,] G, [G's
    rows,] ht)`: the normalised q and k and their norms where the WY kernel normalised them (`c.l2norm`)."""
    p, C, K = c.p, c.C, c.K
    qf, kf, vf, graw, beta = c.flat
    f32 = jnp.float32
    # (under a gradient the WY kernel may sum the gates and write G and its rows, `g_scan`)
    wy_scan = c.store_h and c.takes(plan.delta_wy(c.store_h, c.l2norm), "g_scan")
    G, rows0 = (graw, None) if wy_scan else common.gate_sums(c)

    def gate_rows():
        return common.gate_rows(G, C) if rows0 is None else rows0

    dt = qf.dtype
    NT = c.NT
    grows = rows0  # (G's rows where formed: for the programs that load them, and the backward's)
    if plan.delta_forward_from_inverse(p, K, c.store_h):  # T0, and a state pass that forms v_new from it
        targets = c.targets()
        t0 = jax.ShapeDtypeStruct((NT, c.HV, C, C), dt)
        rows = lambda R: jax.ShapeDtypeStruct((NT, c.HV, R, C), f32)
        inv = "inv_l2" if c.l2norm else "inv"
        gates = graw if c.takes(inv, "g_scan") else G  # (summed by the kernel, or by XLA)
        if c.l2norm:  # G, beta, 1 / |q|, 1 / |k| per chunk and value head, rows that the state pass loads
            t0, gr = runtime.call(p, targets[inv], (t0, rows(4)), q=qf, k=kf, g=gates, beta=beta)
        else:  # G and beta
            t0, gr = runtime.call(p, targets[inv], (t0, rows(2)), k=kf, g=gates, beta=beta)
        N = c.cstart.shape[0]
        ins = dict(q=qf, k=kf, v=vf, t=t0, gr=gr)
        carry = plan.delta_carry_t(p, targets, c.l2norm)  # (walking pieces: their states and maps in one launch)
        o, ht = common.state_pass(c, ins, name=plan.delta_state_pass_t(p, targets, c.l2norm, N, c.HV, c.V, NT // N), values="v",
                                  carry=(carry, dict(k=kf, v=vf, t=t0, gr=gr)) if carry else None)
        return o.reshape(c.B, c.Lr, c.HV, c.V), ht
    assert not c.l2norm or c.store_h, "the forward with no gradient normalises q and k itself only from the inverse"
    like = common.like
    norms = ()
    tm = (jax.ShapeDtypeStruct((NT, c.HV, C, C), f32),) if c.store_h else ()
    sum_shapes = (like(graw), jax.ShapeDtypeStruct((NT, c.HV, C), f32)) if wy_scan else ()  # (`g_scan`: G and its rows)
    name = plan.delta_wy(c.store_h, c.l2norm)
    if c.takes(name, "g_rows"):  # G's rows, also for the passes after it
        grows = gate_rows()
    gates = dict(g=graw if wy_scan else common.gates_for(p, "fwd", K, name, G, C, grows), beta=common.steps_for(p, "fwd", K, name, C, beta)[0])
    if c.l2norm:  # (`wy_t_l2`) from the raw q and k; their normalised y and 1 / |x| for the passes after it
        r = jax.ShapeDtypeStruct(qf.shape[:2], f32)
        wy = runtime.call(p, c.targets()[name], (like(kf, dt, c.HV), like(vf), *tm, like(qf), like(kf), r, r, *sum_shapes), q=qf, k=kf, v=vf,
                          **gates)
    else:
        wy = runtime.call(p, c.targets()[name], (like(kf, dt, c.HV), like(vf), *tm, *sum_shapes), k=kf, v=vf, **gates)
    if wy_scan:
        wy, (G, grows) = wy[:-2], wy[-2:]
    if c.l2norm:
        *wy, qf, kf, rq, rk = wy
        norms = tuple(x.reshape(c.B, c.Lr, *x.shape[1:]) for x in (qf, kf, rq, rk))
    state_name = "fused_h" if c.store_h else "fused"
    if grows is None and c.store_rows:  # (XLA's transpose, for this pass and the backward's)
        grows = gate_rows()
    ins = dict(q=qf, k=kf, w=wy[0], u=wy[1], g=common.gates_for(p, "fwd", K, state_name, G, C, grows))
    rows = lambda x, per_chunk: x.reshape(c.B, (NT if per_chunk else NT * C) // c.B, *x.shape[1:])
    stored = tuple(rows(x, i == 2) for i, x in enumerate(wy)) if c.store_h else ()
    carry = plan.delta_carry_pass(c.targets())  # (storing no h, writing no o: the pieces' other passes)
    light = (carry, dict(ins, g=common.gates_for(p, "fwd", K, carry, G, C, grows)))
    o, v_new, *h, ht = common.state_pass(c, ins, 1, light=light, values="u")
    if stored:  # and v_new, for the backward's consumer kernel
        stored = (*stored, c.unflat(v_new))
    sums = common.stored_sums(c, G, grows)
    return (c.unflat(o), *h, *stored, *norms, *sums, ht)


# ----------------------------------------------------------------------------- use_qk_l2norm_in_kernel
# Inside the op's custom VJP, on the chunk rows. Where `Config.delta_l2norm_fused` (at K <= 128) the kernels
# normalise q and k themselves: without a gradient `inv_l2` and `fused_t_l2`, under one the WY kernel
# `wy_t_l2` (`plan.folds_l2norm`, `plan.folds_l2norm_h`). Elsewhere, without a gradient XLA's fused pass (the faster
# there); under one a kernel per tensor (`norm`), which also keeps 1 / |x| for the backward. The backward
# folds the normalisation's gradient into its consumer and WY VJP (`delta_l2norm_fused`), or runs
# `norm_bwd` per tensor after them.


@functools.cache
def norm_partitioned(p: Problem):
    return _partition.batch_head_partitioned(functools.partial(_norm_forward, p), ("bthk", "bthk"), ("bthk", "bthk", "bth", "bth"))


def _norm_forward(p: Problem, q, k):
    """`(q / |q|, k / |k|, 1 / |q|, 1 / |k|)`, the norms' reciprocals in float32 `[B, T, H]`."""
    target = plan.targets(p, "fwd", q.shape[-1], q.shape[-1])["norm"]
    rows = lambda x: x.reshape(-1, *x.shape[2:])
    like = common.like
    (qn, rq), (kn, rk) = (runtime.call(p, target, (like(rows(x)), jax.ShapeDtypeStruct(rows(x).shape[:2], jnp.float32)), x=rows(x))
                          for x in (q, k))
    return qn.reshape(q.shape), kn.reshape(k.shape), rq.reshape(q.shape[:3]), rk.reshape(k.shape[:3])


def _norm_backward(p: Problem, y, r, dy):
    """The raw x's gradient from the normalised `y [L, H, K]`, `r = 1 / |x|` `[L, H]` and the
    gradient of y."""
    return runtime.call(p, plan.targets(p, "bwd", y.shape[-1], y.shape[-1])["norm_bwd"], common.like(y), y=y, r=r, dy=dy)


def backward(b: common.Reverse, stored, l2norm: bool):
    """dq, dk, dv, dg (per step), dbeta (and dh0 where the call has h0): the reverse state-gradient pass, then
    the consumer and the WY VJP (kernels, or XLA's VJPs, as the call's `Config` says). `stored`: w, u, T,
    v_new; with `l2norm` the tokens hold the normalised q and k and `b.norms` their `1 / |x|`, and the
    gradients are the raw q's and k's."""
    p, C, K = b.p, b.C, b.K
    qf, kf, vf, Gf, beta = b.flat
    wd, ud, Tm, vn = (x.reshape(-1, *x.shape[2:]) for x in stored)
    rq, rk = (x.reshape(-1, x.shape[-1]) for x in b.norms) if l2norm else (None, None)
    H, HV = qf.shape[1], vf.shape[1]
    # value heads -> q/k heads (nothing where they are the same)
    group_sum = lambda x: x if HV == H else x.astype(jnp.float32).reshape(-1, H, HV // H, K).sum(axis=2)
    like = common.like
    # (with dv_new, `du`, the gradient of v_new that its chain forms)
    gates = common.gates_for(p, "bwd", K, "dh", Gf, C, b.grows)
    dh, dh0, du = common.reverse_pass(b, dict(q=qf, k=kf, w=wd, do=b.dof, g=gates), 1, transition=functools.partial(_piece_maps, b, qf, kf, wd, Gf))
    heads = lambda x: like(x, None, HV)
    chosen = plan.delta_backward(p, K, l2norm, b.bwd)
    q_norm, k_norm, name = chosen.q_norm, chosen.k_norm, chosen.grads  # (which of dq, dk take the norms' gradient)
    if name:  # the consumer and the WY VJP in one program
        gates, betas = common.gates_for(p, "bwd", K, name, Gf, C, b.grows), common.steps_for(p, "bwd", K, name, C, beta)
        rs = dict(zip(("rq", "rk"), common.steps_for(p, "bwd", K, name, C, rq, rk))) if name == "grads_l2" else {}
        outs = (heads(qf), heads(kf), like(vf), like(Gf), like(Gf))
        dq, dk, dv, dG, dbeta = runtime.call(p, b.bwd[name], outs, q=qf, k=kf, v=vf, vn=vn, g=gates, beta=betas[0], t=Tm, h=b.hf, do=b.dof,
                                             dh=dh, du=du, **rs, scale=b.s)
        dq, dk = group_sum(dq), group_sum(dk)
        dg = common.in_chunk_cumsum(p, dG, C, reverse=True)  # G's gradient -> the gates' per step
    else:
        dq, dk, dv, dg, dbeta = _two_programs(b, chosen, qf, kf, vf, Gf, beta, wd, ud, Tm, vn, dh, du, rq, rk, group_sum)
    if l2norm and not q_norm:
        dq = _norm_backward(p, qf, rq, dq.astype(qf.dtype))
    if l2norm and not k_norm:
        dk = _norm_backward(p, kf, rk, dk.astype(kf.dtype))
    return (b.rows(dq, qf.dtype), b.rows(dk, kf.dtype), b.rows(dv, vf.dtype), b.rows(dg, jnp.float32),
            b.rows(dbeta, jnp.float32), *((dh0,) if b.has_h0 else ()))


def _piece_maps(b: common.Reverse, qf, kf, wd, Gf, first, count):
    """The forward's map of the state across each piece of the reverse pass (`common.reverse_pass`) `[pieces,
    HV, K, K]`: the forward's pass carrying states alone (`plan.delta_carry_pass`) from an identity state with the values u zeroed (the
    same call as the forward's: under one jit XLA computes it once)."""
    p, C, K = b.p, b.C, b.K
    HV = wd.shape[1]
    zero = jnp.zeros((*wd.shape[:2], K), wd.dtype)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (first.shape[0], HV, K, K))
    targets = plan.targets(p, "fwd", K, K)
    carry = plan.delta_carry_pass(targets)
    gates = common.gates_for(p, "fwd", K, carry, Gf, C, b.grows)
    token = common.like(zero)
    ends = jax.ShapeDtypeStruct(eye.shape, jnp.float32)
    return runtime.call(p, targets[carry], (token, token, ends), q=qf, k=kf, w=wd, u=zero, g=gates, h0=eye, cstart=first, ccount=count,
                        scale=b.s)[-1]


def _two_programs(b: common.Reverse, chosen: plan.DeltaBackward, qf, kf, vf, Gf, beta, wd, ud, Tm, vn, dh, du, rq, rk, group_sum):
    """The backward after the reverse pass in two programs (the consumer on v_new, then the WY VJP
    kernel) or in XLA (`chunk_local`'s VJP and `wy_vjp`), as the planner picks (`chosen`): dq, dk, dv, dg (per
    step), dbeta; dq and dk before the norms' gradient where `chosen.q_norm` / `chosen.k_norm` are off."""
    p, C, K = b.p, b.C, b.K
    fused, wy_kernel, q_norm, k_norm = chosen.consumer, chosen.wy, chosen.q_norm, chosen.k_norm
    V, HV = vf.shape[-1], vf.shape[1]
    hf, dof, bwd, grows = b.hf, b.dof, b.bwd, b.grows
    like = common.like
    f32 = lambda x: x.astype(jnp.float32)  # the VJP in float32, on the inputs as the kernels saw them
    heads = lambda x: like(x, None, HV)
    if fused:  # one chunk's forward is simple GLA's on v_new: its consumer kernel, less dv (du)
        name, rqs = ("dqkvg_l2", (rq,)) if q_norm else ("dqkvg", ())
        rqs, gates = common.steps_for(p, "bwd", K, name, C, *rqs), common.gates_for(p, "bwd", K, name, Gf, C, grows)
        dq, dkv, dG = common.consumer(p, bwd[name], (heads(qf), heads(kf), like(Gf)), q=qf, k=kf, v=vn, g=gates, h=hf, do=dof, dh=dh,
                                      **dict(zip(("rq",), rqs)), scale=b.s)
        dq, dk = group_sum(dq), 0.0  # dk per value head (dkv) goes on to the WY VJP
    else:
        _, local_vjp = jax.vjp(lambda *a: chunk_local(p, C, b.scale, *a), f32(qf), f32(kf), f32(wd), f32(ud), Gf, hf)
        dq, dk, dw, du, dG, _ = local_vjp((f32(dof), f32(dh)))
        dkv = jnp.zeros(heads(kf).shape, kf.dtype)
    summed = False  # whether the WY VJP kernel returns the gates' gradient per step (`dg_sum`)
    if wy_kernel:  # it forms dw = -du h^T itself (v_new = u - w h) and adds dkv to its dk
        outs = (heads(kf), like(vf), like(Gf), like(Gf))
        name, rks = ("wy_bwd_l2", (rk,)) if k_norm else ("wy_bwd", ())
        summed = plan.program_config(p, "bwd", K, name).get("dg_sum", False)  # (then it takes the consumer's dG, and adds it)
        # G, beta (and r) as it takes them (G's rows as the forward kept them)
        sums = dict(g=common.gates_for(p, "bwd", K, name, Gf, C, grows), beta=common.steps_for(p, "bwd", K, name, C, beta)[0])
        rks = dict(zip(("rk",), common.steps_for(p, "bwd", K, name, C, *rks)))
        dk2, dv, dG2, dbeta = runtime.call(p, bwd[name], outs, k=kf, v=vf, **sums, t=Tm, h=hf, du=du.astype(kf.dtype), dk0=dkv,
                                           **({"dg0": dG} if summed else {}), **rks)
        dk2 = group_sum(dk2)
    else:
        if fused:  # the XLA WY VJP takes dw = -du h^T
            NT = hf.shape[0]
            dw = -jnp.einsum("nchv,nhkv->nchk", du.reshape(NT, C, HV, V), hf, preferred_element_type=jnp.float32).reshape(-1, HV, K)
            dk = group_sum(f32(dkv))
        dk2, dv, dG2, dbeta = wy_vjp(p, C, Tm, kf, vf, Gf, beta, dw, f32(du))
    dk = dk2 if fused and wy_kernel else dk + dk2  # (the WY VJP kernel has added the consumer's dk)
    dg = dG2 if summed else common.in_chunk_cumsum(p, dG + dG2, C, reverse=True)  # G's gradient -> the gates' per step
    return dq, dk, dv, dg, dbeta


def wy_vjp(p: Problem, C: int, Tm, k, v, G, beta, dw, du):
    """VJP of the WY preparation (`kernels/delta/wy.py`) given its `T = (I + A)^{-1}`
    `[NT, HV, C, C]` (float32): `dk, dv, dG, dbeta` from `dw, du`. `w = T (k s)`, `u = T (v beta)`
    with `s = beta exp(G)`, `A = tril(Diag(beta) (K K^T * exp(G_i - G_j)), -1)`; the solve's
    gradient is `dA = -T^T dT T^T` (strictly lower part). Flat layout as `chunk_local`."""
    L, H, K = k.shape
    HV = v.shape[1]
    NT = L // C
    f32 = jnp.float32
    ein = functools.partial(jnp.einsum, precision=config.of(p).vjp_precision)
    ch = lambda x: x.astype(f32).reshape(NT, C, *x.shape[1:])
    kc, vc, Gc, bc, dwc, duc = ch(jnp.repeat(k, HV // H, axis=1)), ch(v), ch(G), ch(beta), ch(dw), ch(du)
    eg = jnp.exp(Gc)  # [NT, C, HV]
    s = bc * eg
    dkb = ein("nhij,nihk->njhk", Tm, dwc)  # T^T dw
    dvb = ein("nhij,nihv->njhv", Tm, duc)
    dT = ein("nihk,njhk->nhij", dwc, kc * s[..., None]) + ein("nihv,njhv->nhij", duc, vc * bc[..., None])
    dA = -ein("nhji,nhjl,nhml->nhim", Tm, dT, Tm)  # -T^T dT T^T
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    Gh = jnp.moveaxis(Gc, 1, 2)  # [NT, HV, C]
    E = jnp.where(i > j, jnp.exp(jnp.where(i > j, Gh[..., :, None] - Gh[..., None, :], 0.0)), 0.0)
    kk = ein("nihk,njhk->nhij", kc, kc)
    bh = jnp.moveaxis(bc, 1, 2)
    dkk = dA * E * bh[..., :, None]  # gradient of K K^T, strictly lower
    P = dkk * kk  # dA * A
    kb_dot = jnp.sum(dkb * kc, axis=-1)  # [NT, C, HV]
    dk = dkb * s[..., None] + ein("nhij,njhk->nihk", dkk, kc) + ein("nhij,nihk->njhk", dkk, kc)
    dv = dvb * bc[..., None]
    dbeta = kb_dot * eg + jnp.sum(dvb * vc, axis=-1) + jnp.moveaxis(jnp.sum(dA * E * kk, axis=-1), 1, 2)
    dG = kb_dot * s + jnp.moveaxis(jnp.sum(P, axis=-1) - jnp.sum(P, axis=-2), 1, 2)
    dk = dk.reshape(L, H, HV // H, K).sum(axis=2)
    return dk, dv.reshape(L, HV, -1), dG.reshape(L, HV), dbeta.reshape(L, HV)


def chunk_local(p: Problem, C: int, scale: float, q, k, w, u, G, h):
    """One chunk of the delta-rule forward, every chunk at once, given the state before it:
    `(o, state after)`. Flat layout; q, k `[L, H, K]`, w `[L, HV, K]`, u `[L, HV, V]`,
    G `[L, HV]`, h `[NT, HV, K, V]`. Differentiated by JAX for the parallel part of the backward."""
    L, H, K = q.shape
    HV, V = u.shape[1:]
    NT = L // C
    prec = config.of(p).vjp_precision
    f32 = jnp.float32
    ch = lambda x: x.astype(f32).reshape(NT, C, *x.shape[1:])
    qc, kc = (ch(jnp.repeat(x, HV // H, axis=1)) for x in (q, k))
    wc, uc, Gc, hf = ch(w), ch(u), ch(G), h.astype(f32)
    vn = uc - jnp.einsum("nchk,nhkv->nchv", wc, hf, precision=prec)
    i, j = jnp.arange(C)[:, None, None], jnp.arange(C)[None, :, None]
    decay = jnp.exp(jnp.where(i >= j, Gc[:, :, None, :] - Gc[:, None, :, :], -jnp.inf))  # [NT, i, j, HV]
    A = jnp.einsum("nihk,njhk->nijh", qc, kc, precision=prec) * decay * scale
    o = scale * jnp.einsum("nchk,nhkv->nchv", qc * jnp.exp(Gc)[..., None], hf, precision=prec)
    o = o + jnp.einsum("nijh,njhv->nihv", A, vn, precision=prec)
    glast = Gc[:, -1]  # [NT, HV]
    kd = kc * jnp.exp(glast[:, None] - Gc)[..., None]
    after = jnp.exp(glast)[..., None, None] * hf + jnp.einsum("nchk,nchv->nhkv", kd, vn, precision=prec)
    return o.reshape(L, HV, V), after
