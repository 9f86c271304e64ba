"""The one declared list of kernel variants: build.py builds it, the Python dispatch looks kernels
up in it, and the FFI target names come from it.

This module imports no TileLang: the runtime reads it too.
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

    def prim_func(self, variant: "Variant"):
        mod = importlib.import_module(f"kernels.{self.module}")
        return getattr(mod, self.builder)(K=variant.head_k, V=variant.head_v, dtype=DTYPES[variant.dtype], BT=variant.chunk)


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
        return PROGRAMS[(self.op, self.direction)]

    def target(self, program: Program) -> str:
        """The FFI target name of one program of this variant."""
        return f"{self.symbol}_{program.name}"


PROGRAMS: Final[dict[tuple[str, str], tuple[Program, ...]]] = {
    ("simple_gla", "fwd"): (
        Program(name="h", module="simple_gla.fwd", builder="chunk_fwd_h", outputs=("h", "ht")),
        Program(name="o", module="simple_gla.fwd", builder="chunk_fwd_o", outputs=("o",)),
    ),
    ("simple_gla", "bwd"): (
        Program(name="dh", module="simple_gla.bwd", builder="chunk_bwd_dh", outputs=("dh", "dh0")),
        Program(name="dqkvg", module="simple_gla.bwd", builder="chunk_bwd_dqkvg", outputs=("dq", "dk", "dv", "dg")),
    ),
}

HEAD_DIMS: Final = (64, 128, 256)

VARIANTS: Final[tuple[Variant, ...]] = tuple(
    Variant(op="simple_gla", direction=direction, dtype=dt, head_k=d, head_v=d)
    for direction in ("fwd", "bwd")
    for dt in DTYPES
    for d in HEAD_DIMS
)


def find(op: str, direction: str, dtype: str, head_k: int, head_v: int) -> Variant | None:
    """The variant for a call, or None where none is built (the caller says why)."""
    short = {v: k for k, v in DTYPES.items()}.get(dtype)
    want = Variant(op=op, direction=direction, dtype=short or "bf16", head_k=head_k, head_v=head_v)
    return want if short and want in VARIANTS else None
