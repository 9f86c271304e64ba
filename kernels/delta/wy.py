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

from kernels.common import arrive_once, program, scan_fetch, scan_store


def _hi_lo(BT: int, dtype: str, *, scaled: bool):
    """A macro `split(x, coef, hi_s, lo_s)`: `hi + lo = x` (with `scaled`, `x Diag(coef)`, a column
    scaling) for a float32 `[BT, BT]` matrix, as two input-dtype matrices (about 16 mantissa bits)
    that enter the tensor cores as they are."""
    acc = "float32"
    entry = (lambda x, coef, a, b: x[a, b] * coef[b]) if scaled else (lambda x, coef, a, b: x[a, b])

    @T.macro
    def split(x, coef, hi_s, lo_s):
        for a, b in T.Parallel(BT, BT):
            hi_s[a, b] = T.cast(entry(x, coef, a, b), dtype)
            lo_s[a, b] = T.cast(entry(x, coef, a, b) - T.cast(T.cast(entry(x, coef, a, b), dtype), acc), dtype)

    return split


def chunk_delta_wy(*, K: int, V: int, dtype: str, BT: int = 64, threads: int | None = None, store_t: bool = False,
                   blocked: bool | None = None, merged: bool = False, tma_t: bool = False,
                   late_v: bool | None = None, warp_diagonal: bool = True, tma_loads: bool = True,
                   tma_stores: bool = True, inverse_only: bool = False, l2norm: bool = False, gate_rows: bool = False,
                   pad_rows: bool | None = None, min_blocks: int = 0, g_scan: bool = False, g_rows: bool = False):
    """`blocked`: invert by 16 x 16 blocks (diagonal blocks by substitution, all four at once, then
    one block row at a time: `T_IJ = -T_II sum_K A_IK T_KJ`) instead of row by row; the default
    where it is written for (BT = 64, 128 threads): 0.464 against 0.528 ms at 4,4096,16,128 bf16 on
    an H200. At 256 threads (K = 256) too since 2026-12-04, the second warpgroup idle while the
    first four warps invert the diagonal blocks: `wy` 0.119 against 0.260 ms row by row at
    4,4096,8,256 (`wy_t` 0.128 against 0.270), within 1.6e-6. `tma_t`: store T with TMA, which makes TileLang swizzle the shared buffer the
    substitution walks: 0.809 against 0.542 ms without (the default) at the same shape.
    `merged` (blocked only): the block rows by merges on the tensor cores instead (jla's
    `kkt_fwd`: 16 -> 32 -> 64 with `X <- X - X L X`, each float32 product as three bf16 hi/lo
    products; T within 8e-6 of float64), with v loaded after the inverse (`late_v`, so that its
    buffer takes the merges' operands and three programs still fit on an SM): 0.456 against 0.380
    ms (0.573 with v loaded first, two programs per SM), 2026-12-03: the splits and the fences
    between twelve small GEMMs cost more than the CUDA-core block rows. `warp_diagonal` (blocked
    and merged): each warp inverts its diagonal block with the columns in registers (two barriers
    in all) instead of one row per step through shared memory (thirty): 0.338 against 0.377 ms at
    4,4096,16,128 bf16 on an H200, w and u within 1e-6 (2026-12-03; the default since).
    `tma_loads`: k and v by TMA, both in flight while G and beta load (each thread loaded its
    part of k and waited for it before, with 64-bit index arithmetic for the grouped head);
    `tma_stores`: w and u written to the spent k and v tiles and stored by TMA, whole rows (from
    the accumulators' registers before, half of each 32-byte sector used). Both: 0.182 against
    0.336 ms at 4,4096,16,128 bf16 on an H200 (2026-12-03; `x_wy_sync` keeps the old loads and
    stores), the same w, u and T to the bit.
    The block rows' sums run four steps at a time so that A's entries load 16 bytes at once (they
    loaded one float a step, the kernel bound by its shared-memory load instructions): `inv`
    0.078 against 0.096 ms, `wy` 0.148 against 0.163, `wy_t` 0.160 against 0.173 at
    4,4096,16,128 bf16 on an H200 (2026-12-04), the same bits (the sums keep their order; the
    zero upper half of each diagonal block is now multiplied instead of skipped).
    `inverse_only` (the forward `fused_t` path, see `kernels/delta/fwd.py` `chunk_delta_fwd_t`):
    the gate-free `T0 = (I + tril(Diag(beta) K K^T, -1))^{-1}` alone, in the input dtype
    (`T0 [NT, HV, C, C]`, zero above the diagonal; fla's and jla's forwards keep their inverse in
    the input dtype too); no v, no gates, no w and u. The gated inverse is
    `T = T0 * exp(G_i - G_j)` (`T = D T0 D^-1` with `D = Diag(exp(G))`), which the state pass forms.
    `gate_rows` (with `inverse_only`): also reads G and writes the chunk's G and beta as the rows of
    `gr [NT, HV, R, C]` (float32) for the state pass to load by TMA (`chunk_delta_fwd_t(gate_rows=True)`);
    with `g_scan` g holds the gates per step, which its first warp sums within the chunk
    (`kernels.common.scan_store`; XLA's cumulative sum took three launches before it).
    `g_scan` with `store_t` (the forward under a gradient): g per step likewise, summed into the
    tile the chunk's decays read, and two more outputs, the sums G as the backward takes them
    (`gs [L, HV]`) and as per-chunk rows (`grows [NT, HV, C]`, which the forward's state pass and the
    backward's reverse pass load by TMA): XLA's cumulative sum and its transpose to rows go.
    `l2norm` (with `gate_rows`; `use_qk_l2norm_in_kernel` with no gradient): from the raw q and
    k, T0 of the normalised k, `K K^T` scaled by `r_i r_j` with `r = 1 / sqrt(|k|^2 + 1e-6)` read
    off its own diagonal, and two more rows of `gr` (R = 4): the chunk's `1 / |q|` (off `Q Q^T`'s
    diagonal), then its `1 / |k|`, per value head, by which the state pass scales its rows
    (`chunk_delta_fwd_t(l2norm=True)`): no normalised copy of q and k in HBM (XLA's pass took
    0.06 ms of the 0.33 of a GDN forward at 4,4096,16,128).
    `l2norm` with `store_t` (the forward under a gradient, `wy_t_l2`): w, u and T of the
    normalised k from the raw q and k, `r` read off the diagonals as above, and the normalised
    `y = x r` (input dtype, k's formed in place for w's product) and `r` (float32 `[L, H]`)
    written for the passes after it, once per q/k head (by the group's first value head): 0.208
    ms at 4,4096,16,128 bf16 on an H200 against `wy_t` 0.158 + two `l2norm_fwd` passes 0.040
    each (2026-12-04).
    `pad_rows` (the default but with `tma_t`): the float32 A / T tile's rows padded by 8 floats, A
    formed in the registers and stored from them two floats at a time. Unpadded, its 256-byte rows
    put the eight rows a warp's (one-float) stores span in the same four banks: 8-way conflicts on
    32 stores a thread (jla pads so, `SOLVE_PAD`). With `inverse_only` and `l2norm`, `1 / |q|` is
    formed first, so that q's spent tile can take A's (the padded tile no longer fits in k's at
    K = 128). The same bits; `inv` 0.068 against 0.081 ms, `inv_l2` 0.085 against 0.097, `wy`
    0.135 against 0.147, `wy_t_l2` 0.207 against 0.210 at 4,4096,16,128, at K = 64 `inv` 0.064
    against 0.076, `inv_l2` 0.084 against 0.090 at 8,2048,16,64 (bf16, H200, 2026-12-05, ten
    launches a sample, interleaved).
    `min_blocks`: `__launch_bounds__`' programs a multiprocessor (ptxas keeps the registers to that
    many; 0: TileLang's default, 1). The inverse alone takes 96 registers a thread, five programs an
    SM, where its shared memory would fit eight (K = 64, 26.6 KB) or six (`inv_l2` at K = 128,
    33.3 KB); at 64 / 80 registers ptxas spills 32 / 52 bytes.
    `g_rows` (w and u, with `tma_loads`; not `g_scan`): G and beta as per-chunk rows `[NT, HV, BT]`,
    loaded by TMA with k, not each chunk's columns by each thread (as `chunk_delta_wy_bwd(g_rows=True)`)."""
    L, H, HV, NT = T.dynamic("L, H, HV, NT")
    acc = "float32"
    threads = threads or (128 if inverse_only or max(K, V) <= 128 else 256)
    parts = threads // BT
    span = BT // parts
    NB = 16  # blocked: block size; one thread per (diagonal block, half of j, column)
    if blocked is None:
        blocked = BT == 64 and (threads == 128 or (threads == 256 and warp_diagonal))
    merged = merged and blocked
    if late_v is None:
        late_v = merged
    blocked = blocked and not merged
    assert not blocked or (BT == 64 and (threads == 128 or (threads == 256 and warp_diagonal))), \
        "the blocked inverse is written for BT = 64, 128 threads (or 256 with warp_diagonal)"
    assert not merged or (BT == 64 and threads == 128), "the merged inverse is written for BT = 64, 128 threads"
    assert not l2norm or (tma_loads and (gate_rows or store_t)), \
        "l2norm is written for tma_loads (q arrives by TMA), and for gate_rows or store_t"
    normalise = l2norm and not inverse_only  # (the training forward) y_q, y_k, r_q, r_k written
    assert not normalise or store_t, "l2norm without inverse_only is written for store_t (the training forward)"
    assert not gate_rows or inverse_only, "gate_rows is written for the inverse alone"
    assert not g_scan or gate_rows or store_t, "g_scan is written for gate_rows (the inverse) and store_t"
    assert not g_rows or (tma_loads and not inverse_only and not g_scan), "g_rows is written for w and u, by TMA, without g_scan"
    gshape = (NT, HV, BT) if g_rows else (L, HV)  # G and beta
    pad_rows = not tma_t if pad_rows is None else pad_rows
    assert not (pad_rows and tma_t), "a TMA store of T reads its shared tile whole: no padded rows"
    pad = 8 if pad_rows else 0  # floats after each row of the float32 A / T tile

    @T.macro
    def diagonal_columns(m_s, col, o, pp, cc):
        for i in T.unroll(NB):
            col[i] = T.if_then_else(i == cc, 1.0, 0.0)
            for j in T.unroll(i):
                col[i] -= m_s[o + i, o + j] * col[j]
        for i in T.unroll(NB):
            if T.And(pp == 0, cc < i):
                m_s[o + i, o + cc] = col[i]

    @T.macro
    def invert_diagonal(m_s, s, bpart_s, col):
        # warp bb inverts diagonal block bb (rows and columns o .. o + 15)
        tx = T.get_thread_binding()
        bb, pp, cc = tx // 32, (tx // NB) % 2, tx % NB
        o = bb * NB
        if warp_diagonal:
            # lane (pp, cc) forms column cc of the block's inverse in registers (both halves alike),
            # `T[i, cc] = [i = cc] - sum_{j < i} A[i, j] T[j, cc]`, every read of A a broadcast and
            # no barrier until the columns are written back (rows i > cc, by half pp = 0)
            if threads > BT // NB * 32:  # one warp per diagonal block; the other warps wait
                if tx < BT // NB * 32:
                    diagonal_columns(m_s, col, o, pp, cc)
            else:
                diagonal_columns(m_s, col, o, pp, cc)
            T.sync_threads()
        else:
            for i in T.serial(1, NB):
                s[0] = 0.0
                for jj in T.serial(T.max(T.min(i - pp * 8, 8), 0)):
                    s[0] += m_s[o + i, o + pp * 8 + jj] * m_s[o + pp * 8 + jj, o + cc]
                bpart_s[bb, pp, cc] = s[0]
                T.sync_threads()
                if pp == 0:
                    if cc < i:
                        m_s[o + i, o + cc] = -(bpart_s[bb, 0, cc] + bpart_s[bb, 1, cc])
                T.sync_threads()

    @T.macro
    def invert_merged(m_s, acc_a, xh_s, xl_s, lh_s, ll_s):
        # Diagonal blocks done: merge 16 -> 32 -> 64 with X <- X - X L X on the tensor cores (X the
        # block-diagonal inverse so far, L the next level's off-diagonal blocks of A; only those
        # blocks of the product are new), each float32 product as three bf16 hi/lo products
        # (hi hi' + hi lo' + lo hi', about 16 mantissa bits, lo lo' dropped).
        for lvl in T.unroll(2):
            sz = NB << lvl  # the blocks merged: [sz, sz] pairs into [2 sz, 2 sz]
            for a, b in T.Parallel(BT, BT):
                xh_s[a, b] = T.cast(T.if_then_else(a // sz == b // sz, m_s[a, b], 0.0), "bfloat16")
                xl_s[a, b] = T.cast(
                    T.if_then_else(a // sz == b // sz, m_s[a, b] - T.cast(T.cast(m_s[a, b], "bfloat16"), acc), 0.0),
                    "bfloat16",
                )
                lh_s[a, b] = T.cast(
                    T.if_then_else(T.And((a // sz) % 2 == 1, b // sz == a // sz - 1), m_s[a, b], 0.0), "bfloat16"
                )
                ll_s[a, b] = T.cast(
                    T.if_then_else(
                        T.And((a // sz) % 2 == 1, b // sz == a // sz - 1),
                        m_s[a, b] - T.cast(T.cast(m_s[a, b], "bfloat16"), acc),
                        0.0,
                    ),
                    "bfloat16",
                )
            T.clear(acc_a)  # link = L X
            T.gemm(lh_s, xh_s, acc_a)
            T.gemm(lh_s, xl_s, acc_a)
            T.gemm(ll_s, xh_s, acc_a)
            for a, b in T.Parallel(BT, BT):
                lh_s[a, b] = T.cast(acc_a[a, b], "bfloat16")
                ll_s[a, b] = T.cast(acc_a[a, b] - T.cast(T.cast(acc_a[a, b], "bfloat16"), acc), "bfloat16")
            T.clear(acc_a)  # X link: the new off-diagonal blocks are its negative
            T.gemm(xh_s, lh_s, acc_a)
            T.gemm(xh_s, ll_s, acc_a)
            T.gemm(xl_s, lh_s, acc_a)
            for a, b in T.Parallel(BT, BT):
                if T.And((a // sz) % 2 == 1, b // sz == a // sz - 1):
                    m_s[a, b] = -acc_a[a, b]

    @T.macro
    def invert_blocked(m_s, s, bpart_s, s_s, acc8, col):
        invert_diagonal(m_s, s, bpart_s, col)
        tx = T.get_thread_binding()
        # (The second pass reads rows r0.. of m_s at columns >= r0 and writes them at columns < r0:
        # its sums are written after a barrier of their own, so that no branch both reads and writes
        # m_s. With the write inside the reading branch TileLang's ThreadSync hoisted a barrier out of
        # `if col < r0` and warned "the race remains", which build.py refuses.)
        # Block rows I = 1, 2, 3 (rows r0 + r): thread tx owns column col = tx % BT and the rows
        # r = RS e + tx // BT (e < NE) of the strip left of block I, NE sums at once (independent
        # chains, each operand of column col loaded once for all of them).
        NE = NB * BT // threads
        RS = threads // BT
        col = tx % BT
        for ib in T.serial(1, BT // NB):
            r0 = ib * NB
            if col < r0:  # S = sum_K A_IK T_KJ, K from J = col // NB up to I - 1
                for e in T.unroll(NE):
                    acc8[e] = 0.0
                for x4 in T.serial((r0 - (col // NB) * NB) // 4):  # four steps at once: A's loads 16 bytes wide
                    for xu in T.unroll(4):
                        tv = m_s[(col // NB) * NB + 4 * x4 + xu, col]
                        for e in T.unroll(NE):
                            acc8[e] += m_s[r0 + RS * e + tx // BT, (col // NB) * NB + 4 * x4 + xu] * tv
                for e in T.unroll(NE):
                    s_s[RS * e + tx // BT, col] = acc8[e]
            T.sync_threads()
            if col < r0:  # T_IJ = -T_II S (T_II unit lower triangular: its upper part holds zeros)
                for e in T.unroll(NE):
                    acc8[e] = 0.0
                for mm4 in T.serial(NB // 4):
                    for mu in T.unroll(4):
                        sv = s_s[4 * mm4 + mu, col]
                        for e in T.unroll(NE):
                            acc8[e] += m_s[r0 + RS * e + tx // BT, r0 + 4 * mm4 + mu] * sv
            T.sync_threads()
            if col < r0:
                for e in T.unroll(NE):
                    m_s[r0 + RS * e + tx // BT, col] = -acc8[e]
            T.sync_threads()

    split = _hi_lo(BT, dtype, scaled=True)

    @T.macro
    def q_norms(q_s, acc_a, kv_full, qb, rq_s, gr, ic, ihv):
        # 1 / |q| off the diagonal of Q Q^T: into rq_s (`normalise`) or as row 2 of gr
        T.barrier_wait(kv_full[qb], 0)
        T.clear(acc_a)
        T.gemm(q_s, q_s, acc_a, transpose_B=True)
        for a, b in T.Parallel(BT, BT):
            if a == b:
                if normalise:
                    rq_s[a] = T.rsqrt(acc_a[a, b] + 1e-6)
                else:
                    gr[ic, ihv, 2, a] = T.rsqrt(acc_a[a, b] + 1e-6)

    @T.macro
    def body(k, v, g, beta, w, u, t, qx=None, gr=None, yq=None, yk=None, rq=None, rk=None, gs=None, grows=None):
        with T.Kernel(T.ceildiv(L, BT), HV, threads=threads) as (ic, ihv):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            ih = ihv // (HV // H)
            t0 = ic * BT
            k_s = T.alloc_shared((BT, K), dtype)
            m_s = T.alloc_shared((BT, BT + pad), acc)  # A, turning into T row by row
            hi_s = T.alloc_shared((BT, BT), dtype)
            b_s = T.alloc_shared((BT,), acc)
            acc_a = T.alloc_fragment((BT, BT), acc)
            part_s = T.alloc_shared((parts, BT), acc)
            s = T.alloc_local((1,), acc)
            if l2norm:
                q_s = T.alloc_shared((BT, K), dtype)
                r_s = T.alloc_shared((BT,), acc)
            if normalise:
                rq_s = T.alloc_shared((BT,), acc)
            if g_scan:  # this chunk's gates per step, read first
                ga = T.alloc_local((4,), acc)
                scan_fetch(lambda step: g[t0 + step, ihv], ga)
            elif gate_rows:
                gi_s = T.alloc_shared((BT,), acc)
            if not inverse_only:
                v_s = T.alloc_shared((BT, V), dtype)
                lo_s = T.alloc_shared((BT, BT), dtype)
                g_s = T.alloc_shared((BT,), acc)
                c_s = T.alloc_shared((BT,), acc)
                acc_w = T.alloc_fragment((BT, K), acc)
                acc_u = T.alloc_fragment((BT, V), acc)
            if tma_loads:  # k and v in flight at once, beside G and beta
                kv_full = T.alloc_barrier([1, 1, 1] if normalise else [1, 1])
                qb = 2 if normalise else 1  # q's barrier
                T.tma_copy(k[t0 : t0 + BT, ih, 0:K], k_s, barrier=kv_full[0])
                if g_rows:  # (first read after kv_full[0]'s wait)
                    T.tma_copy(g[ic, ihv, 0:BT], g_s, barrier=kv_full[0])
                    T.tma_copy(beta[ic, ihv, 0:BT], b_s, barrier=kv_full[0])
                arrive_once(kv_full, 0)
                if not late_v and not inverse_only:
                    T.tma_copy(v[t0 : t0 + BT, ihv, 0:V], v_s, barrier=kv_full[1])
                    arrive_once(kv_full, 1)
                if l2norm:
                    T.tma_copy(qx[t0 : t0 + BT, ih, 0:K], q_s, barrier=kv_full[qb])
                    arrive_once(kv_full, qb)
            else:
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                if not late_v and not inverse_only:
                    T.copy(v[t0 : t0 + BT, ihv, 0:V], v_s)
            if not inverse_only and g_scan:  # G summed into g_s, and written for the passes after this one
                scan_store(ga, g_s, ())
                for a in T.Parallel(BT):
                    gs[t0 + a, ihv] = g_s[a]
                    grows[ic, ihv, a] = g_s[a]
            elif not inverse_only and not g_rows:
                T.copy(g[t0 : t0 + BT, ihv], g_s, disable_tma=True)
            if not g_rows:
                T.copy(beta[t0 : t0 + BT, ihv], b_s, disable_tma=True)
            if gate_rows and g_scan:  # G (summed here) and beta as rows of gr
                scan_store(ga, gr, (ic, ihv, 0))
                for a in T.Parallel(BT):
                    gr[ic, ihv, 1, a] = b_s[a]
            elif gate_rows:  # G and beta as rows of gr
                T.copy(g[t0 : t0 + BT, ihv], gi_s, disable_tma=True)
                for a in T.Parallel(BT):
                    gr[ic, ihv, 0, a] = gi_s[a]
                    gr[ic, ihv, 1, a] = b_s[a]
            # (the inverse alone with padded rows: q's norms first, so that A's tile may take q's place too)
            q_first = l2norm and inverse_only and pad_rows
            if q_first:
                q_norms(q_s, acc_a, kv_full, qb, None, gr, ic, ihv)
            if tma_loads:
                T.barrier_wait(kv_full[0], 0)
            T.clear(acc_a)
            T.gemm(k_s, k_s, acc_a, transpose_B=True)
            # the gates' decay (none for the gate-free T0); a function, since TileLang makes a name bound to an
            # expression a variable of its own
            decay = (lambda a, b: 1.0) if inverse_only else (lambda a, b: T.exp(g_s[a] - g_s[b]))
            if l2norm:  # 1 / |k| off the diagonal of K K^T; A of the normalised k
                for a, b in T.Parallel(BT, BT):
                    if a == b:
                        r_s[a] = T.rsqrt(acc_a[a, b] + 1e-6)
                T.sync_threads()
                gates = decay
                decay = lambda a, b: gates(a, b) * r_s[a] * r_s[b]
                if gate_rows:
                    for a in T.Parallel(BT):
                        gr[ic, ihv, 3, a] = r_s[a]
            # A below the diagonal (from K K^T in acc_a), 1 on it
            a_entry = lambda a, b: T.if_then_else(a > b, acc_a[a, b] * b_s[a] * decay(a, b), T.if_then_else(a == b, 1.0, 0.0))
            if pad_rows:  # A formed in the registers, then stored from them as they are
                for a, b in T.Parallel(BT, BT):
                    acc_a[a, b] = a_entry(a, b)
                T.copy(acc_a, m_s[0:BT, 0:BT])
            else:
                for a, b in T.Parallel(BT, BT):
                    m_s[a, b] = a_entry(a, b)
            if l2norm and not q_first:  # and 1 / |q| off the diagonal of Q Q^T
                q_norms(q_s, acc_a, kv_full, qb, rq_s if normalise else None, gr, ic, ihv)
            if normalise:  # y = x r (k in place, for w's product), stored once per q/k head by TMA
                # (through registers: in place, TileLang syncs the block at every unrolled step)
                acc_q = T.alloc_fragment((BT, K), acc)
                T.sync_threads()
                T.copy(k_s, acc_w)
                T.copy(q_s, acc_q)
                for a, b in T.Parallel(BT, K):
                    acc_w[a, b] = acc_w[a, b] * r_s[a]
                    acc_q[a, b] = acc_q[a, b] * rq_s[a]
                T.copy(acc_w, k_s)
                T.copy(acc_q, q_s)
                if ihv % (HV // H) == 0:
                    T.copy(q_s, yq[t0 : t0 + BT, ih, 0:K])
                    T.copy(k_s, yk[t0 : t0 + BT, ih, 0:K])
                    for a in T.Parallel(BT):
                        rq[t0 + a, ih] = rq_s[a]
                        rk[t0 + a, ih] = r_s[a]
            if merged:
                bpart_s = T.alloc_shared((BT // NB, 2, NB), acc)
                xh_s = T.alloc_shared((BT, BT), "bfloat16")
                xl_s = T.alloc_shared((BT, BT), "bfloat16")
                lh_s = T.alloc_shared((BT, BT), "bfloat16")
                ll_s = T.alloc_shared((BT, BT), "bfloat16")
                col = T.alloc_local((NB,), acc) if warp_diagonal else None
                invert_diagonal(m_s, s, bpart_s, col)
                invert_merged(m_s, acc_a, xh_s, xl_s, lh_s, ll_s)
            elif blocked:
                bpart_s = T.alloc_shared((BT // NB, 2, NB), acc)
                s_s = T.alloc_shared((NB, BT), acc)
                acc8 = T.alloc_local((NB * BT // threads,), acc)
                col = T.alloc_local((NB,), acc) if warp_diagonal else None
                invert_blocked(m_s, s, bpart_s, s_s, acc8, col)
            else:
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
            if inverse_only:  # T0 in the input dtype, through hi_s
                for a, b in T.Parallel(BT, BT):
                    hi_s[a, b] = T.cast(m_s[a, b], dtype)
                T.copy(hi_s, t[ic, ihv, 0:BT, 0:BT])
            else:
                if late_v:
                    T.copy(v[t0 : t0 + BT, ihv, 0:V], v_s)
                for a in T.Parallel(BT):
                    c_s[a] = b_s[a] * T.exp(g_s[a])
                split(m_s, c_s, hi_s, lo_s)
                T.clear(acc_w)
                T.gemm(hi_s, k_s, acc_w)
                T.gemm(lo_s, k_s, acc_w)
                if tma_stores:  # through the spent k tile, whole rows per store
                    T.copy(acc_w, k_s)
                    T.copy(k_s, w[t0 : t0 + BT, ihv, 0:K])
                else:
                    T.copy(acc_w, w[t0 : t0 + BT, ihv, 0:K])
                split(m_s, b_s, hi_s, lo_s)
                if tma_loads and not late_v:
                    T.barrier_wait(kv_full[1], 0)
                T.clear(acc_u)
                T.gemm(hi_s, v_s, acc_u)
                T.gemm(lo_s, v_s, acc_u)
                if tma_stores:
                    T.copy(acc_u, v_s)
                    T.copy(v_s, u[t0 : t0 + BT, ihv, 0:V])
                else:
                    T.copy(acc_u, u[t0 : t0 + BT, ihv, 0:V])
                if store_t:  # last, so that waiting for the store holds up nothing else
                    T.copy(m_s[0:BT, 0:BT], t[ic, ihv, 0:BT, 0:BT], disable_tma=not tma_t)

    @T.macro
    def entry(q, k, v, g, beta, w, u, t, gr, yq, yk, rq, rk, gs, grows):  # (body's q is `qx`: its loops take `q`)
        body(k, v, g, beta, w, u, t, q, gr, yq, yk, rq, rk, gs, grows)

    stats = lambda: T.Tensor((L, HV), acc)  # G and beta as the inverse and the kernels summing the gates take them
    return program(
        entry,
        q=T.Tensor((L, H, K), dtype) if l2norm else None,
        k=T.Tensor((L, H, K), dtype),
        v=None if inverse_only else T.Tensor((L, HV, V), dtype),
        g=None if inverse_only and not (l2norm or gate_rows) else stats() if inverse_only or g_scan else T.Tensor(gshape, acc),
        beta=stats() if inverse_only or g_scan else T.Tensor(gshape, acc),
        w=None if inverse_only else T.Tensor((L, HV, K), dtype),
        u=None if inverse_only else T.Tensor((L, HV, V), dtype),
        t=T.Tensor((NT, HV, BT, BT), dtype) if inverse_only else T.Tensor((NT, HV, BT, BT), acc) if store_t else None,
        gr=T.Tensor((NT, HV, 4 if l2norm else 2, BT), acc) if inverse_only and (l2norm or gate_rows) else None,
        yq=T.Tensor((L, H, K), dtype) if normalise else None,
        yk=T.Tensor((L, H, K), dtype) if normalise else None,
        rq=T.Tensor((L, H), acc) if normalise else None,
        rk=T.Tensor((L, H), acc) if normalise else None,
        gs=T.Tensor((L, HV), acc) if g_scan and not inverse_only else None,
        grows=T.Tensor((NT, HV, BT), acc) if g_scan and not inverse_only else None,
    )


def chunk_delta_wy_bwd(*, K: int, V: int, dtype: str, BT: int = 64, threads: int | None = None, BVH: int = 64,
                       tma_loads: bool = True, tma_stores: bool = True, dvb_once: bool = False, t_regs: bool = False,
                       l2norm: bool = False, dg_sum: bool = False, lo: bool = True, g_rows: bool = False):
    """The WY preparation's VJP, one program per (chunk, value head), given the forward's `T`:
    from `du` (input dtype; the consumer's gradient of v_new) and the chunk's state `h` to `dk`
    (per value head: the caller sums a group; the consumer's `dk0` added, so that neither takes a
    float32 round trip) and `dv` (input dtype), `dG`, `dbeta` (float32). First
    `dw = -du h^T` (`v_new = u - w h`), rounded to the input dtype, over value blocks of `BVH`
    (an XLA matmul and a float32 round trip before). With `s = beta exp(G)`:
    `dkb = T^T dw`, `dvb = T^T du`, `dT = (dw k^T) Diag(s) + (du v^T) Diag(beta)`,
    `dA = -T^T dT T^T` (strictly lower part), `dkk = dA * exp(G_i - G_j) beta_i`,
    `dk = dk0 + dkb s + dkk k + dkk^T k`, `dv = dvb beta`,
    `dbeta = exp(G) rowsum(dkb k) + rowsum(dvb v) + rowsum(dA * exp(G_i - G_j) * K K^T)`,
    `dG = s rowsum(dkb k) + rowsum(P) - colsum(P)` with `P = dkk * K K^T`.
    Float32 matrices enter the tensor cores as hi + lo input-dtype halves (`hi lo'` products of
    both halves where both operands are float32, lo * lo dropped).
    `tma_loads`: every input by TMA, in flight from the start (du and the first block of h first
    in line, then k, v, T; dk0 once dw's buffer is spent); `tma_stores`: dk, dv through the spent
    k and v tiles, stored by TMA (`x_wy_bwd_sync`: each thread loads and stores its part, the
    default before). `dvb_once`: `dvb = T^T du` formed once (dv written to the spent du tile
    before the row sums of `dvb v` take the accumulator) instead of twice; the same values
    (`x_wy_bwd_once`: 0.442 / 0.441 against 0.457 / 0.429 ms at 4,4096,16,128 / 2,8192,16,128 bf16,
    H200, 2026-12-03). `t_regs`: T loaded through the registers straight into its halves and P
    transposed for its column sums through X's spent halves (hi + lo) instead of T's float32
    tile: 99.6 KB of shared memory against 115.7 at K = V = 128, so two programs share an SM
    (at K = 64 66.8 KB against 82.9, three programs against two; dispatched at K <= 128: 0.336 against
    0.457 ms at 4,4096,16,128 bf16, H200, 2026-12-03).
    `l2norm` (`use_qk_l2norm_in_kernel`; k is the normalised `y = x r`): one more input, `rk [L, H]`
    (float32 `r = 1 / |x|` of the raw k), and dk is the raw k's gradient `r (dk - y sum(dk y))`
    (linear in dk, so per value head before the caller sums a group).
    `dg_sum`: one more input, `dg0 [L, HV]` (float32, the consumer's gradient of G), and dg is the
    gradient of the gates per step: the reverse in-chunk cumulative sum of `dg0 + dG` by one warp
    (`kernels.common.scan_store(reverse=True)`), in place of XLA's add and reverse sum.
    `lo=False`: the products take the float32 matrices' hi halves alone (T and the matrices formed
    from dT rounded to the input dtype once, as fla's `prepare_wy_repr_bwd` takes its bf16 A): 12
    tensor-core products a program instead of 21 (`t_regs`, not `dvb_once`); the sums as before.
    G, beta and r are loaded by each thread before dw's product (after it before 2026-12-04), so
    that their latency runs beside the TMA loads': `wy_bwd_l2` 0.304 against 0.316 ms at
    4,4096,16,128 bf16 on an H200 (`wy_bwd` 0.286 either way). (The chunk's whole h in one load and
    dw in one product, `BVH = V`, measured 0.288 against 0.285 ms: not kept.)
    (Tried, 2026-12-05: each step's independent products issued as one group of tensor-core
    operations with one wait for all, jla's `_products`, 21 waits a program become 9, through
    `T.gemm(..., annotations={"wg_wait": -1})` and `T.warpgroup_fence_operand` on the accumulators
    read after the group's wait: 0.299 against 0.301 ms at 4,4096,16,128, the same bits; not kept.)
    `g_rows`: G, beta (and r) as per-chunk rows (`[NT, HV, BT]`, r `[NT, H, BT]`), loaded by TMA
    with k and v, not by each thread: Nsight Compute of `wy_bwd_l2` at 4,4096,16,128 (H100,
    2026-12-05) found 12 % of its stall samples at the shared stores waiting on those column loads
    (4-byte elements HV apart), at 12 % occupancy."""
    if g_rows and (dg_sum or not tma_loads):
        raise ValueError("chunk_delta_wy_bwd: g_rows is written for tma_loads, without dg_sum")
    L, H, HV, NT = T.dynamic("L, H, HV, NT")
    gshape, rshape = ((NT, HV, BT), (NT, H, BT)) if g_rows else ((L, HV), (L, H))  # G and beta; r
    acc = "float32"
    threads = threads or (256 if max(K, V) > 128 else 128)

    split = _hi_lo(BT, dtype, scaled=False)

    @T.macro
    def body(k, v, g, beta, t, h, du, dk0, rk, dk, dv, dg, dbeta, dg0=None):
        with T.Kernel(NT, HV, threads=threads) as (ic, ihv):
            ih = ihv // (HV // H)
            t0 = ic * BT
            k_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, V), dtype)
            dw_s = T.alloc_shared((BT, K), dtype)
            du_s = T.alloc_shared((BT, V), dtype)
            t_s = None if t_regs else T.alloc_shared((BT, BT), acc)
            th_s = T.alloc_shared((BT, BT), dtype)  # T = th + tl
            tl_s = T.alloc_shared((BT, BT), dtype)
            xh_s = T.alloc_shared((BT, BT), dtype)  # halves of dT, then of dT T^T, then of dkk
            xl_s = T.alloc_shared((BT, BT), dtype)
            g_s = T.alloc_shared((BT,), acc)
            b_s = T.alloc_shared((BT,), acc)
            rk_s = T.alloc_shared((BT,), acc) if l2norm else None
            rb_s = T.alloc_shared((BT,), acc)  # row sums of dA * E * KK^T (dbeta)
            rg_s = T.alloc_shared((BT,), acc)  # row sums - column sums of P (dG)
            rv_s = T.alloc_shared((BT,), acc)  # row sums of dvb * v
            if dg_sum:
                d0_s = T.alloc_shared((BT,), acc)  # dg0, then the sums of dg0 + dG
                sd_s = T.alloc_shared((BT,), acc)  # dg0 + dG
                da = T.alloc_local((4,), acc)
            acc_c = T.alloc_fragment((BT, BT), acc)
            acc_c2 = T.alloc_fragment((BT, BT), acc)
            acc_kk = T.alloc_fragment((BT, BT), acc)
            row = T.alloc_fragment((BT,), acc)
            col = T.alloc_fragment((BT,), acc)
            vrow = T.alloc_fragment((BT,), acc)
            acc_v = T.alloc_fragment((BT, V), acc)
            acc_k = T.alloc_fragment((BT, K), acc)
            acc_k2 = T.alloc_fragment((BT, K), acc)
            krow = T.alloc_fragment((BT,), acc)
            dub_s = None if tma_loads else T.alloc_shared((BT, BVH), dtype)  # (TMA: dw reads du_s in place)
            hb_s = T.alloc_shared((K, BVH), dtype)

            if tma_loads:  # every load in flight from the start: the first dw block (1, first in line); k, v, du, T (0); dk0 (2)
                full = T.alloc_barrier([1] * 3)
                T.tma_copy(du[t0 : t0 + BT, ihv, 0:V], du_s, barrier=full[1])
                T.tma_copy(h[ic, ihv, 0:K, 0:BVH], hb_s, barrier=full[1])
                arrive_once(full, 1)
                T.tma_copy(k[t0 : t0 + BT, ih, 0:K], k_s, barrier=full[0])
                T.tma_copy(v[t0 : t0 + BT, ihv, 0:V], v_s, barrier=full[0])
                if not t_regs:
                    T.tma_copy(t[ic, ihv, 0:BT, 0:BT], t_s, barrier=full[0])
                if g_rows:  # (first read after full[0]'s wait)
                    T.tma_copy(g[ic, ihv, 0:BT], g_s, barrier=full[0])
                    T.tma_copy(beta[ic, ihv, 0:BT], b_s, barrier=full[0])
                    if l2norm:
                        T.tma_copy(rk[ic, ih, 0:BT], rk_s, barrier=full[0])
                arrive_once(full, 0)
            if not g_rows:  # G, beta (and r) by each thread: before dw's product, so that their latency runs beside the TMA loads'
                T.copy(g[t0 : t0 + BT, ihv], g_s, disable_tma=True)
                T.copy(beta[t0 : t0 + BT, ihv], b_s, disable_tma=True)
                if l2norm:
                    T.copy(rk[t0 : t0 + BT, ih], rk_s, disable_tma=True)
            if dg_sum:
                T.copy(dg0[t0 : t0 + BT, ihv], d0_s, disable_tma=True)
            # dw = -du h^T
            T.clear(acc_k)
            for vb in T.serial(V // BVH):
                if tma_loads:
                    if vb > 0:
                        T.sync_threads()  # the previous block's product has read dub_s and hb_s
                        T.tma_copy(h[ic, ihv, 0:K, vb * BVH : (vb + 1) * BVH], hb_s, barrier=full[1])
                        arrive_once(full, 1)
                    T.barrier_wait(full[1], vb % 2)
                    T.gemm(du_s[0:BT, vb * BVH : (vb + 1) * BVH], hb_s, acc_k, transpose_B=True)
                else:
                    T.copy(du[t0 : t0 + BT, ihv, vb * BVH : (vb + 1) * BVH], dub_s)
                    T.copy(h[ic, ihv, 0:K, vb * BVH : (vb + 1) * BVH], hb_s)
                    T.gemm(dub_s, hb_s, acc_k, transpose_B=True)
            for a, b in T.Parallel(BT, K):
                dw_s[a, b] = T.cast(-acc_k[a, b], dtype)
            if not tma_loads:
                T.copy(k[t0 : t0 + BT, ih, 0:K], k_s)
                T.copy(v[t0 : t0 + BT, ihv, 0:V], v_s)
                T.copy(du[t0 : t0 + BT, ihv, 0:V], du_s)
            if tma_loads:
                T.barrier_wait(full[0], 0)
            if t_regs:  # T through the registers into its halves
                T.copy(t[ic, ihv, 0:BT, 0:BT], acc_c)
                split(acc_c, None, th_s, tl_s)
            else:
                if not tma_loads:
                    T.copy(t[ic, ihv, 0:BT, 0:BT], t_s)
                split(t_s, None, th_s, tl_s)
            # dT = (dw k^T) Diag(s) + (du v^T) Diag(beta), exact products
            T.clear(acc_c)
            T.gemm(dw_s, k_s, acc_c, transpose_B=True)
            T.clear(acc_c2)
            T.gemm(du_s, v_s, acc_c2, transpose_B=True)
            for a, b in T.Parallel(BT, BT):
                acc_c[a, b] = acc_c[a, b] * b_s[b] * T.exp(g_s[b]) + acc_c2[a, b] * b_s[b]
            split(acc_c, None, xh_s, xl_s)
            # X = dT T^T
            T.clear(acc_c)
            T.gemm(xh_s, th_s, acc_c, transpose_B=True)
            if lo:
                T.gemm(xh_s, tl_s, acc_c, transpose_B=True)
                T.gemm(xl_s, th_s, acc_c, transpose_B=True)
            split(acc_c, None, xh_s, xl_s)
            # dA = -T^T X, strictly lower
            T.clear(acc_c)
            T.gemm(th_s, xh_s, acc_c, transpose_A=True)
            if lo:
                T.gemm(th_s, xl_s, acc_c, transpose_A=True)
                T.gemm(tl_s, xh_s, acc_c, transpose_A=True)
            T.clear(acc_kk)
            T.gemm(k_s, k_s, acc_kk, transpose_B=True)
            for a, b in T.Parallel(BT, BT):  # Q = dA * E * KK^T
                acc_c2[a, b] = T.if_then_else(a > b, -acc_c[a, b] * T.exp(g_s[a] - g_s[b]) * acc_kk[a, b], 0.0)
            T.reduce_sum(acc_c2, row, dim=1)
            for a in T.Parallel(BT):
                rb_s[a] = row[a]
            for a, b in T.Parallel(BT, BT):  # P = Q beta_i
                acc_c2[a, b] = acc_c2[a, b] * b_s[a]
            T.reduce_sum(acc_c2, row, dim=1)
            if t_regs:  # P, transposed through the spent halves of X
                split(acc_c2, None, xh_s, xl_s)
                for a, b in T.Parallel(BT, BT):
                    acc_c2[a, b] = T.cast(xh_s[b, a], acc) + T.cast(xl_s[b, a], acc)
            else:  # P, transposed through shared memory for its column sums
                T.copy(acc_c2, t_s)
                for a, b in T.Parallel(BT, BT):
                    acc_c2[a, b] = t_s[b, a]
            T.reduce_sum(acc_c2, col, dim=1)
            for a in T.Parallel(BT):
                rg_s[a] = row[a] - col[a]
            for a, b in T.Parallel(BT, BT):  # dkk = dA * E * beta_i
                acc_c[a, b] = T.if_then_else(a > b, -acc_c[a, b] * T.exp(g_s[a] - g_s[b]) * b_s[a], 0.0)
            split(acc_c, None, xh_s, xl_s)
            # dvb = T^T du; dv = dvb beta
            T.clear(acc_v)
            T.gemm(th_s, du_s, acc_v, transpose_A=True)
            if lo:
                T.gemm(tl_s, du_s, acc_v, transpose_A=True)
            if dvb_once:  # dv into the spent du tile first, then the row sums take the product
                T.sync_threads()  # every warp's share of the product has read du_s
                for a, b in T.Parallel(BT, V):
                    du_s[a, b] = T.cast(acc_v[a, b] * b_s[a], dtype)
            for a, b in T.Parallel(BT, V):
                acc_v[a, b] = acc_v[a, b] * T.cast(v_s[a, b], acc)
            T.reduce_sum(acc_v, vrow, dim=1)
            for a in T.Parallel(BT):
                rv_s[a] = vrow[a]
            if dvb_once:
                T.copy(du_s, dv[t0 : t0 + BT, ihv, 0:V], disable_tma=not tma_stores)
            else:  # the product again
                T.clear(acc_v)
                T.gemm(th_s, du_s, acc_v, transpose_A=True)
                if lo:
                    T.gemm(tl_s, du_s, acc_v, transpose_A=True)
                for a, b in T.Parallel(BT, V):
                    acc_v[a, b] = acc_v[a, b] * b_s[a]
                if tma_stores:  # through the spent v tile, whole rows per store
                    T.sync_threads()
                    T.copy(acc_v, v_s)
                    T.copy(v_s, dv[t0 : t0 + BT, ihv, 0:V])
                else:
                    T.copy(acc_v, dv[t0 : t0 + BT, ihv, 0:V])
            # dkb = T^T dw; dk = dkb s + dkk k + dkk^T k
            T.clear(acc_k)
            T.gemm(th_s, dw_s, acc_k, transpose_A=True)
            if lo:
                T.gemm(tl_s, dw_s, acc_k, transpose_A=True)
            if tma_loads:  # dw_s is free: it takes dk0, in flight while the rest is formed
                T.sync_threads()
                T.tma_copy(dk0[t0 : t0 + BT, ihv, 0:K], dw_s, barrier=full[2])
                arrive_once(full, 2)
            else:
                T.copy(dk0[t0 : t0 + BT, ihv, 0:K], dw_s)
            for a, b in T.Parallel(BT, K):
                acc_k2[a, b] = acc_k[a, b] * T.cast(k_s[a, b], acc)
            T.reduce_sum(acc_k2, krow, dim=1)
            for a in T.Parallel(BT):
                dbeta[t0 + a, ihv] = T.exp(g_s[a]) * krow[a] + rv_s[a] + rb_s[a]
                if dg_sum:  # (summed over the chunk's later steps at the end; threads sharing a row write the same value)
                    sd_s[a] = d0_s[a] + b_s[a] * T.exp(g_s[a]) * krow[a] + rg_s[a]
                else:
                    dg[t0 + a, ihv] = b_s[a] * T.exp(g_s[a]) * krow[a] + rg_s[a]
            for a, b in T.Parallel(BT, K):
                acc_k[a, b] = acc_k[a, b] * b_s[a] * T.exp(g_s[a])
            T.gemm(xh_s, k_s, acc_k)
            if lo:
                T.gemm(xl_s, k_s, acc_k)
            T.gemm(xh_s, k_s, acc_k, transpose_A=True)
            if lo:
                T.gemm(xl_s, k_s, acc_k, transpose_A=True)
            if tma_loads:
                T.barrier_wait(full[2], 0)
            for a, b in T.Parallel(BT, K):
                acc_k[a, b] += T.cast(dw_s[a, b], acc)
            if l2norm:  # the raw k's gradient, r (dk - y sum(dk y))
                for a, b in T.Parallel(BT, K):
                    acc_k2[a, b] = acc_k[a, b] * T.cast(k_s[a, b], acc)
                T.reduce_sum(acc_k2, krow, dim=1)
                for a, b in T.Parallel(BT, K):
                    acc_k[a, b] = rk_s[a] * (acc_k[a, b] - T.cast(k_s[a, b], acc) * krow[a])
            if tma_stores:  # through the spent k tile
                T.sync_threads()
                T.copy(acc_k, k_s)
                T.copy(k_s, dk[t0 : t0 + BT, ihv, 0:K])
            else:
                T.copy(acc_k, dk[t0 : t0 + BT, ihv, 0:K])
            if dg_sum:  # the gates' gradient per step, summed by the first warp (of each warpgroup: the same values)
                scan_fetch(lambda step: sd_s[step], da)
                scan_store(da, d0_s, (), reverse=True)
                for a in T.Parallel(BT):
                    dg[t0 + a, ihv] = d0_s[a]

    return program(body, k=T.Tensor((L, H, K), dtype), v=T.Tensor((L, HV, V), dtype), g=T.Tensor(gshape, acc),
                   beta=T.Tensor(gshape, acc), t=T.Tensor((NT, HV, BT, BT), acc), h=T.Tensor((NT, HV, K, V), dtype),
                   du=T.Tensor((L, HV, V), dtype), dk0=T.Tensor((L, HV, K), dtype),
                   dg0=T.Tensor((L, HV), acc) if dg_sum else None, rk=T.Tensor(rshape, acc) if l2norm else None,
                   dk=T.Tensor((L, HV, K), dtype), dv=T.Tensor((L, HV, V), dtype), dg=T.Tensor((L, HV), acc),
                   dbeta=T.Tensor((L, HV), acc))
