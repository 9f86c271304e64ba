"""simple GLA forward in TileLang.

Token layout (see `fla_jax._layout`): one flat run of `NT` chunks of `BT` tokens, `[NT * BT, H, .]`;
every sequence starts at a chunk boundary, occupies `ccount[n]` chunks from `cstart[n]`, and its
padding slots hold zeros. A dense batch is the same thing with `cstart[b] = b * NT_b`. `g` holds the
in-chunk cumulative log gates (`G_i = g_1 + ... + g_i` within each chunk), float32.

* `chunk_fwd`: the forward in one pass, one program per (V block, sequence * head), chunks in
  order, the state kept on chip; per chunk
  `o = scale (q * exp(G)) S + (scale Q K^T * exp(G_i - G_j), j <= i) v`, then
  `S <- exp(G_C) S + (k * exp(G_C - G))^T v`. Writes `o` and the final states `ht [N, H, K, V]`;
  with `store_h` (the forward of a gradient computation) also the state before every chunk,
  `h [NT, H, K, V]` in the input dtype, which the backward reads instead of recomputing it.
  (It replaced a two-kernel forward, states to HBM then the output: 0.169 + 0.152 ms against
  0.231 ms for this one at 4,4096,16,128 bf16 on an H200.)
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T


def _threads(K: int) -> int:
    return 256 if K > 128 else 128


def chunk_fwd(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int | None = None, stages: int = 2,
              store_h: bool = False):
    """The one-pass forward; `store_h` adds the output `h [NT, H, K, V]` (the state before every
    chunk, input dtype) that the backward reads instead of recomputing it."""
    L, H, N, NT = T.dynamic("L, H, N, NT")
    acc = "float32"
    threads = threads or _threads(K)

    @T.macro
    def body(q, k, v, g, h0, cstart, ccount, scale, o, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=threads) as (iv, inh):
            n = inh // H
            ih = inh % H
            b_h = T.alloc_fragment((K, BV), acc)
            h_s = T.alloc_shared((K, BV), dtype)
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            kd_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, BV), dtype)
            s_s = T.alloc_shared((BT, BT), dtype)
            o_s = T.alloc_shared((BT, BV), dtype)
            g_s = T.alloc_shared((BT,), acc)
            acc_o = T.alloc_fragment((BT, BV), acc)
            acc_s = T.alloc_fragment((BT, BT), acc)
            c0 = cstart[n]
            T.copy(h0[n, ih, 0:K, iv * BV : (iv + 1) * BV], b_h)
            for i in T.Pipelined(ccount[n], num_stages=stages):
                t0 = (c0 + i) * BT
                T.copy(q[t0 : t0 + BT, ih, 0:K], q_s)
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                T.copy(v[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV], v_s)
                T.copy(g[t0 : t0 + BT, ih], g_s, disable_tma=True)
                T.copy(b_h, h_s)
                if store_h:
                    T.copy(h_s, h[c0 + i, ih, 0:K, iv * BV : (iv + 1) * BV])
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
                T.copy(o_s, o[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV])
                for a, b in T.Parallel(BT, K):
                    kd_s[a, b] = T.cast(T.cast(k_s[a, b], acc) * T.exp(g_s[BT - 1] - g_s[a]), dtype)
                for a, b in T.Parallel(K, BV):
                    b_h[a, b] = b_h[a, b] * T.exp(g_s[BT - 1])
                T.gemm(kd_s, v_s, b_h, transpose_A=True)
            T.copy(b_h, ht[n, ih, 0:K, iv * BV : (iv + 1) * BV])

    if store_h:

        @T.prim_func
        def main(
            q: T.Tensor((L, H, K), dtype),
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, H, V), dtype),
            g: T.Tensor((L, H), acc),
            h0: T.Tensor((N, H, K, V), acc),
            cstart: T.Tensor((N,), "int32"),
            ccount: T.Tensor((N,), "int32"),
            scale: T.float32,
            o: T.Tensor((L, H, V), dtype),
            h: T.Tensor((NT, H, K, V), dtype),
            ht: T.Tensor((N, H, K, V), acc),
        ):
            body(q, k, v, g, h0, cstart, ccount, scale, o, ht, h)

    else:

        @T.prim_func
        def main(
            q: T.Tensor((L, H, K), dtype),
            k: T.Tensor((L, H, K), dtype),
            v: T.Tensor((L, H, V), dtype),
            g: T.Tensor((L, H), acc),
            h0: T.Tensor((N, H, K, V), acc),
            cstart: T.Tensor((N,), "int32"),
            ccount: T.Tensor((N,), "int32"),
            scale: T.float32,
            o: T.Tensor((L, H, V), dtype),
            ht: T.Tensor((N, H, K, V), acc),
        ):
            body(q, k, v, g, h0, cstart, ccount, scale, o, ht, None)

    return main
