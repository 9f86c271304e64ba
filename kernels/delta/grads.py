"""The delta rules' per-chunk gradients in one program: the consumer (`chunk_bwd_dqkvg(delta=True,
no_dv=True)`, kernels/simple_gla/bwd.py) and the WY preparation's VJP (`chunk_delta_wy_bwd`,
kernels/delta/wy.py) fused, so that the chunk's state h, k and the consumer's dk are read or
formed once and dk takes no HBM round trip between the two.

Layout and inputs as for `kernels/delta/wy.py` (flat chunk rows; G, beta and `1 / |x|` as per-chunk
rows `[NT, heads, BT]`; T float32 as the training forward stores it; q/k head `j // (HV / H)`).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import program
from kernels.delta.wy import _hi_lo


def chunk_delta_bwd_grads(*, K: int, V: int, dtype: str, BT: int = 64, l2norm: bool = False, g_rows: bool = True,
                          regs: tuple[int, int, int] = (0, 0, 0), late_cols: bool = False):
    """One program per (chunk, value head), three warpgroups and no loading one (jla's `chunk_grads`
    layout, after FlashQLA): every tile of the chunk by TMA from the start, in the order the
    products take them (du and h, then k, v, G, beta, then v_new and dh, then do and q), each
    group on a barrier of its own, and the warpgroups hand each other what they form through
    shared memory on barriers of their own:

    * warpgroup 0, the consumer's query side: `dA = do v_new^T`, `dq = scale e^G (do h^T)`; `dS =
      scale dA * e^(G_i - G_j)` (j <= i) published; `dq += dS k`, its row sums with q (the gate
      gradient's), the normalisation's gradient (`l2norm`), dq stored; then once warpgroup 1 has
      published T's halves `dvb = T^T du`, `dv = dvb beta` and the row sums of `dvb v`;
    * warpgroup 1, the WY VJP's chain: T through the registers into its hi + lo halves
      (published); `dw = -du h^T` (published, input dtype); `dT`, `X = dT T^T`, `dA = -T^T X`
      and `dkk = dA * e^(G_i - G_j) beta_i` (strictly lower, published as halves) with the row
      and column sums dbeta and dG take; last, dbeta and dG from every warpgroup's row sums;
    * warpgroup 2, dk: `dk = e^(G_C - G) (v_new dh^T)`, the last row's state terms
      (`e^(G_C) <h, dh>` and `sum(dk k)`), `+= dS^T q` (the consumer's dk; its row sums with k),
      `dkb = T^T dw` (its row sums with k), `+= dkb beta e^G + dkk k + dkk^T k`, the normalisation's
      gradient (`l2norm`), dk stored.

    The same sums as the two programs (dk's float32 sum is not rounded between them). Outputs
    `dq, dk [L, HV, K]` per value head (the caller sums a group), `dv [L, HV, V]` (input dtype),
    `dg [L, HV]` (the gradient of G: the caller takes its reverse in-chunk sum), `dbeta [L, HV]`.
    K = V <= 128 (222 KB of shared memory at 128: one program per SM). `regs`: each
    warpgroup's register count (`setmaxnreg`; 0: the launch's share, 168). `g_rows` (the only
    layout): read by the caller's dispatch (`_gates_for`, `_steps_for`). `late_cols`: P's column
    sums as the WY VJP takes them, P transposed through dkk's halves once warpgroup 2 is done with
    them, instead of `X^T T` formed beside `T^T X` (three products more before dkk is published).

    Each warpgroup's code opens with a named barrier of its own warpgroup: TileLang's sync planner
    reads the warpgroups' code in sequence, and where the accesses after one warpgroup's last
    barrier and before the next one's first touch one buffer it syncs the whole block between them
    (a deadlock here, where the warpgroups wait on each other; build.py refuses such a program).
    Only warpgroup 2 sums across warps (`<h, dh>`, `sum(dk k)`; every other sum is a row's, within a
    warp): TileLang's cross-warp reduction syncs on named barriers 1 and 2 whatever the warpgroup,
    so two warpgroups reducing so at once would share them."""
    assert K == V and K <= 128, "K = V <= 128"
    assert g_rows, "G, beta and 1 / |x| as per-chunk rows (g_rows) only"
    L, H, HV, NT = T.dynamic("L, H, HV, NT")
    acc = "float32"
    split = _hi_lo(BT, dtype, scaled=False)

    @T.macro
    def body(q, k, v, vn, g, beta, t, h, do, dh, du, rq, rk, scale, dq, dk, dv, dg, dbeta):
        with T.Kernel(NT, HV, threads=384) as (ic, ihv):
            ih = ihv // (HV // H)
            t0 = ic * BT
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, V), dtype)  # v, then dv
            vn_s = T.alloc_shared((BT, V), dtype)
            do_s = T.alloc_shared((BT, V), dtype)  # do, then dq
            du_s = T.alloc_shared((BT, V), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            dh_s = T.alloc_shared((K, V), dtype)
            g_s = T.alloc_shared((BT,), acc)
            b_s = T.alloc_shared((BT,), acc)
            rq_s = T.alloc_shared((BT,), acc) if l2norm else None
            rk_s = T.alloc_shared((BT,), acc) if l2norm else None
            th_s = T.alloc_shared((BT, BT), dtype)  # T = th + tl
            tl_s = T.alloc_shared((BT, BT), dtype)
            ds_s = T.alloc_shared((BT, BT), dtype)
            xh_s = T.alloc_shared((BT, BT), dtype)  # halves of dT, X, then of dkk (and with late_cols then of P)
            xl_s = T.alloc_shared((BT, BT), dtype)
            dw_s = T.alloc_shared((BT, K), dtype)  # dw, then dk
            qrow_s = T.alloc_shared((BT,), acc)  # row sums of dq q (warpgroup 0)
            vrow_s = T.alloc_shared((BT,), acc)  # of dvb v (warpgroup 0)
            krow_s = T.alloc_shared((BT,), acc)  # of the consumer's dk k (warpgroup 2)
            brow_s = T.alloc_shared((BT,), acc)  # of dkb k (warpgroup 2)
            last_s = T.alloc_shared((1,), acc)  # e^(G_C) <h, dh> + sum(dk_state k) (warpgroup 2)
            # warpgroup 0
            acc_da = T.alloc_fragment((BT, BT), acc)
            acc_dq = T.alloc_fragment((BT, K), acc)
            acc_v = T.alloc_fragment((BT, V), acc)
            tmp0 = T.alloc_fragment((BT, K), acc)
            row0 = T.alloc_fragment((BT,), acc)
            # warpgroup 1
            acc_dw = T.alloc_fragment((BT, K), acc)
            acc_c = T.alloc_fragment((BT, BT), acc)
            acc_c2 = T.alloc_fragment((BT, BT), acc)
            acc_kk = T.alloc_fragment((BT, BT), acc)
            row1 = T.alloc_fragment((BT,), acc)
            col1 = T.alloc_fragment((BT,), acc)
            prow1 = T.alloc_fragment((BT,), acc)
            # warpgroup 2
            acc_dk = T.alloc_fragment((BT, K), acc)
            acc_kb = T.alloc_fragment((BT, K), acc)
            tmp2 = T.alloc_fragment((BT, K), acc)
            row2 = T.alloc_fragment((BT,), acc)
            one2 = T.alloc_fragment((1,), acc)
            hd = T.alloc_fragment((K, 32), acc)
            hd_row = T.alloc_fragment((K,), acc)
            hd_sum = T.alloc_fragment((K,), acc)
            one3 = T.alloc_fragment((1,), acc)

            full = T.alloc_barrier([128] * 4)  # the loads: du, h | k, v, G, beta (rk) | v_new, dh | do, q (rq)
            t_ready = T.alloc_barrier([128])  # warpgroup 1: T's halves
            dw_ready = T.alloc_barrier([128])  # warpgroup 1: dw
            ds_ready = T.alloc_barrier([128])  # warpgroup 0: dS
            dkk_ready = T.alloc_barrier([128])  # warpgroup 1: dkk's halves (and done with v_s, k_s)
            rows0 = T.alloc_barrier([128])  # warpgroup 0: its row sums
            rows2 = T.alloc_barrier([128])  # warpgroup 2: its row sums and the last row's state terms
            x_free = T.alloc_barrier([128]) if late_cols else None  # warpgroup 2 has read dkk's halves

            with T.ws(2):
                if regs[2]:
                    T.set_max_nreg(regs[2], 1 if regs[2] > 168 else 0)
                T.sync_threads(13, 128)  # (as warpgroup 0's first)
                # dk = e^(G_C - G) (v_new dh^T), and the last row's state terms
                T.barrier_wait(full[2], 0)
                T.barrier_wait(full[1], 0)
                T.clear(acc_dk)
                T.gemm(vn_s, dh_s, acc_dk, transpose_B=True)
                for a, b in T.Parallel(BT, K):
                    acc_dk[a, b] = acc_dk[a, b] * T.exp(g_s[BT - 1] - g_s[a])
                T.barrier_wait(full[0], 0)
                T.clear(hd_sum)
                for vb in range(V // 32):
                    for a, b in T.Parallel(K, 32):
                        hd[a, b] = T.cast(h_s[a, vb * 32 + b], acc) * T.cast(dh_s[a, vb * 32 + b], acc)
                    T.reduce_sum(hd, hd_row, dim=1)
                    for a in T.Parallel(K):
                        hd_sum[a] = hd_sum[a] + hd_row[a]
                T.reduce_sum(hd_sum, one3, dim=0)
                for a, b in T.Parallel(BT, K):
                    tmp2[a, b] = acc_dk[a, b] * T.cast(k_s[a, b], acc)
                T.reduce_sum(tmp2, row2, dim=1)
                T.reduce_sum(row2, one2, dim=0)
                for a in T.Parallel(1):
                    last_s[a] = T.exp(g_s[BT - 1]) * one3[a] + one2[a]
                # + dS^T q: the consumer's dk, and its row sums with k
                T.barrier_wait(ds_ready[0], 0)
                T.barrier_wait(full[3], 0)
                T.gemm(ds_s, q_s, acc_dk, transpose_A=True)
                for a, b in T.Parallel(BT, K):
                    tmp2[a, b] = acc_dk[a, b] * T.cast(k_s[a, b], acc)
                T.reduce_sum(tmp2, row2, dim=1)
                for a in T.Parallel(BT):
                    krow_s[a] = row2[a]
                # dkb = T^T dw, its row sums with k; dk += dkb beta e^G
                T.barrier_wait(t_ready[0], 0)
                T.barrier_wait(dw_ready[0], 0)
                T.clear(acc_kb)
                T.gemm(th_s, dw_s, acc_kb, transpose_A=True)
                T.gemm(tl_s, dw_s, acc_kb, transpose_A=True)
                for a, b in T.Parallel(BT, K):
                    tmp2[a, b] = acc_kb[a, b] * T.cast(k_s[a, b], acc)
                T.reduce_sum(tmp2, row2, dim=1)
                for a in T.Parallel(BT):
                    brow_s[a] = row2[a]
                T.barrier_arrive(rows2[0])
                for a, b in T.Parallel(BT, K):
                    acc_dk[a, b] = acc_dk[a, b] + acc_kb[a, b] * b_s[a] * T.exp(g_s[a])
                # + dkk k + dkk^T k
                T.barrier_wait(dkk_ready[0], 0)
                T.gemm(xh_s, k_s, acc_dk)
                T.gemm(xl_s, k_s, acc_dk)
                T.gemm(xh_s, k_s, acc_dk, transpose_A=True)
                T.gemm(xl_s, k_s, acc_dk, transpose_A=True)
                if late_cols:
                    T.barrier_arrive(x_free[0])
                if l2norm:  # the raw k's gradient, r (dk - y sum(dk y))
                    for a, b in T.Parallel(BT, K):
                        tmp2[a, b] = acc_dk[a, b] * T.cast(k_s[a, b], acc)
                    T.reduce_sum(tmp2, row2, dim=1)
                    for a, b in T.Parallel(BT, K):
                        acc_dk[a, b] = rk_s[a] * (acc_dk[a, b] - T.cast(k_s[a, b], acc) * row2[a])
                T.copy(acc_dk, dw_s)  # (dw is spent: warpgroup 1's dT and this warpgroup's dkb have read it)
                T.fence_proxy_async()
                T.sync_threads(10, 128)
                T.tma_copy(dw_s, dk[t0 : t0 + BT, ihv, 0:K])
                T.tma_store_wait()

            with T.ws(1):
                if regs[1]:
                    T.set_max_nreg(regs[1], 1 if regs[1] > 168 else 0)
                T.sync_threads(12, 128)  # (as warpgroup 0's first)
                T.copy(t[ic, ihv, 0:BT, 0:BT], acc_c)  # T through the registers into its halves
                split(acc_c, None, th_s, tl_s)
                T.fence_proxy_async()
                T.barrier_arrive(t_ready[0])
                # dw = -du h^T
                T.barrier_wait(full[0], 0)
                T.clear(acc_dw)
                T.gemm(du_s, h_s, acc_dw, transpose_B=True)
                for a, b in T.Parallel(BT, K):
                    dw_s[a, b] = T.cast(-acc_dw[a, b], dtype)
                T.fence_proxy_async()
                T.barrier_arrive(dw_ready[0])
                # dT = (dw k^T) Diag(beta e^G) + (du v^T) Diag(beta)
                T.barrier_wait(full[1], 0)
                T.clear(acc_c)
                T.gemm(dw_s, k_s, acc_c, transpose_B=True)
                T.clear(acc_c2)
                T.gemm(du_s, v_s, acc_c2, transpose_B=True)
                for a, b in T.Parallel(BT, BT):
                    acc_c[a, b] = acc_c[a, b] * b_s[b] * T.exp(g_s[b]) + acc_c2[a, b] * b_s[b]
                split(acc_c, None, xh_s, xl_s)
                # X = dT T^T
                T.clear(acc_c)
                T.gemm(xh_s, th_s, acc_c, transpose_B=True)
                T.gemm(xh_s, tl_s, acc_c, transpose_B=True)
                T.gemm(xl_s, th_s, acc_c, transpose_B=True)
                split(acc_c, None, xh_s, xl_s)
                # dA = -T^T X (acc_c: T^T X) and its transpose (acc_c2: X^T T, for P's column sums as row sums)
                T.clear(acc_c)
                T.gemm(th_s, xh_s, acc_c, transpose_A=True)
                T.gemm(th_s, xl_s, acc_c, transpose_A=True)
                T.gemm(tl_s, xh_s, acc_c, transpose_A=True)
                if not late_cols:
                    T.clear(acc_c2)
                    T.gemm(xh_s, th_s, acc_c2, transpose_A=True)
                    T.gemm(xh_s, tl_s, acc_c2, transpose_A=True)
                    T.gemm(xl_s, th_s, acc_c2, transpose_A=True)
                # dkk = dA * E * beta_i (strictly lower), published as halves
                for a, b in T.Parallel(BT, BT):
                    acc_kk[a, b] = T.if_then_else(a > b, -acc_c[a, b] * T.exp(g_s[a] - g_s[b]) * b_s[a], 0.0)
                split(acc_kk, None, xh_s, xl_s)
                T.fence_proxy_async()
                T.barrier_arrive(dkk_ready[0])
                # Q = dA * E * KK^T: its row sums (dbeta's); P = Q beta_i: its row sums less its column sums (dG's)
                T.clear(acc_kk)
                T.gemm(k_s, k_s, acc_kk, transpose_B=True)
                if not late_cols:
                    for a, b in T.Parallel(BT, BT):  # P^T
                        acc_c2[a, b] = T.if_then_else(b > a, -acc_c2[a, b] * T.exp(g_s[b] - g_s[a]) * acc_kk[a, b] * b_s[b], 0.0)
                    T.reduce_sum(acc_c2, col1, dim=1)
                for a, b in T.Parallel(BT, BT):  # Q
                    acc_c[a, b] = T.if_then_else(a > b, -acc_c[a, b] * T.exp(g_s[a] - g_s[b]) * acc_kk[a, b], 0.0)
                T.reduce_sum(acc_c, row1, dim=1)
                for a, b in T.Parallel(BT, BT):  # P
                    acc_c[a, b] = acc_c[a, b] * b_s[a]
                T.reduce_sum(acc_c, prow1, dim=1)
                if late_cols:  # P, transposed through dkk's halves once warpgroup 2 has read them
                    T.barrier_wait(x_free[0], 0)
                    split(acc_c, None, xh_s, xl_s)
                    for a, b in T.Parallel(BT, BT):
                        acc_c[a, b] = T.cast(xh_s[b, a], acc) + T.cast(xl_s[b, a], acc)
                    T.reduce_sum(acc_c, col1, dim=1)
                T.barrier_wait(rows0[0], 0)
                T.barrier_wait(rows2[0], 0)
                for a in T.Parallel(BT):  # (threads sharing a row write the same value)
                    dbeta[t0 + a, ihv] = T.exp(g_s[a]) * brow_s[a] + vrow_s[a] + row1[a]
                    dg[t0 + a, ihv] = (b_s[a] * T.exp(g_s[a]) * brow_s[a] + prow1[a] - col1[a] + qrow_s[a] - krow_s[a]
                                       + T.if_then_else(a == BT - 1, last_s[0], 0.0))

            with T.ws(0):
                if regs[0]:
                    T.set_max_nreg(regs[0], 1 if regs[0] > 168 else 0)
                T.sync_threads(11, 128)  # (so that TileLang's sync planner sees no access of warpgroup 1's before these loads)
                T.tma_copy(du[t0 : t0 + BT, ihv, 0:V], du_s, barrier=full[0])
                T.tma_copy(h[ic, ihv, 0:K, 0:V], h_s, barrier=full[0])
                T.barrier_arrive(full[0])
                T.tma_copy(k[t0 : t0 + BT, ih, 0:K], k_s, barrier=full[1])
                T.tma_copy(v[t0 : t0 + BT, ihv, 0:V], v_s, barrier=full[1])
                T.tma_copy(g[ic, ihv, 0:BT], g_s, barrier=full[1])
                T.tma_copy(beta[ic, ihv, 0:BT], b_s, barrier=full[1])
                if l2norm:
                    T.tma_copy(rk[ic, ih, 0:BT], rk_s, barrier=full[1])
                T.barrier_arrive(full[1])
                T.tma_copy(vn[t0 : t0 + BT, ihv, 0:V], vn_s, barrier=full[2])
                T.tma_copy(dh[ic, ihv, 0:K, 0:V], dh_s, barrier=full[2])
                T.barrier_arrive(full[2])
                T.tma_copy(do[t0 : t0 + BT, ihv, 0:V], do_s, barrier=full[3])
                T.tma_copy(q[t0 : t0 + BT, ih, 0:K], q_s, barrier=full[3])
                if l2norm:
                    T.tma_copy(rq[ic, ih, 0:BT], rq_s, barrier=full[3])
                T.barrier_arrive(full[3])
                T.barrier_wait(full[3], 0)
                T.barrier_wait(full[2], 0)
                T.barrier_wait(full[0], 0)
                T.barrier_wait(full[1], 0)
                # dA = do v_new^T, dq = do h^T
                T.clear(acc_da)
                T.gemm(do_s, vn_s, acc_da, transpose_B=True)
                T.clear(acc_dq)
                T.gemm(do_s, h_s, acc_dq, transpose_B=True)
                for i, j in T.Parallel(BT, BT):
                    acc_da[i, j] = T.if_then_else(i >= j, acc_da[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
                T.copy(acc_da, ds_s)
                T.fence_proxy_async()
                T.barrier_arrive(ds_ready[0])
                for i, j in T.Parallel(BT, K):
                    acc_dq[i, j] = acc_dq[i, j] * T.exp(g_s[i]) * scale
                T.gemm(ds_s, k_s, acc_dq)
                for i, j in T.Parallel(BT, K):
                    tmp0[i, j] = acc_dq[i, j] * T.cast(q_s[i, j], acc)
                T.reduce_sum(tmp0, row0, dim=1)
                for i in T.Parallel(BT):
                    qrow_s[i] = row0[i]
                if l2norm:  # the raw q's gradient, r (dq - y sum(dq y))
                    for i, j in T.Parallel(BT, K):
                        acc_dq[i, j] = rq_s[i] * (acc_dq[i, j] - T.cast(q_s[i, j], acc) * row0[i])
                T.copy(acc_dq, do_s)  # (do is spent)
                T.fence_proxy_async()
                T.sync_threads(8, 128)
                T.tma_copy(do_s, dq[t0 : t0 + BT, ihv, 0:K])
                # dvb = T^T du; dv = dvb beta
                T.barrier_wait(t_ready[0], 0)
                T.clear(acc_v)
                T.gemm(th_s, du_s, acc_v, transpose_A=True)
                T.gemm(tl_s, du_s, acc_v, transpose_A=True)
                for i, j in T.Parallel(BT, V):
                    tmp0[i, j] = acc_v[i, j] * T.cast(v_s[i, j], acc)
                T.reduce_sum(tmp0, row0, dim=1)
                for i in T.Parallel(BT):
                    vrow_s[i] = row0[i]
                T.barrier_arrive(rows0[0])
                T.barrier_wait(dkk_ready[0], 0)  # warpgroup 1 is done with v_s
                for i, j in T.Parallel(BT, V):
                    v_s[i, j] = T.cast(acc_v[i, j] * b_s[i], dtype)
                T.fence_proxy_async()
                T.sync_threads(8, 128)
                T.tma_copy(v_s, dv[t0 : t0 + BT, ihv, 0:V])
                T.tma_store_wait()

    rows = lambda: T.Tensor((NT, H, BT), acc) if l2norm else None  # 1 / |q|, 1 / |k| as per-chunk rows
    main = program(body, q=T.Tensor((L, H, K), dtype), k=T.Tensor((L, H, K), dtype), v=T.Tensor((L, HV, V), dtype),
                   vn=T.Tensor((L, HV, V), dtype), g=T.Tensor((NT, HV, BT), acc), beta=T.Tensor((NT, HV, BT), acc),
                   t=T.Tensor((NT, HV, BT, BT), acc), h=T.Tensor((NT, HV, K, V), dtype), do=T.Tensor((L, HV, V), dtype),
                   dh=T.Tensor((NT, HV, K, V), dtype), du=T.Tensor((L, HV, V), dtype), rq=rows(), rk=rows(),
                   scale=T.float32, dq=T.Tensor((L, HV, K), dtype), dk=T.Tensor((L, HV, K), dtype),
                   dv=T.Tensor((L, HV, V), dtype), dg=T.Tensor((L, HV), acc), dbeta=T.Tensor((L, HV), acc))
    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    return main.with_attr("fla.disable_shared_memory_reuse", 1)
