"""fa_gen attention as a differentiable PyTorch op that torch.compile traces without graph breaks.

The ops layer: below the public functions (fa_gen.api), above the kernel runtime (fa_gen.runtime,
fa_gen.backward, fa_gen.inference), which never import it.

Two custom ops wrap the compiled kernels, and `register_autograd` joins them:

    fa_gen::attention_forward(q, k, v, spec_key, deterministic, tensors, scalars) -> (out, lse)
    fa_gen::attention_backward(dout, q, k, v, out, lse, spec_key, deterministic, tensors, scalars)
        -> (dq, dk, dv)

A custom op's schema holds tensors and plain values, never a Python object, so the spec travels
as `spec_key`, its canonical JSON; a process-wide registry maps the key back to the Spec.
`spec_key()` fills the registry; a graph traced in this process can call the ops at once, and
a key the registry lacks (a graph reused in a fresh process, say) is an error that says how to
register it. Both ops have fake implementations (shapes only) for FakeTensor and meta tensors.
`lse` is an output, not a differentiable one: gradients flow through `out` only.
A spec's declared inputs (fa_gen.variant) travel as `tensors` and `scalars`, each in declared
order, to the forward and the backward kernel alike. Tensors read by a sink expression alone
get their gradient (fa_gen.variant.sink_grad); any other input that requires grad is an error
at the call, never a silent None.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .backward import build_backward
from .errors import InputError, UnsupportedError
from .inference import decode_shaped, forward_split
from .runtime import build, current_arch, resolve_spec
from .spec import Spec, spec_by_key
from .target import resolve_target
from .variant.sink_grad import differentiable_inputs, sink_input_gradients

_SPECS: dict[str, Spec] = {}
# What callers passed (Spec, name, path) -> key: attention() costs a dict lookup, not a YAML parse.
_KEYS: dict[object, str] = {}


def register_spec(spec: Spec) -> str:
    """Make `spec` reachable by the custom ops; returns its key (canonical JSON). Every Spec
    constructed in this process already is (fa_gen.spec.spec_by_key); this keeps it alive."""
    key = spec.canonical
    _SPECS.setdefault(key, spec)
    return key


def spec_from_key(key: str) -> Spec:
    spec = _SPECS.get(key) or spec_by_key(key)
    if spec is None:
        raise InputError(f"fa_gen custom op: no spec registered under key {key[:120]!r}; call "
                         "fa_gen.autograd.register_spec(spec) in this process first "
                         "(fa_gen.attention does it for you)")
    return spec


@torch.compiler.assume_constant_result
def spec_key(spec: Spec | str | os.PathLike) -> str:
    """The registry key of `spec` (a Spec, a YAML path or a shipped spec's name), registering it.
    torch.compile evaluates this once while tracing and keeps the string as a constant."""
    memo = spec if isinstance(spec, Spec) else os.fspath(spec)
    key = _KEYS.get(memo)
    if key is None:
        key = _KEYS[memo] = register_spec(resolve_spec(spec))
    return key


@torch.compiler.assume_constant_result
def returns_lse(key: str) -> bool:
    return spec_from_key(key).return_lse


@torch.library.custom_op("fa_gen::attention_forward", mutates_args=(), device_types="cuda")
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec_key: str,
                      deterministic: bool, tensors: list[torch.Tensor],
                      scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); `deterministic` is only carried to the backward. Decode-shaped calls (a few
    query rows) take the split-KV forward with GQA packing (fa_gen.inference)."""
    return _forward(q, k, v, spec_from_key(spec_key), tensors, scalars)


def _forward(q, k, v, spec: Spec, tensors, scalars):
    inputs = _inputs_by_name(spec, tensors, scalars)
    if decode_shaped(spec, q):
        return forward_split(spec, q, k, v, inputs=inputs)
    return build(spec).forward(q, k, v, inputs=inputs)


def _inputs_by_name(spec: Spec, tensors, scalars) -> dict | None:
    """The spec's inputs from their op form: tensors and scalars, each in declared order."""
    if not spec.inputs:
        return None
    tensors, scalars = iter(tensors), iter(scalars)
    return {d.name: (_scalar(d, next(scalars)) if d.is_scalar else next(tensors)) for d in spec.inputs}


def _scalar(decl, value: float):
    return int(value) if decl.dtype == "int" else float(value)


def _inputs_as_lists(spec: Spec, inputs) -> tuple[list, list]:
    """`inputs` (name -> tensor or number) as the op's (tensors, scalars); a scalar left out
    takes its declared default (the kernel checks every value)."""
    inputs = dict(inputs or {})
    unknown = sorted(set(inputs) - {d.name for d in spec.inputs})
    if unknown:
        declared = ", ".join(d.name for d in spec.inputs) or "none"
        raise InputError(f"spec {spec.name!r} declares no input {unknown[0]!r} (declared: {declared})")
    tensors, scalars = [], []
    for decl in spec.inputs:
        if decl.name not in inputs and not (decl.is_scalar and decl.default is not None):
            raise InputError(f"spec {spec.name!r} needs input {decl.name!r} "
                             f"({'a number' if decl.is_scalar else 'a tensor'}); pass inputs={{{decl.name!r}: ...}}")
        value = inputs.get(decl.name, decl.default)
        if decl.is_scalar:
            if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
                raise InputError(f"input {decl.name!r} is a scalar ({decl.dtype}); got {type(value).__name__}")
            scalars.append(float(value))
        else:
            if not isinstance(value, torch.Tensor):
                raise InputError(f"input {decl.name!r} must be a torch.Tensor; got {type(value).__name__}")
            tensors.append(value)
    return tensors, scalars


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, spec_key, deterministic, tensors, scalars):
    spec = spec_from_key(spec_key)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, spec.head_dim_v))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("fa_gen::attention_backward", mutates_args=(), device_types="cuda")
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, spec_key: str, deterministic: bool,
                       tensors: list[torch.Tensor],
                       scalars: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the upstream gradient `dout` of `out`; the spec's inputs as the forward took them."""
    spec = spec_from_key(spec_key)
    # Autograd may hand over a gradient in any layout; the kernel wants aligned rows.
    return build_backward(spec)(dout.contiguous(), q, k, v, out, lse, deterministic,
                                inputs=_inputs_by_name(spec, tensors, scalars))


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, spec_key, deterministic, tensors, scalars):
    spec_from_key(spec_key)  # a missing spec fails while tracing, not at run time
    # Contiguous, as the kernel's outputs are.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def refuse_other_devices(op) -> None:
    """Give `op` (a CUDA-only custom op) a CPU kernel that raises a clear InputError, instead of
    the dispatcher's "Could not run ... with arguments from the 'CPU' backend"."""
    def refuse(*args, **kwargs):
        devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        raise InputError(f"fa_gen kernels need CUDA tensors; got tensors on {', '.join(devices)}")

    op.register_kernel("cpu")(refuse)


