"""`use_qk_l2norm_in_kernel` in TileLang: the L2 normalisation of q and k and its gradient, one
pass each (XLA took a reduction and an elementwise pass per tensor and direction: 0.34 ms of a
GDN training step at 4,4096,16,128 on an H200, 2026-12-03).

Rows `x [R, H, K]` (R = batch x time, any count), one program per (64 rows, head), a whole row
of K channels in registers:

* `l2norm_fwd`: `r = 1 / sqrt(sum(x^2) + 1e-6)` (float32, `[R, H]`) and `y = x r` (input dtype);
* `l2norm_bwd`: from y (as `l2norm_fwd` wrote it), r and the gradient of y,
  `dx = r (dy - y sum(dy y))` (input dtype). (It took the raw x and formed `y = x r` in float32
  before 2026-12-04; the backward kernels that fold this gradient in read the stored y, so the
  op keeps y, not x.)

`tma_loads` (the default): the rows by TMA on an mbarrier; each thread loaded its part and
waited for it before (`l2norm_fwd` 0.077 → 0.054 ms per tensor at 4,4096,16,128 bf16, H200,
2026-12-03).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.
import tilelang.language as T

from kernels.common import arrive_once


def l2norm_fwd(*, K: int, V: int, dtype: str, BT: int = 64, threads: int | None = None, tma_loads: bool = True):
    del V
    threads = threads or (256 if K > 128 else 128)
    R, H = T.dynamic("R, H")
    acc = "float32"

    @T.prim_func
    def main(
        x: T.Tensor((R, H, K), dtype),
        y: T.Tensor((R, H, K), dtype),
        r: T.Tensor((R, H), acc),
    ):
        with T.Kernel(T.ceildiv(R, BT), H, threads=threads) as (ib, ih):
            x_s = T.alloc_shared((BT, K), dtype)
            xf = T.alloc_fragment((BT, K), acc)
            sq = T.alloc_fragment((BT, K), acc)
            ss = T.alloc_fragment((BT,), acc)
            if tma_loads:  # (each thread loaded its part and waited for it before)
                full = T.alloc_barrier([1])
                T.tma_copy(x[ib * BT : (ib + 1) * BT, ih, 0:K], x_s, barrier=full[0])
                arrive_once(full, 0)
                T.barrier_wait(full[0], 0)
            else:
                T.copy(x[ib * BT : (ib + 1) * BT, ih, 0:K], x_s)
            T.copy(x_s, xf)
            for a, b in T.Parallel(BT, K):
                sq[a, b] = xf[a, b] * xf[a, b]
            T.reduce_sum(sq, ss, dim=1)
            for a in T.Parallel(BT):
                ss[a] = T.rsqrt(ss[a] + 1e-6)
            for a, b in T.Parallel(BT, K):
                x_s[a, b] = T.cast(xf[a, b] * ss[a], dtype)
            T.copy(x_s, y[ib * BT : (ib + 1) * BT, ih, 0:K])
            for a in T.Parallel(BT):
                if ib * BT + a < R:
                    r[ib * BT + a, ih] = ss[a]

    return main


def l2norm_bwd(*, K: int, V: int, dtype: str, BT: int = 64, threads: int | None = None, tma_loads: bool = True):
    del V
    threads = threads or (256 if K > 128 else 128)
    R, H = T.dynamic("R, H")
    acc = "float32"

    @T.prim_func
    def main(
        y: T.Tensor((R, H, K), dtype),
        r: T.Tensor((R, H), acc),
        dy: T.Tensor((R, H, K), dtype),
        dx: T.Tensor((R, H, K), dtype),
    ):
        with T.Kernel(T.ceildiv(R, BT), H, threads=threads) as (ib, ih):
            y_s = T.alloc_shared((BT, K), dtype)
            dy_s = T.alloc_shared((BT, K), dtype)
            r_s = T.alloc_shared((BT,), acc)
            yf = T.alloc_fragment((BT, K), acc)
            dyf = T.alloc_fragment((BT, K), acc)
            prod = T.alloc_fragment((BT, K), acc)
            s = T.alloc_fragment((BT,), acc)
            if tma_loads:  # both in flight at once, beside r
                full = T.alloc_barrier([1])
                T.tma_copy(y[ib * BT : (ib + 1) * BT, ih, 0:K], y_s, barrier=full[0])
                T.tma_copy(dy[ib * BT : (ib + 1) * BT, ih, 0:K], dy_s, barrier=full[0])
                arrive_once(full, 0)
            else:
                T.copy(y[ib * BT : (ib + 1) * BT, ih, 0:K], y_s)
                T.copy(dy[ib * BT : (ib + 1) * BT, ih, 0:K], dy_s)
            T.copy(r[ib * BT : (ib + 1) * BT, ih], r_s, disable_tma=True)
            if tma_loads:
                T.barrier_wait(full[0], 0)
            T.copy(dy_s, dyf)
            for a, b in T.Parallel(BT, K):
                yf[a, b] = T.cast(y_s[a, b], acc)
                prod[a, b] = yf[a, b] * dyf[a, b]
            T.reduce_sum(prod, s, dim=1)
            for a, b in T.Parallel(BT, K):
                dy_s[a, b] = T.cast(r_s[a] * (dyf[a, b] - yf[a, b] * s[a]), dtype)
            T.copy(dy_s, dx[ib * BT : (ib + 1) * BT, ih, 0:K])

    return main
