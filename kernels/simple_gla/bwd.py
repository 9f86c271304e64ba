"""simple GLA backward in TileLang (fla's chunk_bwd_dh + a fused dq/dk/dv/dg consumer).

Inputs as for the forward (T chunk-aligned, `g` = in-chunk cumulative log gates, float32), plus the
states before each chunk `h [B, NT, H, K, V]` (recomputed by the forward's `chunk_fwd_h`).

* `chunk_bwd_dh`: one program per (V block, batch * head), chunks in reverse. `dh[n]` is the
  gradient of the state after chunk n; `dh0` that of the initial state:
  `dS_before = exp(G_C) dS_after + scale (q * exp(G))^T do`, starting from `dht`.
* `chunk_bwd_dqkvg`: one program per (chunk, batch * head), looping over V blocks with A = the
  masked, decayed `scale Q K^T` and `kd = k * exp(G_C - G)` kept on chip:
  `dv = kd dh + A^T do`, `dq = scale exp(G) (do h^T) + dS k`, `dk = exp(G_C - G) (v dh^T) + dS^T q`
  with `dS = scale (do v^T) * exp(G_i - G_j), j <= i`, and the gate gradient per position
  `dG_i = q_i.dq_i - k_i.dk_i` (+ `exp(G_C) <h, dh> + sum_j k_j.dk_inter_j` at the last row);
  the caller turns dG into dg with a reverse cumulative sum inside each chunk.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T


def chunk_bwd_dh(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int = 128):
    B, Tn, H, NT = T.dynamic("B, T, H, NT")
    acc = "float32"

    @T.prim_func
    def main(
        q: T.Tensor((B, Tn, H, K), dtype),
        do: T.Tensor((B, Tn, H, V), dtype),
        g: T.Tensor((B, Tn, H), acc),
        dht: T.Tensor((B, H, K, V), acc),
        scale: T.float32,
        dh: T.Tensor((B, NT, H, K, V), dtype),
        dh0: T.Tensor((B, H, K, V), acc),
    ):
        with T.Kernel(T.ceildiv(V, BV), B * H, threads=threads) as (iv, ibh):
            ib = ibh // H
            ih = ibh % H
            b_dh = T.alloc_fragment((K, BV), acc)
            dh_s = T.alloc_shared((K, BV), dtype)
            q_s = T.alloc_shared((BT, K), dtype)
            qd_s = T.alloc_shared((BT, K), dtype)
            do_s = T.alloc_shared((BT, BV), dtype)
            g_s = T.alloc_shared((BT,), acc)
            T.copy(dht[ib, ih, 0:K, iv * BV : (iv + 1) * BV], b_dh)
            for ir in T.Pipelined(NT, num_stages=1):
                it = NT - 1 - ir
                T.copy(b_dh, dh_s)
                T.copy(dh_s, dh[ib, it, ih, 0:K, iv * BV : (iv + 1) * BV])
                T.copy(q[ib, it * BT : (it + 1) * BT, ih, 0:K], q_s)
                T.copy(do[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV], do_s)
                T.copy(g[ib, it * BT : (it + 1) * BT, ih], g_s, disable_tma=True)
                for i, j in T.Parallel(BT, K):
                    qd_s[i, j] = T.cast(T.cast(q_s[i, j], acc) * T.exp(g_s[i]) * scale, dtype)
                for i, j in T.Parallel(K, BV):
                    b_dh[i, j] = b_dh[i, j] * T.exp(g_s[BT - 1])
                T.gemm(qd_s, do_s, b_dh, transpose_A=True)
            T.copy(b_dh, dh0[ib, ih, 0:K, iv * BV : (iv + 1) * BV])

    return main


def chunk_bwd_dqkvg(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int | None = None):
    B, Tn, H, NT = T.dynamic("B, T, H, NT")
    acc = "float32"
    NV = V // BV
    threads = threads or 128

    @T.prim_func
    def main(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        g: T.Tensor((B, Tn, H), acc),
        h: T.Tensor((B, NT, H, K, V), dtype),
        do: T.Tensor((B, Tn, H, V), dtype),
        dh: T.Tensor((B, NT, H, K, V), dtype),
        scale: T.float32,
        dq: T.Tensor((B, Tn, H, K), dtype),
        dk: T.Tensor((B, Tn, H, K), dtype),
        dv: T.Tensor((B, Tn, H, V), dtype),
        dg: T.Tensor((B, Tn, H), acc),
    ):
        with T.Kernel(NT, B * H, threads=threads) as (it, ibh):
            ib = ibh // H
            ih = ibh % H
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            kd_s = T.alloc_shared((BT, K), dtype)
            g_s = T.alloc_shared((BT,), acc)
            v_s = T.alloc_shared((BT, BV), dtype)
            do_s = T.alloc_shared((BT, BV), dtype)
            h_s = T.alloc_shared((K, BV), dtype)
            dh_s = T.alloc_shared((K, BV), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            ds_s = T.alloc_shared((BT, BT), dtype)
            dv_s = T.alloc_shared((BT, BV), dtype)
            dq_s = T.alloc_shared((BT, K), dtype)
            dk_s = T.alloc_shared((BT, K), dtype)
            dg_s = T.alloc_shared((BT,), acc)
            hdh_s = T.alloc_shared((1,), acc)
            acc_a = T.alloc_fragment((BT, BT), acc)
            acc_da = T.alloc_fragment((BT, BT), acc)
            acc_dq = T.alloc_fragment((BT, K), acc)
            acc_dk = T.alloc_fragment((BT, K), acc)
            acc_dv = T.alloc_fragment((BT, BV), acc)
            prod = T.alloc_fragment((K, BV), acc)
            prod_row = T.alloc_fragment((K,), acc)
            prod_one = T.alloc_fragment((1,), acc)
            qk = T.alloc_fragment((BT, K), acc)
            qk_row = T.alloc_fragment((BT,), acc)
            qk_row2 = T.alloc_fragment((BT,), acc)
            kdk_one = T.alloc_fragment((1,), acc)

            T.copy(q[ib, it * BT : (it + 1) * BT, ih, 0:K], q_s)
            T.copy(k[ib, it * BT : (it + 1) * BT, ih, 0:K], k_s)
            T.copy(g[ib, it * BT : (it + 1) * BT, ih], g_s, disable_tma=True)
            for i in T.Parallel(1):
                hdh_s[i] = 0.0
            T.clear(acc_a)
            T.gemm(q_s, k_s, acc_a, transpose_B=True)
            for i, j in T.Parallel(BT, BT):
                acc_a[i, j] = T.if_then_else(i >= j, acc_a[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
            T.copy(acc_a, a_s)
            for i, j in T.Parallel(BT, K):
                kd_s[i, j] = T.cast(T.cast(k_s[i, j], acc) * T.exp(g_s[BT - 1] - g_s[i]), dtype)
            T.clear(acc_dq)
            T.clear(acc_dk)
            T.clear(acc_da)
            for iv in T.Pipelined(NV, num_stages=1):
                T.copy(v[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV], v_s)
                T.copy(do[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV], do_s)
                T.copy(h[ib, it, ih, 0:K, iv * BV : (iv + 1) * BV], h_s)
                T.copy(dh[ib, it, ih, 0:K, iv * BV : (iv + 1) * BV], dh_s)
                for i, j in T.Parallel(K, BV):
                    prod[i, j] = T.cast(h_s[i, j], acc) * T.cast(dh_s[i, j], acc)
                T.reduce_sum(prod, prod_row, dim=1)
                T.reduce_sum(prod_row, prod_one, dim=0)
                for i in T.Parallel(1):
                    hdh_s[i] = hdh_s[i] + prod_one[i]
                T.clear(acc_dv)
                T.gemm(kd_s, dh_s, acc_dv)
                T.gemm(a_s, do_s, acc_dv, transpose_A=True)
                T.copy(acc_dv, dv_s)
                T.copy(dv_s, dv[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV])
                T.gemm(do_s, v_s, acc_da, transpose_B=True)
                T.gemm(do_s, h_s, acc_dq, transpose_B=True)
                T.gemm(v_s, dh_s, acc_dk, transpose_B=True)
            # inter-chunk parts, and sum_j k_j . dk_inter_j for the last row's gate gradient
            for i, j in T.Parallel(BT, K):
                acc_dq[i, j] = acc_dq[i, j] * T.exp(g_s[i]) * scale
                acc_dk[i, j] = acc_dk[i, j] * T.exp(g_s[BT - 1] - g_s[i])
            for i, j in T.Parallel(BT, K):
                qk[i, j] = acc_dk[i, j] * T.cast(k_s[i, j], acc)
            T.reduce_sum(qk, qk_row, dim=1)
            T.reduce_sum(qk_row, kdk_one, dim=0)
            for i, j in T.Parallel(BT, BT):
                acc_da[i, j] = T.if_then_else(i >= j, acc_da[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
            T.copy(acc_da, ds_s)
            T.gemm(ds_s, k_s, acc_dq)
            T.gemm(ds_s, q_s, acc_dk, transpose_A=True)
            for i, j in T.Parallel(BT, K):
                qk[i, j] = acc_dq[i, j] * T.cast(q_s[i, j], acc)
            T.reduce_sum(qk, qk_row, dim=1)
            for i, j in T.Parallel(BT, K):
                qk[i, j] = acc_dk[i, j] * T.cast(k_s[i, j], acc)
            T.reduce_sum(qk, qk_row2, dim=1)
            for i in T.Parallel(BT):
                dg_s[i] = qk_row[i] - qk_row2[i] + T.if_then_else(
                    i == BT - 1, T.exp(g_s[BT - 1]) * hdh_s[0] + kdk_one[0], 0.0
                )
            T.copy(acc_dq, dq_s)
            T.copy(dq_s, dq[ib, it * BT : (it + 1) * BT, ih, 0:K])
            T.copy(acc_dk, dk_s)
            T.copy(dk_s, dk[ib, it * BT : (it + 1) * BT, ih, 0:K])
            T.copy(dg_s, dg[ib, it * BT : (it + 1) * BT, ih], disable_tma=True)

    return main