refuse_other_devices(attention_forward)
refuse_other_devices(attention_backward)


def _setup_context(ctx, inputs, output):
    q, k, v, key, deterministic, tensors, scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.scalars = list(scalars)
    ctx.spec_key = key
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)
    # No zeros made for an unused output's gradient (lse never has one; out's may be None too,
    # which _gradients handles): one allocation and one fill kernel less per backward call.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, ctx.needs_input_grad[5])


def _gradients(ctx, dout, tensors_need_grad):
    """(dq, dk, dv, None, None, input gradients, no gradient of the scalars) from the ctx that
    _setup_context (or _EagerAttention.forward) filled; `tensors_need_grad`: per tensor input."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    if dout is None:  # only lse was used, which carries no gradient
        dout = torch.zeros_like(out)
    dout = dout.contiguous()  # autograd may hand over any layout; the kernel wants aligned rows
    spec = spec_from_key(ctx.spec_key)
    if _plain_eager(dout, q, k, v, out, lse, *tensors):
        # Eager autograd on plain tensors: the op's own body, without the dispatcher's round trip.
        dq, dk, dv = build_backward(spec)(dout, q, k, v, out, lse, ctx.deterministic,
                                          inputs=_inputs_by_name(spec, tensors, ctx.scalars), checked=True)
    else:
        # Traced (torch.compile, FakeTensor, a dispatch mode): the op, which tracing records.
        dq, dk, dv = torch.ops.fa_gen.attention_backward.default(dout, q, k, v, out, lse, ctx.spec_key,
                                                                 ctx.deterministic, tensors, ctx.scalars)
    input_grads = _input_gradients(ctx.spec_key, tensors_need_grad, tensors, ctx.scalars, out, dout, lse,
                                   k.shape[1])
    return dq, dk, dv, None, None, input_grads, no_gradient(ctx.scalars)


def no_gradient(value):
    """The "no gradient" of one op argument, in the structure torch.library's autograd expects
    back: a list of tensors (an empty list too) takes a list of as many Nones, anything else
    (a number, a string, a list of numbers) a single None."""
    if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
        return [None] * len(value)
    return None


def _input_gradients(key: str, needs_grad, tensors, scalars, out, dout, lse, seqlen_k) -> list:
    """One gradient (or None where none is wanted) per tensor input, in declared order."""
    spec = spec_from_key(key)
    decls = [d for d in spec.inputs if not d.is_scalar]
    wanted = {d.name for d, needed in zip(decls, needs_grad) if needed}
    if not wanted:
        return [None] * len(tensors)
    _refuse_gradients(spec, wanted, differentiable_input_names(key))
    grads = sink_input_gradients(spec, _inputs_by_name(spec, tensors, scalars), wanted, out, dout, lse, seqlen_k)
    return [grads.get(d.name) for d in decls]


@torch.compiler.assume_constant_result
def differentiable_input_names(key: str) -> tuple[str, ...]:
    """The inputs of the spec registered under `key` whose gradient the backward gives
    (fa_gen.variant.sink_grad); torch.compile keeps the answer as a constant."""
    return tuple(sorted(differentiable_inputs(spec_from_key(key))))


def refuse_missing_backward(key: str, kind: str, *tensors: torch.Tensor) -> None:
    """UnsupportedError now, not at loss.backward(), when a gradient is wanted through a spec
    whose `kind` backward no family renders on this GPU (a forward-only head dim, say). Eager
    calls only: under torch.compile the backward's own resolution reports it."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    if any(isinstance(t, torch.Tensor) and t.requires_grad and t.is_cuda for t in tensors):
        _backward_target(key, current_arch(), kind)


