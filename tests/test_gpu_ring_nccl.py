"""L1 on two or more GPUs (issue 21): ring_attention through NCCL, one process per GPU, gives bit for bit
what the one-GPU simulation of the same ranks gives (deterministic kernels), and so matches the
float64 reference of the whole sequence as tests/test_gpu_distributed.py checks the simulation.

    python -m pytest -m gpu tests/test_gpu_ring_nccl.py        (on a host with 2+ GPUs)
"""

from __future__ import annotations

import io
import os
import socket

import pytest
import torch

from fa_gen.distributed import Layout, shard, simulate_ring_attention, unshard
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (NCCL ring)"),
]

SEQLEN = 1536


def _inputs(spec, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    q, k, v = (torch.randn(2, SEQLEN, h, d, generator=g).to(dtype)
               for h, d in ((8, spec.head_dim_qk), (2, spec.head_dim_qk), (2, spec.head_dim_v)))
    dout = torch.randn(2, SEQLEN, 8, spec.head_dim_v, generator=g).to(dtype)
    return q, k, v, dout


def _rank_main(rank, world, name, layout, inputs, port, results):
    import torch.distributed as dist

    from fa_gen.distributed import ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        spec = resolve_spec(name)
        q, k, v, dout = _inputs(spec, 11)
        parts = [shard(t, rank, world, layout).cuda().requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(*parts, spec, layout=layout, deterministic=True, inputs=inputs)
        grads = torch.autograd.grad(out, parts, shard(dout, rank, world, layout).cuda())
        buffer = io.BytesIO()
        torch.save([t.detach().cpu() for t in (out, lse, *grads)], buffer)
        results.put((rank, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,layout", [("causal_bf16_d128", "zigzag"), ("softcap", "zigzag"),
                                         ("sliding_window_bf16_d128", "contiguous"), ("full_fp16_d64", "contiguous")])
def test_nccl_ring_equals_the_simulated_ring(name, layout):
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    inputs = {"softcap": 7.0} if name == "softcap" else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank_main, args=(r, world, name, layout, inputs, port, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {r: torch.load(io.BytesIO(data)) for r, data in (results.get(timeout=300) for _ in range(world))}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ring = [unshard([got[r][i] for r in range(world)], layout, dim=2 if i == 1 else 1) for i in range(5)]

    spec = resolve_spec(name)
    q, k, v, dout = (t.cuda() for t in _inputs(spec, 11))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = simulate_ring_attention(*leaves, spec, world, layout, deterministic=True, inputs=inputs)
    grads = torch.autograd.grad(out, leaves, dout)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), ring, (out, lse, *grads)):
        assert torch.equal(a, b.cpu()), f"{label}: the NCCL ring differs from the simulated ring"
    # And the simulation (so the NCCL ring) against the whole sequence's float64 reference.
    ref, _ = attention_reference(q, k, v, spec, inputs=inputs)
    same = attention_same_precision(q, k, v, spec, inputs=inputs)
    blocks = len(Layout(layout, world, SEQLEN).chunks(0)) * world
    tol = 2 * (same.double() - ref).abs().max().item() + (blocks + 1) * ref.abs().max().item() * torch.finfo(q.dtype).eps
    assert (out.double() - ref).abs().max().item() <= tol
