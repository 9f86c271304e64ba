"""Pieces shared by several TileLang programs (expanded in place: `T.macro`), and `program`, which
declares a program's interface once."""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import functools

import tilelang.language as T
from tilelang.language.eager import builder as _eager


def program(body, **buffers):
    """A program's `T.prim_func` from its one declaration: `buffers` are its parameters in order, inputs then
    outputs (`name=T.Tensor(shape, dtype)`, or a scalar such as `scale=T.float32`), and the macro `body`
    takes them by name. A flag that adds or drops a buffer gives it as None: no parameter then, and None to
    `body`. (What `@T.prim_func` does for a function whose signature is written out; the signature written
    once per flag combination, as before, differed in nothing else.) build.py records the parameters (the
    interface the runtime binds calls to by name)."""
    b = _eager.Builder()
    with b.prim_func("main"):
        # (a scalar's annotation, `T.float32`, is called for its variable, as `@T.prim_func` does)
        args = {n: b.arg(n, a() if callable(a) else a) for n, a in buffers.items() if a is not None}
        body(**{n: args.get(n) for n in buffers})
    return _eager._patch_prim_func_attrs(b.get(), b)


def v_tile(func, BV: int):
    """`func` (a program that reads V off its buffers, `grid_v`) marked as taking any V that is a multiple of its V
    block BV: build.py has its FFI handler refuse any other V, and the runtime too (`Interface.check`). Its
    body assumes it (`v_tile_assumed`), so that its copies of whole V blocks carry no bound checks (TileLang's
    checks inside a warp-specialized pass also made its ThreadSync pass fail)."""
    return func.with_attr("fla.v_tile", BV)


def v_tile_assumed(V, BV: int):
    """In a program's body: V is a multiple of BV (what `v_tile` has the FFI handler check)."""
    T.evaluate(T.assume(V % BV == 0))


@T.macro
def publish_state(b_h, s_s, s_ready, s_free, i, store_h, h, c0, head, iv):
    """Warpgroup 0 of a warp-specialized forward state pass, at chunk `i`: once warpgroup 1 has
    read the previous state (and, with `store_h`, its TMA store to `h` has), the float32 state
    `b_h` into `s_s` in the input dtype for warpgroup 1 (signalled on `s_ready`); with `store_h`
    also to `h[c0 + i, head, :, V block iv]` by a TMA store that runs on while warpgroup 0 works.
    (Double-buffering `s_s`, jla's choice, measured no faster: 0.131 against 0.126 ms for simple
    GLA, 0.105 against 0.099 for GLA at 4,4096,16,128 on the H200, 2026-12-03.)"""
    K, BV = (int(d) for d in s_s.shape)
    if i >= 1:
        T.barrier_wait(s_free[0], (i + 1) % 2)
        if store_h:
            T.tma_store_wait()
            T.sync_threads(8, 128)
    T.copy(b_h, s_s)
    T.fence_proxy_async()
    T.barrier_arrive(s_ready[0])
    if store_h:
        T.sync_threads(8, 128)
        T.tma_copy(s_s, h[c0 + i, head, 0:K, iv * BV : (iv + 1) * BV])


