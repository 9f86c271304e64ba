"""GLA forward in TileLang (per-key-channel gates).

Token layout as for simple GLA (`kernels/simple_gla/fwd.py`: flat chunk rows, sequences from
`cstart`/`ccount`), with `g [L, H, K]` the in-chunk cumulative log gates per key channel
(`G_i = g_1 + ... + g_i` within each chunk, float32; every `G` is <= 0 and decreasing).

Nothing exponentiates a whole chunk's gate range: every exponent below is a difference
`G_a - G_b` with `a` at or after `b`, so every factor is at most 1.

* `chunk_gla_a`: one program per (chunk, head), chunks independent:
  `A_ij = scale sum_k q_ik k_jk exp(G_ik - G_jk)` for `j <= i`, 0 above, in float32, stored in the
  input dtype `[NT, H, BT, BT]` (the output pass and the backward's dv read it so). By sub-chunks
  of 16 rows: the blocks left of the diagonal, for row sub-chunk r with first row r0, as one GEMM
  of `q_i exp(G_i - G_r0)` (rows of r) and `k_j exp(G_r0 - G_j)` (j < r0); the diagonal blocks
  elementwise on CUDA cores (`exp(G_ik - G_jk)` per term).
* `chunk_gla_fwd`: one program per (V block, sequence * head), chunks in order, the state on
  chip: `o = scale (q * exp(G)) S + A v`, then `S <- Diag(exp(G_C)) S + (k * exp(G_C - G))^T v`.
  Writes `o`, the final states `ht [N, H, K, V]` and with `store_h` the state before every chunk
  `h [NT, H, K, V]` (input dtype) for the backward.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

NS = 16  # sub-chunk rows


def chunk_gla_a(*, K: int, V: int, dtype: str, BT: int = 64, threads: int = 128, sub: int = NS, bounded: bool = False):
    """`sub`: the sub-chunk rows (diagonal blocks elementwise, the rest by one GEMM per sub-chunk).
    `bounded` (an experiment): a chunk whose gate range `max_k (G_0k - G_Ck)` is below `limit`
    takes one chunk-wide GEMM of `q exp(G - G_0)` and `k exp(G_0 - G)` (the latter as hi + lo
    halves in the input dtype; its factors reach `exp(limit)`, which the dtype must hold), and only
    the others take the sub-chunks (as jla's and fla's GLA kernels do)."""
    del V
    NS = sub
    L, H, NT = T.dynamic("L, H, NT")
    acc = "float32"
    limit = 60.0 if dtype == "bfloat16" else 8.0  # fp16 tops out at 65504 = exp(11.1)

    @T.macro
    def sub_chunked(q_s, k_s, g_s, qr_s, kr_s, d_s, kt_s, gt_s, acc_a, d_f, scale):
        T.clear(acc_a)
        for r in range(1, BT // NS):  # blocks left of the diagonal, row sub-chunk r
            r0 = r * NS
            for i, c in T.Parallel(BT, K):
                qr_s[i, c] = T.if_then_else(
                    i // NS == r, T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[r0, c]), dtype), T.cast(0, dtype)
                )
                kr_s[i, c] = T.if_then_else(
                    i < r0, T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[r0, c] - g_s[i, c]), dtype), T.cast(0, dtype)
                )
            T.gemm(qr_s, kr_s, acc_a, transpose_B=True)
        for c, j in T.Parallel(K, BT):
            kt_s[c, j] = k_s[j, c]
            gt_s[c, j] = g_s[j, c]
        T.clear(d_f)
        for c in T.serial(K):  # diagonal blocks: d[i, jj] = A[i, (i // NS) * NS + jj]; channels outer, so
            for i, jj in T.Parallel(BT, NS):  # that each thread's sums are independent chains
                d_f[i, jj] += T.if_then_else(
                    (i // NS) * NS + jj <= i,
                    T.cast(q_s[i, c], acc) * T.cast(kt_s[c, (i // NS) * NS + jj], acc)
                    * T.exp(g_s[i, c] - gt_s[c, (i // NS) * NS + jj]),
                    0.0,
                )
        T.copy(d_f, d_s)
        for i, j in T.Parallel(BT, BT):
            acc_a[i, j] = T.if_then_else(
                j <= i, (acc_a[i, j] + T.if_then_else(i // NS == j // NS, d_s[i, j % NS], 0.0)) * scale, 0.0
            )

    @T.macro
    def chunk_wide(q_s, k_s, g_s, qr_s, kr_s, klo_s, acc_a, scale):
        for i, c in T.Parallel(BT, K):
            qr_s[i, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[0, c]), dtype)
            kr_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[0, c] - g_s[i, c]), dtype)
            klo_s[i, c] = T.cast(
                T.cast(k_s[i, c], acc) * T.exp(g_s[0, c] - g_s[i, c]) - T.cast(kr_s[i, c], acc), dtype
            )
        T.clear(acc_a)
        T.gemm(qr_s, kr_s, acc_a, transpose_B=True)
        T.gemm(qr_s, klo_s, acc_a, transpose_B=True)
        for i, j in T.Parallel(BT, BT):
            acc_a[i, j] = T.if_then_else(j <= i, acc_a[i, j] * scale, 0.0)

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        k: T.Tensor((L, H, K), dtype),
        g: T.Tensor((L, H, K), acc),
        scale: T.float32,
        a: T.Tensor((NT, H, BT, BT), dtype),
    ):
        with T.Kernel(NT, H, threads=threads) as (it, ih):
            t0 = it * BT
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            g_s = T.alloc_shared((BT, K), acc)
            qr_s = T.alloc_shared((BT, K), dtype)
            kr_s = T.alloc_shared((BT, K), dtype)
            d_s = T.alloc_shared((BT, NS), acc)
            kt_s = T.alloc_shared((K, BT), dtype)  # k and G transposed for the diagonal blocks: the
            gt_s = T.alloc_shared((K, BT), acc)  # 16 threads of a row read 16 consecutive words
            a_s = T.alloc_shared((BT, BT), dtype)
            acc_a = T.alloc_fragment((BT, BT), acc)
            d_f = T.alloc_fragment((BT, NS), acc)
            T.copy(q[t0 : t0 + BT, ih, 0:K], q_s)
            T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
            T.copy(g[t0 : t0 + BT, ih, 0:K], g_s)
            if bounded:
                klo_s = T.alloc_shared((BT, K), dtype)
                span = T.alloc_fragment((K,), acc)
                span_max = T.alloc_fragment((1,), acc)
                span_s = T.alloc_shared((1,), acc)
                for c in T.Parallel(K):
                    span[c] = g_s[0, c] - g_s[BT - 1, c]
                T.reduce_max(span, span_max, dim=0)
                for c in T.Parallel(1):
                    span_s[c] = span_max[c]
                if span_s[0] < limit:
                    chunk_wide(q_s, k_s, g_s, qr_s, kr_s, klo_s, acc_a, scale)
                else:
                    sub_chunked(q_s, k_s, g_s, qr_s, kr_s, d_s, kt_s, gt_s, acc_a, d_f, scale)
            else:
                sub_chunked(q_s, k_s, g_s, qr_s, kr_s, d_s, kt_s, gt_s, acc_a, d_f, scale)
            T.copy(acc_a, a_s)
            T.copy(a_s, a[it, ih, 0:BT, 0:BT])

    return main


def chunk_gla_fwd(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int | None = None,
                  stages: int | None = None, store_h: bool = False):
    L, H, N, NT = T.dynamic("L, H, N, NT")
    acc = "float32"
    threads = threads or (256 if K > 128 else 128)
    stages = stages or (2 if K <= 128 else 1)  # K = 256: two stages would exceed 227 KB of shared memory

    @T.macro
    def body(q, k, v, g, a, h0, cstart, ccount, scale, o, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=threads) as (iv, inh):
            n = inh // H
            ih = inh % H
            b_h = T.alloc_fragment((K, BV), acc)
            h_s = T.alloc_shared((K, BV), dtype)
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            g_s = T.alloc_shared((BT, K), acc)
            v_s = T.alloc_shared((BT, BV), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            x_s = T.alloc_shared((BT, K), dtype)  # q * exp(G), then k * exp(G_C - G)
            o_s = T.alloc_shared((BT, BV), dtype)
            acc_o = T.alloc_fragment((BT, BV), acc)
            c0 = cstart[n]
            T.copy(h0[n, ih, 0:K, iv * BV : (iv + 1) * BV], b_h)
            for i in T.Pipelined(ccount[n], num_stages=stages):
                t0 = (c0 + i) * BT
                T.copy(q[t0 : t0 + BT, ih, 0:K], q_s)
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                T.copy(g[t0 : t0 + BT, ih, 0:K], g_s)
                T.copy(v[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV], v_s)
                T.copy(a[c0 + i, ih, 0:BT, 0:BT], a_s)
                T.copy(b_h, h_s)
                if store_h:
                    T.copy(h_s, h[c0 + i, ih, 0:K, iv * BV : (iv + 1) * BV])
                for r, c in T.Parallel(BT, K):
                    x_s[r, c] = T.cast(T.cast(q_s[r, c], acc) * T.exp(g_s[r, c]), dtype)
                T.clear(acc_o)
                T.gemm(x_s, h_s, acc_o)
                for r, c in T.Parallel(BT, BV):
                    acc_o[r, c] = acc_o[r, c] * scale
                T.gemm(a_s, v_s, acc_o)
                T.copy(acc_o, o_s)
                T.copy(o_s, o[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV])
                for r, c in T.Parallel(BT, K):
                    x_s[r, c] = T.cast(T.cast(k_s[r, c], acc) * T.exp(g_s[BT - 1, c] - g_s[r, c]), dtype)
                for r, c in T.Parallel(K, BV):
                    b_h[r, c] = b_h[r, c] * T.exp(g_s[BT - 1, r])
                T.gemm(x_s, v_s, b_h, transpose_A=True)
            T.copy(b_h, ht[n, ih, 0:K, iv * BV : (iv + 1) * BV])

    if store_h:

        @T.prim_func
        def main(
            q: T.Tensor((L, H, K), dtype),
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, H, V), dtype),
            g: T.Tensor((L, H, K), acc),
            a: T.Tensor((NT, H, BT, BT), dtype),
            h0: T.Tensor((N, H, K, V), acc),
            cstart: T.Tensor((N,), "int32"),
            ccount: T.Tensor((N,), "int32"),
            scale: T.float32,
            o: T.Tensor((L, H, V), dtype),
            h: T.Tensor((NT, H, K, V), dtype),
            ht: T.Tensor((N, H, K, V), acc),
        ):
            body(q, k, v, g, a, h0, cstart, ccount, scale, o, ht, h)

    else:

        @T.prim_func
        def main(
            q: T.Tensor((L, H, K), dtype),
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, H, V), dtype),
            g: T.Tensor((L, H, K), acc),
            a: T.Tensor((NT, H, BT, BT), dtype),
            h0: T.Tensor((N, H, K, V), acc),
            cstart: T.Tensor((N,), "int32"),
            ccount: T.Tensor((N,), "int32"),
            scale: T.float32,
            o: T.Tensor((L, H, V), dtype),
            ht: T.Tensor((N, H, K, V), acc),
        ):
            body(q, k, v, g, a, h0, cstart, ccount, scale, o, ht, None)

    return main
