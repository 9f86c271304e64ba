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


# Config overrides shared by several programs. Each was measured against the choice before it, on the same inputs
# and GPU in one process (the numbers: `git log -p fla_jax/_variants.py`; the ops' standing: benchmarks/RESULTS.md).

# The consumer without warp specialization, one load stage, 128 threads: at K = V = 64 a chunk's single V block
# gives its loads nothing to overlap, and several programs share an SM.
FLAT_64: Final = (("stages", 1), ("specialized", False))
# At K = 128 in V blocks of 32 with two load stages: two programs per SM (the warp-specialized one fits one).
FLAT_BV32: Final = (("stages", 2), ("specialized", False), ("BV", 32))
# The same with one load stage: TileLang's software pipeline over a loop of V blocks whose count is read off the
# buffers (`GRID_V`) does not lower with two (its wait counts become expressions).
FLAT_BV32_S1: Final = (("stages", 1), ("specialized", False), ("BV", 32))
# The delta rules' reverse pass stores du (the gradient of v_new, formed on its chain), so their consumer forms dq,
# dk, dg only (neither Q K^T nor the two products per V block that would form du again).
DU: Final = (("store_du", True),)
NO_DV: Final = (("delta", True), ("no_dv", True))
# G as per-chunk rows `[NT, HV, C]`, loaded by TMA with the stage: a column loaded by each thread delayed the stage.
G_ROWS: Final = (("g_rows", True),)
# The gates per step, summed within each chunk by one warp of the program (`kernels.common.scan_store`), so XLA's
# cumulative sum (and transpose to rows) goes.
G_SCAN: Final = (("g_scan", True),)
# The training WY kernel summing the gates itself also writes G and its rows for the passes after it.
WY_T_L2_SCAN_OUTPUTS: Final = ("w", "u", "t", "yq", "yk", "rq", "rk", "gs", "grows")
# The WY VJP adding the consumer's gradient of G to its own and summing it back to the gates per step.
DG_SUM: Final = (("dg_sum", True),)
# The state passes' chain warpgroup forms exp(G_C - G) once per row of v (v_new), not once per element (the same bits).
ROW_FACTORS: Final = (("row_factors", True),)
# V read off the buffers (the gated ops' forward programs but simple GLA's `enter`, and their backward's twins
# `<name>_v`): one program serves every V that is a multiple of its V block, so a call with V != K runs as it is
# (`fla_jax._tiling.GRID_V`), with no copies of q and k per V part and no padding of K to V.
GRID_V: Final = (("grid_v", True),)
# The inverse alone, writing G and beta as rows of `gr` (with use_qk_l2norm_in_kernel also 1 / |q|, 1 / |k|).
INV: Final = (("inverse_only", True), ("gate_rows", True))
INV_L2: Final = (*INV, ("l2norm", True))
# The training forward's WY kernel from the raw q and k (use_qk_l2norm_in_kernel), storing T.
WY_T_L2: Final = (("store_t", True), ("l2norm", True))
# Held to the registers that let eight programs share an SM (`min_blocks`).
MB8: Final = (("min_blocks", 8),)

# The recurrent ops' token steps on a dense batch (`fla_jax.fused_recurrent_*`, a decode step is T = 1): each state read
# and written once (`kernels/recurrent/step.py`); simple GLA's with a scalar gate, GLA's with a gate per key channel,
# the delta rules' with a scalar gate.
STEP: Final = dict(name="step", module="recurrent.step", builder="step", outputs=("o", "ht"))

# Held to the registers that let 10, 6, 3 programs share an SM at K = 64, 128, 256 (`min_blocks`, the most without
# spills): more states in flight. Not GLA's, whose gate rows spill there (measured slower held to 5 and 2).
STEP_BLOCKS: Final = {64: 10, 128: 6, 256: 3}


