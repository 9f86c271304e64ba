"""simple GLA backward in TileLang (fla's chunk_bwd_dh + a fused dq/dk/dv/dg consumer).

Token layout and inputs as for the forward (`kernels/simple_gla/fwd.py`: flat chunk rows, sequences
from `cstart`/`ccount`, `g` = in-chunk cumulative log gates, float32), plus the states before each
chunk `h [NT, H, K, V]` (stored by the forward, `chunk_fwd(store_h=True)`).

* `chunk_bwd_dh`: one program per (V block, sequence * head), its chunks in reverse,
  warp-specialized (a producer and the chain's warpgroup). `dh[c]` is the gradient of the state
  after chunk c; `dh0[n]` that of sequence n's initial state:
  `dS_before = exp(G_C) dS_after + scale q^T (do * exp(G))`, starting from `dht[n]`. With
  `channel_gates` it is GLA's pass (per-channel decay, from the forward's `q * exp(G)`).
* `chunk_bwd_dqkvg`: one program per (chunk, head), looping over V blocks with A = the
  masked, decayed `scale Q K^T` and `kd = k * exp(G_C - G)` kept on chip:
  `dv = kd dh + A^T do`, `dq = scale exp(G) (do h^T) + dS k`, `dk = exp(G_C - G) (v dh^T) + dS^T q`
  with `dS = scale (do v^T) * exp(G_i - G_j), j <= i`, and the gate gradient per position
  `dG_i = q_i.dq_i - k_i.dk_i` (+ `exp(G_C) <h, dh> + sum_j k_j.dk_inter_j` at the last row);
  the caller turns dG into dg with a reverse cumulative sum inside each chunk.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import (
    arrive_once,
    final_state,
    gate_load,
    initial_state,
    program,
    stage_loads,
    v_tile,
    v_tile_assumed,
)


def chunk_bwd_dh(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int = 2, channel_gates: bool = False,
                 g_rows: bool = False, grid_v: bool = False):
    """The reverse state-gradient pass, warp-specialized: per (V block, sequence * head) program a
    producer warpgroup streams q, do (TMA) and the gates into `stages` buffers, and warpgroup 0
    keeps `dS` in registers: it stores `dS` (input dtype, by a TMA store that runs while it
    works), then `dS <- exp(G_C) dS + q^T dod` with `dod = scale do * exp(G)` (rows). With
    `channel_gates` (GLA) `q` is the forward's `q exp(G)` and `g` the per-channel `G [L, H, K]`,
    of which only each chunk's last row is read; the chain then carries `dS / scale`, so that the
    GEMM takes `q` and `do` as stored. (A third warpgroup forming `dod` a chunk ahead made
    TileLang sync the whole block between the warpgroups: a deadlock.)
    `dht` and `dh0` have rows of their own (`ND`, `N0`): none where the loss takes no final state
    (the pass starts from zeros) or the call has no initial state (dh0 is not written).
    `g_rows` (scalar gates): G arrives as per-chunk rows `[NT, H, BT]`, loaded by TMA with the
    stage, not by the loading warpgroup's threads (whose loads the next chunk's copies wait out:
    see simple GLA's forward, `kernels/README.md`). `grid_v`: V read off the buffers."""
    if g_rows and channel_gates:
        raise ValueError("chunk_bwd_dh: g_rows is for scalar gates")
    L, H, N, NT, ND, N0 = T.dynamic("L, H, N, NT, ND, N0")
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"

    @T.macro
    def body(q, do, g, dht, cstart, ccount, scale, dh, dh0):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=256) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            n = inh // H
            ih = inh % H
            q_s = T.alloc_shared((stages, BT, K), dtype)
            do_s = T.alloc_shared((stages, BT, BV), dtype)
            g_s = T.alloc_shared((stages, K if channel_gates else BT), acc)
            dod_s = None if channel_gates else T.alloc_shared((BT, BV), dtype)
            dh_s = T.alloc_shared((K, BV), dtype)
            b_dh = T.alloc_fragment((K, BV), acc)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([128] * stages)  # warpgroup 0 is done with a stage
            c1 = cstart[n] + ccount[n] - 1
            nc = ccount[n]
            with T.ws(1):  # chunks in reverse: q, the V block of do, and G (its last row per channel)
                rows = lambda c: slice(c * BT, c * BT + BT)
                gates = (lambda c: g[c * BT + BT - 1, ih, 0:K], g_s, True) if channel_gates else \
                    gate_load(g, g_s, ih, g_rows)
                loads = ((lambda c: q[rows(c), ih, 0:K], q_s, True), (lambda c: do[rows(c), ih, iv * BV : (iv + 1) * BV], do_s, True), gates)
                stage_loads(loads, full, free, nc, stages, c1, -1)
            with T.ws(0):
                T.set_max_nreg(240, 1)
                initial_state(dht, b_dh, n, ih, iv)
                if channel_gates:
                    for r, c in T.Parallel(K, BV):
                        b_dh[r, c] = b_dh[r, c] / scale
                for ir in T.serial(nc):
                    slot = ir % stages
                    T.barrier_wait(full[slot], (ir // stages) % 2)
                    if ir >= 1:  # the previous chunk's store has read dh_s
                        T.tma_store_wait()
                        T.sync_threads(8, 128)
                    if channel_gates:
                        for r, c in T.Parallel(K, BV):
                            dh_s[r, c] = T.cast(b_dh[r, c] * scale, dtype)
                    else:
                        T.copy(b_dh, dh_s)
                    T.fence_proxy_async()
                    T.sync_threads(8, 128)
                    T.tma_copy(dh_s, dh[c1 - ir, ih, 0:K, iv * BV : (iv + 1) * BV])
                    if channel_gates:
                        for r, c in T.Parallel(K, BV):
                            b_dh[r, c] = b_dh[r, c] * T.exp(g_s[slot, r])
                        T.gemm(q_s[slot, :, :], do_s[slot, :, :], b_dh, transpose_A=True)
                    else:
                        for r, c in T.Parallel(BT, BV):
                            dod_s[r, c] = T.cast(T.cast(do_s[slot, r, c], acc) * T.exp(g_s[slot, r]) * scale, dtype)
                        for r, c in T.Parallel(K, BV):
                            b_dh[r, c] = b_dh[r, c] * T.exp(g_s[slot, BT - 1])
                        T.gemm(q_s[slot, :, :], dod_s, b_dh, transpose_A=True)
                    T.barrier_arrive(free[slot])
                T.tma_store_wait()
                if channel_gates:
                    for r, c in T.Parallel(K, BV):
                        b_dh[r, c] = b_dh[r, c] * scale
                final_state(b_dh, dh0, n, ih, iv)

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        do: T.Tensor((L, H, V), dtype),
        g: T.Tensor((L, H, K) if channel_gates else (NT, H, BT) if g_rows else (L, H), acc),
        dht: T.Tensor((ND, H, K, V), acc),
        cstart: T.Tensor((N,), "int32"),
        ccount: T.Tensor((N,), "int32"),
        scale: T.float32,
        dh: T.Tensor((NT, H, K, V), dtype),
        dh0: T.Tensor((N0, H, K, V), acc),
    ):
        body(q, do, g, dht, cstart, ccount, scale, dh, dh0)

    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    main = main.with_attr("fla.disable_shared_memory_reuse", 1)
    return v_tile(main, BV) if grid_v else main


def chunk_bwd_dqkvg(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, threads: int | None = None,
                    stages: int | None = None, delta: bool = False, BK: int | None = None, tma_qk: bool = True,
                    specialized: bool = True, l2norm: bool = False, no_dv: bool = False, g_rows: bool = False,
                    grid_v: bool = False):
    """`BK` < K splits the key channels over `K / BK` programs per (chunk, head), each the
    unsplit program at K = BK: dq and dk of a channel need only its q, k, h and dh rows (and dS,
    which each program forms from do and v). What sums over all channels is written in float32
    parts for the caller to sum: `dv [K / BK, L, heads, V]` (each part with its channels' share of
    `A = scale Q K^T`) and `dg [K / BK, L, heads]`.

    `tma_qk` (the default): q and k by TMA on an mbarrier, in flight while G loads; each thread
    loaded its part and waited before, which on the delta rules also took 64-bit divisions for
    the grouped head per address (0.576 → 0.405 ms there at 4,4096,16,128 bf16, H200,
    2026-12-03; `x_dqkvg_sync_qk`).

    `specialized=False`: lowered without TileLang's warp specialization (no producer warpgroup:
    128 threads, 164 registers at K = V = 64 with one stage, so three programs share an SM where
    the specialized program's 256 threads at 240 registers take one; its loads have nothing to
    overlap at V = 64, one V block): dispatched at K = 64 (`variants.FLAT_64`: 0.138 against 0.231
    ms at 8,2048,16,64 bf16, H200, 2026-12-03) and at K = 128 in V blocks of 32 with two stages
    (`variants.FLAT_BV32`, two programs per SM); at K = 128 with V blocks of 64 it is slower
    (`x_dqkvg_flat`), and so is FLAT_BV32 at K = 256 with `BK = 128` (0.60 against 0.50 ms).

    `l2norm` (delta rules, `use_qk_l2norm_in_kernel`; q is the normalised `y = x r`): one more
    input, `rq [L, H]` (float32 `r = 1 / |x|` of the raw q), and dq is the raw q's gradient
    `r (dy - y sum(dy y))` (the normalisation's gradient, linear in dy, so per value head before
    the caller sums a group); `sum(dy y)` is the row sum the gate gradient takes anyway. Not with
    `BK < K` (a row's sum would span programs).

    `no_dv` (delta rules, whose reverse pass stores `dv_new` itself: `chunk_delta_bwd_dh(store_du=True)`):
    no dv output, so neither `A = scale Q K^T` nor `k exp(G_C - G)` nor the two products per V
    block that formed dv; the outputs are dq, dk, dg.

    `g_rows` (with `tma_qk`): G (and `rq`) as per-chunk rows, `g [NT, heads, BT]` (`rq [NT, H, BT]`), loaded
    by TMA with q and k, not each chunk's column by each thread. `grid_v`: V read off the buffers, any multiple
    of BV, its blocks looped over."""
    BK = BK or K
    split = BK < K
    assert not (l2norm and split), "l2norm needs whole rows of dq"
    assert delta or not no_dv, "no_dv: the delta rules, whose reverse pass stores dv_new"
    assert tma_qk or not g_rows, "g_rows: loaded by TMA with q and k (tma_qk)"
    # two-stage loads over the V blocks: 0.387 against 0.431 ms at 4,4096,16,128 bf16 (H200); at
    # K = 256 the second stage would need 273 KB of shared memory, over Hopper's 227 KB
    # (two warpgroups sharing every GEMM and elementwise step, 256 threads with the loads not
    # pipelined, measured 0.415 against 0.412 ms; on the delta rules' v_new 0.577 against 0.579)
    stages = stages or (2 if BK <= 128 else 1)
    L, H, HV, NT = T.dynamic("L, H, HV, NT")
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"
    NV = V // BV
    threads = threads or 128
    # delta rules (the same consumer on v_new): HV value heads, q/k head j // (HV / H)
    heads, group = (HV, HV // H) if delta else (H, 1)
    gshape, rshape = ((NT, heads, BT), (NT, H, BT)) if g_rows else ((L, heads), (L, H))  # G; 1 / |q|

    @T.macro
    def body(it, ihv, ik, q, k, v, g, h, do, dh, rq, scale, dq, dk, dv, dg):
        if grid_v:
            v_tile_assumed(V, BV)
        ih = ihv // group
        c0 = ik * BK  # this program's key channels
        q_s = T.alloc_shared((BT, BK), dtype)
        k_s = T.alloc_shared((BT, BK), dtype)
        kd_s = None if no_dv else T.alloc_shared((BT, BK), dtype)
        g_s = T.alloc_shared((BT,), acc)
        v_s = T.alloc_shared((BT, BV), dtype)
        do_s = T.alloc_shared((BT, BV), dtype)
        h_s = T.alloc_shared((BK, BV), dtype)
        dh_s = T.alloc_shared((BK, BV), dtype)
        a_s = None if no_dv else T.alloc_shared((BT, BT), dtype)
        ds_s = T.alloc_shared((BT, BT), dtype)
        dv_s = None if split or no_dv else T.alloc_shared((BT, BV), dtype)
        dq_s = T.alloc_shared((BT, BK), dtype)
        dk_s = T.alloc_shared((BT, BK), dtype)
        dg_s = T.alloc_shared((BT,), acc)
        hdh_s = T.alloc_shared((1,), acc)
        acc_a = None if no_dv else T.alloc_fragment((BT, BT), acc)
        acc_da = T.alloc_fragment((BT, BT), acc)
        acc_dq = T.alloc_fragment((BT, BK), acc)
        acc_dk = T.alloc_fragment((BT, BK), acc)
        acc_dv = None if no_dv else T.alloc_fragment((BT, BV), acc)
        prod = T.alloc_fragment((BK, BV), acc)
        prod_row = T.alloc_fragment((BK,), acc)
        prod_one = T.alloc_fragment((1,), acc)
        qk = T.alloc_fragment((BT, BK), acc)
        qk_row = T.alloc_fragment((BT,), acc)
        qk_row2 = T.alloc_fragment((BT,), acc)
        kdk_one = T.alloc_fragment((1,), acc)
        rq_s = T.alloc_shared((BT,), acc) if l2norm else None

        if tma_qk:  # both loads in flight at once, beside G's
            qk_full = T.alloc_barrier([1])
            T.tma_copy(q[it * BT : (it + 1) * BT, ih, c0 : c0 + BK], q_s, barrier=qk_full[0])
            T.tma_copy(k[it * BT : (it + 1) * BT, ih, c0 : c0 + BK], k_s, barrier=qk_full[0])
            if g_rows:  # (first read after qk_full's wait)
                T.tma_copy(g[it, ihv, 0:BT], g_s, barrier=qk_full[0])
                if l2norm:
                    T.tma_copy(rq[it, ih, 0:BT], rq_s, barrier=qk_full[0])
            arrive_once(qk_full, 0)
        else:
            T.copy(q[it * BT : (it + 1) * BT, ih, c0 : c0 + BK], q_s)
            T.copy(k[it * BT : (it + 1) * BT, ih, c0 : c0 + BK], k_s)
        if not g_rows:
            T.copy(g[it * BT : (it + 1) * BT, ihv], g_s, disable_tma=True)
            if l2norm:
                T.copy(rq[it * BT : (it + 1) * BT, ih], rq_s, disable_tma=True)
        if tma_qk:
            T.barrier_wait(qk_full[0], 0)
        for i in T.Parallel(1):
            hdh_s[i] = 0.0
        if not no_dv:
            T.clear(acc_a)
            T.gemm(q_s, k_s, acc_a, transpose_B=True)
            for i, j in T.Parallel(BT, BT):
                acc_a[i, j] = T.if_then_else(i >= j, acc_a[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
            T.copy(acc_a, a_s)
            for i, j in T.Parallel(BT, BK):
                kd_s[i, j] = T.cast(T.cast(k_s[i, j], acc) * T.exp(g_s[BT - 1] - g_s[i]), dtype)
        T.clear(acc_dq)
        T.clear(acc_dk)
        T.clear(acc_da)
        for iv in T.Pipelined(NV, num_stages=stages):
            T.copy(v[it * BT : (it + 1) * BT, ihv, iv * BV : (iv + 1) * BV], v_s)
            T.copy(do[it * BT : (it + 1) * BT, ihv, iv * BV : (iv + 1) * BV], do_s)
            T.copy(h[it, ihv, c0 : c0 + BK, iv * BV : (iv + 1) * BV], h_s)
            T.copy(dh[it, ihv, c0 : c0 + BK, iv * BV : (iv + 1) * BV], dh_s)
            for i, j in T.Parallel(BK, BV):
                prod[i, j] = T.cast(h_s[i, j], acc) * T.cast(dh_s[i, j], acc)
            T.reduce_sum(prod, prod_row, dim=1)
            T.reduce_sum(prod_row, prod_one, dim=0)
            for i in T.Parallel(1):
                hdh_s[i] = hdh_s[i] + prod_one[i]
            if not no_dv:
                T.clear(acc_dv)
                T.gemm(kd_s, dh_s, acc_dv)
                T.gemm(a_s, do_s, acc_dv, transpose_A=True)
                if split:
                    T.copy(acc_dv, dv[ik, it * BT : (it + 1) * BT, ihv, iv * BV : (iv + 1) * BV])
                else:
                    T.copy(acc_dv, dv_s)
                    T.copy(dv_s, dv[it * BT : (it + 1) * BT, ihv, iv * BV : (iv + 1) * BV])
            T.gemm(do_s, v_s, acc_da, transpose_B=True)
            T.gemm(do_s, h_s, acc_dq, transpose_B=True)
            T.gemm(v_s, dh_s, acc_dk, transpose_B=True)
        # inter-chunk parts, and sum_j k_j . dk_inter_j for the last row's gate gradient
        for i, j in T.Parallel(BT, BK):
            acc_dq[i, j] = acc_dq[i, j] * T.exp(g_s[i]) * scale
            acc_dk[i, j] = acc_dk[i, j] * T.exp(g_s[BT - 1] - g_s[i])
        for i, j in T.Parallel(BT, BK):
            qk[i, j] = acc_dk[i, j] * T.cast(k_s[i, j], acc)
        T.reduce_sum(qk, qk_row, dim=1)
        T.reduce_sum(qk_row, kdk_one, dim=0)
        for i, j in T.Parallel(BT, BT):
            acc_da[i, j] = T.if_then_else(i >= j, acc_da[i, j] * T.exp(g_s[i] - g_s[j]) * scale, 0.0)
        T.copy(acc_da, ds_s)
        T.gemm(ds_s, k_s, acc_dq)
        T.gemm(ds_s, q_s, acc_dk, transpose_A=True)
        for i, j in T.Parallel(BT, BK):
            qk[i, j] = acc_dq[i, j] * T.cast(q_s[i, j], acc)
        T.reduce_sum(qk, qk_row, dim=1)
        for i, j in T.Parallel(BT, BK):
            qk[i, j] = acc_dk[i, j] * T.cast(k_s[i, j], acc)
        T.reduce_sum(qk, qk_row2, dim=1)
        for i in T.Parallel(BT):
            dg_s[i] = qk_row[i] - qk_row2[i] + T.if_then_else(
                i == BT - 1, T.exp(g_s[BT - 1]) * hdh_s[0] + kdk_one[0], 0.0
            )
        if l2norm:  # the raw q's gradient, r (dq - y sum(dq y)); qk_row holds sum(dq y)
            for i, j in T.Parallel(BT, BK):
                acc_dq[i, j] = rq_s[i] * (acc_dq[i, j] - T.cast(q_s[i, j], acc) * qk_row[i])
        T.copy(acc_dq, dq_s)
        T.copy(dq_s, dq[it * BT : (it + 1) * BT, ihv, c0 : c0 + BK])
        T.copy(acc_dk, dk_s)
        T.copy(dk_s, dk[it * BT : (it + 1) * BT, ihv, c0 : c0 + BK])
        if split:
            T.copy(dg_s, dg[ik, it * BT : (it + 1) * BT, ihv], disable_tma=True)
        else:
            T.copy(dg_s, dg[it * BT : (it + 1) * BT, ihv], disable_tma=True)

    @T.macro
    def entry(q, k, v, g, h, do, dh, rq, scale, dq, dk, dv, dg):
        if split:
            with T.Kernel(NT, heads, K // BK, threads=threads) as (it, ihv, ik):
                body(it, ihv, ik, q, k, v, g, h, do, dh, rq, scale, dq, dk, dv, dg)
        else:
            with T.Kernel(NT, heads, threads=threads) as (it, ihv):
                body(it, ihv, 0, q, k, v, g, h, do, dh, rq, scale, dq, dk, dv, dg)

    parts = (K // BK,) if split else ()  # (the key channels split over programs: dv, dg in float32 parts)
    main = program(entry, q=T.Tensor((L, H, K), dtype), k=T.Tensor((L, H, K), dtype), v=T.Tensor((L, heads, V), dtype),
                   g=T.Tensor(gshape, acc), h=T.Tensor((NT, heads, K, V), dtype), do=T.Tensor((L, heads, V), dtype),
                   dh=T.Tensor((NT, heads, K, V), dtype), rq=T.Tensor(rshape, acc) if l2norm else None, scale=T.float32,
                   dq=T.Tensor((L, heads, K), dtype), dk=T.Tensor((L, heads, K), dtype),
                   dv=None if no_dv else T.Tensor((*parts, L, heads, V), acc if split else dtype),
                   dg=T.Tensor((*parts, L, heads), acc))

    main = v_tile(main, BV) if grid_v else main
    # (build.py reads the attribute into the lowering's pass config)
    return main if specialized else main.with_attr("fla.disable_warp_specialized", 1)
