"""L1: the runtime on a GPU: streams, CUDA graphs, the one-liner, device errors."""

from __future__ import annotations

import pytest
import torch

from fa_gen.check import Shape, compare, random_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPEC = "causal_bf16_d128"


@pytest.fixture(scope="module")
def kernel():
    import fa_gen

    return fa_gen.build(SPEC)


def _inputs(kernel, shape=Shape(2, 300, 517, 8, 2), seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return random_inputs(kernel.spec, shape, torch.bfloat16, "cuda", gen)


def test_launches_on_the_current_stream(kernel):
    # Graph capture fails if the kernel launches anywhere but the capturing stream,
    # and replaying the graph must recompute the output from new inputs in place.
    q, k, v = _inputs(kernel)
    out, lse = kernel(q, k, v)          # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = kernel(q, k, v)
    for seed in (1, 2):
        q2, k2, v2 = _inputs(kernel, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        assert compare(kernel.spec, q, k, v, out, lse).ok


def test_side_stream_orders_with_producers(kernel):
    q, k, v = _inputs(kernel)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)     # delay the side stream so a wrong stream would race
        q2 = q * 1.0
        out, lse = kernel(q2, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert compare(kernel.spec, q, k, v, out, lse).ok


def test_one_liner_matches_build(kernel):
    import fa_gen

    q, k, v = _inputs(kernel)
    out1, lse1 = fa_gen.attention(q, k, v, spec=SPEC)
    out2, lse2 = kernel(q, k, v)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_mixed_devices_are_refused(kernel):
    from fa_gen.errors import InputError

    q, k, v = _inputs(kernel)
    with pytest.raises(InputError, match="need CUDA tensors"):
        kernel(q, k.cpu(), v)