@functools.lru_cache(maxsize=None)
def _backward_target(key: str, arch: str, kind: str):
    return resolve_target(spec_from_key(key), arch, kind)


def _refuse_gradients(spec: Spec, names, allowed: tuple[str, ...]) -> None:
    """Inputs whose gradient the backward does not give may not require one."""
    refused = sorted(set(names) - set(allowed))
    if refused:
        raise UnsupportedError(f"gradient of spec {spec.name!r}'s input {refused[0]!r}", [
            "the backward gives gradients of float tensors read by the sink expression alone; a score "
            "mod's inputs would need a reduction of dS over every (query, key) pair; detach the input "
            "(or pass it with requires_grad=False)"])


def _plain_eager(*tensors) -> bool:
    """True when no tracer can be watching: not compiling, no Python dispatch mode, and every
    tensor a plain CUDA torch.Tensor (FakeTensor, FunctionalTensor and the like are subclasses;
    meta tensors take the op's fake implementation)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor and t.is_cuda for t in tensors)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The forward op and its backward as one autograd.Function, for calls no tracer can watch
    (_plain_eager): the same kernels and the same ctx, without torch.library's autograd wrapper
    (flattening and checking the op's arguments and gradients costs tens of us a call on the
    host, and a short backward's GPU waits for its launches). The spec's tensor inputs come last,
    as arguments of their own, so that autograd tracks them."""

    @staticmethod
    def forward(ctx, q, k, v, key, deterministic, scalars, *tensors):
        out, lse = _forward(q, k, v, spec_from_key(key), tensors, scalars)
        _setup_context(ctx, (q, k, v, key, deterministic, tensors, scalars), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, _, _, input_grads, _ = _gradients(ctx, dout, ctx.needs_input_grad[6:])
        return (dq, dk, dv, None, None, None, *input_grads)


def attention_op(q, k, v, key: str, deterministic: bool, tensors: list, scalars: list):
    """(out, lse) of fa_gen::attention_forward, differentiable: through _EagerAttention where
    nothing traces the call, else the custom op (torch.compile, FakeTensor, dispatch modes)."""
    if _plain_eager(q, k, v, *tensors):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors))):
            # Nothing to differentiate: the forward alone, without the Function's bookkeeping.
            return _forward(q, k, v, spec_from_key(key), tensors, scalars)
        return _EagerAttention.apply(q, k, v, key, deterministic, tuple(scalars), *tensors)
    return attention_forward(q, k, v, key, deterministic, tensors, scalars)
