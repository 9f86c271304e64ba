"""Delta rule / GDN backward in TileLang: the sequential part.

Layout and inputs as for `kernels/delta/fwd.py`, plus `w [L, HV, K]` and the states before each
chunk `h [NT, HV, K, V]` stored by the forward (`store_h`).

* `chunk_delta_bwd_dh`: one program per (V block, sequence * value head), its chunks in reverse,
  the state gradient on chip. With `dS` the gradient of the state after the chunk (from `dht` at
  a sequence's last chunk):
  `dv_new = (scale Q K^T * exp(G_i - G_j), j <= i)^T do + (k * exp(G_C - G)) dS`,
  `dS <- exp(G_C) dS + scale (q * exp(G))^T do - w^T dv_new`.
  Writes `dh[c]`, the gradient of the state after chunk c (input dtype), and `dh0 [N, HV, K, V]`.
  `dht` and `dh0` have rows of their own (`ND`, `N0`): none where the loss takes no final state
  (the pass starts from zeros, `kernels.common.initial_state`) or the call has no initial state
  (dh0 is not written, `final_state`).
  Everything else of the backward is parallel over chunks given these (the per-chunk VJP).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import delta_loads, final_state, initial_state, program, stage_loads


def _prim_func(body, *, K: int, V: int, dtype: str, store_du: bool, dims, g_rows: bool = False):
    """The prim_func of a reverse pass `body` (a macro of the inputs and outputs), with `du` among
    its outputs under `store_du`: the interface of every reverse pass of the delta rules, declared once."""
    L, H, HV, N, NT, ND, N0 = dims
    acc = "float32"
    gshape = (NT, HV, 64) if g_rows else (L, HV)  # (G as per-chunk rows, BT = 64)
    return program(body, q=T.Tensor((L, H, K), dtype), k=T.Tensor((L, H, K), dtype), w=T.Tensor((L, HV, K), dtype),
                   do=T.Tensor((L, HV, V), dtype), g=T.Tensor(gshape, acc), dht=T.Tensor((ND, HV, K, V), acc),
                   cstart=T.Tensor((N,), "int32"), ccount=T.Tensor((N,), "int32"), scale=T.float32,
                   dh=T.Tensor((NT, HV, K, V), dtype), dh0=T.Tensor((N0, HV, K, V), acc),
                   du=T.Tensor((L, HV, V), dtype) if store_du else None)


def chunk_delta_bwd_dh_1wg(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int | None = None,
                           stages: int | None = None, store_du: bool = False, g_rows: bool = False):
    """One warpgroup doing everything (TileLang's pipeline adds a producer): the dispatched kernel
    at K = 256, and at K <= 128 before `chunk_delta_bwd_dh` (kept as the experiment `x_dh_1wg`).
    The rows' factors `exp(G_C - G)`, `exp(G)` are formed once per chunk into shared memory (as
    `chunk_delta_bwd_dh(row_factors=True)` does; an exponential per element of k and q before,
    2026-12-04), the same bits. `store_du` as `chunk_delta_bwd_dh`'s (stored from the registers)."""
    L, H, HV, N, NT, ND, N0 = T.dynamic("L, H, HV, N, NT, ND, N0")
    acc = "float32"
    threads = threads or (256 if K > 128 else 128)
    stages = stages or (2 if K <= 128 else 1)  # two stages at K = 256 would exceed 227 KB of shared memory

    @T.macro
    def body(q, k, w, do, g, dht, cstart, ccount, scale, dh, dh0, du):
        with T.Kernel(T.ceildiv(V, BV), N * HV, threads=threads) as (iv, inh):
            n = inh // HV
            ihv = inh % HV
            ih = ihv // (HV // H)
            b_dh = T.alloc_fragment((K, BV), acc)
            dh_s = T.alloc_shared((K, BV), dtype)
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            w_s = T.alloc_shared((BT, K), dtype)
            qd_s = T.alloc_shared((BT, K), dtype)
            kd_s = T.alloc_shared((BT, K), dtype)
            do_s = T.alloc_shared((BT, BV), dtype)
            dv_s = T.alloc_shared((BT, BV), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            g_s = T.alloc_shared((BT,), acc)
            fk_s = T.alloc_shared((BT,), acc)  # exp(G_C - G), exp(G) of the chunk's rows
            fq_s = T.alloc_shared((BT,), acc)
            acc_a = T.alloc_fragment((BT, BT), acc)
            acc_dv = T.alloc_fragment((BT, BV), acc)
            c1 = cstart[n] + ccount[n] - 1
            initial_state(dht, b_dh, n, ihv, iv)
            for ir in T.Pipelined(ccount[n], num_stages=stages):
                t0 = (c1 - ir) * BT
                T.copy(q[t0 : t0 + BT, ih, 0:K], q_s)
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                T.copy(w[t0 : t0 + BT, ihv, 0:K], w_s)
                T.copy(do[t0 : t0 + BT, ihv, iv * BV : (iv + 1) * BV], do_s)
                if g_rows:
                    T.copy(g[c1 - ir, ihv, 0:BT], g_s)
                else:
                    T.copy(g[t0 : t0 + BT, ihv], g_s, disable_tma=True)
                T.copy(b_dh, dh_s)
                T.copy(dh_s, dh[c1 - ir, ihv, 0:K, iv * BV : (iv + 1) * BV])
                # dv_new = A^T do + kd dS   (A: the masked, decayed, scaled Q K^T)
                T.clear(acc_a)
                T.gemm(q_s, k_s, acc_a, transpose_B=True)
                for a, b in T.Parallel(BT, BT):
                    acc_a[a, b] = T.if_then_else(a >= b, acc_a[a, b] * T.exp(g_s[a] - g_s[b]) * scale, 0.0)
                T.copy(acc_a, a_s)
                for a in T.Parallel(BT):
                    fk_s[a] = T.exp(g_s[BT - 1] - g_s[a])
                    fq_s[a] = T.exp(g_s[a])
                for a, b in T.Parallel(BT, K):
                    kd_s[a, b] = T.cast(T.cast(k_s[a, b], acc) * fk_s[a], dtype)
                    qd_s[a, b] = T.cast(T.cast(q_s[a, b], acc) * fq_s[a] * scale, dtype)
                T.clear(acc_dv)
                T.gemm(a_s, do_s, acc_dv, transpose_A=True)
                T.gemm(kd_s, dh_s, acc_dv)
                T.copy(acc_dv, dv_s)
                if store_du:
                    T.copy(acc_dv, du[t0 : t0 + BT, ihv, iv * BV : (iv + 1) * BV])
                # dS <- exp(G_C) dS + (q exp(G) scale)^T do - w^T dv_new
                for a, b in T.Parallel(K, BV):
                    b_dh[a, b] = b_dh[a, b] * T.exp(g_s[BT - 1])
                T.gemm(qd_s, do_s, b_dh, transpose_A=True)
                for a, b in T.Parallel(BT, BV):
                    dv_s[a, b] = -dv_s[a, b]
                T.gemm(w_s, dv_s, b_dh, transpose_A=True)
            final_state(b_dh, dh0, n, ihv, iv)

    return _prim_func(body, K=K, V=V, dtype=dtype, store_du=store_du, dims=(L, H, HV, N, NT, ND, N0), g_rows=g_rows)


def chunk_delta_bwd_dh(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int = 2, row_factors: bool = True,
                       store_du: bool = False, g_rows: bool = False, pad_adv: bool = True):
    """The reverse pass, warp-specialized as the forward's (`kernels/delta/fwd.py`): three
    warpgroups per (V block, sequence * value head) program, K <= 128 (at K = 256 two stages would
    not fit in shared memory: `chunk_delta_bwd_dh_1wg` there).

    * warpgroup 2 streams each chunk's q, k, w, do (TMA) and G into `stages` buffers;
    * warpgroup 1 does what does not depend on dS, ahead of the chain: `A^T do` (float32, into
      `adv_s`), then rescales the stage's k and q in place to `k exp(G_C - G)` and
      `scale q exp(G)`;
    * warpgroup 0 keeps dS (float32) in registers and runs the chain: it publishes dS (input
      dtype) and stores it as `dh` by TMA, forms `dv_new = A^T do + kd dS`, then
      `dS <- exp(G_C) dS + qd^T do - w^T dv_new`.

    Nsight Compute (H200, 4,4096,16,128, 2026-12-04) found warpgroup 1 the bound: it never waited
    for a stage while warpgroup 0 waited for it in half of its stall samples. Its rescale took an
    exponential per element and, in place, a barrier per unrolled step (TileLang's guard between
    one step's stores and the next step's loads). `row_factors`: the factors `exp(G_C - G)` and
    `exp(G)` once per row (into shared memory), k and q read whole into registers, rescaled there
    and written back, so one barrier parts the loads from the stores; the same bits.

    `store_du`: one more output, `du [L, HV, V]` (input dtype), the gradient of v_new that the
    chain forms anyway (`dv_new`, rounded as the `w^T dv_new` product takes it), stored by TMA
    from a tile of its own once the chunk's products are issued; the consumer then need not form
    it again (`chunk_bwd_dqkvg(no_dv=True)`).

    `g_rows`: G as per-chunk rows `[NT, HV, BT]`, loaded by TMA with the stage (as
    `chunk_delta_fwd(g_rows=True)`).

    `pad_adv`: `adv_s`'s float32 rows padded by 8 floats. Unpadded, the accumulator layout's
    two-float stores (warpgroup 1) and loads (warpgroup 0, on the chain) put the eight rows a warp
    spans, 256 bytes apart, in the same eight banks: 4-way conflicts; padded, a warp's access
    takes the two wavefronts its 256 bytes need. The same bits; 0.161 against 0.184 ms at
    4,4096,16,128 (K = 128), 0.121 against 0.144 at 8,2048,16,64 (bf16, H200, 2026-12-05, ten
    launches a sample, interleaved); the default since."""
    assert K <= 128, "K = 256: chunk_delta_bwd_dh_1wg"
    L, H, HV, N, NT, ND, N0 = T.dynamic("L, H, HV, N, NT, ND, N0")
    acc = "float32"

    @T.macro
    def body(q, k, w, do, g, dht, cstart, ccount, scale, dh, dh0, du):
        with T.Kernel(T.ceildiv(V, BV), N * HV, threads=384) as (iv, inh):
            n = inh // HV
            ihv = inh % HV
            ih = ihv // (HV // H)
            q_s = T.alloc_shared((stages, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            w_s = T.alloc_shared((stages, BT, K), dtype)
            do_s = T.alloc_shared((stages, BT, BV), dtype)
            g_s = T.alloc_shared((stages, BT), acc)
            adv_s = T.alloc_shared((stages, BT, BV + (8 if pad_adv else 0)), acc)
            if row_factors:
                fk_s = T.alloc_shared((BT,), acc)  # exp(G_C - G), exp(G) of the chunk's rows
                fq_s = T.alloc_shared((BT,), acc)
                k_r = T.alloc_fragment((BT, K), dtype)
                q_r = T.alloc_fragment((BT, K), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            dh_s = T.alloc_shared((K, BV), dtype)
            dv_s = T.alloc_shared((BT, BV), dtype)
            du_s = T.alloc_shared((BT, BV), dtype) if store_du else None
            b_dh = T.alloc_fragment((K, BV), acc)
            acc_dv = T.alloc_fragment((BT, BV), acc)
            acc_a = T.alloc_fragment((BT, BT), acc)
            acc_adv = T.alloc_fragment((BT, BV), acc)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            ready = T.alloc_barrier([128] * stages)  # warpgroup 1 is done with a stage (adv_s, kd, qd)
            free = T.alloc_barrier([128] * stages)  # warpgroup 0 is done with a stage
            c1 = cstart[n] + ccount[n] - 1
            nc = ccount[n]
            with T.ws(2):
                stage_loads(delta_loads(q, k, w, do, g, q_s, k_s, w_s, do_s, g_s, ih, ihv, iv, g_rows), full, free, nc, stages, c1, -1)
            with T.ws(1):
                T.set_max_nreg(232, 1)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    T.clear(acc_a)
                    T.gemm(q_s[slot, :, :], k_s[slot, :, :], acc_a, transpose_B=True)
                    for a, b in T.Parallel(BT, BT):
                        acc_a[a, b] = T.if_then_else(a >= b, acc_a[a, b] * T.exp(g_s[slot, a] - g_s[slot, b]) * scale, 0.0)
                    T.copy(acc_a, a_s)
                    if row_factors:
                        for a in T.Parallel(BT):
                            fk_s[a] = T.exp(g_s[slot, BT - 1] - g_s[slot, a])
                            fq_s[a] = T.exp(g_s[slot, a])
                        T.copy(k_s[slot, :, :], k_r)
                        T.copy(q_s[slot, :, :], q_r)
                        for a, b in T.Parallel(BT, K):
                            k_r[a, b] = T.cast(T.cast(k_r[a, b], acc) * fk_s[a], dtype)
                            q_r[a, b] = T.cast(T.cast(q_r[a, b], acc) * fq_s[a] * scale, dtype)
                        T.copy(k_r, k_s[slot, :, :])
                        T.copy(q_r, q_s[slot, :, :])
                    else:
                        for a, b in T.Parallel(BT, K):
                            k_s[slot, a, b] = T.cast(T.cast(k_s[slot, a, b], acc) * T.exp(g_s[slot, BT - 1] - g_s[slot, a]), dtype)
                            q_s[slot, a, b] = T.cast(T.cast(q_s[slot, a, b], acc) * T.exp(g_s[slot, a]) * scale, dtype)
                    T.clear(acc_adv)
                    T.gemm(a_s, do_s[slot, :, :], acc_adv, transpose_A=True)
                    T.copy(acc_adv, adv_s[slot, :, 0:BV])
                    T.fence_proxy_async()
                    T.barrier_arrive(ready[slot])
            with T.ws(0):
                T.set_max_nreg(232, 1)
                initial_state(dht, b_dh, n, ihv, iv)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(ready[slot], (i // stages) % 2)
                    if i >= 1:  # the store of the previous chunk's dS (and du) has read dh_s (du_s)
                        T.tma_store_wait()
                        T.sync_threads(8, 128)
                    T.copy(b_dh, dh_s)
                    T.fence_proxy_async()
                    T.sync_threads(8, 128)
                    T.tma_copy(dh_s, dh[c1 - i, ihv, 0:K, iv * BV : (iv + 1) * BV])
                    # dv_new = A^T do + kd dS
                    T.copy(adv_s[slot, :, 0:BV], acc_dv)
                    T.gemm(k_s[slot, :, :], dh_s, acc_dv)
                    for a, b in T.Parallel(BT, BV):
                        dv_s[a, b] = T.cast(-acc_dv[a, b], dtype)
                    # dS <- exp(G_C) dS + qd^T do - w^T dv_new
                    for a, b in T.Parallel(K, BV):
                        b_dh[a, b] = b_dh[a, b] * T.exp(g_s[slot, BT - 1])
                    T.gemm(q_s[slot, :, :], do_s[slot, :, :], b_dh, transpose_A=True)
                    T.gemm(w_s[slot, :, :], dv_s, b_dh, transpose_A=True)
                    T.barrier_arrive(free[slot])
                    if store_du:  # dv_new, as the product above took it, by TMA (waited for with dh's)
                        for a, b in T.Parallel(BT, BV):
                            du_s[a, b] = T.cast(acc_dv[a, b], dtype)
                        T.fence_proxy_async()
                        T.sync_threads(8, 128)
                        T.tma_copy(du_s, du[(c1 - i) * BT : (c1 - i + 1) * BT, ihv, iv * BV : (iv + 1) * BV])
                T.tma_store_wait()
                final_state(b_dh, dh0, n, ihv, iv)

    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    return _prim_func(body, K=K, V=V, dtype=dtype, store_du=store_du, dims=(L, H, HV, N, NT, ND, N0), g_rows=g_rows).with_attr(
        "fla.disable_shared_memory_reuse", 1)
