"""Inputs a spec declares for its expressions: aux tensors and runtime scalars.

A tensor input has a shape (shape symbols batch / heads_q / seqlen_q / seqlen_k,
or fixed sizes) and an element dtype; a scalar input is an int or a float with an
optional default. Both may state inclusive bounds on their values: the loader uses
them to prove reads in bounds and divisors positive, and callers' values are
checked against them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .language import SHAPE_SYMBOLS
from .tree import Type

# Element dtypes a tensor input may have, and the expression type of its elements.
TENSOR_DTYPES = {"int32": Type.INT, "float32": Type.FLOAT, "float16": Type.FLOAT, "bfloat16": Type.FLOAT}
SCALAR_TYPES = {"int": Type.INT, "float": Type.FLOAT}


@dataclass(frozen=True)
class InputDecl:
    name: str
    dtype: str                                    # a TENSOR_DTYPES key, or "int"/"float" for a scalar
    shape: tuple[str | int, ...] | None = None    # None: a scalar
    default: int | float | None = None            # scalars only
    min: int | float | None = None
    max: int | float | None = None

    @property
    def is_scalar(self) -> bool:
        return self.shape is None

    @property
    def type(self) -> Type:
        """The expression type of the scalar, or of one element of the tensor."""
        return SCALAR_TYPES[self.dtype] if self.is_scalar else TENSOR_DTYPES[self.dtype]

    def index_name(self, dim: int) -> str | None:
        """The only index a symbolic dimension may be read with (None for a fixed size)."""
        size = self.shape[dim]
        return SHAPE_SYMBOLS[size] if isinstance(size, str) else None

    def resolved_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The tensor's shape for one call, `sizes` giving batch, heads_q, seqlen_q, seqlen_k."""
        return tuple(sizes[s] if isinstance(s, str) else s for s in self.shape)

    def to_dict(self) -> dict:
        """Canonical form, as the spec's canonical JSON holds it (unset fields left out)."""
        out: dict = {"scalar": self.dtype} if self.is_scalar else {"shape": list(self.shape), "dtype": self.dtype}
        for key in ("default", "min", "max"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def find_input(inputs: tuple[InputDecl, ...], name: str) -> InputDecl | None:
    return next((decl for decl in inputs if decl.name == name), None)