def steps_held(*config) -> tuple[Program, ...]:
    """The step program at each head dim, held to `STEP_BLOCKS`."""
    return tuple(Program(**STEP, config=(*config, ("min_blocks", n)), dims=(K,)) for K, n in STEP_BLOCKS.items())


PROGRAMS: Final[dict[tuple[str, str], tuple[Program, ...]]] = {
    ("simple_gla", "fwd"): (
        # the state pass computing o on chip; at K <= 128 two output warpgroups on alternate chunks
        # (`chunk_fwd_2out`) and three load stages, where they measured faster
        Program(name="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*GRID_V, *G_ROWS, ("stages", 3), *ROW_FACTORS), dims=(64, 128)),
        Program(name="fused", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "ht"), dims=(256,), config=(*GRID_V, *G_ROWS)),
        # under a gradient also storing h, the state before each chunk
        Program(name="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(*GRID_V, ("g_rows", True), ("store_h", True)), dims=(128,)),
        Program(name="fused_h", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "h", "ht"), config=(*GRID_V, ("g_rows", True), ("store_h", True)),
                dims=(64, 256)),
        # the forward split into pieces (`Config.split_programs`): what the pieces' entering states add to o, in place
        Program(name="enter", module="simple_gla.fwd", builder="chunk_fwd_enter", outputs=("o",)),
        *steps_held(),
    ),
    ("delta", "fwd"): (
        # use_qk_l2norm_in_kernel where no other kernel folds it in: q and k normalised in one pass each (r = 1 / |x|,
        # for the backward)
        Program(name="norm", module="delta.norm", builder="l2norm_fwd", outputs=("y", "r")),
        # the WY preparation: w and u (and under a gradient T, for the backward)
        Program(name="wy", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u")),
        Program(name="wy_t", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t"), config=(("store_t", True),)),
        # under a gradient with use_qk_l2norm_in_kernel (K <= 128) from the raw q and k: r = 1 / |x| read off the
        # diagonals of K K^T and Q Q^T, the normalised y = x r and r written for the passes after it (no `norm`)
        Program(name="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("w", "u", "t", "yq", "yk", "rq", "rk"),
                config=(*WY_T_L2, *G_ROWS), dims=(64, 128)),
        # the state pass on w and u, o computed on chip (v_new written for the backward's consumer)
        Program(name="fused", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"), config=ROW_FACTORS),
        # under a gradient also storing h
        Program(name="fused_h", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "h", "ht"),
                config=(("store_h", True), *G_ROWS, *ROW_FACTORS), dims=(64, 128)),
        Program(name="fused_h", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "h", "ht"),
                config=(("store_h", True), *ROW_FACTORS), dims=(256,)),
        # the chain alone (`states_only`: no q loaded, o and v_new left unwritten, the output warpgroup idle) for the
        # passes over pieces of a sequence that carry states under a gradient (`fla_jax._tilelang.plan.delta_carry_pass`):
        # from zero states, and the map of an identity state that the backward shares
        Program(name="fused_s", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"),
                config=(("states_only", True), *G_ROWS, *ROW_FACTORS), dims=(64, 128)),
        # the forward with no gradient (`Config.delta_fwd_inverse`): the gate-free inverse alone, writing G and beta
        # as the rows of `gr [NT, HV, 2, C]` that the state pass loads by TMA, then a state pass that forms v_new from
        # it with no w and u (jla's fused_fwd_wy). Its state passes take V on the grid (`GRID_V`): a call with V != K
        # runs one inverse per value head for all of V (the gradient's programs take V in parts as value heads)
        Program(name="inv", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=INV),
        # at K <= 128 four warpgroups, the fourth forming the decay matrix, Ag and P (`prep`), and warpgroup 0 carrying
        # S^T (`transposed`: its GEMMs' left operands from registers, nothing on the chain waiting for a tile it wrote);
        # at K = 256 the state's registers leave no room for that: three warpgroups with one published tile each of
        # S^T and v_new^T and two load stages (jla's `fused_fwd_kb`)
        Program(name="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("transposed", True), ("col_factors", True), *GRID_V), dims=(64, 128)),
        Program(name="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t_wide", outputs=("o", "ht"), config=GRID_V, dims=(256,)),
        # where V blocks of 64 leave half the SMs idle (few sequences and heads: `plan.delta_state_pass_t`):
        # V blocks of 32, twice the programs, warpgroup 0 carrying S (S^T [32, K] would be no tensor-core GEMM's left
        # operand: M >= 64)
        Program(name="fused_t_v32", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("BV", 32), *GRID_V), dims=(64, 128)),
        # with use_qk_l2norm_in_kernel from the raw q and k: the inverse reads 1 / |k| off K K^T's diagonal (and 1 / |q|
        # off Q Q^T's) and writes both as two more rows of gr; the state pass scales rows by them. At K = 64 held to
        # eight programs an SM (faster there, not at 128)
        Program(name="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=(*INV_L2, *MB8), dims=(64,)),
        Program(name="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"), config=INV_L2, dims=(128, 256)),
        Program(name="fused_t_l2", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("transposed", True), ("l2norm", True), ("col_factors", True), *GRID_V),
                dims=(64, 128)),
        Program(name="fused_t_l2", module="delta.fwd", builder="chunk_delta_fwd_t_wide", outputs=("o", "ht"),
                config=(("l2norm", True), *GRID_V), dims=(256,)),
        Program(name="fused_t_l2_v32", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("l2norm", True), ("BV", 32), *GRID_V), dims=(64, 128)),
        # where few sequences and heads walk in pieces (`plan.pieces`), the passes from the inverse that carry states
        # alone, in one launch (`carry`): each piece's state from zeros (`ht`) and its map of the state (`at`, from an
        # identity state with the values zero: K / BV more blocks on the grid); no q, no P, no output
        Program(name="carry_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("ht", "at"),
                config=(("transposed", True), ("col_factors", True), ("carry", True), *GRID_V), dims=(64, 128)),
        Program(name="carry_t_l2", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("ht", "at"),
                config=(("transposed", True), ("l2norm", True), ("col_factors", True), ("carry", True), *GRID_V), dims=(64, 128)),
        *steps_held(("delta", True)),
    ),
    ("delta", "bwd"): (
        # the reverse pass: warp-specialized at K <= 128; in one warpgroup at K = 256 (two stages would not fit). Each
        # also stores du, the gradient of v_new its chain forms
        Program(name="dh", module="delta.bwd", builder="chunk_delta_bwd_dh", outputs=("dh", "dh0", "du"), config=(*DU, *G_ROWS),
                dims=(64, 128)),
        Program(name="dh", module="delta.bwd", builder="chunk_delta_bwd_dh_1wg", outputs=("dh", "dh0", "du"), config=DU, dims=(256,)),
        # the simple GLA consumer on v_new, less dv (the reverse pass stored du): `Config.delta_fused_bwd`
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, *FLAT_64, *G_ROWS), dims=(64,)),
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, *FLAT_BV32, *G_ROWS), dims=(128,)),
        # K = 256: two programs per (chunk, head), 128 key channels each
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("BK", 128)), dims=(256,)),
        # the WY preparation's VJP given T (`Config.delta_wy_bwd_kernel`); at K <= 128 with T through the registers
        # (`t_regs`: small enough shared memory for two programs per SM at K = 128, three at 64)
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
        # the consumer and the WY VJP in one program (`kernels/delta/grads.py`; `Config.delta_grads_kernel`): the
        # chunk's state, k and the consumer's dk read or formed once (jla's `chunk_grads` layout: three warpgroups, one
        # program per SM); P's column sums through dkk's halves once warpgroup 2 has read them (`late_cols`)
        Program(name="grads", module="delta.grads", builder="chunk_delta_bwd_grads", outputs=("dq", "dk", "dv", "dg", "dbeta"),
                config=(*G_ROWS, ("late_cols", True)), dims=(64, 128)),
        Program(name="grads_l2", module="delta.grads", builder="chunk_delta_bwd_grads", outputs=("dq", "dk", "dv", "dg", "dbeta"),
                config=(("l2norm", True), *G_ROWS, ("late_cols", True)), dims=(64, 128)),
    ),
    ("simple_gla", "bwd"): (
        # The backward's programs at V = K (as dispatched before V went on the grid: V static, so the consumer's loop
        # over V blocks is unrolled; 4-22 % faster steps than the programs taking V on the grid, RESULTS.md), and
        # their twins `<name>_v` taking V on the grid (`GRID_V`) for every other V (`plan.v_twin`).
        # the reverse pass (G's rows as the forward under a gradient hands them over, `plan.stores_gate_rows`)
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=G_ROWS, dims=(64, 128)),
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), dims=(256,)),
        Program(name="dh_v", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=(*GRID_V, *G_ROWS),
                dims=(64, 128)),
        Program(name="dh_v", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=GRID_V, dims=(256,)),
        # the consumer: dq, dk, dv, dg per chunk. At K = 128 V blocks of 32, in two stages at V = K, in one taking V on
        # the grid (TileLang's pipeline over a loop of V blocks of unknown count does not lower with two)
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"), config=FLAT_64,
                dims=(64,)),
        Program(name="dqkvg_v", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*GRID_V, *FLAT_64), dims=(64,)),
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*FLAT_BV32, *G_ROWS), dims=(128,)),
        Program(name="dqkvg_v", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*GRID_V, *FLAT_BV32_S1, *G_ROWS), dims=(128,)),
        # K = 256: two programs per (chunk, head), 128 key channels each; dv and dg in float32 parts
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(("BK", 128),), dims=(256,)),
        Program(name="dqkvg_v", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*GRID_V, ("BK", 128)), dims=(256,)),
    ),
    ("gla", "fwd"): (
        # A, G, and the state pass's operands q exp(G), k exp(G_C - G)
        Program(name="a", module="gla.fwd", builder="chunk_gla_a", outputs=("a", "gc", "qg", "kg")),
        Program(name="fused", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "ht"), config=GRID_V),
        Program(name="fused_h", module="gla.fwd", builder="chunk_gla_fwd", outputs=("o", "h", "ht"), config=(*GRID_V, ("store_h", True))),
        Program(**STEP, config=(("gate_rows", True),)),
    ),
    ("gla", "bwd"): (
        # at V = K and, taking V on the grid, every other V (`<name>_v`), as simple GLA's
        # simple GLA's pass with per-channel gates, from the stored q exp(G)
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=(("channel_gates", True),)),
        Program(name="dh_v", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0"), config=(*GRID_V, ("channel_gates", True))),
        Program(name="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"), dims=(64, 128)),
        Program(name="dqkvg_v", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"), config=GRID_V,
                dims=(64, 128)),
        # K = 256: two programs per (chunk, head), 128 key channels each; dv in float32 parts ([2, L, H, V])
        Program(name="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(("BK", 128),), dims=(256,)),
        Program(name="dqkvg_v", module="gla.bwd", builder="chunk_gla_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=(*GRID_V, ("BK", 128)), dims=(256,)),
    ),
}

