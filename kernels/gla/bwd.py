"""GLA backward in TileLang: one fused consumer per chunk (the reverse state-gradient pass is simple GLA's).

Layout and inputs as for the forward (`kernels/gla/fwd.py`: flat chunk rows, `g [L, H, K]` the
in-chunk cumulative log gates per key channel, float32), plus what the forward stored: `A`
(`[NT, H, BT, BT]`, scaled and masked, input dtype) and the states before each chunk
`h [NT, H, K, V]`.

* The reverse state-gradient pass is simple GLA's warp-specialized `chunk_bwd_dh(channel_gates=True)`
  (`kernels/simple_gla/bwd.py`), from `q * exp(G)` as the forward's `chunk_gla_a` wrote it.
* `chunk_gla_bwd_dqkvg`: one program per (chunk, head), over the V blocks with q, k, G and A on
  chip: `dv = (k * exp(G_C - G)) dh + A^T do`, and accumulated `P = do h^T`, `R = v dh^T`,
  `dA = scale (do v^T)` (j <= i), `sum_v h * dh` per key row. Then
  `dq_ik = scale exp(G_ik) P_ik + sum_{j <= i} dA_ij k_jk exp(G_ik - G_jk)`,
  `dk_jk = exp(G_Ck - G_jk) R_jk + sum_{i >= j} dA_ij q_ik exp(G_ik - G_jk)`, the sums as one
  chunk-wide GEMM each where the chunk's gate range is bounded (as in the forward, referenced to
  the middle row; see `chunk_gla_bwd_dqkvg`), else by 16-row sub-chunks: blocks off the diagonal
  as GEMMs referenced to a row of the sub-chunk (dq: the first row r0 of i's sub-chunk, dk: the
  last row n of j's), so that `dq = exp(G - G_r0) (scale exp(G_r0) P + dA k exp(G_r0 - G))` has no
  factor above 1, and the diagonal blocks elementwise. The gate gradient per position and channel
  `dG = q * dq - k * dk` (+ `exp(G_C) sum_v h * dh + sum_j k_j * exp(G_C - G_j) R_j` at the last
  row) in float32, and its reverse cumulative sum within the chunk is written: `dg`, the gradient
  of the per-step gates.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import arrive_once, v_tile, v_tile_assumed
from kernels.gla.fwd import chunk_span, half_limit

NS = 16  # sub-chunk rows


def chunk_gla_bwd_dqkvg(*, K: int, V: int, dtype: str, BT: int = 64, BV: int | None = None, threads: int = 128,
                        stages: int = 1, bounded: bool | None = None, BK: int | None = None, tma_loads: bool = True,
                        grid_v: bool = False):
    """`bounded` (the default): a chunk of bounded gate range (`kernels.gla.fwd.chunk_span` below
    `half_limit(dtype)`) takes the intra-chunk dq and dk as one chunk-wide GEMM each, referenced
    to the middle row m: `dq = exp(G - G_m) (scale exp(G_m) P + dA (k exp(G_m - G)))` and
    `dk = exp(G_m - G) (exp(G_C - G_m) R + dA^T (q exp(G - G_m)))` (the bracketed factors as hi +
    lo halves in the input dtype); the others the sub-chunks. Unsplit, K = 256 takes the sub-chunks
    only (the four operand buffers would need 288 KB of shared memory) and spills.

    `BK` < K splits the key channels over `K / BK` programs per (chunk, head): dq, dk and dg of
    a channel need only that channel's q, k, G, h and dh rows (and dA, which each program forms
    from do and v), so each program is the unsplit one at K = BK; dv sums over all channels, so
    each writes its part in float32, `dv [K / BK, L, H, V]` (the first adds `A^T do`), and the
    caller sums the parts. `grid_v`: V read off the buffers, any multiple of BV, its blocks looped over."""
    BK = BK or K
    split = BK < K
    bounded = BK <= 128 if bounded is None else bounded
    limit = half_limit(dtype)
    m = BT // 2
    BV = BV or (32 if BK > 128 else 64)  # K = 256 unsplit: 64 would need 256 KB of shared memory
    L, H, NT = T.dynamic("L, H, NT")
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"
    NV = V // BV
    nsub = BT // NS

    @T.macro
    def sub_chunked(q_s, k_s, g_s, x_s, a_s, da_s, acc_dq, acc_dk, scale):
        # dq: rescaled to each sub-chunk's first row r0, the blocks left of the diagonal by GEMMs
        for i, c in T.Parallel(BT, BK):
            acc_dq[i, c] = acc_dq[i, c] * scale * T.exp(g_s[(i // NS) * NS, c])
        for r in range(1, nsub):
            r0 = r * NS
            for i, j in T.Parallel(BT, BT):
                a_s[i, j] = T.cast(T.if_then_else((i // NS == r) & (j < r0), da_s[i, j], 0.0), dtype)
            for i, c in T.Parallel(BT, BK):
                x_s[i, c] = T.if_then_else(
                    i < r0, T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[r0, c] - g_s[i, c]), dtype), T.cast(0, dtype)
                )
            T.gemm(a_s, x_s, acc_dq)
        for i, c in T.Parallel(BT, BK):
            acc_dq[i, c] = acc_dq[i, c] * T.exp(g_s[i, c] - g_s[(i // NS) * NS, c])
        # dk: rescaled to the last row n of each sub-chunk, the blocks below the diagonal by GEMMs
        for i, c in T.Parallel(BT, BK):
            acc_dk[i, c] = acc_dk[i, c] * T.exp(g_s[BT - 1, c] - g_s[(i // NS) * NS + NS - 1, c])
        for r in range(nsub - 1):
            n1 = r * NS + NS - 1
            for i, j in T.Parallel(BT, BT):
                a_s[i, j] = T.cast(T.if_then_else((j // NS == r) & (i > n1), da_s[i, j], 0.0), dtype)
            for i, c in T.Parallel(BT, BK):
                x_s[i, c] = T.if_then_else(
                    i > n1, T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[n1, c]), dtype), T.cast(0, dtype)
                )
            T.gemm(a_s, x_s, acc_dk, transpose_A=True)
        for i, c in T.Parallel(BT, BK):
            acc_dk[i, c] = acc_dk[i, c] * T.exp(g_s[(i // NS) * NS + NS - 1, c] - g_s[i, c])
        # diagonal blocks, elementwise (jj outer: each thread's elements are independent chains)
        for jj in T.serial(NS):
            for i, c in T.Parallel(BT, BK):
                acc_dq[i, c] += T.if_then_else(
                    (i // NS) * NS + jj <= i,
                    da_s[i, (i // NS) * NS + jj] * T.cast(k_s[(i // NS) * NS + jj, c], acc)
                    * T.exp(g_s[i, c] - g_s[(i // NS) * NS + jj, c]),
                    0.0,
                )
                acc_dk[i, c] += T.if_then_else(
                    (i // NS) * NS + jj >= i,
                    da_s[(i // NS) * NS + jj, i] * T.cast(q_s[(i // NS) * NS + jj, c], acc)
                    * T.exp(g_s[(i // NS) * NS + jj, c] - g_s[i, c]),
                    0.0,
                )

    @T.macro
    def chunk_wide(q_s, k_s, g_s, x_s, xl_s, y_s, yl_s, a_s, da_s, acc_dq, acc_dk, scale):
        # The pair (i, j) enters dG_i through dq_i and -dG_j through dk_j, and the reverse cumulative
        # sum of dG cancels the two for every row at or before j: only operands exact to ~2^-17 (hi
        # and lo halves in the input dtype; dA rounded once, the same in both) keep what is left
        # accurate (bf16-rounded factors gave dg errors of 2e-2 at gate normaliser 1).
        for i, j in T.Parallel(BT, BT):
            a_s[i, j] = T.cast(da_s[i, j], dtype)  # dA, masked (j <= i) and scaled
        for i, c in T.Parallel(BT, BK):
            x_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]), dtype)
            xl_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]) - T.cast(x_s[i, c], acc), dtype)
            y_s[i, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[m, c]), dtype)
            yl_s[i, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[m, c]) - T.cast(y_s[i, c], acc), dtype)
        for i, c in T.Parallel(BT, BK):
            acc_dq[i, c] = acc_dq[i, c] * scale * T.exp(g_s[m, c])
            acc_dk[i, c] = acc_dk[i, c] * T.exp(g_s[BT - 1, c] - g_s[m, c])
        T.gemm(a_s, x_s, acc_dq)
        T.gemm(a_s, xl_s, acc_dq)
        T.gemm(a_s, y_s, acc_dk, transpose_A=True)
        T.gemm(a_s, yl_s, acc_dk, transpose_A=True)
        for i, c in T.Parallel(BT, BK):
            acc_dq[i, c] = acc_dq[i, c] * T.exp(g_s[i, c] - g_s[m, c])
            acc_dk[i, c] = acc_dk[i, c] * T.exp(g_s[m, c] - g_s[i, c])

    @T.macro
    def program(it, ih, ik, q, k, v, g, a, h, do, dh, scale, dq, dk, dv, dg):
        if grid_v:
            v_tile_assumed(V, BV)
        t0 = it * BT
        c0 = ik * BK  # this program's key channels
        q_s = T.alloc_shared((BT, BK), dtype)
        k_s = T.alloc_shared((BT, BK), dtype)
        x_s = T.alloc_shared((BT, BK), dtype)  # k * exp(G_C - G); then the sub-chunk GEMMs' right operands
        # the chunk-wide path's operands k exp(G_m - G) (x_s) and q exp(G - G_m), hi and lo halves
        xl_s, y_s, yl_s = (T.alloc_shared((BT, BK), dtype) if bounded else None for _ in range(3))
        g_s = T.alloc_shared((BT, BK), acc)
        a_s = T.alloc_shared((BT, BT), dtype)  # A; then the sub-chunk GEMMs' dA blocks
        da_s = T.alloc_shared((BT, BT), acc)
        v_s = T.alloc_shared((BT, BV), dtype)
        do_s = T.alloc_shared((BT, BV), dtype)
        h_s = T.alloc_shared((BK, BV), dtype)
        dh_s = T.alloc_shared((BK, BV), dtype)
        dv_s = None if split else T.alloc_shared((BT, BV), dtype)
        e_s = T.alloc_shared((BT // 2, BK), acc)  # k * (inter dk) in float32, half the rows at a time
        last_s = T.alloc_shared((BK,), acc)
        acc_da = T.alloc_fragment((BT, BT), acc)
        acc_dv = T.alloc_fragment((BT, BV), acc)
        acc_dq = T.alloc_fragment((BT, BK), acc)
        acc_dk = T.alloc_fragment((BT, BK), acc)
        hdh = T.alloc_fragment((BK,), acc)
        kdk = T.alloc_fragment((BK,), acc)

        if tma_loads:  # all four in flight at once
            full = T.alloc_barrier([1])
            T.tma_copy(q[t0 : t0 + BT, ih, c0 : c0 + BK], q_s, barrier=full[0])
            T.tma_copy(k[t0 : t0 + BT, ih, c0 : c0 + BK], k_s, barrier=full[0])
            T.tma_copy(g[t0 : t0 + BT, ih, c0 : c0 + BK], g_s, barrier=full[0])
            T.tma_copy(a[it, ih, 0:BT, 0:BT], a_s, barrier=full[0])
            arrive_once(full, 0)
            T.barrier_wait(full[0], 0)
        else:
            T.copy(q[t0 : t0 + BT, ih, c0 : c0 + BK], q_s)
            T.copy(k[t0 : t0 + BT, ih, c0 : c0 + BK], k_s)
            T.copy(g[t0 : t0 + BT, ih, c0 : c0 + BK], g_s)
            T.copy(a[it, ih, 0:BT, 0:BT], a_s)
        for i, c in T.Parallel(BT, BK):
            x_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[BT - 1, c] - g_s[i, c]), dtype)
        T.clear(hdh)
        T.clear(acc_dq)
        T.clear(acc_dk)
        T.clear(acc_da)
        for iv in T.Pipelined(NV, num_stages=stages):
            T.copy(v[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV], v_s)
            T.copy(do[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV], do_s)
            T.copy(h[it, ih, c0 : c0 + BK, iv * BV : (iv + 1) * BV], h_s)
            T.copy(dh[it, ih, c0 : c0 + BK, iv * BV : (iv + 1) * BV], dh_s)
            for c in T.Parallel(BK):
                for j in T.serial(BV):
                    hdh[c] += T.cast(h_s[c, j], acc) * T.cast(dh_s[c, j], acc)
            T.clear(acc_dv)
            T.gemm(x_s, dh_s, acc_dv)
            if split:
                if ik == 0:
                    T.gemm(a_s, do_s, acc_dv, transpose_A=True)
                T.copy(acc_dv, dv[ik, t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV])
            else:
                T.gemm(a_s, do_s, acc_dv, transpose_A=True)
                T.copy(acc_dv, dv_s)
                T.copy(dv_s, dv[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV])
            T.gemm(do_s, v_s, acc_da, transpose_B=True)
            T.gemm(do_s, h_s, acc_dq, transpose_B=True)
            T.gemm(v_s, dh_s, acc_dk, transpose_B=True)
        for i, j in T.Parallel(BT, BT):
            da_s[i, j] = T.if_then_else(j <= i, acc_da[i, j] * scale, 0.0)
        # the last row's gate gradient: exp(G_C) sum_v h * dh + sum_j k_j * (inter dk)_j, in float32:
        # -k_j (inter dk)_j is also in row j's dG, and under strong decay the two nearly cancel
        T.clear(kdk)
        for half in range(2):
            for i, c in T.Parallel(BT, BK):
                if i // (BT // 2) == half:
                    e_s[i % (BT // 2), c] = T.cast(k_s[i, c], acc) * acc_dk[i, c] * T.exp(g_s[BT - 1, c] - g_s[i, c])
            for c in T.Parallel(BK):
                for j in T.serial(BT // 2):
                    kdk[c] += e_s[j, c]
        for c in T.Parallel(BK):
            last_s[c] = T.exp(g_s[BT - 1, c]) * hdh[c] + kdk[c]
        if bounded:
            span_s = T.alloc_shared((1,), acc)
            chunk_span(g_s, span_s)
            if span_s[0] < limit:
                chunk_wide(q_s, k_s, g_s, x_s, xl_s, y_s, yl_s, a_s, da_s, acc_dq, acc_dk, scale)
            else:
                sub_chunked(q_s, k_s, g_s, x_s, a_s, da_s, acc_dq, acc_dk, scale)
        else:
            sub_chunked(q_s, k_s, g_s, x_s, a_s, da_s, acc_dq, acc_dk, scale)
        T.copy(acc_dq, dq[t0 : t0 + BT, ih, c0 : c0 + BK])  # stored from registers
        T.copy(acc_dk, dk[t0 : t0 + BT, ih, c0 : c0 + BK])
        for i, c in T.Parallel(BT, BK):  # dG in place of dq
            acc_dq[i, c] = T.cast(q_s[i, c], acc) * acc_dq[i, c] - T.cast(k_s[i, c], acc) * acc_dk[i, c] + T.if_then_else(
                i == BT - 1, last_s[c], 0.0
            )
        # the reverse cumulative sum within the chunk (dg of the per-step gates), through g_s
        T.copy(acc_dq, g_s)
        run = T.alloc_fragment((BK,), acc)
        T.clear(run)
        for ir in T.serial(BT):
            for c in T.Parallel(BK):
                run[c] = run[c] + g_s[BT - 1 - ir, c]
                dg[t0 + BT - 1 - ir, ih, c0 + c] = run[c]

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        k: T.Tensor((L, H, K), dtype),
        v: T.Tensor((L, H, V), dtype),
        g: T.Tensor((L, H, K), acc),
        a: T.Tensor((NT, H, BT, BT), dtype),
        h: T.Tensor((NT, H, K, V), dtype),
        do: T.Tensor((L, H, V), dtype),
        dh: T.Tensor((NT, H, K, V), dtype),
        scale: T.float32,
        dq: T.Tensor((L, H, K), dtype),
        dk: T.Tensor((L, H, K), dtype),
        dv: T.Tensor((K // BK, L, H, V) if split else (L, H, V), acc if split else dtype),
        dg: T.Tensor((L, H, K), acc),
    ):
        if split:
            with T.Kernel(NT, H, K // BK, threads=threads) as (it, ih, ik):
                program(it, ih, ik, q, k, v, g, a, h, do, dh, scale, dq, dk, dv, dg)
        else:
            with T.Kernel(NT, H, threads=threads) as (it, ih):
                program(it, ih, 0, q, k, v, g, a, h, do, dh, scale, dq, dk, dv, dg)

    return v_tile(main, BV) if grid_v else main
