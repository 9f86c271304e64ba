"""Delta rule / GDN WY preparation in TileLang: the chunk-parallel part of the forward.

Layout and inputs as for `kernels/delta/fwd.py` (flat chunk rows, `g` = in-chunk cumulative log
gates, float32; `beta` float32). Every chunk is independent, padding chunks included (zero k and v
give `T = I`, `w = u = 0`).

* `chunk_delta_wy`: one program per (chunk, value head):
  `A = tril(Diag(beta) (K K^T * exp(G_i - G_j)), -1)` (bf16/fp16 operands, float32 accumulation:
  the products are exact), `T = (I + A)^{-1}` by forward substitution in float32 on CUDA cores (no
  TF32: the inverse amplifies error), in place in one shared buffer (row i of T replaces row i of
  A once rows < i are done); then `w = T (k * beta * exp(G))` and `u = T (v * beta)` computed as
  `(T Diag(s)) k` with the float32 coefficient matrix split into two input-dtype halves
  (`hi + lo`, about 16 mantissa bits), so k and v enter the tensor cores exactly.
  Writes `w [L, HV, K]`, `u [L, HV, V]` (input dtype) and with `store_t` `T [NT, HV, C, C]` (float32,
  for the backward's VJP of the preparation). Grouped heads: value head j reads k head `j // (HV / H)`.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T


def chunk_delta_wy(*, K: int, V: int, dtype: str, BT: int = 64, threads: int | None = None, store_t: bool = False):
    L, H, HV, NT = T.dynamic("L, H, HV, NT")
    acc = "float32"
    threads = threads or (256 if max(K, V) > 128 else 128)
    parts = threads // BT
    span = BT // parts

    @T.macro
    def split(m_s, coef, hi_s, lo_s):
        """`hi + lo = m_s Diag(coef)` (column scaling), float32 -> two input-dtype matrices."""
        for a, b in T.Parallel(BT, BT):
            hi_s[a, b] = T.cast(m_s[a, b] * coef[b], dtype)
            lo_s[a, b] = T.cast(m_s[a, b] * coef[b] - T.cast(T.cast(m_s[a, b] * coef[b], dtype), acc), dtype)

    @T.macro
    def body(k, v, g, beta, w, u, t):
        with T.Kernel(T.ceildiv(L, BT), HV, threads=threads) as (ic, ihv):
            ih = ihv // (HV // H)
            t0 = ic * BT
            k_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, V), dtype)
            m_s = T.alloc_shared((BT, BT), acc)  # A, turning into T row by row
            hi_s = T.alloc_shared((BT, BT), dtype)
            lo_s = T.alloc_shared((BT, BT), dtype)
            g_s = T.alloc_shared((BT,), acc)
            b_s = T.alloc_shared((BT,), acc)
            c_s = T.alloc_shared((BT,), acc)
            acc_a = T.alloc_fragment((BT, BT), acc)
            part_s = T.alloc_shared((parts, BT), acc)
            s = T.alloc_local((1,), acc)
            acc_w = T.alloc_fragment((BT, K), acc)
            acc_u = T.alloc_fragment((BT, V), acc)
            T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
            T.copy(v[t0 : t0 + BT, ihv, 0:V], v_s)
            T.copy(g[t0 : t0 + BT, ihv], g_s, disable_tma=True)
            T.copy(beta[t0 : t0 + BT, ihv], b_s, disable_tma=True)
            T.clear(acc_a)
            T.gemm(k_s, k_s, acc_a, transpose_B=True)
            for a, b in T.Parallel(BT, BT):
                m_s[a, b] = T.if_then_else(
                    a > b, acc_a[a, b] * b_s[a] * T.exp(g_s[a] - g_s[b]), T.if_then_else(a == b, 1.0, 0.0)
                )
            # forward substitution, T[i, c] = -sum_{j < i} A[i, j] T[j, c] for c < i (T[j, j] = 1):
            # thread (part p, column c) sums its span of j, the spans are added through part_s
            tx = T.get_thread_binding()
            c, p = tx % BT, tx // BT
            for i in T.serial(1, BT):
                s[0] = 0.0
                for jj in T.serial(T.max(T.min(i - p * span, span), 0)):
                    s[0] += m_s[i, p * span + jj] * m_s[p * span + jj, c]
                part_s[p, c] = s[0]
                T.sync_threads()
                if tx < i:
                    s[0] = 0.0
                    for q in T.serial(parts):
                        s[0] += part_s[q, tx]
                    m_s[i, tx] = -s[0]
                T.sync_threads()  # row i is read by the next step
            for a in T.Parallel(BT):
                c_s[a] = b_s[a] * T.exp(g_s[a])
            split(m_s, c_s, hi_s, lo_s)
            T.clear(acc_w)
            T.gemm(hi_s, k_s, acc_w)
            T.gemm(lo_s, k_s, acc_w)
            T.copy(acc_w, w[t0 : t0 + BT, ihv, 0:K])
            split(m_s, b_s, hi_s, lo_s)
            T.clear(acc_u)
            T.gemm(hi_s, v_s, acc_u)
            T.gemm(lo_s, v_s, acc_u)
            T.copy(acc_u, u[t0 : t0 + BT, ihv, 0:V])
            if store_t:  # last, so that waiting for the store holds up nothing else
                T.copy(m_s, t[ic, ihv, 0:BT, 0:BT])

    if store_t:

        @T.prim_func
        def main(
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, HV, V), dtype),
            g: T.Tensor((L, HV), acc),
            beta: T.Tensor((L, HV), acc),
            w: T.Tensor((L, HV, K), dtype),
            u: T.Tensor((L, HV, V), dtype),
            t: T.Tensor((NT, HV, BT, BT), acc),
        ):
            body(k, v, g, beta, w, u, t)

    else:

        @T.prim_func
        def main(
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, HV, V), dtype),
            g: T.Tensor((L, HV), acc),
            beta: T.Tensor((L, HV), acc),
            w: T.Tensor((L, HV, K), dtype),
            u: T.Tensor((L, HV, V), dtype),
        ):
            body(k, v, g, beta, w, u, None)

    return main