# Alternative kernel configs declared for one variant only, for benchmarks/bench_kernels.py and `bench.py --alt` to
# compare; the dispatch never calls them, and only `build.py --experiments` builds them (the default build, CI and an
# install hold the dispatched programs alone). Each measured slower than, or within the noise of, the dispatched
# program it stands in for (`of`); the numbers are in the git history of this file and of benchmarks/RESULTS.md.
EXPERIMENTS: Final[dict[tuple[str, str, str, int], tuple[Program, ...]]] = {
    # GLA's intra-chunk parts without the chunk-wide fast path (every chunk by sub-chunks). The
    # state pass with V blocks of 128 (half the programs, q and k read once: jla's choice when
    # batch x heads > 32), with two stages (three dispatched). The state-gradient pass with V blocks
    # of 32 (twice the programs), and in one warpgroup.
    ("gla", "fwd", "bf16", 128): (
        # the step program held to five programs an SM, as the other ops' (`steps_held`; its gate rows spill there)
        Program(**dict(STEP, name="x_step_mb", of="step"), config=(("gate_rows", True), ("min_blocks", 5))),
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
        # q, k, G and A loaded by each thread (the default before)
        Program(name="x_dqkvg_sync", of="dqkvg", module="gla.bwd", builder="chunk_gla_bwd_dqkvg",
                outputs=("dq", "dk", "dv", "dg"), config=(("tma_loads", False),)),
    ),
    # the intra-chunk parts' exact path at K = 64 too
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
        # the training WY kernel with G and beta as columns loaded by each thread (dispatched before `g_rows`)
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
        Program(name="x_fused_s3", of="fused", module="delta.fwd", builder="chunk_delta_fwd", outputs=("o", "vnew", "ht"),
                config=(("stages", 3),)),
        # G's rows by TMA, exp(G_C - G) per element
        Program(name="x_fused_h_rows", of="fused_h", module="delta.fwd", builder="chunk_delta_fwd",
                outputs=("o", "vnew", "h", "ht"), config=(("store_h", True), *G_ROWS)),
        # the forward from T0 with the fourth warpgroup also forming k exp(G_C - G) so that warpgroup 0 updates the
        # state from the published v_new (`decay_k`): the fourth warpgroup becomes the bound
        Program(name="x_fused_t_kd", of="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"),
                config=(("decay_k", True), *GRID_V)),
        # warpgroup 0 carrying S, not S^T (dispatched before)
        Program(name="x_fused_t_prep", of="fused_t", module="delta.fwd", builder="chunk_delta_fwd_t", outputs=("o", "ht"), config=GRID_V),
    ),
    # the inverse summing the gates per step itself (G_SCAN) at K = 64, and the training WY kernel so (as at 128)
    ("delta", "fwd", "bf16", 64): (
        Program(name="x_inv_l2_scan", of="inv_l2", module="delta.wy", builder="chunk_delta_wy", outputs=("t", "gr"),
                config=(*INV_L2, *MB8, *G_SCAN)),
        Program(name="x_wy_t_l2_scan", of="wy_t_l2", module="delta.wy", builder="chunk_delta_wy", outputs=WY_T_L2_SCAN_OUTPUTS,
                config=(*WY_T_L2, *G_SCAN)),
    ),
    # at K = 256: the state pass with one stage of everything, and the WY inverse row by row (both the
    # default before)
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
    # output warpgroup, with two and three stages
    ("simple_gla", "fwd", "bf16", 128): (
        # the gates per step summed by one warp of the loading warpgroup (G_SCAN: no cumulative sum or transpose left
        # to XLA, but the scan delays the next chunk's loads)
        Program(name="x_fused_scan", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_SCAN, ("stages", 3), *ROW_FACTORS)),
        # as jla's fused_fwd, S^T carried (the state GEMM's left operand, the decayed v^T, in registers), with P kept in
        # registers by the output warpgroups (`p_regs`) and the fourth stage the freed shared memory makes room for
        Program(name="x_fused_tp4", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_ROWS, ("stages", 4), ("transposed", True), ("p_regs", True))),
        Program(name="x_fused_h_3wg", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
        # storing h with three stages (193 KB of shared memory)
        Program(name="x_fused_h_2out_s3", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True), ("stages", 3))),
    ),
    # at K = 64 too; two output warpgroups under a gradient
    ("simple_gla", "fwd", "bf16", 64): (
        Program(name="x_fused_scan", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_SCAN, ("stages", 3), *ROW_FACTORS)),
        Program(name="x_fused_tp4", of="fused", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "ht"),
                config=(*G_ROWS, ("stages", 4), ("transposed", True), ("p_regs", True))),
        Program(name="x_fused_h_2out", of="fused_h", module="simple_gla.fwd", builder="chunk_fwd_2out", outputs=("o", "h", "ht"),
                config=(("g_rows", True), ("store_h", True),)),
    ),
    # the state-gradient pass in one warpgroup (the default before), and so with K split in two
    # (twice the programs; dispatched for grids of at most 66 programs before the warp-specialized pass)
    # the delta rules' state-gradient pass in one warpgroup (the default before)
    # and the WY VJP and the consumer with their loads (and the WY VJP's stores) by each thread (the default before)
    ("delta", "bwd", "bf16", 128): (
        # P's column sums as row sums of X^T T formed beside T^T X (dispatched before `late_cols`)
        Program(name="x_grads_l2_xt", of="grads_l2", module="delta.grads", builder="chunk_delta_bwd_grads",
                outputs=("dq", "dk", "dv", "dg", "dbeta"), config=(("l2norm", True), *G_ROWS)),
        # G, beta and r as columns loaded by each thread (dispatched before `g_rows`)
        Program(name="x_wy_bwd_l2_cols", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True))),
        # the consumer with G and 1 / |q| as columns loaded by each thread (dispatched before `g_rows`)
        Program(name="x_dqkvg_l2_cols", of="dqkvg_l2", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dg"),
                config=(*NO_DV, ("l2norm", True), *FLAT_BV32)),
        # the products from T's and dT's hi halves alone (`lo=False`; fla's precision: its A in bf16), 12 GEMMs a
        # program instead of 21, yet slower
        Program(name="x_wy_bwd_l2_hi", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), ("lo", False))),
        Program(name="x_wy_bwd_hi", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("lo", False))),
        Program(name="x_wy_bwd_l2_sum", of="wy_bwd_l2", module="delta.wy", builder="chunk_delta_wy_bwd",
                outputs=("dk", "dv", "dg", "dbeta"), config=(("t_regs", True), ("l2norm", True), *DG_SUM)),
        Program(name="x_dh_1wg", of="dh", module="delta.bwd", builder="chunk_delta_bwd_dh_1wg", outputs=("dh", "dh0", "du"),
                config=(*DU, *G_ROWS)),
        # warpgroup 1 rescaling k and q in place element by element (dispatched before `row_factors`)
        Program(name="x_dh_prev", of="dh", module="delta.bwd", builder="chunk_delta_bwd_dh", outputs=("dh", "dh0", "du"),
                config=(*DU, *G_ROWS, ("row_factors", False))),
        Program(name="x_wy_bwd_sync", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("tma_loads", False), ("tma_stores", False))),
        # dvb = T^T du formed once
        Program(name="x_wy_bwd_once", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta"),
                config=(("dvb_once", True),)),
        # T in a float32 shared tile (dispatched before t_regs; one program per SM)
        Program(name="x_wy_bwd_tile", of="wy_bwd", module="delta.wy", builder="chunk_delta_wy_bwd", outputs=("dk", "dv", "dg", "dbeta")),
        # the consumer without warp specialization, one stage (as dispatched at K = 64)
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
        # G as per-chunk rows by TMA (`g_rows`, as dispatched at K = 128): slower here (the delta rules' consumer at
        # K = 64, with no dv, gains)
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
        # G as columns loaded by each thread (dispatched before `g_rows`)
        Program(name="x_dqkvg_cols", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=FLAT_BV32),
        Program(name="x_dqkvg_flat", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg"),
                config=FLAT_64),  # slower, see the delta rules' above
        Program(name="x_dqkvg_ws", of="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg")),
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
