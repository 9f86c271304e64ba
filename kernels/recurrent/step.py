"""The recurrent ops' token steps in TileLang (`fla_jax.fused_recurrent_*` on a dense batch: a decode step
is T = 1): each state `[K, V]` read once and written once, whatever T.

One program per (row b * value head, V block of BV = 32 columns), 128 threads: lane l of warp w holds column
`l` of the block and key rows `w R .. w R + R - 1` (R = K / 4) of the float32 state in registers, so a warp
reads and writes whole 128-byte rows of the state. Per token, with q, k of head `hv // (HV / H)`:

    S <- D S                        (D = exp(g) a scalar, or Diag(exp(g)) over the key rows: `gate_rows`)
    u  = beta (v - S^T k)           (the delta rules, `delta`; else u = v)
    S <- S + k u^T,   o = scale S^T q = scale (S_D^T q + (k . q) u)

The products over K (S^T k, S^T q, and |q|^2, |k|^2, k . q for `l2norm`) are summed over a thread's rows,
then over the four warps through shared memory (double-buffered by token parity: one barrier a token).
With `l2norm` (int32 attribute, nonzero: `use_qk_l2norm_in_kernel`) q and k are scaled by
`1 / sqrt(|x|^2 + 1e-6)` inside (fla_jax._problem.l2_normalise).

`step(K, V, dtype, gate_rows, delta)`: inputs `q, k [B, T, H, K]`, `v [B, T, HV, V]`, `g [B, T, HV]` float32 (or
`[B, T, HV, K]` with `gate_rows`), `beta [B, T, HV]` float32 (`delta` only), `h0 [B, HV, K, V]` float32;
outputs `o [B, T, HV, V]` (input dtype) and `ht [B, HV, K, V]` float32. V on the grid (a multiple of BV).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import program, v_tile, v_tile_assumed

WARPS = 4


def step(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 32, gate_rows: bool = False, delta: bool = False,
         min_blocks: int = 0):
    """`min_blocks`: `__launch_bounds__`' programs a multiprocessor (ptxas holds the registers to that; 0: one), so
    that more of the states are in flight at once."""
    del V, BT  # (V is read off the buffers; no chunks)
    assert K % WARPS == 0 and BV == 32, "a warp's lanes are the V block's columns"
    R = K // WARPS
    B, Tn, H, HV, V = T.dynamic("B, T, H, HV, V")
    acc = "float32"
    NP = 5  # partial sums: S^T k, S^T q, |k|^2, |q|^2, k . q

    @T.macro
    def body(q, k, v, g, beta, h0, scale, l2norm, o, ht):
        with T.Kernel(B * HV, T.ceildiv(V, BV), threads=WARPS * 32) as (bh, iv):
            v_tile_assumed(V, BV)
            # (once, in registers: recomputed at each index, the divisions dominated the program)
            b = T.alloc_var("int32", init=bh // HV)
            hv = T.alloc_var("int32", init=bh % HV)
            ih = T.alloc_var("int32", init=T.min(hv // T.max(HV // H, 1), H - 1))  # (in bounds whatever the shapes)
            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            col = iv * BV + lane
            s = T.alloc_local((R,), acc)
            qj = T.alloc_local((1,), acc)  # (q a row at a time: K = 256 left no registers for all of it)
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            ka = T.alloc_local((R,), acc)
            part = T.alloc_local((NP,), acc)
            tot = T.alloc_local((NP,), acc)
            red = T.alloc_shared((2, NP, WARPS, 32), acc)
            for j in T.unroll(R):
                s[j] = h0[b, hv, w * R + j, col]
            for t in T.serial(Tn):
                for j in T.unroll(R):
                    ka[j] = T.cast(k[b, t, ih, w * R + j], acc)
                if gate_rows:
                    for j in T.unroll(R):
                        s[j] = s[j] * T.exp(g[b, t, hv, w * R + j])
                else:
                    part[0] = T.exp(g[b, t, hv])
                    for j in T.unroll(R):
                        s[j] = s[j] * part[0]
                for i in T.unroll(NP):
                    part[i] = T.float32(0)
                for j in T.unroll(R):
                    qj[0] = T.cast(q[b, t, ih, w * R + j], acc)
                    part[0] = part[0] + ka[j] * s[j]
                    part[1] = part[1] + qj[0] * s[j]
                    part[2] = part[2] + ka[j] * ka[j]
                    part[3] = part[3] + qj[0] * qj[0]
                    part[4] = part[4] + ka[j] * qj[0]
                for i in T.unroll(NP):
                    red[t % 2, i, w, lane] = part[i]
                T.sync_threads()
                for i in T.unroll(NP):
                    tot[i] = red[t % 2, i, 0, lane] + red[t % 2, i, 1, lane] + red[t % 2, i, 2, lane] + red[t % 2, i, 3, lane]
                # tot: 0 S^T k, 1 S^T q (of the decayed state), 2 |k|^2, 3 |q|^2, 4 k . q; then rk, rq in 2, 3
                if l2norm != 0:
                    tot[2] = T.rsqrt(tot[2] + 1e-6)
                    tot[3] = T.rsqrt(tot[3] + 1e-6)
                else:
                    tot[2] = T.float32(1)
                    tot[3] = T.float32(1)
                # u (in part[0]): v, or beta (v - S^T k) with k normalised
                if delta:
                    part[0] = beta[b, t, hv] * (T.cast(v[b, t, hv, col], acc) - tot[0] * tot[2])
                else:
                    part[0] = T.cast(v[b, t, hv, col], acc)
                for j in T.unroll(R):
                    s[j] = s[j] + ka[j] * tot[2] * part[0]
                if w == 0:
                    o[b, t, hv, col] = T.cast(scale * tot[3] * (tot[1] + tot[4] * tot[2] * part[0]), dtype)
            for j in T.unroll(R):
                ht[b, hv, w * R + j, col] = s[j]

    func = program(body, q=T.Tensor((B, Tn, H, K), dtype), k=T.Tensor((B, Tn, H, K), dtype), v=T.Tensor((B, Tn, HV, V), dtype),
                   g=T.Tensor((B, Tn, HV, K) if gate_rows else (B, Tn, HV), acc),
                   beta=T.Tensor((B, Tn, HV), acc) if delta else None, h0=T.Tensor((B, HV, K, V), acc), scale=T.float32,
                   l2norm=T.int32, o=T.Tensor((B, Tn, HV, V), dtype), ht=T.Tensor((B, HV, K, V), acc))
    return v_tile(func, BV)
