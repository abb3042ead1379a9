"""L0: the spec's inputs in the backward without a GPU: the sink logits' gradient
(fa_gen.variant.sink_grad) against float64 autograd through the reference, the inputs that may
and may not require grad, and the custom ops carrying inputs (meta tensors, torch.compile)."""

from __future__ import annotations

import pytest
import torch

import fa_gen
from fa_gen.check import Shape, random_inputs
from fa_gen.errors import UnsupportedError
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec
from fa_gen.variant.sink_grad import differentiable_inputs, sink_input_gradients

# A sink reading one table at two places: gradients from both reads land in the same tensor.
TABLE_SINK = {"name": "table_sink", "dtype": "bf16", "head_dim": 64, "mask": "causal",
              "sink": {"expr": "table[h % 8] * 2.0 + 0.5 * table[(h + 3) % 8] ** 2 - 0.01 * q_idx"},
              "inputs": {"table": {"shape": [8], "dtype": "float32"}}}


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def sink_rounded_o_effect(spec, out, dout, lse, inputs, name) -> float:
    """How far the gradient of input `name` moves when D = rowsum(dO * O) uses O rounded to dO's
    dtype, as the backward's does (the float64 reference never rounds O)."""
    exact = sink_input_gradients(spec, inputs, {name}, out, dout.double(), lse, out.shape[1])[name]
    rounded = sink_input_gradients(spec, inputs, {name}, out.to(dout.dtype).double(), dout.double(), lse,
                                   out.shape[1])[name]
    return _max_abs(rounded.double() - exact.double())


@pytest.mark.parametrize("spec_source, name", [("sink_logit", "sinks"), (TABLE_SINK, "table")])
@pytest.mark.parametrize("shape", [Shape(2, 40, 33, 4, 2), Shape(1, 50, 20, 8, 8)])  # sq > sk: rows that see no key
def test_sink_gradient_matches_float64_autograd(spec_source, name, shape):
    spec = resolve_spec(spec_source) if isinstance(spec_source, str) else load_spec(spec_source)
    generator = torch.Generator().manual_seed(shape.seqlen_q)
    q, k, v = random_inputs(spec, shape, torch.bfloat16, "cpu", generator)
    dout = torch.randn(*q.shape[:3], spec.head_dim_v, generator=generator).to(torch.bfloat16)
    size = shape.heads_q if name == "sinks" else 8
    table = torch.randn(size, generator=generator)

    def grad_of(fn, *tensors):
        leaf = table.clone().requires_grad_()
        fn(*tensors, inputs={name: leaf})[0 if fn is attention_reference else slice(None)].backward(
            dout.to(tensors[0].dtype))
        return leaf.grad

    ref = grad_of(attention_reference, q.double(), k.double(), v.double(), spec)
    same = grad_of(attention_same_precision, q, k, v, spec)
    out, lse = attention_reference(q, k, v, spec, inputs={name: table})
    # What the kernel hands over: O rounded to bf16, LSE in float32.
    got = sink_input_gradients(spec, {name: table}, {name}, out.to(torch.bfloat16), dout, lse.float(),
                               shape.seqlen_k)[name]
    assert got.shape == table.shape and got.dtype == table.dtype
    rounded_o = sink_rounded_o_effect(spec, out, dout, lse, {name: table}, name)
    tol = 2 * _max_abs(same.double() - ref.double()) + rounded_o + 2 * _max_abs(ref) * torch.finfo(torch.float32).eps
    assert _max_abs(got.double() - ref.double()) <= tol


def test_only_sink_only_float_tensors_are_differentiable():
    assert differentiable_inputs(resolve_spec("sink_logit")) == {"sinks"}
    assert differentiable_inputs(load_spec(TABLE_SINK)) == {"table"}
    for name in ("relative_bias", "alibi_supplied", "document", "softcap"):
        assert differentiable_inputs(resolve_spec(name)) == frozenset()
    shared = load_spec({**TABLE_SINK, "name": "shared", "score_mod": {"expr": "score + table[h % 8]"}})
    assert differentiable_inputs(shared) == frozenset()   # the score mod reads it too


def _meta(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device="meta", requires_grad=True)


def test_meta_autograd_gives_the_sinks_a_gradient():
    q, k, v = _meta(2, 33, 4, 64), _meta(2, 40, 2, 64), _meta(2, 40, 2, 64)
    sinks = torch.randn(4, device="meta", requires_grad=True)
    out, _ = fa_gen.attention(q, k, v, spec="sink_logit", inputs={"sinks": sinks})
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.shape == sinks.shape and sinks.grad.dtype == torch.float32
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_torch_compile_traces_the_sink_gradient():
    class Sinks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.zeros(4, device="meta"))

        def forward(self, q, k, v):
            out, _ = fa_gen.attention(q, k, v, spec="sink_logit", inputs={"sinks": self.sinks})
            return out.float().sum()

    torch._dynamo.reset()
    module = Sinks()
    q, k, v = _meta(2, 33, 4, 64), _meta(2, 40, 2, 64), _meta(2, 40, 2, 64)
    torch.compile(module, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert module.sinks.grad.shape == (4,)


def test_an_input_whose_gradient_is_not_given_may_not_require_one():
    q = _meta(1, 8, 2, 64)
    bias = torch.randn(2, 257, device="meta", requires_grad=True)
    with pytest.raises(UnsupportedError, match="rel_bias"):
        fa_gen.attention(q, q, q, spec="relative_bias", inputs={"rel_bias": bias})
    with torch.no_grad():   # no graph, nothing to refuse
        fa_gen.attention(q, q, q, spec="relative_bias", inputs={"rel_bias": bias})
    out, _ = fa_gen.attention(q, q, q, spec="relative_bias", inputs={"rel_bias": bias.detach()})
    out.float().sum().backward()
    assert q.grad is not None


def test_backward_op_carries_the_inputs():
    schema = torch.ops.fa_gen.attention_backward.default._schema
    assert [a.name for a in schema.arguments][-2:] == ["tensors", "scalars"]
