"""The one declared list of kernel variants: build.py builds it (through `kernels.variants`), the
Python dispatch looks kernels up in it, and the FFI target names come from it.

This module imports no TileLang (only `Program.prim_func`, which the build alone calls, imports the
TileLang programs of `kernels/`): the runtime reads it, and an installed wheel has no `kernels`.
"""

import dataclasses
import importlib
from typing import Final, Literal

DTYPES: Final = {"bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Program:
    """One TileLang program of a variant: `kernels.<module>.<builder>(**config)` returns its
    `T.prim_func`; `outputs` names the buffers it writes (the FFI results, in this order)."""

    name: str
    module: str
    builder: str
    outputs: tuple[str, ...]
    config: tuple[tuple[str, int | bool], ...] = ()  # kernel config overrides (block sizes, threads, stages)
    of: str = ""  # an experiment: the dispatched program it stands in for (same inputs and outputs)
    dims: tuple[int, ...] = ()  # the head dims K it is built for (all when empty)

    @property
    def kind(self) -> str:
        """The dispatched program this one computes: its own name, or that of the one it stands in for."""
        return self.of or self.name

    def prim_func(self, variant: "Variant"):
        mod = importlib.import_module(f"kernels.{self.module}")
        kw = dict(K=variant.head_k, V=variant.head_v, dtype=DTYPES[variant.dtype], BT=variant.chunk, **dict(self.config))
        return getattr(mod, self.builder)(**kw)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    op: str
    direction: Literal["fwd", "bwd"]
    dtype: Literal["bf16", "fp16"]
    head_k: int
    head_v: int
    chunk: int = 64

    @property
    def symbol(self) -> str:
        return f"fla_{self.op}_{self.direction}_{self.dtype}_k{self.head_k}_v{self.head_v}_c{self.chunk}"

    @property
    def programs(self) -> tuple[Program, ...]:
        """The dispatched programs: what the default build holds and the runtime needs."""
        return tuple(p for p in PROGRAMS[(self.op, self.direction)] if not p.dims or self.head_k in p.dims)

    @property
    def experiments(self) -> tuple[Program, ...]:
        """Alternative configs declared for this variant (`EXPERIMENTS`): built by `build.py --experiments` only."""
        return tuple(p for p in EXPERIMENTS.get((self.op, self.direction, self.dtype, self.head_k), ())
                     if not p.dims or self.head_k in p.dims)

    @property
    def declared(self) -> tuple[Program, ...]:
        """Every program declared for this variant, dispatched and experimental."""
        return self.programs + self.experiments

    def target(self, program: Program) -> str:
        """The FFI target name of one program of this variant."""
        return f"{self.symbol}_{program.name}"


# the consumer at K = V = 64 (one V block: its loads have nothing to overlap) without warp
# specialization, one load stage, 128 threads: 0.138 against 0.231 ms for the warp-specialized
# program (simple GLA; delta rules' v_new 0.141 against 0.237) at 8,2048,16,64 bf16, H200, 2026-12-03
FLAT_64: Final = (("stages", 1), ("specialized", False))
# and at K = 128 in V blocks of 32 with two load stages (111.6 KB of shared memory, 226 registers
# at 128 threads: two programs per SM where the warp-specialized one, 256 threads at 240 registers,
# fits one). H200, bf16, 2026-12-03, ms at 4,4096,16,128 / 2,8192,16,128: with one stage 0.375 /
# 0.357 against 0.426 / 0.405 (warp-specialized) on the delta rules' v_new, simple GLA 0.352 / 0.386
# against 0.418 / 0.431; with two (a later call, on a slower GPU) 0.341 / 0.315 against one stage's
# 0.397 / 0.387 (delta), 0.309 / 0.346 against 0.387 / 0.378 (simple GLA)
FLAT_BV32: Final = (("stages", 2), ("specialized", False), ("BV", 32))
# the delta rules' reverse pass stores du (the gradient of v_new, formed on its chain), and their
# consumer forms dq, dk, dg only (neither Q K^T nor the two products per V block that formed du again)
DU: Final = (("store_du", True),)
NO_DV: Final = (("delta", True), ("no_dv", True))
# the delta rules' training passes (the forward storing h, the reverse pass) at K <= 128 take G as per-chunk
# rows `[NT, HV, C]` and load them by TMA with the stage (each loading thread's load of a column delayed it)
G_ROWS: Final = (("g_rows", True),)
# the gates per step, summed within each chunk by one warp of the program (`kernels.common.scan_store`): in the
# forward with no gradient XLA's cumulative sum and, for simple GLA, its transpose to rows go (simple GLA's `fused`
# at K <= 128 since 2026-12-05; the delta rules' inverse as the experiments x_inv_scan, x_inv_l2_scan: 0.0904
# against 0.0893 ms for `inv_l2` at 4,4096,16,128 on an H100, the op's gain within the noise between processes)
G_SCAN: Final = (("g_scan", True),)
# under a gradient (built 2026-12-05; the same values as the dispatched programs on an H100 the same day): the delta
# rules' training WY kernel summing the gates per step and writing G and its rows (`x_wy_t_l2_scan`: XLA's cumulative
# sum and transpose go; at K = 256, where `wy_t_l2` is not dispatched, it also takes the two `norm` passes' place), and
# their WY VJP adding the consumer's gradient of G to its own and summing it back to the gates per step
# (`x_wy_bwd_l2_sum`: XLA's add and reverse cumulative sum go)
WY_T_L2_SCAN_OUTPUTS: Final = ("w", "u", "t", "yq", "yk", "rq", "rk", "gs", "grows")
DG_SUM: Final = (("dg_sum", True),)
# the forward state passes' chain warpgroup forms exp(G_C - G) once per row of v (v_new) rather than once per element
# (the same bits): the delta rules' forward storing h 0.173 -> 0.156 ms at 4,4096,16,128 (with G_ROWS; 0.170 with
# G_ROWS alone), 0.309 -> 0.257 at 2,8192,16,128; at K = 256 `fused` 0.436 -> 0.400, `fused_h` 0.464 -> 0.451;
# simple GLA's `fused` 0.101 -> 0.095 (bf16, H200, 2026-12-04, ten launches a sample, old and new in one call)
ROW_FACTORS: Final = (("row_factors", True),)
# the inverse alone, writing G and beta as rows of `gr` (and with use_qk_l2norm_in_kernel 1 / |q|, 1 / |k|)
INV: Final = (("inverse_only", True), ("gate_rows", True))
INV_L2: Final = (*INV, ("l2norm", True))
# the training forward's WY kernel from the raw q and k (use_qk_l2norm_in_kernel), storing T
WY_T_L2: Final = (("store_t", True), ("l2norm", True))
# the inverse alone held to the registers that let eight programs share an SM (`min_blocks`)
MB8: Final = (("min_blocks", 8),)

PROGRAMS: Final[dict[tuple[str, str], tuple[Program, ...]]] = {
    ("simple_gla", "fwd"): (
        # two output warpgroups on alternate chunks (chunk_fwd_2out) where they measured faster: the
        # forward at K = 64 and 128, the forward under a gradient (storing h) at K = 128; with three load
        # stages (0.073 against 0.089 ms with two at 8,2048,16,64 bf16, H200, 2026-12-03; at K = 128
        # 0.1004 / 0.1823 against 0.1025 / 0.1844 at 4,4096,16,128 / 2,8192,16,128, 2026-12-04, ten
        # launches a sample, interleaved)
        # Since 2026-12-05 summing the gates per step itself (G_SCAN, by one warp of the loading warpgroup): 0.1721
        # against 0.1842 ms with G's rows by TMA at 4,4096,16,128 (bf16, H100, ten launches a sample, interleaved),
        # and XLA's cumulative sum and transpose go (the op's forward 0.202 -> 0.186 ms with ZERO_ROW_H0 too)
        # With the state in registers again (kernels.common.initial_state: a branch around h0's load had put it in local
        # memory, 768 bytes a thread, in every warp-specialized state pass): 0.1712 -> 0.1164 ms at 4,4096,16,128
        # (0.0661 -> 0.0644 at 8,2048,16,64; bf16, H100, 2026-12-05, ten launches a sample, interleaved)
        # Since the twenty-sixth session G's rows by TMA again: with the chain no longer the bound, the gate scan was (the
        # loading warpgroup's TMA-issuing warp waits out the gates' load and the scan before the next chunk's loads, and
        # every consumer waited on `full`: 70 % of DRAM's bandwidth by Nsight Compute); rows 0.1040 / 0.1682 / 0.0574 ms
        # against the scan's 0.1200 / 0.1868 / 0.0622 at 4,4096,16,128 / 2,8192,16,128 / 8,2048,16,64, the op's forward
        # with XLA's cumulative sum and transpose 0.117 / 0.187 / 0.078 against 0.127 / 0.199 / 0.083 (bf16, H100)
        Program(name="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_ROWS, ("stages", 3), *ROW_FACTORS), dims=(64, 128)),
        Program(name="fused", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "ht"), dims=(256,), config=G_ROWS),
        # (with ROW_FACTORS 0.134 against 0.125 ms at 4,4096,16,128 bf16, H200, 2026-12-04: not taken here)
        Program(name="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True)), dims=(128,)),
        Program(name="fused_h", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "h", "ht"), config=(("g_rows", True), ("store_h", True),),
                dims=(64, 256)),
        # the forward split into pieces (SPLIT_PROGRAMS): what the pieces' entering states add to o, in place
        Program(name="enter", module="simple_gla.fwd", builder="chunk_fwd_enter", outputs=("o",)),
    ),
    ("delta", "fwd"): (
        # use_qk_l2norm_in_kernel: q and k normalised in one pass each (r = 1 / |x|, for the backward)
        Program(name="norm", module="delta.norm", builder="l2norm_fwd", outputs=("y", "r")),
        Program(name="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u")),
        Program(name="wy_t", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t"), config=(("store_t", True),)),
        # and under a gradient with use_qk_l2norm_in_kernel (at K <= 128) from the raw q and k: r = 1 / |x| read off
        # the diagonals of K K^T and Q Q^T, the normalised y = x r and r written for the passes after it (no `norm`)
        # with G and beta as per-chunk rows by TMA with k (`g_rows`, since the twenty-eighth session; G's rows formed before
        # it, for it, the state pass and the backward): 0.2255 / 0.2269 / 0.1521 ms against 0.2378 / 0.2385 / 0.1584 at
        # 4,4096,16,128 / 2,8192,16,128 / 8,2048,16,64 (bf16, H100, 2026-12-05, ten launches a sample, interleaved; the
        # same bits), GDN's training step 0.997x / 0.987x / 0.978x
        Program(name="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t", "yq", "yk", "rq", "rk"),
                config=(*WY_T_L2, *G_ROWS), dims=(64, 128)),
        Program(name="fused", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"), config=ROW_FACTORS),
        # (at K <= 128 with G as per-chunk rows `[NT, HV, C]`, loaded by TMA with the stage: `G_ROWS`; and
        # warpgroup 0's exp(G_C - G) once per row)
        Program(name="fused_h", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "h", "ht"),
                config=(("store_h", True), *G_ROWS, *ROW_FACTORS), dims=(64, 128)),
        Program(name="fused_h", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "h", "ht"),
                config=(("store_h", True), *ROW_FACTORS), dims=(256,)),
        # the chain alone (`states_only`: no q loaded, o and v_new left unwritten, the output warpgroup idle) for the
        # passes over pieces of a sequence that carry states under a gradient (`fla_jax._tilelang.delta.carry_pass`):
        # from zero states, and the map of an identity state that the backward shares
        Program(name="fused_s", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"),
                config=(("states_only", True), *G_ROWS, *ROW_FACTORS), dims=(64, 128)),
        # the forward with no gradient under DELTA_FWD_INVERSE: the gate-free inverse alone, then a state
        # pass that forms v_new from it with no w and u (jla's fused_fwd_wy)
        # (at K <= 128 also writing G and beta as the rows of `gr [NT, HV, 2, C]`, which the state pass loads by
        # TMA with its stage instead of as columns by the loading warpgroup's threads)
        Program(name="inv", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=INV),
        # with a fourth warpgroup forming the decay matrix, Ag and P (`prep`) at K <= 128: 0.175 / 0.345 ms
        # against 0.193 / 0.385 in three warpgroups at 4,4096,16,128 / 2,8192,16,128 (bf16, H200,
        # 2026-12-04, ten launches a sample, interleaved), the same bits; at K = 256 the state's registers
        # leave no room for it. Warpgroup 0 carrying S^T (`transposed`: its three GEMMs' left operands
        # from registers, nothing on the chain waiting for a tile it wrote): 0.164 / 0.276 / 0.0857 ms
        # against 0.177 / 0.340 / 0.0873 with S (`x_fused_t_prep`) at those shapes and 8,2048,16,64, the
        # same bits (2026-12-04). (With three warpgroups, 2026-12-03, S^T gained nothing: the output
        # warpgroup bounded that pass.)
        Program(name="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("transposed", True), ("col_factors", True)), dims=(64, 128)),
        # At K = 256 (where DELTA_FWD_INVERSE does not take it yet) in three warpgroups with one published tile each of
        # S^T and v_new^T and two load stages (jla's `fused_fwd_kb`; `chunk_delta_fwd_t_wide`). (It replaced, unmeasured,
        # `chunk_delta_fwd_t` in three warpgroups with one load stage and S: inv + fused_t 0.052 + 0.359 ms against
        # wy + fused 0.119 + 0.215 at 4,4096,8,256 bf16, H200, 2026-12-04.)
        Program(name="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t_wide", outputs=("o", "ht"), dims=(256,)),
        # where V blocks of 64 leave half the SMs idle (few sequences and heads: `fla_jax._tilelang.delta.state_pass_t`),
        # V blocks of 32, twice the programs, warpgroup 0 carrying S (S^T [32, K] would be no tensor-core
        # GEMM's left operand: M >= 64): 0.231 against 0.256 ms at 2,8192,16,128 (0.232 against 0.135 at
        # 4,4096,16,128, where the programs fill the SMs; bf16, H200, 2026-12-04); with l2norm below
        Program(name="fused_t_v32", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("BV", 32),), dims=(64, 128)),
        # and with use_qk_l2norm_in_kernel from the raw q and k: the inverse reads 1 / |k| off K K^T's diagonal
        # (and 1 / |q| off Q Q^T's) and writes both as two more rows of gr; the state pass scales rows by them
        # (at K = 64 held to 64 registers, eight programs an SM instead of five: 0.078 against 0.082 ms at
        # 8,2048,16,64, ptxas spilling 32 bytes; the same bits. Not so at K = 128, six programs an SM: 0.096
        # against 0.083; nor `inv` at eight: 0.063 / 0.067 against 0.062 / 0.066 at K = 64 / 128; bf16,
        # H200, 2026-12-05)
        Program(name="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=(*INV_L2, *MB8), dims=(64,)),
        Program(name="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=INV_L2, dims=(128, 256)),
        Program(name="fused_t_l2", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("transposed", True), ("l2norm", True), ("col_factors", True)),
                dims=(64, 128)),
        Program(name="fused_t_l2", module="delta.fwd", builder="chunk_delta_fwd_t_wide", outputs=("o", "ht"), config=(("l2norm", True),),
                dims=(256,)),
        # (0.238 against 0.263 at 2,8192,16,128; at K = 64 0.207 against 0.219 at 2,8192,16,64)
        Program(name="fused_t_l2_v32", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("l2norm", True), ("BV", 32)), dims=(64, 128)),
    ),
    ("delta", "bwd"): (
        # warp-specialized at K <= 128; in one warpgroup at K = 256 (two stages would not fit). Each also
        # stores du, the gradient of v_new its chain forms (`store_du`), which the consumer formed again before
        Program(name="dh", module="delta.bwd", builder="chunk_delta_bwd_dh", outputs=("dh", "dh0", "du"), config=(*DU, *G_ROWS),
                dims=(64, 128)),
        Program(name="dh", module="delta.bwd", builder="chunk_delta_bwd_dh_1wg", outputs=("dh", "dh0", "du"), config=DU, dims=(256,)),
        # the simple GLA consumer on v_new, less dv (`no_dv`: the reverse pass stored it): with DELTA_FUSED_BWD (the default).
        # At K <= 128 it takes G (and 1 / |q|) as per-chunk rows by TMA with q and k (`g_rows`, since the twenty-eighth
        # session; G's rows as the training forward kept them), not their columns by each thread: `dqkvg_l2` 0.2809 /
        # 0.2862 / 0.1097 ms against 0.2898 / 0.2944 / 0.1127 at 4,4096,16,128 / 2,8192,16,128 / 8,2048,16,64 (bf16, H100,
        # 2026-12-05, ten launches a sample, interleaved; the same bits); GDN's training step 0.995x / 0.997x / 0.991x
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, *FLAT_64, *G_ROWS), dims=(64,)),
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, *FLAT_BV32, *G_ROWS), dims=(128,)),
        # (at K = 256 as FLAT_BV32, 82.9 KB, two programs per SM: 0.602 ms, with two stages 0.552,
        # against 0.500 at 4,4096,8,256; simple GLA 0.634 against 0.519; bf16, H200, 2026-12-03: not kept)
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("BK", 128)), dims=(256,)),
        # the WY preparation's VJP given T: with DELTA_WY_BWD_KERNEL (the default). At K <= 128 with T
        # through the registers (t_regs: 99.6 KB of shared memory at K = 128, two programs per SM, 66.8
        # KB at 64, three): 0.336 / 0.347 / 0.187 ms against 0.457 / 0.453 / 0.242 at 4,4096,16,128 /
        # 2,8192,16,128 / 8,2048,16,64 bf16 (H200, 2026-12-03); at K = 256 one program per SM either way
        # G, beta (and r) as per-chunk rows by TMA with k and v (`g_rows`, since the twenty-eighth session; G's rows as the
        # training forward kept them), not each chunk's columns by each thread (12 % of the stall samples at the shared
        # stores waiting on them, Nsight Compute at 4,4096,16,128 on an H100): `wy_bwd_l2` 0.3172 / 0.3156 / 0.1591 ms
        # against 0.3422 / 0.3409 / 0.1874 at 4,4096,16,128 / 2,8192,16,128 / 8,2048,16,64 (bf16, H100, 2026-12-05, ten
        # launches a sample, interleaved; the same bits); GDN's training step 0.986x / 1.000x / 0.965x
        Program(name="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("t_regs", True), *G_ROWS), dims=(64, 128)),
        Program(name="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"), dims=(256,)),
        # the normalisation's gradient
        Program(name="norm_bwd", module="delta.norm", builder="l2norm_bwd", outputs=("dx",)),
        # use_qk_l2norm_in_kernel: the consumer and the WY VJP with the normalisation's gradient folded in
        # (one more input each, 1 / |q| and 1 / |k|; dq and dk of the raw q and k), in place of two
        # `norm_bwd` passes. Not at K = 256, where the consumer splits a row's key channels over two programs.
        Program(name="dqkvg_l2", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("l2norm", True), *FLAT_64, *G_ROWS), dims=(64,)),
        Program(name="dqkvg_l2", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("l2norm", True), *FLAT_BV32, *G_ROWS), dims=(128,)),
        Program(name="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("t_regs", True), ("l2norm", True), *G_ROWS), dims=(64, 128)),
        Program(name="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("l2norm", True),), dims=(256,)),
        # the consumer and the WY VJP in one program (`kernels/delta/grads.py`; DELTA_GRADS_KERNEL, at K = 128), K <= 128:
        # the chunk's state, k and the consumer's dk read or formed once (jla's `chunk_grads` layout: three warpgroups, one
        # program per SM). `grads_l2` 0.3725 / 0.3724 ms against `dqkvg_l2` + `wy_bwd_l2` 0.2822 + 0.3257 / 0.2828 + 0.3255
        # at 4,4096,16,128 / 2,8192,16,128, at K = 64 0.2799 against 0.1057 + 0.1630 at 8,2048,16,64 (bf16, H100, 2026-12-05,
        # ten launches a sample, interleaved); P's column sums through dkk's halves once warpgroup 2 has read them
        # (`late_cols`, as the WY VJP), not as row sums of X^T T beside T^T X: 0.3673 / 0.3684 against 0.3717 / 0.3714 ms
        # (`x_grads_l2_xt`; H100, 2026-12-06), the same bits but dG's last places
        Program(name="grads", module="delta.grads", builder="chunk_delta_bwd_grads", outputs=("dq", "dk", "dv", "dg", "dbeta"),
                config=(*G_ROWS, ("late_cols", True)), dims=(64, 128)),
        Program(name="grads_l2", module="delta.grads", builder="chunk_delta_bwd_grads", outputs=("dq", "dk", "dv", "dg", "dbeta"),
                config=(("l2norm", True), *G_ROWS, ("late_cols", True)), dims=(64, 128)),
    ),
    ("simple_gla", "bwd"): (
        # G's rows by TMA at K = 64, 128 (since the twenty-seventh session; the forward under a gradient hands them over,
        # `_stores_gate_rows`), not each chunk's column by the loading warpgroup's threads, whose loads the next chunk's
        # copies waited out (as the forward's gate scan did): 0.1102 / 0.1447 / 0.0577 against 0.1233 / 0.1814 / 0.0619 ms
        # at 4,4096,16,128 / 2,8192,16,128 / 8,2048,16,64 (bf16, H100, 2026-12-05, ten launches a sample, interleaved;
        # the same bits); the training step 0.688 against 0.703, 0.779 against 0.811, 0.309 against 0.311
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=G_ROWS, dims=(64, 128)),
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), dims=(256,)),
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"), config=FLAT_64,
                dims=(64,)),
        # at K = 128 with G as per-chunk rows by TMA (`g_rows`, since the twenty-eighth session): 0.3229 / 0.3247 ms against
        # 0.3287 / 0.3335 at 4,4096,16,128 / 2,8192,16,128 (bf16, H100, 2026-12-05, the same bits), the training step 0.990x /
        # 0.994x at 4,4096,16,128 / 2,8192,16,128; at K = 64 slower (x_dqkvg_rows)
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*FLAT_BV32, *G_ROWS), dims=(128,)),
        # K = 256: two programs per (chunk, head), 128 key channels each; dv and dg in float32 parts
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(("BK", 128),), dims=(256,)),
    ),
    ("gla", "fwd"): (
        # A, G, and the state pass's operands q exp(G), k exp(G_C - G)
        Program(name="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg")),
        Program(name="fused", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "ht")),
        Program(name="fused_h", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "h", "ht"), config=(("store_h", True),)),
    ),
    ("gla", "bwd"): (
        # simple GLA's pass with per-channel gates, from the stored q exp(G)
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=(("channel_gates", True),)),
        Program(name="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"), dims=(64, 128)),
        # K = 256: two programs per (chunk, head), 128 key channels each; dv in float32 parts ([2, L, H, V])
        Program(name="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(("BK", 128),), dims=(256,)),
    ),
}

