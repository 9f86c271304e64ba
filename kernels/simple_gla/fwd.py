"""simple GLA forward in TileLang: chunk states, then the output.

Inputs are chunk-aligned (T a multiple of the chunk, padded by the caller) and `g` holds the
in-chunk cumulative log gates (`G_i = g_1 + ... + g_i` within each chunk of 64), float32.

* `chunk_fwd_h`: one program per (V block, batch * head); walks the chunks in order, writes the
  state before each chunk to `h [B, NT, H, K, V]` (input dtype) and the final state to
  `ht [B, H, K, V]` (float32):  `S <- exp(G_C) S + (k * exp(G_C - G))^T v`.
* `chunk_fwd_o`: one program per (V block, chunk, batch * head):
  `o = scale (q * exp(G)) h + (scale Q K^T * exp(G_i - G_j), j <= i) v`.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T


def chunk_fwd_h(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int = 128):
    # task config: K, V, dtype; kernel config: BT, BV, threads
    B, Tn, H, NT = T.dynamic("B, T, H, NT")
    acc = "float32"

    @T.prim_func
    def main(
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        g: T.Tensor((B, Tn, H), acc),
        h0: T.Tensor((B, H, K, V), acc),
        h: T.Tensor((B, NT, H, K, V), dtype),
        ht: T.Tensor((B, H, K, V), acc),
    ):
        with T.Kernel(T.ceildiv(V, BV), B * H, threads=threads) as (iv, ibh):
            ib = ibh // H
            ih = ibh % H
            b_h = T.alloc_fragment((K, BV), acc)
            h_s = T.alloc_shared((K, BV), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            kd_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            g_s = T.alloc_shared((BT,), acc)
            T.copy(h0[ib, ih, 0:K, iv * BV : (iv + 1) * BV], b_h)
            for it in T.Pipelined(NT, num_stages=1):
                T.copy(b_h, h_s)
                T.copy(h_s, h[ib, it, ih, 0:K, iv * BV : (iv + 1) * BV])
                T.copy(k[ib, it * BT : (it + 1) * BT, ih, 0:K], k_s)
                T.copy(v[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV], v_s)
                T.copy(g[ib, it * BT : (it + 1) * BT, ih], g_s, disable_tma=True)
                for i, j in T.Parallel(BT, K):
                    kd_s[i, j] = T.cast(T.cast(k_s[i, j], acc) * T.exp(g_s[BT - 1] - g_s[i]), dtype)
                for i, j in T.Parallel(K, BV):
                    b_h[i, j] = b_h[i, j] * T.exp(g_s[BT - 1])
                T.gemm(kd_s, v_s, b_h, transpose_A=True)
            T.copy(b_h, ht[ib, ih, 0:K, iv * BV : (iv + 1) * BV])

    return main


def chunk_fwd_o(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int = 128):
    B, Tn, H, NT = T.dynamic("B, T, H, NT")
    acc = "float32"

    @T.prim_func
    def main(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, H, V), dtype),
        g: T.Tensor((B, Tn, H), acc),
        h: T.Tensor((B, NT, H, K, V), dtype),
        scale: T.float32,
        o: T.Tensor((B, Tn, H, V), dtype),
    ):
        with T.Kernel(T.ceildiv(V, BV), NT, B * H, threads=threads) as (iv, it, ibh):
            ib = ibh // H
            ih = ibh % H
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            h_s = T.alloc_shared((K, BV), dtype)
            s_s = T.alloc_shared((BT, BT), dtype)
            g_s = T.alloc_shared((BT,), acc)
            o_s = T.alloc_shared((BT, BV), dtype)
            acc_o = T.alloc_fragment((BT, BV), acc)
            acc_s = T.alloc_fragment((BT, BT), acc)
            T.copy(q[ib, it * BT : (it + 1) * BT, ih, 0:K], q_s)
            T.copy(k[ib, it * BT : (it + 1) * BT, ih, 0:K], k_s)
            T.copy(v[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV], v_s)
            T.copy(h[ib, it, ih, 0:K, iv * BV : (iv + 1) * BV], h_s)
            T.copy(g[ib, it * BT : (it + 1) * BT, ih], g_s, disable_tma=True)
            T.clear(acc_o)
            T.clear(acc_s)
            T.gemm(q_s, h_s, acc_o)
            T.gemm(q_s, k_s, acc_s, transpose_B=True)
            for i, j in T.Parallel(BT, BV):
                acc_o[i, j] = acc_o[i, j] * T.exp(g_s[i]) * scale
            for i, j in T.Parallel(BT, BT):
                acc_s[i, j] = T.if_then_else(i >= j, acc_s[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
            T.copy(acc_s, s_s)
            T.gemm(s_s, v_s, acc_o)
            T.copy(acc_o, o_s)
            T.copy(o_s, o[ib, it * BT : (it + 1) * BT, ih, iv * BV : (iv + 1) * BV])

    return main
