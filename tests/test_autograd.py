"""L0: the autograd custom ops without a GPU: registration, fake shapes, the spec registry,
tracing by torch.compile(fullgraph=True) on meta tensors, and the backward's input checks."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa_gen
from fa_gen import autograd
from fa_gen.backward import ROW_ALIGN, Backward, _workspace
from fa_gen.errors import InputError
from fa_gen.runtime import resolve_spec


def _meta(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype, device="meta", requires_grad=True)


def test_ops_are_registered_with_autograd():
    forward = torch.ops.fa_gen.attention_forward.default
    backward = torch.ops.fa_gen.attention_backward.default
    assert [a.name for a in forward._schema.arguments] == ["q", "k", "v", "spec_key", "deterministic",
                                                                    "tensors", "scalars"]
    assert len(forward._schema.returns) == 2 and len(backward._schema.returns) == 3
    assert torch._C._dispatch_has_kernel_for_dispatch_key(forward.name(), "Autograd")


def test_fake_shapes_follow_the_spec():
    key = autograd.spec_key("causal_bf16_qk192_v128")  # head_dim_v differs from head_dim_qk
    with FakeTensorMode():
        q = torch.empty(2, 37, 8, 192, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 50, 2, 192, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 50, 2, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.fa_gen.attention_forward(q, k, v, key, False, [], [])
        assert out.shape == (2, 37, 8, 128) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 37) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.fa_gen.attention_backward(out, q, k, v, out, lse, key, True, [], [])
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


def test_unregistered_spec_key_is_an_error():
    bogus = resolve_spec("full_fp16_d64").canonical_json().replace("full_fp16_d64", "never_registered")
    with pytest.raises(InputError, match="register_spec"):
        autograd.spec_from_key(bogus)
    with FakeTensorMode():
        q = torch.empty(1, 4, 1, 64, dtype=torch.float16, device="cuda")
        with pytest.raises(InputError, match="no spec registered"):
            torch.ops.fa_gen.attention_forward(q, q, q, bogus, False, [], [])


def test_spec_key_is_the_same_for_a_name_and_its_spec():
    spec = resolve_spec("causal_fp16_d64")
    assert autograd.spec_key("causal_fp16_d64") == autograd.spec_key(spec) == spec.canonical_json()
    assert autograd.spec_from_key(spec.canonical_json()) == spec


def test_meta_autograd_gives_gradients_of_input_shapes():
    q, k, v = _meta(2, 33, 4, 64), _meta(2, 40, 2, 64), _meta(2, 40, 2, 64)
    out, lse = fa_gen.attention(q, k, v, spec="causal_fp16_d64")
    assert out.requires_grad and not lse.requires_grad  # lse carries no gradient
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("by_name", [True, False], ids=["spec_name", "spec_object"])
def test_torch_compile_fullgraph_traces_forward_and_backward(by_name):
    spec = "causal_fp16_d64" if by_name else resolve_spec("causal_fp16_d64")

    class Tiny(torch.nn.Module):
        def forward(self, q, k, v):
            out, _ = fa_gen.attention(q, k, v, spec=spec)
            return (out.float() * 2).sum()

    torch._dynamo.reset()
    q, k, v = _meta(2, 33, 4, 64), _meta(2, 40, 2, 64), _meta(2, 40, 2, 64)
    # fullgraph=True: any graph break is an error. aot_eager also traces the backward graph.
    loss = torch.compile(Tiny(), fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_torch_compile_fullgraph_traces_a_spec_with_inputs():
    # relative_bias reads a (heads_q, 257) tensor; the op carries it, traced without a break.
    class Biased(torch.nn.Module):
        def forward(self, q, k, v, bias):
            out, _ = fa_gen.attention(q, k, v, spec="relative_bias", inputs={"rel_bias": bias})
            return out.float().sum()

    torch._dynamo.reset()
    q, k, v = (_meta(2, 33, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(4, 257, device="meta")
    assert torch.compile(Biased(), fullgraph=True, backend="aot_eager")(q, k, v, bias).shape == ()


def test_attention_inputs_are_checked_against_the_spec():
    q = _meta(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="needs input 'rel_bias'"):
        fa_gen.attention(q, q, q, spec="relative_bias")
    with pytest.raises(InputError, match="declares no input 'bias'"):
        fa_gen.attention(q, q, q, spec="relative_bias", inputs={"bias": q})
    wide = _meta(1, 8, 2, 128, dtype=torch.bfloat16)  # softcap's head dim
    with pytest.raises(InputError, match="'softcap' is a scalar"):
        fa_gen.attention(wide, wide, wide, spec="softcap", inputs={"softcap": wide})
    out, lse = fa_gen.attention(wide, wide, wide, spec="softcap")  # a scalar with a default may be left out
    assert out.shape == wide.shape


def test_backward_checks_inputs_before_the_device():
    spec = resolve_spec("full_fp16_d64")
    bwd = Backward(spec, "sm_80", function=None, info=None)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(InputError, match="dtype"):
        bwd(q, q.float(), q, q, q, lse)
    with pytest.raises(InputError, match="dout must have shape"):
        bwd(q[:, :4], q, q, q, q, lse)
    with pytest.raises(InputError, match="lse must be float32"):
        bwd(q, q, q, q, q, lse.half())
    with pytest.raises(InputError, match="need CUDA tensors"):
        bwd(q, q, q, q, q, lse)


def test_workspace_is_padded_and_compact():
    q = torch.zeros(2, 130, 3, 64, dtype=torch.float16)
    dq_accum, lse_log2, dpsum, semaphore = _workspace(q, 64)
    rows = 2 * ROW_ALIGN
    assert dq_accum.shape == (2, 3, rows * 64) and lse_log2.shape == dpsum.shape == (2, 3, rows)
    assert semaphore.dtype == torch.int32 and semaphore.shape[2] * 32 >= 130
    assert all(t.is_contiguous() for t in (dq_accum, lse_log2, dpsum, semaphore))
    assert dq_accum.data_ptr() % 16 == 0
    # One allocation, the parts back to back in it (views cut by as_strided: none overlaps the next).
    parts = (dq_accum, lse_log2, dpsum, semaphore)
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 1
    for part, following in zip(parts, parts[1:]):
        assert part.data_ptr() + part.numel() * 4 == following.data_ptr()
    assert semaphore.data_ptr() + semaphore.numel() * 4 == dq_accum.data_ptr() + dq_accum.untyped_storage().nbytes()


@pytest.mark.parametrize("seqlen_q", [1, 31, 32, 33, 100, 128, 129, 200, 4097])
def test_workspace_holds_every_counter_the_prepass_zeroes(seqlen_q):
    """Hopper's pre-pass zeroes the semaphores of every query tile in each of its 128-row blocks
    (templates/sm90/backward_passes.j2, prepare_rows): the semaphore row must hold them for every
    backward tile height, or the last (batch, head) writes past the workspace (a short sequence
    with 64-row tiles: two counters for one 32-row tile's room)."""
    from fa_gen.families.sm90_backward import _TILES

    q = torch.zeros(2, seqlen_q, 3, 64, dtype=torch.float16)
    semaphore = _workspace(q, 64)[-1]
    blocks = -(-seqlen_q // ROW_ALIGN)
    for tile_m in {cfg.tile_m for cfgs in _TILES.values() for cfg in cfgs}:
        assert semaphore.shape[2] >= blocks * (ROW_ALIGN // tile_m), (seqlen_q, tile_m)


def test_eager_function_hands_back_each_gradient_in_its_place(monkeypatch):
    """Plain eager calls go through autograd._EagerAttention: with the kernels replaced by CPU
    stand-ins, q, k and v get the backward's dq, dk, dv, a sink tensor that requires grad gets
    the sink gradient (and one that does not, none), and the backward sees the saved out, lse,
    inputs and deterministic flag."""
    from fa_gen.variant.sink_grad import sink_input_gradients

    batch, seqlen, heads, dim = 2, 5, 3, 64
    seen = {}

    def forward(q, k, v, spec, tensors, scalars):
        seen["forward_inputs"] = list(tensors)
        out = (q * 2 + 1).detach()
        lse = torch.randn(batch, heads, seqlen, generator=torch.Generator().manual_seed(1))
        return out, lse

    class Backward:
        def __call__(self, dout, q, k, v, out, lse, deterministic, inputs=None, checked=False):
            seen.update(dout=dout, out=out, lse=lse, deterministic=deterministic, inputs=inputs, checked=checked)
            return dout * 3, k * 0 + 4, v * 0 + 5

    monkeypatch.setattr(autograd, "_plain_eager", lambda *tensors: True)
    monkeypatch.setattr(autograd, "_forward", forward)
    monkeypatch.setattr(autograd, "build_backward", lambda spec: Backward())
    q, k, v = (torch.randn(batch, seqlen, heads, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for sink_grad in (True, False):
        sinks = torch.randn(heads, requires_grad=sink_grad)
        out, lse = fa_gen.attention(q, k, v, "sink_logit", deterministic=True, inputs={"sinks": sinks})
        assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_EagerAttentionBackward"
        assert seen["forward_inputs"][0] is sinks
        dout = torch.randn_like(out)
        wanted = (q, k, v, sinks) if sink_grad else (q, k, v)
        grads = torch.autograd.grad(out, wanted, dout)
        assert torch.equal(grads[0], dout * 3)
        assert torch.equal(grads[1], torch.full_like(k, 4)) and torch.equal(grads[2], torch.full_like(v, 5))
        assert torch.equal(seen["out"], out) and torch.equal(seen["lse"], lse)
        assert seen["deterministic"] is True and seen["inputs"]["sinks"] is sinks
        # The forward checked q, k, v and made out and lse: the eager backward checks dout alone.
        assert seen["checked"] is True
        spec = resolve_spec("sink_logit")
        if sink_grad:
            expected = sink_input_gradients(spec, {"sinks": sinks}, {"sinks"}, out, dout, lse, seqlen)["sinks"]
            assert grads[3].shape == sinks.shape and torch.allclose(grads[3], expected)
        else:
            assert sinks.grad is None


def test_a_call_with_nothing_to_differentiate_skips_the_autograd_function(monkeypatch):
    """attention_op runs the forward alone (no ctx, nothing saved) unless grad mode is on and an
    input requires grad; then it goes through _EagerAttention, whose forward saves the context."""
    saved = []
    monkeypatch.setattr(autograd, "_plain_eager", lambda *tensors: True)
    monkeypatch.setattr(autograd, "_forward", lambda q, k, v, spec, tensors, scalars: (
        q * 2, torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    setup = autograd._setup_context
    monkeypatch.setattr(autograd, "_setup_context", lambda ctx, inputs, output: (saved.append(1),
                                                                                    setup(ctx, inputs, output)))
    key = autograd.spec_key("causal_bf16_d128")
    q = torch.randn(1, 5, 2, 128)
    qg = q.clone().requires_grad_()
    out, _ = autograd.attention_op(q, q, q, key, False, [], [])
    assert torch.equal(out, q * 2) and out.grad_fn is None and not saved
    with torch.no_grad():
        out, _ = autograd.attention_op(qg, q, q, key, False, [], [])
    assert out.grad_fn is None and not saved
    out, _ = autograd.attention_op(qg, q, q, key, False, [], [])
    assert out.grad_fn is not None and saved == [1]
