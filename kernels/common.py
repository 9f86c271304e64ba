"""Pieces shared by several TileLang programs (expanded in place: `T.macro`)."""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T


def chunk_output_and_update(*, BT: int, K: int, BV: int, dtype: str):
    """One chunk of a forward with the state `S` on chip (simple GLA, and the delta rules with
    `v_new` as the values): `o = scale (q * exp(G)) S + (scale Q K^T * exp(G_i - G_j), j <= i) v`
    into `o[t0 : t0 + BT, head, V block iv]`, then `S <- exp(G_C) S + (k * exp(G_C - G))^T v`.
    `h_s` holds S in the input dtype, `b_h` the float32 S that is updated."""
    acc = "float32"

    @T.macro
    def step(q_s, k_s, v_s, h_s, g_s, b_h, kd_s, s_s, o_s, acc_o, acc_s, o, t0, head, iv, scale):
        T.clear(acc_o)
        T.clear(acc_s)
        T.gemm(q_s, h_s, acc_o)
        T.gemm(q_s, k_s, acc_s, transpose_B=True)
        for a, b in T.Parallel(BT, BV):
            acc_o[a, b] = acc_o[a, b] * T.exp(g_s[a]) * scale
        for a, b in T.Parallel(BT, BT):
            acc_s[a, b] = T.if_then_else(a >= b, acc_s[a, b] * T.exp(g_s[a] - g_s[b]) * scale, 0.0)
        T.copy(acc_s, s_s)
        T.gemm(s_s, v_s, acc_o)
        T.copy(acc_o, o_s)
        T.copy(o_s, o[t0 : t0 + BT, head, iv * BV : (iv + 1) * BV])
        for a, b in T.Parallel(BT, K):
            kd_s[a, b] = T.cast(T.cast(k_s[a, b], acc) * T.exp(g_s[BT - 1] - g_s[a]), dtype)
        for a, b in T.Parallel(K, BV):
            b_h[a, b] = b_h[a, b] * T.exp(g_s[BT - 1])
        T.gemm(kd_s, v_s, b_h, transpose_A=True)

    return step
