"""L0: the backward of every fa_gen custom op returns what torch.library's autograd expects back,
for every input kind, without a GPU.

torch.library flattens an op's inputs with lists of non-tensors as leaves (so `scalars: float[]`
is one leaf, or an empty list when empty) and checks that the backward's return flattens to the
same structure. The spec with runtime scalars (softcap, windows) crashed there in its backward
(issue 22): these tests run that check directly, and the user path (`fa_gen.attention` ->
autograd, eager and under torch.compile(fullgraph=True)) on meta tensors for every shipped spec.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree

import fa_gen
from fa_gen import autograd, generate, varlen
from fa_gen.spec_load import load_spec

# A spec with several runtime scalars and tensors, beside the shipped ones (0 or 1 of each).
MANY_INPUTS = load_spec({
    "name": "many_inputs", "dtype": "bf16", "head_dim": 64,
    "mask": {"expr": "kv_idx <= q_idx + seqlen_k - seqlen_q + w and q_doc[b, q_idx] == kv_doc[b, kv_idx]"},
    "score_mod": {"expr": "cap * tanh(score / cap) + bias[h] + n * 0.0"},
    "inputs": {"w": {"scalar": "int", "default": 64}, "cap": {"scalar": "float", "default": 20.0, "min": 1.0},
               "n": {"scalar": "float", "default": 1.0},
               "q_doc": {"shape": ["batch", "seqlen_q"], "dtype": "int32"},
               "kv_doc": {"shape": ["batch", "seqlen_k"], "dtype": "int32"},
               "bias": {"shape": ["heads_q"], "dtype": "float32"}},
})
# fp8 specs are forward only (fa_gen.attention_fp8): no autograd structure to check.
SPECS = {spec.name: spec for spec in [*generate.shipped_specs(), MANY_INPUTS] if not spec.is_fp8}


def _torch_input_structure(args):
    return _pytree.tree_flatten(args, torch._library.autograd.not_list_of_tensor)[1]


def _torch_grad_structure(grads):
    return _pytree.tree_flatten(grads, torch._library.autograd.not_list_of_optional_tensor)[1]


@pytest.mark.parametrize("value", [[], [1.0], [1.0, 2.0, 3.0], [torch.empty(0)], [], "key", True, 3, 2.5])
def test_no_gradient_has_the_structure_of_its_input(value):
    assert _torch_grad_structure((autograd.no_gradient(value),)) == _torch_input_structure((value,))


class _Ctx:
    """What setup_context leaves on the autograd context, for calling _backward directly."""

    def __init__(self, saved, scalars, key, needs_tensor_grads):
        self.saved_tensors = saved
        self.scalars = scalars
        self.spec_key = key
        self.deterministic = False
        self.needs_input_grad = (True, True, True, False, False, needs_tensor_grads, False)


def _meta_call(spec, batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, grad_inputs=True):
    dtype = torch.float16 if spec.dtype.value == "fp16" else torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads_q, spec.head_dim_qk, dtype=dtype, device="meta", requires_grad=True)
    k = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_qk, dtype=dtype, device="meta", requires_grad=True)
    v = torch.randn(batch, seqlen_k, heads_kv, spec.head_dim_v, dtype=dtype, device="meta", requires_grad=True)
    sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    differentiable = set(autograd.differentiable_input_names(autograd.spec_key(spec)))
    inputs = {}
    for decl in spec.inputs:
        if decl.is_scalar:
            inputs[decl.name] = (decl.default if decl.default is not None else 1) + (decl.min or 0)
            continue
        t = torch.empty(decl.resolved_shape(sizes), dtype=getattr(torch, decl.dtype), device="meta")
        inputs[decl.name] = t.requires_grad_() if grad_inputs and decl.name in differentiable else t
    return q, k, v, inputs


@pytest.mark.parametrize("name", sorted(SPECS))
def test_backward_returns_the_structure_of_the_forward_inputs(name):
    spec = SPECS[name]
    key = autograd.spec_key(spec)
    q, k, v, inputs = _meta_call(spec)
    tensors, scalars = autograd._inputs_as_lists(spec, inputs)
    op_inputs = (q, k, v, key, False, tensors, scalars)
    out, lse = torch.ops.fa_gen.attention_forward(*op_inputs)
    ctx = _Ctx((q, k, v, out, lse, *tensors), list(scalars), key,
               tuple(t.requires_grad for t in tensors))
    grads = autograd._backward(ctx, torch.ones_like(out), None)
    assert _torch_grad_structure(grads) == _torch_input_structure(op_inputs), (
        f"{name}: backward returns {grads}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_user_path_backward_on_meta_tensors(name, compiled):
    """fa_gen.attention -> .backward() for every shipped spec, as a user trains with it."""
    spec = SPECS[name]
    q, k, v, inputs = _meta_call(spec)

    def loss(q, k, v, inputs):
        out = fa_gen.attention(q, k, v, spec, inputs=inputs)
        out = out[0] if isinstance(out, tuple) else out
        return out.float().sum()

    if compiled:
        torch._dynamo.reset()
        loss = torch.compile(loss, fullgraph=True, backend="aot_eager")
    loss(q, k, v, inputs).backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    for decl in spec.inputs:
        value = inputs[decl.name]
        if isinstance(value, torch.Tensor) and value.requires_grad:
            assert value.grad is not None and value.grad.shape == value.shape, decl.name


def _sample_forward(spec):
    q, k, v, inputs = _meta_call(spec, grad_inputs=False)
    tensors, scalars = autograd._inputs_as_lists(spec, inputs)
    return (q, k, v, autograd.spec_key(spec), False, tensors, scalars)


def _sample_backward(spec):
    q, k, v, key, det, tensors, scalars = _sample_forward(spec)
    out, lse = torch.ops.fa_gen.attention_forward(q, k, v, key, det, tensors, scalars)
    return (out, q, k, v, out, lse, key, det, tensors, scalars)


def _sample_varlen_forward(spec):
    q, k, v, key, det, tensors, scalars = _sample_forward(spec)
    q, k, v = (t.detach().flatten(0, 1) for t in (q, k, v))
    cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="meta") for _ in range(2))
    used_k = torch.empty(2, dtype=torch.int32, device="meta")
    return (q, k, v, cu_q, cu_k, used_k, 33, 47, key, det, 0, -1, tensors, scalars)


def _sample_varlen_backward(spec):
    q, k, v, cu_q, cu_k, used_k, max_q, max_k, key, det, _, _, tensors, scalars = _sample_varlen_forward(spec)
    out, lse = torch.ops.fa_gen.attention_varlen_forward(q, k, v, cu_q, cu_k, used_k, max_q, max_k, key, det, 0, -1,
                                                         tensors, scalars)
    return (out, q, k, v, out, lse, cu_q, cu_k, used_k, max_q, max_k, key, det, tensors, scalars)


# Sample arguments of every op in the fa_gen namespace: an op added without one fails below.
OP_SAMPLES = {"attention_forward": _sample_forward, "attention_backward": _sample_backward,
              "attention_varlen_forward": _sample_varlen_forward, "attention_varlen_backward": _sample_varlen_backward}


def _schema_kind(type_str: str) -> str:
    if type_str.endswith("[]") or type_str.startswith("List["):
        return "list"
    return "tensor" if type_str.startswith(("Tensor", "Optional[Tensor]")) else "value"


@pytest.mark.parametrize("name", ["causal_fp16_d64", "softcap", "many_inputs"])
def test_every_fa_gen_op_fake_matches_its_schema(name):
    """Each op of the fa_gen namespace has sample arguments here; its fake implementation takes
    them (meta tensors, lists of 0..n tensors and numbers) and returns what its schema declares."""
    ops = {n: getattr(torch.ops.fa_gen, n) for n in dir(torch.ops.fa_gen)
           if isinstance(getattr(torch.ops.fa_gen, n, None), torch._ops.OpOverloadPacket)}
    assert set(ops) == set(OP_SAMPLES), f"ops without sample arguments here: {sorted(set(ops) - set(OP_SAMPLES))}"
    for op_name, packet in ops.items():
        schema = packet.default._schema
        args = OP_SAMPLES[op_name](SPECS[name])
        assert [_schema_kind(str(a.type)) for a in schema.arguments] == [
            "list" if isinstance(a, list) else "tensor" if isinstance(a, torch.Tensor) else "value" for a in args]
        result = packet.default(*args)
        result = result if isinstance(result, tuple) else (result,)
        assert len(result) == len(schema.returns), op_name
        assert all(isinstance(r, torch.Tensor) and r.device.type == "meta" for r in result), op_name


def test_varlen_user_path_on_meta_tensors():
    """fa_gen.attention_varlen -> .backward() on meta tensors: shapes of out, lse and every gradient."""
    spec = SPECS["causal_fp16_d64"]
    q, k, v, _ = _meta_call(spec, grad_inputs=False)
    q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = fa_gen.attention_varlen(q, k, v, cu, cu, 33, 47, spec)
    assert out.shape == (*q.shape[:2], spec.head_dim_v) and lse.shape == (q.shape[1], q.shape[0])
    out.float().sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_a_spec_object_reaches_the_op_as_its_key(monkeypatch):
    """fa_gen.attention with a Spec never hands the Spec to an assume_constant_result function:
    torch.compile (2.11) cannot rebuild a frozen dataclass as a constant and failed every
    compiled call given a Spec (found on the H200 with this suite's compiled user path)."""
    def refuse(spec):
        assert not isinstance(spec, fa_gen.Spec), "spec_key got a Spec object"
        return original(spec)

    spec = SPECS["softcap"]
    q, k, v, inputs = _meta_call(spec)
    original = autograd.spec_key
    monkeypatch.setattr(autograd, "spec_key", refuse)
    out, _ = fa_gen.attention(q, k, v, spec, inputs=inputs)
    out.float().sum().backward()
    assert q.grad.shape == q.shape


def test_specs_are_reachable_by_key_also_after_pickling():
    import pickle

    from fa_gen import spec as spec_module

    spec = SPECS["chunked_causal"]
    spec_module._BY_KEY.pop(spec.canonical)
    copy = pickle.loads(pickle.dumps(spec))
    assert autograd.spec_from_key(spec.canonical) == spec == copy
