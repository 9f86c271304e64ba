"""How the tilelang backend runs a call: `Config` (public as `fla_jax.TileLangConfig`), and the call as the
backend carries it (`Configured`: a `Problem` with its `Config`)."""

from __future__ import annotations

import dataclasses

import jax

from fla_jax._problem import Problem


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """How the kernels run a call: the dispatched choices by default; alternatives for tests and benchmarks.
    Passed explicitly, `chunk_gla(..., backend=fla_jax.TileLangConfig(...))` (the tilelang backend with this
    configuration), and part of what the op traces and caches, so a compiled function cannot disagree with it.
    Measurements behind the defaults: benchmarks/RESULTS.md and git history."""

    # The delta rules' backward after the reverse pass: the per-chunk part by the simple GLA consumer kernel on
    # v_new (`chunk_bwd_dqkvg(delta=True)`), and the WY preparation's VJP by a kernel
    # (`kernels/delta/wy.py` `chunk_delta_wy_bwd`), each instead of JAX's VJP in XLA (several times slower).
    delta_fused_bwd: bool = True
    delta_wy_bwd_kernel: bool = True
    # The head dims at which the consumer and the WY VJP run as one program (`kernels/delta/grads.py`, built at
    # K <= 128; with both switches above): h, k and dk read or formed once, three warpgroups handing each other
    # their products through shared memory, one program per SM. Not at K = 64, where the two programs each run
    # several programs to an SM and the fused one runs one, and measured slower.
    delta_grads_kernel: tuple[int, ...] = (128,)
    # The gates' in-chunk cumulative sums (and their VJP) in XLA as one float32 product with a triangle of
    # ones (`_in_chunk_cumsum`), the per-chunk rows loaded by TMA (`g_rows`) straight from it, instead of
    # XLA's scan and a transpose. Off: it saved ~1.5 us a call, within the ops' spread.
    gate_sum_dot: bool = False
    # The head dims at which the delta rules' forward with no gradient runs from the gate-free inverse T0
    # (`chunk_delta_wy(inverse_only=True)`, program `inv`) and `chunk_delta_fwd_t` (`fused_t`, which forms
    # v_new = Ag (v - exp(G) k S) on chip), instead of the WY kernel's w and u (jla's forward).
    delta_fwd_inverse: tuple[int, ...] = (64, 128, 256)
    # The forward from the inverse where few sequences and heads leave SMs idle: where its state pass's
    # programs (one per V block of 64, sequence and value head) number at most half this (the H200's SMs),
    # V blocks of 32 (`fused_t_v32`, `fused_t_l2_v32`: twice the programs). 0 switches it off.
    delta_narrow_programs: int = 132
    # The forward from the inverse walking pieces (`split_programs`): each piece's state from zeros and its map of the
    # state (from an identity state) by one program that carries states alone (`carry_t`, K <= 128: no q, no P, no
    # output, k and T0 read once for both), instead of two passes of the state pass's own program. Off until it has
    # run on a GPU (built 2026-12-08 with no device lent: tests/test_tilelang.py `test_delta_carry_pass_*` and the
    # pieces' tests with it on, then benchmarks/RESULTS.md, decide the default).
    delta_carry_t: bool = False
    # use_qk_l2norm_in_kernel folded into the kernels: under a gradient the normalisation's gradient in the
    # backward's consumer (`dqkvg_l2`, K <= 128) and WY VJP (`wy_bwd_l2`) instead of a `norm_bwd` pass per
    # tensor, the normalisation in the WY kernel (`wy_t_l2`) instead of a `norm` pass per tensor; without a
    # gradient, from the inverse, in `inv_l2` and `fused_t_l2` instead of XLA's pass before them.
    delta_l2norm_fused: bool = True
    # Few sequences and heads: where a state pass's programs (one per V block of 64, sequence and value head)
    # number at most a quarter of `split_programs`, each sequence is walked in 2, 4, ... pieces at once (up to
    # `split_programs` programs in all; simple GLA's forward with no gradient from half of it), of at least
    # `split_min_chunks` chunks on average, by every op's state passes, forward and reverse, dense and varlen
    # (`common.state_pass`, `common.reverse_pass`): a pass over the pieces from zero states, their maps of the
    # state (the gates' decays, or the delta rules' pass from an identity state), a fold of the P pieces in XLA,
    # then the pass from the states entering them. Simple GLA's
    # forward with no gradient on dense input instead walks them once, every piece but the first from a zero
    # state, and `chunk_fwd_enter` adds what the entering states contribute to the later pieces' output in
    # place. 0 switches both off.
    split_programs: int = 132
    split_min_chunks: int = 8
    # Calls with no initial state: the forward state passes get `h0` with no rows and start from zeros
    # themselves (`kernels.common.initial_state`), so XLA writes no `[N, H, K, V]` zeros for them; likewise
    # the reverse passes where the loss takes no final state (`dht` with no rows), and with no initial state
    # they write no `dh0` (`kernels.common.final_state`). XLA's zeros when off.
    zero_row_h0: bool = True
    zero_row_dht: bool = True
    # Dot precision of the XLA parts of the delta-rule backward (`_delta_local`'s VJP, `_wy_vjp`, with the
    # switches above off): three bf16 passes with float32 accumulation (about 16 mantissa bits; no TF32).
    vjp_precision: jax.lax.DotAlgorithmPreset | jax.lax.Precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    # Non-finite inputs keep the recurrence's causality (`fla_jax._nonfinite`): where a call's final states come
    # out non-finite, its o and final states again from the forward with no gradient on inputs with the
    # offending steps zeroed, poisoned from them on (a chunk's masked products otherwise carry a later step's
    # NaN to its earlier steps). Off by default: the branch on the final states costs a forward measurably, and
    # the second run's buffers, planned whether it runs or not, raise a step's temp memory (benchmarks/RESULTS.md).
    nonfinite_guard: bool = False
    # Tests: every kernel writes into NaN-filled buffers (`_call`), so an output element that a kernel
    # leaves unwritten shows up as NaN.
    poison_outputs: bool = False
    # Built experiments in place of dispatched programs (`benchmarks/bench.py --experiments`, tests):
    # ((op, direction, program name), experiment name) pairs; where a variant has no such experiment its
    # own program runs. Empty: the dispatched programs only.
    experiments: tuple[tuple[tuple[str, str, str], str], ...] = ()

    def overrides(self) -> dict[tuple[str, str, str], str]:
        return dict(self.experiments)


DEFAULT = Config()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Configured(Problem):
    """A call as this backend runs it: the `Problem` and the `Config` (hashable: the custom VJP's static
    argument and the partitioned functions' cache key)."""

    cfg: Config = DEFAULT


def of(p: Problem) -> Config:
    """The configuration of a call (the default for a bare `Problem`)."""
    return p.cfg if isinstance(p, Configured) else DEFAULT


def configured(p: Problem, cfg: Config | None = None) -> Configured:
    """`p` with the configuration `cfg` (the default where None)."""
    return Configured(op=p.op, delta=p.delta, chunk_size=p.chunk_size, dtype=p.dtype, cfg=cfg or DEFAULT)
