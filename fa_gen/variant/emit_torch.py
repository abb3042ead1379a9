"""Tree -> a function evaluating it on broadcastable torch tensors (the reference's emitter).

The function takes an environment mapping each name the tree reads to a value:
built-in names and scalar inputs as tensors or Python numbers, tensor inputs as
the tensors themselves (the function indexes them). Integers compute in int64 with
Python's semantics (floor `//`, `%` with the divisor's sign), floats in the float
dtype chosen at emit time (float64 for the reference). The result has the broadcast
shape of what it read, e.g. (B, H, Lq, Lk) from b (B,1,1,1), ..., kv_idx (1,1,1,Lk).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import reduce

import torch

from .tree import Binary, Call, Compare, Const, Logic, Name, Node, Read, ToFloat, Type, Unary

Env = Mapping[str, object]
Fn = Callable[[Env, torch.device], torch.Tensor]

_BINARY = {
    "+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div,
    "//": lambda a, b: torch.div(a, b, rounding_mode="floor"), "%": torch.remainder, "**": torch.pow,
}
_COMPARE = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne}
_CALLS = {
    "abs": torch.abs, "tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "sqrt": torch.sqrt, "min": torch.minimum, "max": torch.maximum,
}


def emit_torch(tree: Node, float_dtype: torch.dtype = torch.float64) -> Callable[[Env], torch.Tensor]:
    """A function env -> tensor computing `tree`; floats in `float_dtype`."""
    fn = _Emitter(float_dtype).emit(tree)

    def evaluate(env: Env) -> torch.Tensor:
        return fn(env, _device_of(env))
    return evaluate


def _device_of(env: Env) -> torch.device:
    # Constants go where the data is (a CUDA tensor with a 0-d CPU operand is fine, but
    # torch.where and friends want every tensor on one device).
    for value in env.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return value.device
    return torch.device("cpu")


class _Emitter:
    def __init__(self, float_dtype: torch.dtype):
        self.float_dtype = float_dtype

    def dtype(self, type_: Type) -> torch.dtype:
        return {Type.BOOL: torch.bool, Type.INT: torch.int64, Type.FLOAT: self.float_dtype}[type_]

    def emit(self, node: Node) -> Fn:
        return getattr(self, f"emit_{type(node).__name__}")(node)

    # Numbers become tensors through torch.full, which tracers (make_fx under FakeTensorMode, as
    # torch.compile traces a backward) record as they record any op; torch.tensor they do not.

    def emit_Const(self, node: Const) -> Fn:
        dtype = self.dtype(node.type)
        return lambda env, device: torch.full((), node.value, dtype=dtype, device=device)

    def emit_Name(self, node: Name) -> Fn:
        dtype = self.dtype(node.type)

        def name(env, device):
            value = env[node.id]
            if isinstance(value, torch.Tensor):
                return value.to(dtype=dtype, device=device)
            # dtype at creation: a Python float through the default float32 would lose its low bits.
            return torch.full((), value, dtype=dtype, device=device)
        return name

    def emit_Read(self, node: Read) -> Fn:
        indices = [self.emit(i) for i in node.indices]
        dtype = self.dtype(node.type)

        def read(env, device):
            tensor = env[node.input]
            return tensor[tuple(index(env, device) for index in indices)].to(dtype)
        return read

    def emit_ToFloat(self, node: ToFloat) -> Fn:
        operand, dtype = self.emit(node.operand), self.float_dtype
        return lambda env, device: operand(env, device).to(dtype)

    def emit_Unary(self, node: Unary) -> Fn:
        operand = self.emit(node.operand)
        op = torch.logical_not if node.op == "not" else torch.neg
        return lambda env, device: op(operand(env, device))

    def emit_Binary(self, node: Binary) -> Fn:
        left, right, op = self.emit(node.left), self.emit(node.right), _BINARY[node.op]
        return lambda env, device: op(left(env, device), right(env, device))

    def emit_Compare(self, node: Compare) -> Fn:
        left, right, op = self.emit(node.left), self.emit(node.right), _COMPARE[node.op]
        return lambda env, device: op(left(env, device), right(env, device))

    def emit_Logic(self, node: Logic) -> Fn:
        operands = [self.emit(o) for o in node.operands]
        op = torch.logical_and if node.op == "and" else torch.logical_or
        return lambda env, device: reduce(op, (o(env, device) for o in operands))

    def emit_Call(self, node: Call) -> Fn:
        args = [self.emit(a) for a in node.args]
        if node.func == "where":
            cond, a, b = args
            return lambda env, device: torch.where(cond(env, device), a(env, device), b(env, device))
        op = _CALLS[node.func]
        if len(args) == 1:
            (arg,) = args
            return lambda env, device: op(arg(env, device))
        # min/max of more than two arguments: fold pairwise.
        return lambda env, device: reduce(op, (a(env, device) for a in args))
