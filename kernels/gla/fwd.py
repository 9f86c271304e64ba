"""GLA forward in TileLang (per-key-channel gates).

Token layout as for simple GLA (`kernels/simple_gla/fwd.py`: flat chunk rows, sequences from
`cstart`/`ccount`). `chunk_gla_a` reads the per-step log gates `g [L, H, K]` (float32, <= 0) and
writes their in-chunk cumulative sums `G_i = g_1 + ... + g_i` (`gc`), which the other kernels read
as `g` (every `G` is <= 0 and decreasing within a chunk).

* `chunk_gla_a`: one program per (chunk, head), chunks independent: `G` (written out), the state
  passes' operands `qg = q exp(G)` and `kg = k exp(G_C - G)` (input dtype), and
  `A_ij = scale sum_k q_ik k_jk exp(G_ik - G_jk)` for `j <= i`, 0 above, accumulated in float32,
  stored in the input dtype `[NT, H, BT, BT]` (the output pass and the backward's dv read it so).
  A chunk whose gate range from its middle row m is bounded (`chunk_span` below `half_limit`)
  takes one chunk-wide GEMM of `q exp(G - G_m)` and `k exp(G_m - G)`, every factor within
  `exp(+-half_limit)`; the others go by sub-chunks of 16 rows, where nothing exponentiates more
  than a sub-chunk's gate range: the blocks left of the diagonal, for row sub-chunk r with first
  row r0, as one GEMM of `q_i exp(G_i - G_r0)` (rows of r) and `k_j exp(G_r0 - G_j)` (j < r0),
  factors at most 1; the diagonal blocks elementwise on CUDA cores (`exp(G_ik - G_jk)` per term).
* `chunk_gla_fwd`: one program per (V block, sequence * head), chunks in order, the state on
  chip, warp-specialized: `o = scale qg S + A v`, then `S <- Diag(exp(G_C)) S + kg^T v`.
  Writes `o`, the final states `ht [N, H, K, V]` and with `store_h` the state before every chunk
  `h [NT, H, K, V]` (input dtype) for the backward (which also keeps `qg` for its
  state-gradient pass, simple GLA's `chunk_bwd_dh(channel_gates=True)`).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import arrive_once, initial_state, program, publish_state, stage_loads, v_tile, v_tile_assumed

NS = 16  # sub-chunk rows


def half_limit(dtype: str) -> float:
    """The largest gate range from a chunk's middle row (either way) for which the chunk-wide
    factors `x exp(+-range)` stay well inside the input dtype's range (fp16 tops out at
    65504 = exp(11.1) and must leave room for |q|, |k| up to ~1000)."""
    return 60.0 if dtype == "bfloat16" else 4.0


# Gates below this are summed as it (the runtime's `fla_jax.xla.GATE_FLOOR`): a decay of zero (g = -inf) is legal,
# but in-chunk sums of -inf give -inf - -inf = NaN, and of -1e8 lose every small gate after it (GLA's o off by 2x).
GATE_FLOOR = -110.0


@T.macro
def chunk_cumsum(g_s, threads):
    """`g_s [BT, K]` (float32, shared memory) <- its cumulative sum along the rows, in place, each
    gate taken as at least GATE_FLOOR: a row at a time, each thread's channels a running sum in registers.

    With fewer channels than threads (K = 64 in 128 threads) a `[K]` fragment is held twice, and
    two threads would read and write each element in place: a race (seen on the H200 at
    8,2048,16,64: wrong G, and every chunk then took the exact path). So the rows are cut in
    `threads / K` blocks (one where K >= threads), each summed by its own threads, and each block
    then adds the last row of the one before it."""
    BT, K = (int(d) for d in g_s.shape)
    parts = max(1, threads // K)
    R = BT // parts
    run = T.alloc_fragment((parts, K), "float32")
    T.clear(run)
    for i in T.unroll(R):  # unrolled: the loads of later rows issue ahead of the running sum
        for b, c in T.Parallel(parts, K):
            # (fmaxf drops a NaN: sqrt(-1) puts it back, branch-free, so that it poisons what it touches)
            run[b, c] = run[b, c] + T.max(g_s[b * R + i, c], GATE_FLOOR) + T.sqrt(-T.Cast("float32", T.isnan(g_s[b * R + i, c])))
            g_s[b * R + i, c] = run[b, c]
    for b in range(1, parts):  # block b after block b - 1 is final
        for i, c in T.Parallel(R, K):
            g_s[b * R + i, c] = g_s[b * R + i, c] + g_s[b * R - 1, c]


@T.macro
def chunk_span(g_s, span_s):
    """`span_s[0] = max_k max(G_0k - G_mk, G_mk - G_(BT-1)k)` (m = BT // 2) of the chunk's
    cumulative gates `g_s [BT, K]` (float32, shared memory): the exponent range of the chunk-wide
    factors `exp(+-(G - G_m))`."""
    BT, K = (int(d) for d in g_s.shape)
    span = T.alloc_fragment((K,), "float32")
    span_max = T.alloc_fragment((1,), "float32")
    for c in T.Parallel(K):
        span[c] = T.max(g_s[0, c] - g_s[BT // 2, c], g_s[BT // 2, c] - g_s[BT - 1, c])
    T.reduce_max(span, span_max, dim=0)
    for c in T.Parallel(1):
        span_s[c] = span_max[c]


def chunk_gla_a(*, K: int, V: int, dtype: str, BT: int = 64, threads: int = 128, sub: int = NS, bounded: bool = True,
                lean: bool = True, split: bool = True, inplace: bool = False, tma_loads: bool = True):
    """Two paths, chosen per chunk at run time:

    * chunk-wide (`bounded`, the default), for a chunk whose gate range from its middle row m,
      `max_k max(G_0k - G_mk, G_mk - G_(BT-1)k)`, is below `half_limit(dtype)`: one GEMM of
      `q exp(G - G_m)` and `k exp(G_m - G)` (the latter as hi + lo halves in the input dtype with
      `split`), every factor within `exp(+-half_limit)`; entries above the diagonal, which may
      overflow, are discarded. jla's fast path (from FlashKDA); with the usual gates every chunk
      takes it (0.22 against 1.43 ms at 4,4096,16,128 bf16 on an H200).
    * exact, for the others: by sub-chunks of `sub` rows, the blocks left of the diagonal as one
      GEMM per row sub-chunk referenced to its first row, the diagonal blocks elementwise in
      float32; nothing exponentiates more than a sub-chunk's gate range.

    `lean` (the default): the exact path reads k and G as stored (bank conflicts) instead of
    transposed copies, for less shared memory (two programs per SM at K = 128; K = 256 fits only
    so). `inplace` (an experiment, 0.43 ms): the chunk-wide operands formed in place of q and k
    (TileLang then syncs the block at every row group)."""
    del V
    NS = sub
    L, H, NT = T.dynamic("L, H, NT")
    acc = "float32"
    limit = half_limit(dtype)
    m = BT // 2

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
        if not lean:
            for c, j in T.Parallel(K, BT):
                kt_s[c, j] = k_s[j, c]
                gt_s[c, j] = g_s[j, c]
        T.clear(d_f)
        for c in T.serial(K):  # diagonal blocks: d[i, jj] = A[i, (i // NS) * NS + jj]; channels outer, so
            for i, jj in T.Parallel(BT, NS):  # that each thread's sums are independent chains
                if lean:
                    d_f[i, jj] += T.if_then_else(
                        (i // NS) * NS + jj <= i,
                        T.cast(q_s[i, c], acc) * T.cast(k_s[(i // NS) * NS + jj, c], acc)
                        * T.exp(g_s[i, c] - g_s[(i // NS) * NS + jj, c]),
                        0.0,
                    )
                else:
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
    def chunk_wide(q_s, k_s, g_s, qr_s, kr_s, acc_a, scale):
        if inplace:  # q_s <- q exp(G - G_m), k_s <- k exp(G_m - G) (hi) and qr_s <- its lo half
            for i, c in T.Parallel(BT, K):
                qr_s[i, c] = T.cast(
                    T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c])
                    - T.cast(T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]), dtype), acc),
                    dtype,
                )
                k_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]), dtype)
                q_s[i, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[m, c]), dtype)
            T.clear(acc_a)
            T.gemm(q_s, k_s, acc_a, transpose_B=True)
            T.gemm(q_s, qr_s, acc_a, transpose_B=True)
        else:  # qr_s <- q exp(G - G_m), kr_s <- k exp(G_m - G) (hi), then q_s <- its lo half
            for i, c in T.Parallel(BT, K):
                qr_s[i, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c] - g_s[m, c]), dtype)
                kr_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]), dtype)
            if split:
                for i, c in T.Parallel(BT, K):
                    q_s[i, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[m, c] - g_s[i, c]) - T.cast(kr_s[i, c], acc), dtype)
            T.clear(acc_a)
            T.gemm(qr_s, kr_s, acc_a, transpose_B=True)
            if split:
                T.gemm(qr_s, q_s, acc_a, transpose_B=True)
        for i, j in T.Parallel(BT, BT):
            acc_a[i, j] = T.if_then_else(j <= i, acc_a[i, j] * scale, 0.0)

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        k: T.Tensor((L, H, K), dtype),
        g: T.Tensor((L, H, K), acc),
        scale: T.float32,
        a: T.Tensor((NT, H, BT, BT), dtype),
        gc: T.Tensor((L, H, K), acc),
        qg: T.Tensor((L, H, K), dtype),
        kg: T.Tensor((L, H, K), dtype),
    ):
        with T.Kernel(NT, H, threads=threads) as (it, ih):
            t0 = it * BT
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            g_s = T.alloc_shared((BT, K), acc)
            qr_s = T.alloc_shared((BT, K), dtype)
            kr_s = T.alloc_shared((BT, K), dtype)
            d_s = T.alloc_shared((BT, NS), acc)
            kt_s = None if lean else T.alloc_shared((K, BT), dtype)  # k and G transposed for the diagonal
            gt_s = None if lean else T.alloc_shared((K, BT), acc)  # blocks: a row's 16 threads read 16 consecutive words
            acc_a = T.alloc_fragment((BT, BT), acc)
            d_f = T.alloc_fragment((BT, NS), acc)
            if tma_loads:  # all three in flight at once
                full = T.alloc_barrier([1])
                T.tma_copy(q[t0 : t0 + BT, ih, 0:K], q_s, barrier=full[0])
                T.tma_copy(k[t0 : t0 + BT, ih, 0:K], k_s, barrier=full[0])
                T.tma_copy(g[t0 : t0 + BT, ih, 0:K], g_s, barrier=full[0])
                arrive_once(full, 0)
                T.barrier_wait(full[0], 0)
            else:
                T.copy(q[t0 : t0 + BT, ih, 0:K], q_s)
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                T.copy(g[t0 : t0 + BT, ih, 0:K], g_s)
            chunk_cumsum(g_s, threads)
            T.copy(g_s, gc[t0 : t0 + BT, ih, 0:K])
            for i, c in T.Parallel(BT, K):  # the state pass's operands, rounded as its GEMMs take them
                qg[t0 + i, ih, c] = T.cast(T.cast(q_s[i, c], acc) * T.exp(g_s[i, c]), dtype)
                kg[t0 + i, ih, c] = T.cast(T.cast(k_s[i, c], acc) * T.exp(g_s[BT - 1, c] - g_s[i, c]), dtype)
            if bounded:
                span_s = T.alloc_shared((1,), acc)
                chunk_span(g_s, span_s)
                if span_s[0] < limit:
                    chunk_wide(q_s, k_s, g_s, qr_s, kr_s, acc_a, scale)
                else:
                    sub_chunked(q_s, k_s, g_s, qr_s, kr_s, d_s, kt_s, gt_s, acc_a, d_f, scale)
            else:
                sub_chunked(q_s, k_s, g_s, qr_s, kr_s, d_s, kt_s, gt_s, acc_a, d_f, scale)
            T.copy(acc_a, a[it, ih, 0:BT, 0:BT])

    return main


def chunk_gla_fwd(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int | None = None, store_h: bool = False,
                  grid_v: bool = False):
    """The state pass, warp-specialized (jla's and FlashQLA's structure): three warpgroups per
    (V block, sequence * head) program.

    * warpgroup 2 streams each chunk's `qg`, `kg`, `v`, `A` and `G_C` (the last row of `g`) with
      TMA into `stages` buffers;
    * warpgroup 0 keeps `S` (float32) in registers and runs only the chain: it publishes `S` in the
      input dtype to shared memory (and, with `store_h`, to `h` by a TMA store that runs while it
      works), then `S <- Diag(exp(G_C)) S + kg^T v`;
    * warpgroup 1 computes `o = scale qg S + A v` from the published state and stores it.

    `qg = q exp(G)` and `kg = k exp(G_C - G)` come from `chunk_gla_a`, rounded to the input dtype
    as the GEMMs take them, so this pass reads neither q, k nor the float32 gates of every row.
    Three stages where they fit (K <= 128; 0.093 against 0.106 ms for two at 4,4096,16,128 bf16
    on an H200), else two. `grid_v`: V read off the buffers, any multiple of BV."""
    stages = stages or (3 if K <= 128 else 2)
    L, H, N, NT, N0 = T.dynamic("L, H, N, NT, N0")  # (N0: the initial states' rows, none where the call has none)
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"

    @T.macro
    def body(qg, kg, v, g, a, h0, cstart, ccount, scale, o, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=384) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            n = inh // H
            ih = inh % H
            kg_s = T.alloc_shared((stages, BT, K), dtype)
            qg_s = T.alloc_shared((stages, BT, K), dtype)
            v_s = T.alloc_shared((stages, BT, BV), dtype)
            a_s = T.alloc_shared((stages, BT, BT), dtype)
            gl_s = T.alloc_shared((stages, K), acc)
            s_s = T.alloc_shared((K, BV), dtype)
            o_s = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment((K, BV), acc)
            acc_o = T.alloc_fragment((BT, BV), acc)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([256] * stages)  # both consumers are done with a stage
            s_ready = T.alloc_barrier([128])  # warpgroup 0 published S
            s_free = T.alloc_barrier([128])  # warpgroup 1 has read it
            c0 = cstart[n]
            nc = ccount[n]
            with T.ws(2):  # k exp(G_C - G), v, q exp(G), A and the chunk's last G row
                rows = lambda c: slice(c * BT, c * BT + BT)
                loads = ((lambda c: kg[rows(c), ih, 0:K], kg_s, True), (lambda c: v[rows(c), ih, iv * BV : (iv + 1) * BV], v_s, True),
                         (lambda c: qg[rows(c), ih, 0:K], qg_s, True), (lambda c: a[c, ih, 0:BT, 0:BT], a_s, True),
                         (lambda c: g[c * BT + BT - 1, ih, 0:K], gl_s, True))
                stage_loads(loads, full, free, nc, stages, c0, 1)
            with T.ws(0):
                T.set_max_nreg(232, 1)
                initial_state(h0, b_h, n, ih, iv)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    publish_state(b_h, s_s, s_ready, s_free, i, store_h, h, c0, ih, iv)
                    for r, c in T.Parallel(K, BV):
                        b_h[r, c] = b_h[r, c] * T.exp(gl_s[slot, r])
                    T.gemm(kg_s[slot, :, :], v_s[slot, :, :], b_h, transpose_A=True)
                    T.barrier_arrive(free[slot])
                if store_h:
                    T.tma_store_wait()
                T.copy(b_h, ht[n, ih, 0:K, iv * BV : (iv + 1) * BV])
            with T.ws(1):
                T.set_max_nreg(232, 1)
                for i in T.serial(nc):
                    slot = i % stages
                    t0 = (c0 + i) * BT
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    T.barrier_wait(s_ready[0], i % 2)
                    T.clear(acc_o)
                    T.gemm(qg_s[slot, :, :], s_s, acc_o)
                    T.barrier_arrive(s_free[0])
                    for r, c in T.Parallel(BT, BV):
                        acc_o[r, c] = acc_o[r, c] * scale
                    T.gemm(a_s[slot, :, :], v_s[slot, :, :], acc_o)
                    T.barrier_arrive(free[slot])
                    T.copy(acc_o, o_s)
                    T.copy(o_s, o[t0 : t0 + BT, ih, iv * BV : (iv + 1) * BV])

    main = program(body, qg=T.Tensor((L, H, K), dtype), kg=T.Tensor((L, H, K), dtype), v=T.Tensor((L, H, V), dtype),
                   g=T.Tensor((L, H, K), acc), a=T.Tensor((NT, H, BT, BT), dtype), h0=T.Tensor((N0, H, K, V), acc),
                   cstart=T.Tensor((N,), "int32"), ccount=T.Tensor((N,), "int32"), scale=T.float32,
                   o=T.Tensor((L, H, V), dtype), h=T.Tensor((NT, H, K, V), dtype) if store_h else None,
                   ht=T.Tensor((N, H, K, V), acc))
    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    main = main.with_attr("fla.disable_shared_memory_reuse", 1)
    return v_tile(main, BV) if grid_v else main