# Alternative kernel configs declared for one variant only, for benchmarks/bench_kernels.py to compare; the
# dispatch never calls them, and only `build.py --experiments` builds them (the default build, CI and an install
# hold the dispatched programs alone).
EXPERIMENTS: Final[dict[tuple[str, str, str, int], tuple[Program, ...]]] = {
    # GLA's intra-chunk parts without the chunk-wide fast path (every chunk by sub-chunks). The
    # state pass with V blocks of 128 (half the programs, q and k read once: jla's choice when
    # batch x heads > 32), with two stages (three dispatched). The state-gradient pass with V blocks
    # of 32 (twice the programs), and in one warpgroup.
    ("gla", "fwd", "bf16", 128): (
        Program(name="x_fused_bv128", of="fused", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "ht"), config=(("BV", 128),)),
        Program(name="x_fused_h_bv128", of="fused_h", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "h", "ht"),
                config=(("store_h", True), ("BV", 128))),
        Program(name="x_fused_s2", of="fused", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "ht"), config=(("stages", 2),)),
        Program(name="x_fused_h_s2", of="fused_h", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "h", "ht"),
                config=(("store_h", True), ("stages", 2))),
        Program(name="x_a_exact", of="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg"),
                config=(("bounded", False),)),
        Program(name="x_a_nolo", of="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg"),
                config=(("split", False),)),
        Program(name="x_a_inplace", of="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg"),
                config=(("inplace", True),)),
        # q, k and the gates loaded by each thread (the default before)
        Program(name="x_a_sync", of="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg"),
                config=(("tma_loads", False),)),
    ),
    ("gla", "bwd", "bf16", 128): (
        Program(name="x_dqkvg_exact", of="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg",
                outputs=("dq", "dk", "dv", "dg"), config=(("bounded", False),)),
        Program(name="x_dh_bv32", of="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"),
                config=(("channel_gates", True), ("BV", 32))),
        Program(name="x_dh_1wg", of="dh", module="gla.bwd", builder="chunk_gla_bwd_dh", outputs=("dh", "dh0")),
        # q, k, G and A loaded by each thread (the default before)
        Program(name="x_dqkvg_sync", of="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg",
                outputs=("dq", "dk", "dv", "dg"), config=(("tma_loads", False),)),
    ),
    # the intra-chunk parts' exact path at K = 64 too (the one every chunk took while the cumulative
    # sum raced there: 0.57 / 1.36 ms at 8,2048,16,64 against 0.16 / 0.50 for the dispatched programs now)
    ("gla", "fwd", "bf16", 64): (
        Program(name="x_a_exact", of="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg"),
                config=(("bounded", False),)),
    ),
    ("gla", "bwd", "bf16", 64): (
        Program(name="x_dqkvg_exact", of="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg",
                outputs=("dq", "dk", "dv", "dg"), config=(("bounded", False),)),
    ),
    # the WY inverse row by row (the default before the blocked one), with the block rows by
    # tensor-core merges (slower, see kernels/delta/wy.py), with k and v loaded and w and u stored by
    # each thread (the default before); T stored by TMA; the state pass in one
    # warpgroup (the default before the warp-specialized one)
    ("delta", "fwd", "bf16", 128): (
        # the training WY kernel with G and beta as columns loaded by each thread (dispatched before the twenty-eighth session)
        Program(name="x_wy_t_l2_cols", of="wy_t_l2", module="delta.wy", builder="chunk_delta_wy",
                outputs=("w", "u", "t", "yq", "yk", "rq", "rk"), config=WY_T_L2),
        Program(name="x_wy_t_l2_scan", of="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=WY_T_L2_SCAN_OUTPUTS,
                config=(*WY_T_L2, *G_SCAN)),
        Program(name="x_inv_scan", of="inv", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=(*INV, *G_SCAN)),
        Program(name="x_inv_l2_scan", of="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"),
                config=(*INV_L2, *G_SCAN)),
        Program(name="x_wy_rows", of="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u"), config=(("blocked", False),)),
        Program(name="x_wy_merged", of="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u"), config=(("merged", True),)),
        Program(name="x_wy_sync", of="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u"),
                config=(("tma_loads", False), ("tma_stores", False))),
        Program(name="x_wy_t_tma", of="wy_t", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t"),
                config=(("store_t", True), ("tma_t", True))),
        Program(name="x_fused_1wg", of="fused", module="delta.fwd", builder="chunk_delta_fwd_1wg", outputs=("o", "vnew", "ht")),
        Program(name="x_fused_s3", of="fused", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"),
                config=(("stages", 3),)),
        Program(name="x_fused_h_1wg", of="fused_h", module="delta.fwd", builder="chunk_delta_fwd_1wg",
                outputs=("o", "vnew", "h", "ht"), config=(("store_h", True), *G_ROWS)),
        # G's rows by TMA, exp(G_C - G) per element
        Program(name="x_fused_h_rows", of="fused_h", module="delta.fwd", builder="chunk_delta_fwd",
                outputs=("o", "vnew", "h", "ht"), config=(("store_h", True), *G_ROWS)),
        # the forward from T0 with the fourth warpgroup also
        # forming k exp(G_C - G) so that warpgroup 0 updates the state from the published v_new (`decay_k`):
        # slower, 0.183 / 0.349 ms against 0.175 / 0.345 without at 4,4096,16,128 / 2,8192,16,128 (bf16,
        # H200, 2026-12-04): the fourth warpgroup becomes the bound (warpgroup 0 waits on Ag for 22 % of its
        # stall samples, the output warpgroup on P for 64 %). (With P left to the output warpgroup, its own
        # fragment, 0.184 / 0.346: not kept.)
        # (The three-warpgroup pass, x_fused_t_3wg, was dropped with gate_rows; its code on 2026-12-04.)
        Program(name="x_fused_t_kd", of="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("decay_k", True),)),
        # (Tried, not kept: warpgroup 0 reading its v^T into registers before its first GEMM, so that the
        # transposed two-byte loads overlap the GEMM: 0.165 / 0.289 ms against 0.159 / 0.270; the fourth
        # warpgroup forming exp(G) and exp(G_C - G) for it, 0.159 / 0.283 against 0.160 / 0.269; three load
        # stages, one P tile each, 0.160 / 0.274 against 0.1595 / 0.265, 2026-12-04.)
        # warpgroup 0 carrying S, not S^T (dispatched before)
        Program(name="x_fused_t_prep", of="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht")),
    ),
    # the inverse summing the gates per step itself (G_SCAN) at K = 64, and the training WY kernel so (as at 128)
    ("delta", "fwd", "bf16", 64): (
        Program(name="x_inv_l2_scan", of="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"),
                config=(*INV_L2, *MB8, *G_SCAN)),
        Program(name="x_wy_t_l2_scan", of="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=WY_T_L2_SCAN_OUTPUTS,
                config=(*WY_T_L2, *G_SCAN)),
    ),
    # at K = 256: the state pass with one stage of everything, and the WY inverse row by row (both the
    # default before 2026-12-04)
    ("delta", "fwd", "bf16", 256): (
        # the training WY kernel normalising q and k too (no `norm` passes; `wy_t_l2` is dispatched at K <= 128 only),
        # and summing the gates (as x_wy_t_l2_scan at K <= 128: the same override puts it in place)
        Program(name="x_wy_t_l2_scan", of="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=WY_T_L2_SCAN_OUTPUTS,
                config=(*WY_T_L2, *G_SCAN)),
        Program(name="x_fused_s1", of="fused", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"),
                config=(("single_qw", False),)),
        Program(name="x_fused_h_s1", of="fused_h", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "h", "ht"),
                config=(("store_h", True), ("single_qw", False))),
        Program(name="x_wy_rows", of="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u"), config=(("blocked", False),)),
        Program(name="x_wy_t_rows", of="wy_t", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t"),
                config=(("store_t", True), ("blocked", False))),
    ),
    # the one-pass forward storing h in one warpgroup (the default before the warp-specialized one), with one
    # output warpgroup, with two and three stages. (The forward's experiments went when it took the gates per
    # step, G_SCAN: the one-warpgroup pass, V blocks of 128, 3 and 4 stages, one output warpgroup, two with two
    # stages; their timings in the git history of benchmarks/RESULTS.md. Tried and not kept, 2026-12-03 on an H200: V blocks of
    # 32, two programs per SM, 0.221 against 0.139 ms at 4,4096,16,128 but 0.198 against 0.266 at
    # 2,8192,16,128 where 64 programs leave half the GPU idle; the output's two GEMMs in flight together with
    # P in registers, 0.135 against 0.139.)
    ("simple_gla", "fwd", "bf16", 128): (
        # the gates per step summed by one warp of the loading warpgroup (G_SCAN; dispatched from the twenty-fourth to the
        # twenty-fifth session: no cumulative sum or transpose left to XLA, but see `fused`)
        Program(name="x_fused_scan", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_SCAN, ("stages", 3), *ROW_FACTORS)),
        # as jla's fused_fwd, S^T carried (the state GEMM's left operand, the decayed v^T, in registers), with P kept in
        # registers by the output warpgroups (`p_regs`) and the fourth stage the freed shared memory makes room for
        # (214 KB). With the gate scan (H100, 2026-12-05, ten launches a sample, interleaved; same bits as `fused`):
        # 0.1135 / 0.1173 against 0.1161 / 0.1200 ms at 4,4096,16,128 (two calls), 0.1833 against 0.1868 at
        # 2,8192,16,128, 0.0626 against 0.0622 at 8,2048,16,64. S^T alone (x_fused_t, 0.1156 against 0.1164), P in
        # registers alone (0.1151), with four stages (0.1144), the scan's gates fetched a chunk ahead (0.1209 against
        # 0.1200): within ~2 %, dropped. With G's rows, as `fused` takes them (H100, 2026-12-05, the same bits): 0.1041
        # against 0.1011 ms at 4,4096,16,128, 0.1510 against 0.1659 at 2,8192,16,128 (where the op splits the pass:
        # the op 1.021x slower there), 0.0607 against 0.0589 at 8,2048,16,64; not taken
        Program(name="x_fused_tp4", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_ROWS, ("stages", 4), ("transposed", True), ("p_regs", True))),
        Program(name="x_fused_h_1wg", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_1wg", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
        Program(name="x_fused_h_3wg", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
        # storing h with three stages (193 KB of shared memory): 0.152 against 0.149 ms dispatched at
        # 4,4096,16,128, 0.213 against 0.217 at 2,8192,16,128 (bf16, H200, 2026-12-03, one launch a sample):
        # within noise, not kept
        Program(name="x_fused_h_2out_s3", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True), ("stages", 3))),
    ),
    # at K = 64 too (0.099 against 0.063 ms for the warp-specialized pass at 8,2048,16,64); two output
    # warpgroups under a gradient (slower here)
    ("simple_gla", "fwd", "bf16", 64): (
        Program(name="x_fused_scan", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_SCAN, ("stages", 3), *ROW_FACTORS)),
        Program(name="x_fused_tp4", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_ROWS, ("stages", 4), ("transposed", True), ("p_regs", True))),
        Program(name="x_fused_h_1wg", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_1wg", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
        Program(name="x_fused_h_2out", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
    ),
    # the state-gradient pass in one warpgroup (the default before), and so with K split in two
    # (twice the programs; dispatched for grids of at most 66 programs before the warp-specialized pass).
    # (The consumer with one stage, 108 KB of shared memory against 165 so two programs per SM, measured
    # 0.428 against 0.397 ms; on the delta rules' v_new 0.594 against 0.576: not kept.)
    # the delta rules' state-gradient pass in one warpgroup (the default before)
    # and the WY VJP and the consumer with their loads (and the WY VJP's stores) by each thread (the default before)
    ("delta", "bwd", "bf16", 128): (
        # P's column sums as row sums of X^T T formed beside T^T X (dispatched until the thirtieth session, before
        # `late_cols`: 0.3725 / 0.3724 against 0.3694 / 0.3697 ms at 4,4096,16,128 / 2,8192,16,128, bf16, H100, 2026-12-05)
        Program(name="x_grads_l2_xt", of="grads_l2", module="delta.grads", builder="chunk_delta_bwd_grads",
                outputs=("dq", "dk", "dv", "dg", "dbeta"), config=(("l2norm", True), *G_ROWS)),
        # G, beta and r as columns loaded by each thread (dispatched before the twenty-eighth session)
        Program(name="x_wy_bwd_l2_cols", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True))),
        # the consumer with G and 1 / |q| as columns loaded by each thread (dispatched before the twenty-eighth session)
        Program(name="x_dqkvg_l2_cols", of="dqkvg_l2", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("l2norm", True), *FLAT_BV32)),
        # the products from T's and dT's hi halves alone (`lo=False`; fla's precision: its A in bf16), 12 GEMMs a
        # program instead of 21: slower, 0.3528 against 0.3496 ms at 4,4096,16,128 (K = 64: 0.1965 against 0.1872 at
        # 8,2048,16,64; bf16, H100, 2026-12-05, ten launches a sample, interleaved), within 2.5e-3 of the dispatched
        # program: not taken
        Program(name="x_wy_bwd_l2_hi", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), ("lo", False))),
        Program(name="x_wy_bwd_hi", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("lo", False))),
        Program(name="x_wy_bwd_l2_sum", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), *DG_SUM)),
        Program(name="x_dh_1wg", of="dh", module="delta.bwd", builder="chunk_delta_bwd_dh_1wg", outputs=("dh", "dh0", "du"),
                config=(*DU, *G_ROWS)),
        # warpgroup 1 rescaling k and q in place element by element (dispatched before 2026-12-04)
        Program(name="x_dh_prev", of="dh", module="delta.bwd", builder="chunk_delta_bwd_dh", outputs=("dh", "dh0", "du"),
                config=(*DU, *G_ROWS, ("row_factors", False))),
        Program(name="x_wy_bwd_sync", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("tma_loads", False), ("tma_stores", False))),
        # dvb = T^T du formed once: 0.442 / 0.441 ms against 0.457 / 0.429 at 4,4096,16,128 / 2,8192,16,128
        # (bf16, H200, 2026-12-03), not kept
        Program(name="x_wy_bwd_once", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("dvb_once", True),)),
        # T in a float32 shared tile (dispatched before t_regs; one program per SM)
        Program(name="x_wy_bwd_tile", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta")),
        # (Each step's independent products issued as one group, one wait for all, `x_wy_bwd_l2_batched`:
        # 0.299 against 0.301 ms at 4,4096,16,128, bf16, H200, 2026-12-05, the same bits; not kept.)
        # (Two warpgroups a program, `wy_bwd_l2` with threads=256: each GEMM's columns split between them, 99.8 KB
        # of shared memory either way, two programs per SM: 0.327 against 0.305 ms at 4,4096,16,128 bf16, H200,
        # 2026-12-05, the same values within 3.2e-7: not kept.)
        # the consumer without warp specialization, one stage (as dispatched at K = 64): 0.448 / 0.448 ms
        # against 0.425 / 0.426 at 4,4096,16,128 / 2,8192,16,128 (simple GLA 0.470 / 0.474 against
        # 0.427 / 0.411; bf16, H200, 2026-12-03), not kept
        Program(name="x_dqkvg_flat", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, *FLAT_64)),
        # the warp-specialized consumer (dispatched before FLAT_BV32)
        Program(name="x_dqkvg_ws", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV,)),
        Program(name="x_dqkvg_sync_qk", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("tma_qk", False))),
    ),
    # the warp-specialized consumer at K = 64 (dispatched before FLAT_64)
    ("simple_gla", "bwd", "bf16", 64): (
        Program(name="x_dqkvg_ws", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg")),
        # G as per-chunk rows by TMA (`g_rows`, as dispatched at K = 128): slower here, 0.1452 against 0.1266 ms at
        # 8,2048,16,64 (bf16, H100, 2026-12-05, ten launches a sample, interleaved; the same bits), the training step
        # 1.051x; not taken (the delta rules' consumer at K = 64, with no dv, gains: 0.1097 against 0.1127)
        Program(name="x_dqkvg_rows", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*FLAT_64, *G_ROWS)),
    ),
    ("delta", "bwd", "bf16", 256): (
        Program(name="x_wy_bwd_l2_sum", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("l2norm", True), *DG_SUM)),
    ),
    ("delta", "bwd", "bf16", 64): (
        Program(name="x_wy_bwd_l2_cols", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True))),
        Program(name="x_wy_bwd_l2_hi", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), ("lo", False))),
        Program(name="x_wy_bwd_hi", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("lo", False))),
        Program(name="x_wy_bwd_l2_sum", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), *DG_SUM)),
        # the WY VJP with T in a float32 shared tile (dispatched before t_regs)
        Program(name="x_wy_bwd_tile", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta")),
        Program(name="x_dqkvg_ws", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=NO_DV),
    ),
    ("simple_gla", "bwd", "bf16", 128): (
        # G as columns loaded by each thread (dispatched before the twenty-eighth session)
        Program(name="x_dqkvg_cols", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=FLAT_BV32),
        Program(name="x_dqkvg_flat", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=FLAT_64),  # slower, see the delta rules' above
        Program(name="x_dqkvg_ws", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg")),
        Program(name="x_dh_1wg", of="dh", module="simple_gla.bwd", builder="chunk_bwd_dh_1wg", outputs=("dh", "dh0")),
        Program(name="x_dh_bk64", of="dh", module="simple_gla.bwd", builder="chunk_bwd_dh_1wg", outputs=("dh", "dh0"),
                config=(("BK", 64),)),
    ),
}

HEAD_DIMS: Final = (64, 128, 256)

VARIANTS: Final[tuple[Variant, ...]] = tuple(
    Variant(op=op, direction=direction, dtype=dt, head_k=d, head_v=d)
    for op, direction in PROGRAMS
    for dt in DTYPES
    for d in HEAD_DIMS
)


def find(op: str, direction: str, dtype: str, head_k: int, head_v: int) -> Variant | None:
    """The variant for a call, or None where none is built (the caller says why)."""
    short = {v: k for k, v in DTYPES.items()}.get(dtype)
    want = Variant(op=op, direction=direction, dtype=short or "bf16", head_k=head_k, head_v=head_v)
    return want if short and want in VARIANTS else None
