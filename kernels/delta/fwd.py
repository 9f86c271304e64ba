"""Delta rule / gated delta rule (GDN) forward in TileLang: the sequential part.

Token layout as for simple GLA (`kernels/simple_gla/fwd.py`): flat chunk rows, sequences from
`cstart`/`ccount`, `g` = in-chunk cumulative log gates (zeros for the plain delta rule), float32.
The WY preparation (`kernels/delta/wy.py`) runs before this kernel, per chunk and in parallel: with
`T = (I + tril(Diag(beta)(K K^T * Gamma), -1))^{-1}`, `w = T (k * beta * exp(G))` and
`u = T (v * beta)`, both `[L, HV, .]` per value head.

* `chunk_delta_fwd`: one program per (V block, sequence * value head), chunks in order, the state
  on chip; per chunk
  `v_new = u - w S`, `o = scale (q * exp(G)) S + (scale Q K^T * exp(G_i - G_j), j <= i) v_new`,
  `S <- exp(G_C) S + (k * exp(G_C - G))^T v_new`.
  Writes `o`, `v_new` (input dtype, for the backward), the final states `ht`, and with
  `store_h` the state before every chunk `h [NT, HV, K, V]`. Grouped heads: value head j reads
  q/k head `j // (HV / H)`.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import (
    delta_loads,
    final_state,
    initial_state,
    output_chunk,
    output_from_p,
    program,
    stage_loads,
    v_tile,
    v_tile_assumed,
)


def _prim_func(body, *, K: int, V: int, dtype: str, store_h: bool, dims, g_rows: bool = False):
    """The prim_func of a state pass `body` (a macro of the inputs and outputs), with the stored
    states `h` among its outputs under `store_h` (one declaration for every such pass); `g_rows`:
    G as per-chunk rows `[NT, HV, BT]`."""
    L, H, HV, N, NT = dims
    N0 = T.dynamic("N0")  # (the initial states' rows: none where the call has none, `initial_state`)
    acc = "float32"
    gshape = (NT, HV, 64) if g_rows else (L, HV)  # (G as per-chunk rows, BT = 64)
    return program(body, q=T.Tensor((L, H, K), dtype), k=T.Tensor((L, H, K), dtype), w=T.Tensor((L, HV, K), dtype),
                   u=T.Tensor((L, HV, V), dtype), g=T.Tensor(gshape, acc), h0=T.Tensor((N0, HV, K, V), acc),
                   cstart=T.Tensor((N,), "int32"), ccount=T.Tensor((N,), "int32"), scale=T.float32,
                   o=T.Tensor((L, HV, V), dtype), vnew=T.Tensor((L, HV, V), dtype),
                   h=T.Tensor((NT, HV, K, V), dtype) if store_h else None, ht=T.Tensor((N, HV, K, V), acc))


def chunk_delta_fwd(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int | None = None,
                    store_h: bool = False, single_qw: bool | None = None, g_rows: bool = False, row_factors: bool = False,
                    states_only: bool = False):
    """The state pass, warp-specialized (jla's and FlashQLA's structure): three warpgroups per
    (V block, sequence * value head) program.

    * warpgroup 2 streams each chunk's q, k, w, u (TMA) and G into `stages` buffers (two; at
      K = 256, where two of everything would exceed 227 KB of shared memory, q and w in one, see
      `single_qw`);
    * warpgroup 0 keeps `S` (float32) in registers and runs the chain: it publishes `S` in the
      input dtype to shared memory, forms `v_new = u - w S` there (and stores it, with `h` under
      `store_h`, by TMA stores that run while it works), then
      `S <- exp(G_C) S + k^T (v_new * exp(G_C - G))`;
    * warpgroup 1 computes `P = scale Q K^T * exp(G_i - G_j)` (j <= i) while warpgroup 0 works,
      then `o = scale (q * exp(G)) S + P v_new` from the published tiles, and stores it.

    `single_qw` (the default at K = 256): two stages of k, u and G, but one buffer each of q and w
    with barriers of their own (`stage_loads`' `singles`): w is refilled once warpgroup 0's first
    GEMM has read it, q once warpgroup 1's `q S` has; 208.5 KB of shared memory at K = 256, where
    two stages of everything would take 272 KB and one stage left every load exposed.

    `g_rows`: G as per-chunk rows `[NT, HV, BT]` (XLA transposes the `[L, HV]` cumulative sum),
    loaded by TMA with the stage instead of by the loading warpgroup's threads, whose load delayed
    each stage's arrival (Nsight Compute, 2026-12-04: a third of that warpgroup's samples).
    `row_factors`: warpgroup 0 (the bound: Nsight Compute found it waiting in 5 % of its samples,
    the rest its elementwise work and its products) forms `exp(G_C - G)` once per row of its
    fragment rather than once per element of v_new; the same bits.
    `states_only`: the chain alone (the sequences' final states `ht`, and h under `store_h`): no q loaded, no
    o or v_new written (their buffers stay as they were), warpgroup 1 idle and nothing waiting on it; for the
    passes over pieces of a sequence that only carry states (`fla_jax._tilelang.common.state_pass`)."""
    L, H, HV, N, NT = T.dynamic("L, H, HV, N, NT")
    acc = "float32"
    if single_qw is None:
        single_qw = K > 128
    stages = stages or (2 if K <= 128 or single_qw else 1)
    qw = 1 if single_qw else stages  # q's and w's buffers

    @T.macro
    def body(q, k, w, u, g, h0, cstart, ccount, scale, o, vnew, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * HV, threads=384) as (iv, inh):
            n = inh // HV
            ihv = inh % HV
            ih = ihv // (HV // H)
            q_s = T.alloc_shared((qw, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            w_s = T.alloc_shared((qw, BT, K), dtype)
            u_s = T.alloc_shared((stages, BT, BV), dtype)
            g_s = T.alloc_shared((stages, BT), acc)
            h_s = T.alloc_shared((K, BV), dtype)
            vn_s = T.alloc_shared((BT, BV), dtype)
            vd_s = T.alloc_shared((BT, BV), dtype)
            p_s = T.alloc_shared((BT, BT), dtype)
            o_s = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment((K, BV), acc)
            acc_v = T.alloc_fragment((BT, BV), acc)
            acc_o = T.alloc_fragment((BT, BV), acc)
            acc_s = T.alloc_fragment((BT, BT), acc)
            fv = T.alloc_fragment((BT,), acc) if row_factors else None  # warpgroup 0's exp(G_C - G)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([128 if states_only else 256] * stages)  # both consumers are done with a stage
            s_ready = T.alloc_barrier([128])  # warpgroup 0 published S and v_new
            s_free = T.alloc_barrier([128])  # warpgroup 1 has read them
            c0 = cstart[n]
            nc = ccount[n]
            loads = delta_loads(q, k, w, u, g, q_s, k_s, w_s, u_s, g_s, ih, ihv, iv, g_rows)  # q, k, w, u, G
            if states_only:  # (no output: no q)
                assert not single_qw, "states_only takes two stages of everything (K <= 128)"
                loads = loads[1:]
            one_full = one_free = q_sync = None
            singles = ()
            if single_qw:  # w's and q's own buffers: landed (w, q), read by warpgroup 0 / 1
                one_full = T.alloc_barrier([128, 128])
                one_free = T.alloc_barrier([128, 128])
                q_sync = (one_full, one_free, 1)
                loads, singles = (loads[1], *loads[3:]), (loads[2][:2], loads[0][:2])
            with T.ws(2):
                stage_loads(loads, full, free, nc, stages, c0, 1, singles, one_full, one_free)
            with T.ws(0):
                T.set_max_nreg(232, 1)
                initial_state(h0, b_h, n, ihv, iv)
                for i in T.serial(nc):
                    slot = i % stages
                    t0 = (c0 + i) * BT
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    if i >= 1:  # warpgroup 1 and the stores of the previous chunk have read h_s and vn_s
                        if not states_only:
                            T.barrier_wait(s_free[0], (i + 1) % 2)
                        T.tma_store_wait()
                        T.sync_threads(8, 128)
                    T.copy(b_h, h_s)
                    T.clear(acc_v)
                    if single_qw:
                        T.barrier_wait(one_full[0], i % 2)
                        T.gemm(w_s[0, :, :], h_s, acc_v)
                        T.barrier_arrive(one_free[0])
                    else:
                        T.gemm(w_s[slot, :, :], h_s, acc_v)
                    for r, c in T.Parallel(BT, BV):
                        acc_v[r, c] = T.cast(u_s[slot, r, c], acc) - acc_v[r, c]
                    if not states_only:
                        T.copy(acc_v, vn_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(s_ready[0])
                    elif store_h:
                        T.fence_proxy_async()
                    T.sync_threads(8, 128)
                    if not states_only:
                        T.tma_copy(vn_s, vnew[t0 : t0 + BT, ihv, iv * BV : (iv + 1) * BV])
                    if store_h:
                        T.tma_copy(h_s, h[c0 + i, ihv, 0:K, iv * BV : (iv + 1) * BV])
                    decay = lambda r: T.exp(g_s[slot, BT - 1] - g_s[slot, r])  # exp(G_C - G) of row r
                    if row_factors:  # once per row, not per element
                        for r in T.Parallel(BT):
                            fv[r] = decay(r)
                        decay = lambda r: fv[r]
                    for r, c in T.Parallel(BT, BV):
                        vd_s[r, c] = T.cast(acc_v[r, c] * decay(r), dtype)
                    for r, c in T.Parallel(K, BV):
                        b_h[r, c] = b_h[r, c] * T.exp(g_s[slot, BT - 1])
                    T.gemm(k_s[slot, :, :], vd_s, b_h, transpose_A=True)
                    T.barrier_arrive(free[slot])
                T.tma_store_wait()
                T.copy(b_h, ht[n, ihv, 0:K, iv * BV : (iv + 1) * BV])
            with T.ws(1):
                T.set_max_nreg(232, 1)
                if not states_only:
                    for i in T.serial(nc):
                        slot = i % stages
                        t0 = (c0 + i) * BT
                        output_chunk(q_s, k_s, g_s, h_s, vn_s, p_s, acc_s, acc_o, o_s, o, full, free, s_ready, s_free, i, slot, stages,
                                     t0, ihv, iv, scale, True, i, q_sync=q_sync)

    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    return _prim_func(body, K=K, V=V, dtype=dtype, store_h=store_h, dims=(L, H, HV, N, NT), g_rows=g_rows).with_attr(
        "fla.disable_shared_memory_reuse", 1)


def chunk_delta_fwd_t(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, decay_k: bool = False,
                      transposed: bool = False, l2norm: bool = False, col_factors: bool = False, grid_v: bool = False,
                      carry: bool = False):
    """The forward (no gradient) from the gate-free inverse `T0` (`kernels/delta/wy.py`
    `chunk_delta_wy(inverse_only=True)`) instead of w and u, which never exist in HBM: jla's
    `fused_fwd_wy` and FlashQLA's forward. With `Ag = T0 * exp(G_i - G_j) * beta_j` (j <= i, the
    gated inverse times Diag(beta)), `v_new = u - w S = Ag (v - exp(G) * (k S))`. Four
    warpgroups per (V block, sequence * value head) program:

    * warpgroup 3 streams q, k, the V block of v, T0 and `gr` (TMA) into two stages: G and beta
      per chunk as the rows of `gr [NT, HV, R, C]` (float32, written by
      `chunk_delta_wy(inverse_only=True, gate_rows=True)`);
    * warpgroup 2 forms the decay matrix `exp(G_i - G_j)` once per chunk, Ag in place of T0
      (signalled on `ag_ready`), then `P = scale Q K^T * exp(G_i - G_j)` into the stage's own P
      tile (`p_ready`) and the output warpgroup's `exp(G)` exponent;
    * warpgroup 1 forms `o = scale (q * exp(G)) S + P v_new` from P and the published tiles, and
      stores it;
    * warpgroup 0 keeps `S` (float32) in registers: per chunk it publishes `S` (input dtype) in
      buffer `i % 2`, forms `W = v - exp(G) * (k S)` (input dtype), `v_new = Ag W` into the
      same buffer's `v_new` tile, then `S <- exp(G_C) S + k^T (v_new * exp(G_C - G))`.

    The published S and v_new are double-buffered (jla's choice), so warpgroup 0 waits for
    warpgroup 1 only two chunks back. Writes `o` and the final states `ht`; not v_new nor h (a
    gradient takes `chunk_delta_fwd` after `chunk_delta_wy`, whose w, u, T the backward reads).
    At K = 256 the state's registers leave no room for this: `chunk_delta_fwd_t_wide`.

    History. In three warpgroups (until 2026-12-04) warpgroup 1 formed Ag, P and o. Nsight Compute
    (H200, 4,4096,16,128) found it busy all the time, 37 % of it on Ag (the decay matrix formed twice
    per chunk, for Ag and for P), and warpgroup 0 waiting on Ag for 15 % of its time; the fourth
    warpgroup (`prep`): the same bits, 0.175 / 0.345 ms against 0.193 / 0.385 at 4,4096,16,128 /
    2,8192,16,128 bf16 (H200, 2026-12-04). The third warpgroup's block must come before warpgroup
    0's in the program: after it, TileLang synced the whole block between the warpgroups (as it
    does where two warpgroups share a fragment). G and beta came as `[L, HV]` columns that the
    loading warpgroup's threads loaded, each such load delaying the stage's arrival, until
    `gate_rows` (2026-12-04: 0.139 / 0.261 ms against 0.166 / 0.281). The three-warpgroup pass and
    the columns were removed on 2026-12-04 (twenty-first session) once nothing built them.

    `decay_k`: the third warpgroup also forms `kd = k exp(G_C - G)` (input dtype, a
    tile per stage) before signalling `ag_ready`, and warpgroup 0 updates the state from the
    published v_new, `S <- exp(G_C) S + kd^T v_new`, instead of decaying v_new itself (the decay,
    its rounding and its store took 30 % of warpgroup 0's stall samples). The same as fla's
    `k exp(G_C - G)` update; the product is rounded where the other rounds `v_new exp(G_C - G)`.

    `transposed`: warpgroup 0 carries `S^T [BV, K]` as jla's `fused_fwd_wy` does, so
    that all three of its GEMMs take their left operand from registers: `U^T = S^T k^T` (S^T in the
    input dtype, the tile it also publishes), `v_new^T = W^T Ag^T` with
    `W^T = v^T - U^T Diag(exp(G))`, `S^T <- exp(G_C) S^T + (v_new^T Diag(exp(G_C - G))) k`. Nothing
    on the chain waits for a shared-memory tile it wrote; the published S^T and v_new^T enter the
    output warpgroup's GEMMs transposed. (Tried with three warpgroups on 2026-12-03 it gained
    nothing: the output warpgroup bounded that pass; with four the chain does.) The same bits;
    0.161 / 0.273 ms against 0.177 / 0.344 at 4,4096,16,128 / 2,8192,16,128 bf16 (H200,
    2026-12-04). Nsight Compute then found warpgroup 0 waiting for its stage's loads 16 % of its
    time (a stage is refilled only once the output warpgroup has formed that chunk's o); three
    stages (one P tile per stage, 231 KB: `transposed` frees W's and the decayed v_new's tiles)
    measured no faster, 0.160 / 0.274 against 0.1595 / 0.265 ms (2026-12-04), and were dropped.

    `l2norm` (`use_qk_l2norm_in_kernel`): q and k arrive raw, `gr` has two more
    rows, `1 / |q|` and `1 / |k|` (R = 4; two more `[L, HV]` columns loaded by the loading
    warpgroup's threads made the pass 0.232 ms against 0.159 without l2norm at 4,4096,16,128); the
    normalisation becomes row factors of what the pass forms anyway: `U^T`'s columns and the
    decayed `v_new^T`'s times rk (with S, not transposed: the rows of `k S` and of the decayed
    v_new), P's rows and columns times rq and rk, and the output's `exp(G)` row factor times rq
    (the third warpgroup writes `G + log rq` for the output warpgroup with P). (Tried on
    2026-12-04: `1 / |q|` read off `Q Q^T`'s diagonal in this pass, where q is on chip anyway, so
    that the inverse loads no q (0.084 against 0.095 ms at 4,4096,16,128): by the third warpgroup
    before P, 0.152 / 0.288 against 0.143 / 0.264 at 4,4096,16,128 / 2,8192,16,128; by the output
    warpgroup while P formed, o's rows scaled by it last, 0.169 / 0.322 against 0.139 / 0.262.
    Both slower than the inverse's loads saved.)

    `col_factors` (with `transposed`): warpgroup 0 forms `exp(G) / |k|` and `exp(G_C - G) / |k|`
    once per column of its `[BV, BT]` fragments (16 of each per thread) rather than once per
    element (32 each); the same bits.

    `grid_v`: V read off the buffers, any multiple of BV (the state is separable along V: each V block's columns
    evolve on their own), so a call with V != K runs as it is, one inverse per value head for every V block.

    `carry` (with `transposed`, `grid_v`): the passes over pieces of a sequence that carry states alone, both in one
    launch (`fla_jax._tilelang.common.state_pass`): the first V / BV blocks of the grid take the V blocks of v from
    zero states (`ht`), K / BV more take zero values from the identity's columns (the piece's map of the state,
    `at [N, HV, K, K]`). No q is loaded, no P formed, no o written: warpgroup 1 idles and warpgroup 0 waits on
    nothing but the stage and Ag; the chain's bits are those of the pass. Inputs k, v, T0, gr and the tables."""
    L, H, HV, N, NT = T.dynamic("L, H, HV, N, NT")
    V = T.dynamic("V") if grid_v else V
    acc = "float32"
    stages = 2  # (one P tile per stage)
    if transposed and decay_k:
        raise ValueError("chunk_delta_fwd_t(transposed=True) is written without decay_k")
    R = 4 if l2norm else 2  # gr's rows: G, beta (, 1 / |q|, 1 / |k|)

    st = (BV, K) if transposed else (K, BV)  # the state's tiles: S^T or S
    vt = (BV, BT) if transposed else (BT, BV)  # v_new's

    @T.macro
    def body(q, k, v, t, gr, h0, cstart, ccount, scale, o, ht, at=None):
        with T.Kernel(T.ceildiv(V, BV) + (K // BV if carry else 0), N * HV, threads=512) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            nv = V // BV  # (with `carry`, the first nv blocks are v's, the rest the map's)
            n = inh // HV
            ihv = inh % HV
            ih = ihv // (HV // H)
            q_s = T.alloc_shared((stages, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            v_s = T.alloc_shared((stages, BT, BV), dtype)
            t_s = T.alloc_shared((stages, BT, BT), dtype)  # T0, then Ag (written by warpgroup 2)
            gr_s = T.alloc_shared((stages, R, BT), acc)  # G, beta (and the row factors of l2norm)
            gq_s = T.alloc_shared((stages, BT), acc)  # G (+ log 1 / |q|), the output warpgroup's exponent
            G, Bt, qf, kf, grow, decay = _gr_rows(gr_s, l2norm)
            pf = lambda slot, a, c: qf(slot, a) * kf(slot, c)
            # warpgroup 0's column factors (transposed; row factors with S) per element or, with col_factors,
            # read from the fragments fe, fd it fills once per chunk
            col_e, col_d = ((lambda slot, c: fe[c]), (lambda slot, c: fd[c])) if col_factors else (grow, decay)
            value = lambda slot, c, r: T.cast(v_s[slot, c, r], acc)  # (v^T's element; zero in a map's block)
            if carry:
                value = lambda slot, c, r: T.if_then_else(iv < nv, T.cast(v_s[slot, c, r], acc), 0.0)
            h_s0 = T.alloc_shared(st, dtype)
            h_s1 = T.alloc_shared(st, dtype)
            vn_s0 = T.alloc_shared(vt, dtype)
            vn_s1 = T.alloc_shared(vt, dtype)
            if transposed:  # S^T and W^T / the decayed v_new^T as GEMM operands in registers
                s_lo = T.alloc_fragment((BV, K), dtype)
                x_t = T.alloc_fragment((BV, BT), dtype)
                if col_factors:  # exp(G) and exp(G_C - G) (times 1 / |k|) once per column of v_new^T
                    fe = T.alloc_fragment((BT,), acc)
                    fd = T.alloc_fragment((BT,), acc)
            else:
                w_s = T.alloc_shared((BT, BV), dtype)
                vd_s = T.alloc_shared((BT, BV), dtype)
            p_s = T.alloc_shared((BT, BT), dtype)
            p_s1 = T.alloc_shared((BT, BT), dtype)  # stage 1's P (stage 0's in p_s)
            o_s = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment(st, acc)
            acc_v = T.alloc_fragment(vt, acc)
            acc_o = T.alloc_fragment((BT, BV), acc)
            acc_s = T.alloc_fragment((BT, BT), acc)
            acc_d = T.alloc_fragment((BT, BT), acc)  # the chunk's decay matrix
            p_ready = T.alloc_barrier([128] * stages)  # the stage's P is written
            if decay_k:
                kd_s = T.alloc_shared((stages, BT, K), dtype)  # k exp(G_C - G)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([128 if carry else 256] * stages)  # warpgroups 0 and 1 are done with a stage
            ag_ready = T.alloc_barrier([128] * stages)  # the stage's Ag is written
            s_ready0 = T.alloc_barrier([128])  # warpgroup 0 published S and v_new in buffer 0
            s_free0 = T.alloc_barrier([128])  # warpgroup 1 has read them
            s_ready1 = T.alloc_barrier([128])
            s_free1 = T.alloc_barrier([128])
            bufs = ((h_s0, vn_s0, s_ready0, s_free0), (h_s1, vn_s1, s_ready1, s_free1))
            c0 = cstart[n]
            nc = ccount[n]
            with T.ws(3):
                if carry:  # no q; a map's block loads v's last block, unused
                    loads = _t_loads(k, k, v, t, gr, q_s, k_s, v_s, t_s, gr_s, ih, ihv, T.min(iv, nv - 1))[1:]
                else:
                    loads = _t_loads(q, k, v, t, gr, q_s, k_s, v_s, t_s, gr_s, ih, ihv, iv)
                stage_loads(loads, full, free, nc, stages, c0, 1)
            with T.ws(2):
                T.set_max_nreg(136, 1)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    if carry:  # (see below)
                        T.sync_threads(12, 128)
                    _ag_in_place(t_s, acc_s, acc_d, G, Bt, slot)
                    if decay_k:
                        for r, c in T.Parallel(BT, K):
                            kd_s[slot, r, c] = T.cast(T.cast(k_s[slot, r, c], acc) * T.exp(G(slot, BT - 1) - G(slot, r)), dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(ag_ready[slot])
                    if carry:  # (barriers of this warpgroup alone, for TileLang's sync planner: without them it
                        # synced the whole block before and after this warpgroup's, as where no product follows Ag)
                        T.sync_threads(12, 128)
                    if not carry:  # (P, and the output warpgroup's exponent)
                        T.clear(acc_s)
                        T.gemm(q_s[slot, :, :], k_s[slot, :, :], acc_s, transpose_B=True)
                        for r, c in T.Parallel(BT, BT):
                            acc_s[r, c] = acc_s[r, c] * acc_d[r, c] * scale * pf(slot, r, c)
                        for r in T.Parallel(BT):  # the output warpgroup's exponent, G (+ log 1 / |q|)
                            gq_s[slot, r] = G(slot, r) + (T.log(gr_s[slot, 2, r]) if l2norm else 0.0)
                        if slot == 0:
                            T.copy(acc_s, p_s)
                        else:
                            T.copy(acc_s, p_s1)
                        T.fence_proxy_async()
                        T.barrier_arrive(p_ready[slot])
            with T.ws(0):
                T.set_max_nreg(200, 1)
                if carry:  # zeros, or the identity's columns in a map's block (S^T)
                    for r, c in T.Parallel(BV, K):
                        b_h[r, c] = T.if_then_else(c == (iv - nv) * BV + r, 1.0, 0.0)
                else:
                    initial_state(h0, b_h, n, ihv, iv, transposed)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    for j, (h_s, vn_s, s_ready, s_free) in enumerate(bufs):  # buffer i % 2, written out once per parity
                        if i % 2 == j:
                            if i >= 2 and not carry:  # warpgroup 1 has read this buffer's tiles of chunk i - 2
                                T.barrier_wait(s_free[0], (i // 2 + 1) % 2)
                            if transposed:  # W^T = v^T - (S^T k^T) Diag(exp(G)), in registers
                                T.copy(b_h, s_lo)
                                if not carry:
                                    T.copy(s_lo, h_s)
                                T.clear(acc_v)
                                T.gemm(s_lo, k_s[slot, :, :], acc_v, transpose_B=True)
                                if col_factors:
                                    for c in T.Parallel(BT):
                                        fe[c] = grow(slot, c)
                                        fd[c] = decay(slot, c)
                                for r, c in T.Parallel(BV, BT):
                                    x_t[r, c] = T.cast(value(slot, c, r) - acc_v[r, c] * col_e(slot, c), dtype)
                            else:  # W = v - exp(G) (k S), through shared memory
                                T.copy(b_h, h_s)
                                T.clear(acc_v)
                                T.gemm(k_s[slot, :, :], h_s, acc_v)
                                for r, c in T.Parallel(BT, BV):
                                    acc_v[r, c] = T.cast(v_s[slot, r, c], acc) - acc_v[r, c] * grow(slot, r)
                                T.copy(acc_v, w_s)
                            T.barrier_wait(ag_ready[slot], (i // stages) % 2)
                            T.clear(acc_v)
                            if transposed:  # v_new^T = W^T Ag^T
                                T.gemm(x_t, t_s[slot, :, :], acc_v, transpose_B=True)
                            else:
                                T.gemm(t_s[slot, :, :], w_s, acc_v)
                            if not carry:
                                T.copy(acc_v, vn_s)
                                T.fence_proxy_async()
                                T.barrier_arrive(s_ready[0])
                            if decay_k:  # S <- exp(G_C) S + kd^T v_new, from the published v_new
                                for r, c in T.Parallel(K, BV):
                                    b_h[r, c] = b_h[r, c] * T.exp(G(slot, BT - 1))
                                T.gemm(kd_s[slot, :, :], vn_s, b_h, transpose_A=True)
                    if transposed:  # S^T <- exp(G_C) S^T + (v_new^T Diag(exp(G_C - G))) k
                        for r, c in T.Parallel(BV, BT):
                            x_t[r, c] = T.cast(acc_v[r, c] * col_d(slot, c), dtype)
                        for r, c in T.Parallel(BV, K):
                            b_h[r, c] = b_h[r, c] * T.exp(G(slot, BT - 1))
                        T.gemm(x_t, k_s[slot, :, :], b_h)
                    elif not decay_k:
                        for r, c in T.Parallel(BT, BV):
                            vd_s[r, c] = T.cast(acc_v[r, c] * decay(slot, r), dtype)
                        for r, c in T.Parallel(K, BV):
                            b_h[r, c] = b_h[r, c] * T.exp(G(slot, BT - 1))
                        T.gemm(k_s[slot, :, :], vd_s, b_h, transpose_A=True)
                    T.barrier_arrive(free[slot])
                if not carry:
                    final_state(b_h, ht, n, ihv, iv, transposed)
                elif iv < nv:
                    final_state(b_h, ht, n, ihv, iv, transposed)
                else:
                    final_state(b_h, at, n, ihv, iv - nv, transposed)
            with T.ws(1):
                if carry:  # (no output: idle)
                    T.set_max_nreg(24, 0)
                else:
                    T.set_max_nreg(136, 1)
                    for i in T.serial(nc):
                        slot = i % stages
                        t0 = (c0 + i) * BT
                        T.barrier_wait(p_ready[slot], (i // stages) % 2)
                        for j, (h_s, vn_s, s_ready, s_free) in enumerate(bufs):
                            if i % 2 == j:  # two stages: chunk i's P is in stage j's tile
                                output_from_p(q_s, gq_s, h_s, vn_s, (p_s, p_s1)[j], acc_o, o_s, o, free, s_ready,
                                              s_free, slot, t0, ihv, iv, scale, True, i // 2, transposed)

    if carry:  # k, v, T0 and gr in; each piece's state from zeros (`ht`) and its map (`at`) out
        assert transposed and grid_v, "carry is written for the transposed chain taking V on the grid"
        acc_t = lambda *shape: T.Tensor(shape, acc)
        func = program(body, q=None, k=T.Tensor((L, H, K), dtype), v=T.Tensor((L, HV, V), dtype), t=T.Tensor((NT, HV, BT, BT), dtype),
                       gr=acc_t(NT, HV, R, BT), h0=None, cstart=T.Tensor((N,), "int32"), ccount=T.Tensor((N,), "int32"), scale=None,
                       o=None, ht=acc_t(N, HV, K, V), at=acc_t(N, HV, K, K)).with_attr("fla.disable_shared_memory_reuse", 1)
    else:
        func = _t_prim_func(body, K=K, V=V, dtype=dtype, BT=BT, R=R, dims=(L, H, HV, N, NT))
    return v_tile(func, BV) if grid_v else func


def chunk_delta_fwd_t_wide(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, l2norm: bool = False,
                           col_factors: bool = True, grid_v: bool = False):
    """`chunk_delta_fwd_t` for wide keys (K = 256), where its four warpgroups and double-buffered
    published tiles do not fit: `S^T [BV, K]` in float32 takes 128 registers a thread of warpgroup
    0, two stages of q and k 128 KB of shared memory (jla's `fused_fwd_kb` at K = 256 is built so).
    G and beta (and with `l2norm` 1 / |q|, 1 / |k|) arrive as the rows of `gr`, two
    stages of everything; three warpgroups per (V block, sequence * value head) program:

    * warpgroup 2 streams q, k, the V block of v, T0 and gr (TMA);
    * warpgroup 0 carries `S^T` (float32, registers) and publishes it in the input dtype to one
      shared tile, from which its own `U^T = S^T k^T` reads (no 16-bit copy in registers: no room),
      then `W^T = v^T - U^T Diag(exp(G) / |k|)` (registers), `v_new^T = W^T Ag^T`, published to a
      second tile, and `S^T <- exp(G_C) S^T + (v_new^T Diag(exp(G_C - G) / |k|)) k`;
    * warpgroup 1 forms the decay matrix once per chunk, Ag in place of T0 (`ag_ready`), P (in
      registers), then `o = scale Diag(exp(G) / |q|) q S + P v_new` from the published tiles.

    The published S^T and v_new^T have a barrier pair each, so warpgroup 0 rewrites `S^T` once
    warpgroup 1's `q S` of the chunk before has read it, and `v_new^T` once its `P v_new` has (jla
    releases both after the last). 210 KB of shared memory at K = 256. `col_factors` and `grid_v` as for
    `chunk_delta_fwd_t`."""
    L, H, HV, N, NT = T.dynamic("L, H, HV, N, NT")
    V = T.dynamic("V") if grid_v else V
    acc = "float32"
    stages = 2
    R = 4 if l2norm else 2  # gr's rows: G, beta (, 1 / |q|, 1 / |k|)

    @T.macro
    def body(q, k, v, t, gr, h0, cstart, ccount, scale, o, ht):
        with T.Kernel(T.ceildiv(V, BV), N * HV, threads=384) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            n = inh // HV
            ihv = inh % HV
            ih = ihv // (HV // H)
            q_s = T.alloc_shared((stages, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            v_s = T.alloc_shared((stages, BT, BV), dtype)
            t_s = T.alloc_shared((stages, BT, BT), dtype)  # T0, then Ag (written by warpgroup 1)
            gr_s = T.alloc_shared((stages, R, BT), acc)
            h_s = T.alloc_shared((BV, K), dtype)  # S^T, published
            vn_s = T.alloc_shared((BV, BT), dtype)  # v_new^T, published
            o_s = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment((BV, K), acc)  # warpgroup 0's
            acc_v = T.alloc_fragment((BV, BT), acc)
            x_t = T.alloc_fragment((BV, BT), dtype)
            if col_factors:
                fe = T.alloc_fragment((BT,), acc)
                fd = T.alloc_fragment((BT,), acc)
            acc_d = T.alloc_fragment((BT, BT), acc)  # warpgroup 1's: the decay matrix, Ag and P, o
            acc_s = T.alloc_fragment((BT, BT), acc)
            p_f = T.alloc_fragment((BT, BT), dtype)
            acc_o = T.alloc_fragment((BT, BV), acc)
            fq = T.alloc_fragment((BT,), acc)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([256] * stages)  # warpgroups 0 and 1 are done with a stage
            ag_ready = T.alloc_barrier([128] * stages)  # the stage's Ag is written
            h_ready = T.alloc_barrier([128])  # S^T published
            h_free = T.alloc_barrier([128])  # and read by warpgroup 1
            v_ready = T.alloc_barrier([128])  # v_new^T published
            v_free = T.alloc_barrier([128])
            G, Bt, qf, kf, grow, decay = _gr_rows(gr_s, l2norm)
            col_e, col_d = ((lambda slot, c: fe[c]), (lambda slot, c: fd[c])) if col_factors else (grow, decay)
            c0 = cstart[n]
            nc = ccount[n]
            with T.ws(2):
                stage_loads(_t_loads(q, k, v, t, gr, q_s, k_s, v_s, t_s, gr_s, ih, ihv, iv), full, free, nc, stages, c0, 1)
            with T.ws(0):
                T.set_max_nreg(232, 1)
                initial_state(h0, b_h, n, ihv, iv, True)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    if i >= 1:  # warpgroup 1's q S of chunk i - 1 has read S^T
                        T.barrier_wait(h_free[0], (i + 1) % 2)
                    T.copy(b_h, h_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(h_ready[0])
                    T.clear(acc_v)
                    T.gemm(h_s, k_s[slot, :, :], acc_v, transpose_B=True)  # U^T = S^T k^T
                    if col_factors:
                        for c in T.Parallel(BT):
                            fe[c] = grow(slot, c)
                            fd[c] = decay(slot, c)
                    for r, c in T.Parallel(BV, BT):  # W^T
                        x_t[r, c] = T.cast(T.cast(v_s[slot, c, r], acc) - acc_v[r, c] * col_e(slot, c), dtype)
                    T.barrier_wait(ag_ready[slot], (i // stages) % 2)
                    T.clear(acc_v)
                    T.gemm(x_t, t_s[slot, :, :], acc_v, transpose_B=True)  # v_new^T = W^T Ag^T
                    if i >= 1:  # warpgroup 1's P v_new of chunk i - 1 has read v_new^T
                        T.barrier_wait(v_free[0], (i + 1) % 2)
                    T.copy(acc_v, vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(v_ready[0])
                    for r, c in T.Parallel(BV, BT):
                        x_t[r, c] = T.cast(acc_v[r, c] * col_d(slot, c), dtype)
                    for r, c in T.Parallel(BV, K):
                        b_h[r, c] = b_h[r, c] * T.exp(G(slot, BT - 1))
                    T.gemm(x_t, k_s[slot, :, :], b_h)  # S^T <- exp(G_C) S^T + (v_new^T Diag(exp(G_C - G))) k
                    T.barrier_arrive(free[slot])
                final_state(b_h, ht, n, ihv, iv, transposed=True)
            with T.ws(1):
                T.set_max_nreg(232, 1)
                for i in T.serial(nc):
                    slot = i % stages
                    t0 = (c0 + i) * BT
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    _ag_in_place(t_s, acc_s, acc_d, G, Bt, slot)
                    T.fence_proxy_async()
                    T.barrier_arrive(ag_ready[slot])
                    T.clear(acc_s)
                    T.gemm(q_s[slot, :, :], k_s[slot, :, :], acc_s, transpose_B=True)
                    for r, c in T.Parallel(BT, BT):
                        p_f[r, c] = T.cast(acc_s[r, c] * acc_d[r, c] * scale * qf(slot, r) * kf(slot, c), dtype)
                    for r in T.Parallel(BT):
                        fq[r] = T.exp(G(slot, r)) * qf(slot, r) * scale
                    T.barrier_wait(h_ready[0], i % 2)
                    T.clear(acc_o)
                    T.gemm(q_s[slot, :, :], h_s, acc_o, transpose_B=True)
                    T.barrier_arrive(h_free[0])
                    for r, c in T.Parallel(BT, BV):
                        acc_o[r, c] = acc_o[r, c] * fq[r]
                    T.barrier_wait(v_ready[0], i % 2)
                    T.gemm(p_f, vn_s, acc_o, transpose_B=True)
                    T.barrier_arrive(v_free[0])
                    T.barrier_arrive(free[slot])
                    T.copy(acc_o, o_s)
                    T.copy(o_s, o[t0 : t0 + BT, ihv, iv * BV : (iv + 1) * BV])

    func = _t_prim_func(body, K=K, V=V, dtype=dtype, BT=BT, R=R, dims=(L, H, HV, N, NT))
    return v_tile(func, BV) if grid_v else func


def _t_loads(q, k, v, t, gr, q_s, k_s, v_s, t_s, gr_s, ih, ihv, iv):
    """`stage_loads`' list for the passes from the inverse: q, k (head `ih`), the V block `iv` of v,
    T0 and the chunk's rows of `gr` (value head `ihv`), all by TMA."""
    BT, K = (int(d) for d in q_s.shape[1:])
    BV = int(v_s.shape[2])
    R = int(gr_s.shape[1])
    rows = lambda c: slice(c * BT, c * BT + BT)
    return ((lambda c: q[rows(c), ih, 0:K], q_s, True), (lambda c: k[rows(c), ih, 0:K], k_s, True),
            (lambda c: v[rows(c), ihv, iv * BV : (iv + 1) * BV], v_s, True), (lambda c: t[c, ihv, 0:BT, 0:BT], t_s, True),
            (lambda c: gr[c, ihv, 0:R, 0:BT], gr_s, True))


def _gr_rows(gr_s, l2norm: bool):
    """Accessors `(slot, index)` of a stage's rows of `gr` (functions, since TileLang makes a name
    bound to an expression a variable): G, beta, `1 / |q|` and `1 / |k|` (1 without `l2norm`), and
    warpgroup 0's factors `exp(G) / |k|` and `exp(G_C - G) / |k|`."""
    BT = int(gr_s.shape[2])
    G = lambda slot, x: gr_s[slot, 0, x]
    Bt = lambda slot, x: gr_s[slot, 1, x]
    qf = (lambda slot, a: gr_s[slot, 2, a]) if l2norm else (lambda slot, a: 1.0)
    kf = (lambda slot, c: gr_s[slot, 3, c]) if l2norm else (lambda slot, c: 1.0)
    grow = lambda slot, c: T.exp(G(slot, c)) * kf(slot, c)
    decay = lambda slot, c: T.exp(G(slot, BT - 1) - G(slot, c)) * kf(slot, c)
    return G, Bt, qf, kf, grow, decay


@T.macro
def _ag_in_place(t_s, acc_s, acc_d, G, Bt, slot):
    """The stage's T0 turned into `Ag = T0 * exp(G_i - G_j) * beta_j` in place, through the
    registers, with the chunk's decay matrix left in `acc_d` (P takes it too)."""
    BT = int(acc_s.shape[0])
    T.copy(t_s[slot, :, :], acc_s)
    for r, c in T.Parallel(BT, BT):
        acc_d[r, c] = T.if_then_else(r >= c, T.exp(G(slot, r) - G(slot, c)), 0.0)
    for r, c in T.Parallel(BT, BT):
        acc_s[r, c] = acc_s[r, c] * acc_d[r, c] * Bt(slot, c)
    T.copy(acc_s, t_s[slot, :, :])


def _t_prim_func(body, *, K: int, V: int, dtype: str, BT: int, R: int, dims):
    """The prim_func of a pass from the inverse: `body(q, k, v, t, gr, h0, cstart, ccount, scale, o,
    ht)`, G and beta (and the l2norm factors) as the rows of `gr [NT, HV, R, BT]`."""
    L, H, HV, N, NT = dims
    N0 = T.dynamic("N0")  # (the initial states' rows: none where the call has none, `initial_state`)
    acc = "float32"

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        k: T.Tensor((L, H, K), dtype),
        v: T.Tensor((L, HV, V), dtype),
        t: T.Tensor((NT, HV, BT, BT), dtype),
        gr: T.Tensor((NT, HV, R, BT), acc),
        h0: T.Tensor((N0, HV, K, V), acc),
        cstart: T.Tensor((N,), "int32"),
        ccount: T.Tensor((N,), "int32"),
        scale: T.float32,
        o: T.Tensor((L, HV, V), dtype),
        ht: T.Tensor((N, HV, K, V), acc),
    ):
        body(q, k, v, t, gr, h0, cstart, ccount, scale, o, ht)

    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    return main.with_attr("fla.disable_shared_memory_reuse", 1)
