"""simple GLA forward in TileLang.

Token layout (see `fla_jax._layout`): one flat run of `NT` chunks of `BT` tokens, `[NT * BT, H, .]`;
every sequence starts at a chunk boundary, occupies `ccount[n]` chunks from `cstart[n]`, and its
padding slots hold zeros. A dense batch is the same thing with `cstart[b] = b * NT_b`. `g` holds the
in-chunk cumulative log gates (`G_i = g_1 + ... + g_i` within each chunk), float32.

* `chunk_fwd`: the forward in one pass, one program per (V block, sequence * head), chunks in
  order, the state kept on chip; per chunk
  `o = scale (q * exp(G)) S + (scale Q K^T * exp(G_i - G_j), j <= i) v`, then
  `S <- exp(G_C) S + k^T (v * exp(G_C - G))`. Writes `o` and the final states `ht [N, H, K, V]`;
  with `store_h` (the forward of a gradient computation) also the state before every chunk,
  `h [NT, H, K, V]` in the input dtype, which the backward reads instead of recomputing it.
  Warp-specialized: a producer warpgroup loads, one warpgroup runs the state chain, one the
  output (see its docstring); `chunk_fwd_2out` gives the output two warpgroups taking alternate
  chunks (dispatched at K = 64 and 128 for the forward, K = 128 storing h). (The one-pass design
  replaced a two-kernel forward, states to HBM then the output: 0.169 + 0.152 ms against 0.231 ms
  at 4,4096,16,128 bf16 on an H200.)
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import (
    final_state,
    gate_load,
    gate_scan_load,
    initial_state,
    output_chunk,
    program,
    publish_state,
    stage_loads,
    v_tile,
    v_tile_assumed,
)


def _prim_func(body, *, K: int, V: int, dtype: str, store_h: bool, dims, g_rows: bool = False):
    """The prim_func of a forward pass `body` (a macro of the inputs and outputs), with the stored
    states `h` among its outputs under `store_h` (one declaration for every such pass); with
    `g_rows` G arrives as per-chunk rows `[NT, H, BT]` (BT = 64). The initial states `h0` have
    rows of their own (`N0`): none where the call has none (`kernels.common.initial_state`)."""
    L, H, N, NT = dims
    N0 = T.dynamic("N0")
    acc = "float32"
    gshape = (NT, H, 64) if g_rows else (L, H)
    return program(body, q=T.Tensor((L, H, K), dtype), k=T.Tensor((L, H, K), dtype), v=T.Tensor((L, H, V), dtype),
                   g=T.Tensor(gshape, acc), h0=T.Tensor((N0, H, K, V), acc), cstart=T.Tensor((N,), "int32"),
                   ccount=T.Tensor((N,), "int32"), scale=T.float32, o=T.Tensor((L, H, V), dtype),
                   h=T.Tensor((NT, H, K, V), dtype) if store_h else None, ht=T.Tensor((N, H, K, V), acc))


def _loads(q, k, v, g, q_s, k_s, v_s, g_s, ih, iv, g_rows=False, g_scan=False):
    """`stage_loads`' list for the warp-specialized passes: q, k, the V block `iv` of v (TMA),
    then G (`kernels.common.gate_load`, or with `g_scan` summed from the per-step gates,
    `gate_scan_load`)."""
    BT, K = (int(d) for d in q_s.shape[1:])
    BV = int(v_s.shape[2])
    rows = lambda c: slice(c * BT, c * BT + BT)
    return ((lambda c: q[rows(c), ih, 0:K], q_s, True), (lambda c: k[rows(c), ih, 0:K], k_s, True),
            (lambda c: v[rows(c), ih, iv * BV : (iv + 1) * BV], v_s, True), gate_scan_load(g, g_s, ih) if g_scan else gate_load(g, g_s, ih, g_rows))


@T.macro
def _state_update(b_h, k_s, v_s, g_s, vd_s, free, slot, fv=None, v_r=None):
    """The state warpgroup, its state published: `S <- exp(G_C) S + k^T (v exp(G_C - G))` from
    stage `slot`, which it then frees. With `fv` (`[BT]`) and `v_r` (`[BT, BV]`) fragments
    (`row_factors`): `exp(G_C - G)` once per row of v (read into `v_r`), not once per element."""
    BT, BV = (int(d) for d in vd_s.shape)
    K = int(b_h.shape[0])
    if fv is not None:
        for r in T.Parallel(BT):
            fv[r] = T.exp(g_s[slot, BT - 1] - g_s[slot, r])
        T.copy(v_s[slot, :, :], v_r)
        for r, c in T.Parallel(BT, BV):
            vd_s[r, c] = T.cast(T.cast(v_r[r, c], "float32") * fv[r], vd_s.dtype)
    else:
        for r, c in T.Parallel(BT, BV):
            vd_s[r, c] = T.cast(T.cast(v_s[slot, r, c], "float32") * T.exp(g_s[slot, BT - 1] - g_s[slot, r]), vd_s.dtype)
    for r, c in T.Parallel(K, BV):
        b_h[r, c] = b_h[r, c] * T.exp(g_s[slot, BT - 1])
    T.gemm(k_s[slot, :, :], vd_s, b_h, transpose_A=True)
    T.barrier_arrive(free[slot])


def chunk_fwd(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int = 2, store_h: bool = False,
              g_rows: bool = False, g_scan: bool = False, grid_v: bool = False):
    """The one-pass forward, warp-specialized (jla's and FlashQLA's structure): three warpgroups per
    (V block, sequence * head) program.

    * warpgroup 2 streams each chunk's q, k, v (TMA) and G into `stages` buffers;
    * warpgroup 0 keeps `S` (float32) in registers and runs only the chain: it publishes `S` in
      the input dtype to shared memory (and, with `store_h`, to `h` by a TMA store that runs
      while it works), then `S <- exp(G_C) S + k^T (v * exp(G_C - G))`;
    * warpgroup 1 computes `P = scale Q K^T * exp(G_i - G_j)` (j <= i) while warpgroup 0 works,
      then `o = scale (q * exp(G)) S + P v` from the published state, and stores it.

    `g_scan`: g holds the gates per step, which warpgroup 2 sums within each chunk as it loads them
    (`kernels.common.gate_scan_load`). `grid_v`: V read off the buffers, any multiple of BV."""
    L, H, N, NT = T.dynamic("L, H, N, NT")
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"

    @T.macro
    def body(q, k, v, g, h0, cstart, ccount, scale, o, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=384) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            n = inh // H
            ih = inh % H
            q_s = T.alloc_shared((stages, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            v_s = T.alloc_shared((stages, BT, BV), dtype)
            g_s = T.alloc_shared((stages, BT), acc)
            h_s = T.alloc_shared((K, BV), dtype)
            vd_s = T.alloc_shared((BT, BV), dtype)
            p_s = T.alloc_shared((BT, BT), dtype)
            o_s = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment((K, BV), acc)
            acc_o = T.alloc_fragment((BT, BV), acc)
            acc_s = T.alloc_fragment((BT, BT), acc)
            full = T.alloc_barrier([128] * stages)  # a stage's loads landed (producer threads + TMA bytes)
            free = T.alloc_barrier([256] * stages)  # both consumers are done with a stage
            s_ready = T.alloc_barrier([128])  # warpgroup 0 published S
            s_free = T.alloc_barrier([128])  # warpgroup 1 has read it
            c0 = cstart[n]
            nc = ccount[n]
            with T.ws(2):
                stage_loads(_loads(q, k, v, g, q_s, k_s, v_s, g_s, ih, iv, g_rows, g_scan), full, free, nc, stages, c0, 1)
            with T.ws(0):
                T.set_max_nreg(232, 1)
                initial_state(h0, b_h, n, ih, iv)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    publish_state(b_h, h_s, s_ready, s_free, i, store_h, h, c0, ih, iv)
                    _state_update(b_h, k_s, v_s, g_s, vd_s, free, slot)
                if store_h:
                    T.tma_store_wait()
                T.copy(b_h, ht[n, ih, 0:K, iv * BV : (iv + 1) * BV])
            with T.ws(1):
                T.set_max_nreg(232, 1)
                for i in T.serial(nc):
                    slot = i % stages
                    t0 = (c0 + i) * BT
                    output_chunk(q_s, k_s, g_s, h_s, v_s[slot, :, :], p_s, acc_s, acc_o, o_s, o, full, free, s_ready, s_free, i, slot,
                                 stages, t0, ih, iv, scale, False, i)

    # the warpgroups' buffers are live at once: no reuse of one's shared memory by another's
    func = _prim_func(body, K=K, V=V, dtype=dtype, store_h=store_h, dims=(L, H, N, NT), g_rows=g_rows).with_attr("fla.disable_shared_memory_reuse", 1)
    return v_tile(func, BV) if grid_v else func


def chunk_fwd_2out(*, K: int, V: int, dtype: str, BT: int = 64, BV: int = 64, stages: int = 2, store_h: bool = False,
                   g_rows: bool = False, row_factors: bool = False, g_scan: bool = False, transposed: bool = False,
                   p_regs: bool = False, grid_v: bool = False):
    """`chunk_fwd` with two output warpgroups taking alternate chunks (512 threads): warpgroup 3
    streams the loads into `stages` stages, warpgroup 0 runs the state chain and publishes chunk i's
    state into buffer `i % 2`, warpgroup 1 + (i % 2) forms chunk i's output from stage `i % stages`
    and buffer `i % 2`, so each output warpgroup has two chunks' time for its three GEMMs (the output
    warpgroup, not the chain, bounds `chunk_fwd`). The same bits as `chunk_fwd`; on an H200
    (2026-12-03, bf16) 0.126 / 0.202 ms against 0.139 / 0.266 at 4,4096,16,128 / 2,8192,16,128,
    storing h 0.148 / 0.221 against 0.180 / 0.255; at 8,2048,16,64 0.073 against 0.075, storing
    h 0.098 against 0.085 (so not dispatched there). `stages`: the loads' pipeline depth (chunk i
    in stage `i % stages`; three and four built as experiments). `row_factors`: warpgroup 0 forms
    `exp(G_C - G)` once per row (`_state_update`); the same bits. `g_scan`: as `chunk_fwd`'s.
    `transposed` (no `store_h`): warpgroup 0 carries `S^T [BV, K]` as jla's `fused_fwd` does, so that
    its GEMM takes the decayed `v^T` from registers, `S^T <- exp(G_C) S^T + (v^T Diag(exp(G_C - G))) k`
    (no tile written to shared memory and waited for on the chain; `exp(G_C - G)` once per column
    of its fragment), and publishes S^T, which the output warpgroups' `q S` reads transposed.
    `p_regs`: the output warpgroups keep P in registers (`P V` with its left operand there), no
    `[BT, BT]` tile of shared memory each: room for a fourth stage at K = 128."""
    if transposed and store_h:
        raise ValueError("chunk_fwd_2out(transposed=True) is written without store_h")
    L, H, N, NT = T.dynamic("L, H, N, NT")
    V = T.dynamic("V") if grid_v else V  # (one program for every V that is a multiple of BV)
    acc = "float32"
    st = (BV, K) if transposed else (K, BV)  # the state's tiles: S^T or S

    @T.macro
    def body(q, k, v, g, h0, cstart, ccount, scale, o, ht, h):
        with T.Kernel(T.ceildiv(V, BV), N * H, threads=512) as (iv, inh):
            if grid_v:
                v_tile_assumed(V, BV)
            n = inh // H
            ih = inh % H
            q_s = T.alloc_shared((stages, BT, K), dtype)
            k_s = T.alloc_shared((stages, BT, K), dtype)
            v_s = T.alloc_shared((stages, BT, BV), dtype)
            g_s = T.alloc_shared((stages, BT), acc)
            h_s0 = T.alloc_shared(st, dtype)
            h_s1 = T.alloc_shared(st, dtype)
            if transposed:  # the decayed v^T, the state GEMM's left operand, and its column factors
                x_t = T.alloc_fragment((BV, BT), dtype)
                fd = T.alloc_fragment((BT,), acc)
            else:
                vd_s = T.alloc_shared((BT, BV), dtype)
            p_s0 = (T.alloc_fragment if p_regs else T.alloc_shared)((BT, BT), dtype)
            p_s1 = (T.alloc_fragment if p_regs else T.alloc_shared)((BT, BT), dtype)
            o_s0 = T.alloc_shared((BT, BV), dtype)
            o_s1 = T.alloc_shared((BT, BV), dtype)
            b_h = T.alloc_fragment(st, acc)
            acc_o0 = T.alloc_fragment((BT, BV), acc)
            acc_s0 = T.alloc_fragment((BT, BT), acc)
            acc_o1 = T.alloc_fragment((BT, BV), acc)
            acc_s1 = T.alloc_fragment((BT, BT), acc)
            rf = (T.alloc_fragment((BT,), acc), T.alloc_fragment((BT, BV), dtype)) if row_factors and not transposed else (None, None)
            full = T.alloc_barrier([128] * stages)
            free = T.alloc_barrier([256] * stages)  # warpgroup 0 and the stage's output warpgroup
            s_ready0 = T.alloc_barrier([128])
            s_free0 = T.alloc_barrier([128])
            s_ready1 = T.alloc_barrier([128])
            s_free1 = T.alloc_barrier([128])
            c0 = cstart[n]
            nc = ccount[n]
            with T.ws(3):
                stage_loads(_loads(q, k, v, g, q_s, k_s, v_s, g_s, ih, iv, g_rows, g_scan), full, free, nc, stages, c0, 1)
            with T.ws(0):
                T.set_max_nreg(200, 1)
                initial_state(h0, b_h, n, ih, iv, transposed)
                for i in T.serial(nc):
                    slot = i % stages
                    T.barrier_wait(full[slot], (i // stages) % 2)
                    if i % 2 == 0:  # buffer i % 2, which output warpgroup 1 + i % 2 reads
                        publish_state(b_h, h_s0, s_ready0, s_free0, i // 2, store_h, h, c0 + i - i // 2, ih, iv)
                    else:
                        publish_state(b_h, h_s1, s_ready1, s_free1, i // 2, store_h, h, c0 + i - i // 2, ih, iv)
                    if transposed:
                        for c in T.Parallel(BT):
                            fd[c] = T.exp(g_s[slot, BT - 1] - g_s[slot, c])
                        for r, c in T.Parallel(BV, BT):
                            x_t[r, c] = T.cast(T.cast(v_s[slot, c, r], acc) * fd[c], dtype)
                        for r, c in T.Parallel(BV, K):
                            b_h[r, c] = b_h[r, c] * T.exp(g_s[slot, BT - 1])
                        T.gemm(x_t, k_s[slot, :, :], b_h)
                        T.barrier_arrive(free[slot])
                    else:
                        _state_update(b_h, k_s, v_s, g_s, vd_s, free, slot, *rf)
                if store_h:
                    T.tma_store_wait()
                final_state(b_h, ht, n, ih, iv, transposed)
            outs = ((h_s0, p_s0, acc_s0, acc_o0, o_s0, s_ready0, s_free0), (h_s1, p_s1, acc_s1, acc_o1, o_s1, s_ready1, s_free1))
            for w, (h_s, p_s, acc_s, acc_o, o_s, s_ready, s_free) in enumerate(outs):  # chunks 2 j + w, buffer w
                with T.ws(1 + w):
                    T.set_max_nreg(136, 1)
                    for j in T.serial((nc + 1 - w) // 2):
                        t0 = (c0 + 2 * j + w) * BT
                        slot = (2 * j + w) % stages  # w with two stages
                        output_chunk(q_s, k_s, g_s, h_s, v_s[slot, :, :], p_s, acc_s, acc_o, o_s, o, full, free, s_ready, s_free,
                                     2 * j + w, slot, stages, t0, ih, iv, scale, False, j, state_t=transposed)

    func = _prim_func(body, K=K, V=V, dtype=dtype, store_h=store_h, dims=(L, H, N, NT), g_rows=g_rows).with_attr("fla.disable_shared_memory_reuse", 1)
    return v_tile(func, BV) if grid_v else func


def chunk_fwd_enter(*, K: int, V: int, dtype: str, BT: int = 64, CG: int = 8, stages: int | None = None):
    """What the states entering a sequence's later pieces add to their output, in place (the
    forward split, `fla_jax.tilelang_backend.SPLIT_PROGRAMS`: the state pass walked every piece
    but the first from a zero state). Piece `ps` (of NS) starts at chunk `first[ps]`, M chunks
    long, and entered with state `s[ps]`; one program per (`CG` of its chunks, piece, head) loads
    that state once and, for chunk i of the piece, `o += scale exp(d[ps, i] + G) (q s)` (d: the
    decay of the piece's chunks before), the chunks' q and o pipelined. `o` is read and written
    (the FFI call aliases it)."""
    L, H, NT, NS, M = T.dynamic("L, H, NT, NS, M")
    acc = "float32"
    stages = stages or (2 if max(K, V) <= 128 else 1)  # (at K = V = 256 the state alone takes 128 KB)

    @T.prim_func
    def main(
        q: T.Tensor((L, H, K), dtype),
        g: T.Tensor((NT, H, BT), acc),
        d: T.Tensor((NS, M, H), acc),
        s: T.Tensor((NS, H, K, V), dtype),
        first: T.Tensor((NS,), "int32"),
        scale: T.float32,
        o: T.Tensor((L, H, V), dtype),
    ):
        with T.Kernel(T.ceildiv(M, CG), NS, H, threads=128) as (ig, ps, ih):
            s_s = T.alloc_shared((K, V), dtype)
            q_s = T.alloc_shared((BT, K), dtype)
            o_s = T.alloc_shared((BT, V), dtype)
            f_s = T.alloc_shared((BT,), acc)
            acc_o = T.alloc_fragment((BT, V), acc)
            T.copy(s[ps, ih, 0:K, 0:V], s_s)
            for i in T.Pipelined(T.min(CG, M - ig * CG), num_stages=stages):
                c = first[ps] + ig * CG + i
                T.copy(q[c * BT : (c + 1) * BT, ih, 0:K], q_s)
                T.copy(o[c * BT : (c + 1) * BT, ih, 0:V], o_s)
                for t in T.Parallel(BT):
                    f_s[t] = scale * T.exp(d[ps, ig * CG + i, ih] + g[c, ih, t])
                T.clear(acc_o)
                T.gemm(q_s, s_s, acc_o)
                for t, e in T.Parallel(BT, V):
                    acc_o[t, e] = acc_o[t, e] * f_s[t] + T.cast(o_s[t, e], acc)
                T.copy(acc_o, o[c * BT : (c + 1) * BT, ih, 0:V])

    return main