@T.macro
def output_chunk(q_s, k_s, g_s, h_s, values, p_s, acc_s, acc_o, o_s, o, full, free, s_ready, s_free, i, slot, stages, t0, head,
                 iv, scale, values_published, pub_i, q_sync=None, state_t=False):
    """Warpgroup 1 of a warp-specialized scalar-gate forward state pass (simple GLA, the delta
    rules), at chunk `i` in stage `slot`: `P = scale Q K^T * exp(G_i - G_j)` (j <= i) while
    warpgroup 0 works, then `o = scale (q * exp(G)) S + P values` from the state warpgroup 0
    published in `h_s`, into `o[t0 : t0 + BT, head, V block iv]`. `values_published`: `values`
    (v_new) is published by warpgroup 0 too, so `s_free` is signalled after the last GEMM reads
    it, not after the state's. `pub_i`: how many states were published into `h_s` before this
    one (`i` where one warpgroup takes every chunk). `q_sync`: `(full, free, j)` where q has one
    buffer of its own (`q_s[0]`, `stage_loads`' `singles`), waited for on `full[j]` and freed on
    `free[j]` once read. `state_t`: `h_s` holds `S^T [BV, K]`."""
    BT = int(o_s.shape[0])
    T.barrier_wait(full[slot], (i // stages) % 2)
    if q_sync is not None:
        T.barrier_wait(q_sync[0][q_sync[2]], i % 2)
    T.clear(acc_s)
    T.gemm(q_s[slot if q_sync is None else 0, :, :], k_s[slot, :, :], acc_s, transpose_B=True)
    for r, c in T.Parallel(BT, BT):
        acc_s[r, c] = T.if_then_else(r >= c, acc_s[r, c] * T.exp(g_s[slot, r] - g_s[slot, c]) * scale, 0.0)
    T.copy(acc_s, p_s)
    output_from_p(q_s, g_s, h_s, values, p_s, acc_o, o_s, o, free, s_ready, s_free, slot, t0, head, iv, scale, values_published,
                  pub_i, q_sync=q_sync, state_t=state_t)


@T.macro
def output_from_p(q_s, g_s, h_s, values, p_s, acc_o, o_s, o, free, s_ready, s_free, slot, t0, head, iv, scale, values_published,
                  pub_i, transposed=False, q_sync=None, state_t=None):
    """`output_chunk` once `P` is in `p_s`: `o = scale (q * exp(G)) S + P values` from the state
    published in `h_s` (waited for on `s_ready`), stage `slot` freed, `o` stored (the output
    warpgroup of a pass whose P another warpgroup forms calls it alone). `transposed`: `h_s` and
    `values` hold `S^T [BV, K]` and `values^T [BV, BT]`; `state_t`, where given, says it of `h_s`
    alone. `q_sync` as for `output_chunk`."""
    BT, BV = (int(d) for d in o_s.shape)
    T.barrier_wait(s_ready[0], pub_i % 2)
    T.clear(acc_o)
    T.gemm(q_s[slot if q_sync is None else 0, :, :], h_s, acc_o, transpose_B=transposed if state_t is None else state_t)
    if q_sync is not None:
        T.barrier_arrive(q_sync[1][q_sync[2]])
    if not values_published:
        T.barrier_arrive(s_free[0])
    for r, c in T.Parallel(BT, BV):
        acc_o[r, c] = acc_o[r, c] * T.exp(g_s[slot, r]) * scale
    T.gemm(p_s, values, acc_o, transpose_B=transposed)
    if values_published:
        T.barrier_arrive(s_free[0])
    T.barrier_arrive(free[slot])
    T.copy(acc_o, o_s)
    T.copy(o_s, o[t0 : t0 + BT, head, iv * BV : (iv + 1) * BV])


def _stage(buf, slot):
    """Stage `slot` of a staged shared buffer `[stages, ...]`, whole."""
    return buf[(slot,) + (slice(None),) * (len(buf.shape) - 1)]


@T.macro
def scan_fetch(src, a):
    """A chunk's in-chunk cumulative sum by one warp, first half: lane t of the first warp of the
    threads' (first) warpgroup reads steps 2 t and 2 t + 1 (`src(step)`) into `a[0:2]` (a local
    `[4]` float32; issued early, so that their latency hides behind other work)."""
    t = T.get_thread_binding() % 128
    if t < 32:
        a[0] = src(2 * t)
        a[1] = src(2 * t + 1)


@T.macro
def scan_store(a, dst, prefix, reverse=False):
    """Second half: the inclusive cumulative sum of the 64 steps into `dst[prefix + (step,)]`: each
    lane sums its pair, the pairs' sums are scanned across the warp by shuffles (Hillis-Steele,
    five steps), and a lane's first step takes the scan of the pairs before it. `reverse`: the sum
    from each step to the chunk's end (the cumulative sum's VJP), the pairs scanned from the last
    lane down."""
    t = T.get_thread_binding() % 128
    if t < 32:
        a[2] = a[0] + a[1]
        for d in (1, 2, 4, 8, 16):
            if reverse:
                a[3] = T.shfl_down(a[2], d)
                if t + d < 32:
                    a[2] = a[2] + a[3]
            else:
                a[3] = T.shfl_up(a[2], d)
                if t >= d:
                    a[2] = a[2] + a[3]
        if reverse:  # (a lane's second step takes the sums of the pairs after it)
            a[3] = T.shfl_down(a[2], 1)
            if t == 31:
                a[3] = T.float32(0)
            dst[prefix + (2 * t,)] = a[2]
            dst[prefix + (2 * t + 1,)] = a[3] + a[1]
        else:
            a[3] = T.shfl_up(a[2], 1)
            if t == 0:
                a[3] = T.float32(0)
            dst[prefix + (2 * t,)] = a[3] + a[0]
            dst[prefix + (2 * t + 1,)] = a[2]


@T.macro
def stage_loads(loads, full, free, nc, stages, c_first, step, singles=(), one_full=None, one_free=None):
    """The loading warpgroup of the warp-specialized passes: for its i-th chunk
    `c = c_first + step i` (`step` 1 forward, -1 in reverse), once its users freed stage
    `i % stages` (on `free`), each `(source, buffer, tma)` of `loads` in order: `source(c)` (a region of chunk
    c) into that stage of `buffer`, by TMA on `full` or, where `tma` is False, by each thread
    (the scalar gates), or where `tma` is `"scan"` (at most one such entry, `gate_scan_load`) the
    in-chunk cumulative sum of `source(c, step)` by one warp (`scan_fetch` before the wait,
    `scan_store`); then the warpgroup's own arrival on `full`. Then each `(source, buffer)` `j` of
    `singles`, a buffer of one slot (`buffer[0]`) with barriers of its own: once its user freed it
    on `one_free[j]`, by TMA on `one_full[j]` (where the stages of every tile would not fit in
    shared memory)."""
    T.set_max_nreg(40, 0)
    scans = tuple(load for load in loads if isinstance(load[2], str))
    a = T.alloc_local((4,), "float32")
    for i in T.serial(nc):
        slot = i % stages
        c = c_first + i if step == 1 else c_first - i
        for load in scans:
            scan_fetch(functools.partial(load[0], c), a)
        if i >= stages:
            T.barrier_wait(free[slot], (i // stages + 1) % 2)
        for load in loads:  # (no name binds a buffer here: TileLang would rename it after the name)
            if isinstance(load[2], str):
                scan_store(a, load[1], (slot,))
            elif load[2]:
                T.tma_copy(load[0](c), _stage(load[1], slot), barrier=full[slot])
            else:
                T.copy(load[0](c), _stage(load[1], slot), disable_tma=True)
        T.barrier_arrive(full[slot])
        for j, single in enumerate(singles):
            if i >= 1:
                T.barrier_wait(one_free[j], (i + 1) % 2)
            T.tma_copy(single[0](c), _stage(single[1], 0), barrier=one_full[j])
            T.barrier_arrive(one_full[j])


def gate_scan_load(g, g_s, head):
    """`stage_loads`' entry for a chunk's G formed from the per-step gates `g [L, H]` (`g_scan`):
    the loading warpgroup sums them within the chunk itself (`scan_store`), so that XLA's
    cumulative sum and the transpose to per-chunk rows (four small launches, 6.5 us at
    4,4096,16,128 on the H200) go."""
    BT = int(g_s.shape[-1])
    assert BT == 64, "one warp scans a chunk of 64 steps, two a lane"
    return (lambda c, t: g[c * BT + t, head], g_s, "scan")


def gate_load(g, g_s, head, g_rows):
    """`stage_loads`' entry for a chunk's G: a TMA box of its per-chunk row `g [NT, H, BT]` with
    `g_rows`, else its `[L, H]` column by the loading warpgroup's threads (each such load delays
    the stage's arrival: the delta rules' forward from the inverse 0.166 -> 0.139 ms at
    4,4096,16,128 with G and beta as rows, H200, 2026-12-04)."""
    BT = int(g_s.shape[-1])
    if g_rows:
        return (lambda c: g[c, head, 0:BT], g_s, True)
    return (lambda c: g[c * BT : c * BT + BT, head], g_s, False)


def delta_loads(q, k, w, x, g, q_s, k_s, w_s, x_s, g_s, ih, ihv, iv, g_rows=False):
    """`stage_loads`' list for the delta rules' passes: q, k (head `ih`), w and the V block `iv`
    of `x` (u, or do) by TMA, then G (`gate_load`)."""
    BT, BV = (int(d) for d in x_s.shape[1:])
    K = int(q_s.shape[2])
    rows = lambda c: slice(c * BT, c * BT + BT)
    return ((lambda c: q[rows(c), ih, 0:K], q_s, True), (lambda c: k[rows(c), ih, 0:K], k_s, True),
            (lambda c: w[rows(c), ihv, 0:K], w_s, True), (lambda c: x[rows(c), ihv, iv * BV : (iv + 1) * BV], x_s, True),
            gate_load(g, g_s, ihv, g_rows))


@T.macro
def initial_state(h0, b_h, n, head, iv, transposed=False, k0=0):
    """`b_h` <- the V block `iv` of sequence n's initial state `h0[n, head]` (`[K, BV]` from key
    channel `k0`, or `[BV, K]` with `transposed`), or zeros where the call has none: `h0` with no
    rows (`N0 = 0`), so that XLA writes no zero states for the pass to read. (The reverse passes
    start so from the final state's gradient `dht`.) The zeros come from TileLang's guard on the
    load (`n < N0`, its dynamic extent: an element past it reads as zero). A branch around the
    load and a clear instead (as written until 2026-12-05) made ptxas keep the state in local
    memory in the warp-specialized state passes (768 bytes of spills a thread, tensor-core products
    serialized); build.py now reports spills, and a test refuses them in the dispatched programs."""
    if transposed:
        BV, K = (int(d) for d in b_h.shape)
        for r, c in T.Parallel(BV, K):
            b_h[r, c] = h0[n, head, c, iv * BV + r]
    else:
        K, BV = (int(d) for d in b_h.shape)
        T.copy(h0[n, head, k0 : k0 + K, iv * BV : (iv + 1) * BV], b_h)


@T.macro
def final_state(b_h, ht, n, head, iv, transposed=False, k0=0):
    """`ht[n, head]`'s V block `iv` (from key channel `k0`) <- `b_h` `[K, BV]` (`[BV, K]` with
    `transposed`, as `initial_state` takes it), where `ht` has rows: the reverse passes' `dh0`, which
    has none where the call has no initial state to take it (TileLang's guard on the store, `n < N`,
    skips it then; no branch, as for `initial_state`)."""
    if transposed:
        BV, K = (int(d) for d in b_h.shape)
        for r, c in T.Parallel(BV, K):
            ht[n, head, c, iv * BV + r] = b_h[r, c]
    else:
        K, BV = (int(d) for d in b_h.shape)
        T.copy(b_h, ht[n, head, k0 : k0 + K, iv * BV : (iv + 1) * BV])


@T.macro
def arrive_once(barriers, i):
    """The one arrival barrier `i` (of count 1) waits for besides the bytes: after `T.tma_copy`s on it,
    from thread 0, the thread that posts their byte count (the first warp's leader), so that the
    same code serves any number of threads (TileLang adds a loading warpgroup to pipelined kernels)."""
    if T.get_thread_binding() == 0:
        T.barrier_arrive(barriers[i])
