"""L0 (CPU): context-parallel ring attention's logic (issue 21) with float64 reference blocks.

The ring over 2, 3 and 4 ranks, contiguous and zig-zag layouts, for every mask kind, mask and
score-mod expressions, GQA: outputs, LSE and gradients match fa_gen.reference's attention over
the whole sequence. The simulated ranks run the very rank programs that torch.distributed runs;
the last tests run those through torch.distributed itself (gloo, one process per rank).
"""

from __future__ import annotations

import io
import math
import os

import pytest
import torch

from fa_gen.distributed import Layout, shard, simulate_ring_attention, unshard
from fa_gen.distributed.blocks import DIAGONAL, FULL, HIDDEN, PARTIAL, KernelBlocks, classify
from fa_gen.distributed.layout import Chunk
from fa_gen.distributed.ring import merge_into, run_simulated
from fa_gen.errors import InputError, UnsupportedError
from fa_gen.reference import attention_reference
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec

# Specs with their inputs (document ids per token cross the shards' boundaries on purpose).
SPECS = ["full_bf16_d128", "causal_bf16_d128", "sliding_window_bf16_d128", "causal_topleft_fp16_d96",
         "alibi", "softcap", "document", "chunked_causal", "prefix_lm"]


def _inputs(spec, batch: int, seqlen: int, generator):
    """Values for the spec's inputs that make the mask cross the shards' boundaries."""
    if spec.name == "document":
        ids = torch.sort(torch.randint(0, 4, (batch, seqlen), generator=generator), dim=1).values.to(torch.int32)
        return {"q_doc": ids, "kv_doc": ids}
    if spec.name == "prefix_lm":
        return {"prefix_len": torch.randint(0, seqlen, (batch,), generator=generator, dtype=torch.int32)}
    return {"chunk": 7} if spec.name == "chunked_causal" else {"softcap": 2.0} if spec.name == "softcap" else None


def _qkv(spec, batch, seqlen, generator, heads_q=4, heads_kv=2):
    def draw(h, d):
        return torch.randn(batch, seqlen, h, d, generator=generator, dtype=torch.float64).requires_grad_()
    return draw(heads_q, spec.head_dim_qk), draw(heads_kv, spec.head_dim_qk), draw(heads_kv, spec.head_dim_v)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("world,layout", [(2, "contiguous"), (3, "zigzag"), (4, "zigzag"), (4, "contiguous")])
def test_ring_matches_whole_sequence_reference(name, world, layout):
    spec = resolve_spec(name)
    generator = torch.Generator().manual_seed(world * 31 + len(name))
    seqlen = 10 * world * (2 if layout == "zigzag" else 1)
    q, k, v = _qkv(spec, 2, seqlen, generator)
    inputs = _inputs(spec, 2, seqlen, generator)
    out, lse = simulate_ring_attention(q, k, v, spec, world, layout, inputs=inputs)
    ref, ref_lse = attention_reference(q, k, v, spec, inputs=inputs)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)) and torch.allclose(lse[seen], ref_lse[seen], rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for label, got, want in zip("qkv", grads, ref_grads):
        assert torch.allclose(got, want, rtol=0, atol=1e-11), f"d{label}: {(got - want).abs().max()}"


def test_layouts_cut_and_join_the_sequence():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for kind in ("contiguous", "zigzag"):
        for world in (1, 2, 3, 4):
            parts = [shard(x, r, world, kind) for r in range(world)]
            assert all(p.shape[1] == 24 // world for p in parts)
            assert torch.equal(unshard(parts, kind), x)
    # Zig-zag: rank r holds chunks r and 2N - 1 - r.
    assert Layout("zigzag", 3, 24).chunks(1) == (Chunk(4, 0, 4), Chunk(16, 4, 4))
    with pytest.raises(InputError, match="not a multiple of 6"):
        Layout("zigzag", 3, 20)
    with pytest.raises(InputError, match="layout must be one of"):
        Layout("ring", 2, 8)


def test_block_classification_at_global_positions():
    causal, full = resolve_spec("causal_bf16_d128"), resolve_spec("full_bf16_d128")
    window = load_spec({"name": "w", "dtype": "bf16", "head_dim": 64, "mask": {"kind": "sliding_window", "left": 5, "right": 0}})
    a, b, c = Chunk(0, 0, 8), Chunk(8, 0, 8), Chunk(16, 0, 8)
    assert classify(causal, b, a) == FULL and classify(causal, a, b) == HIDDEN and classify(causal, b, b) == DIAGONAL
    assert classify(full, a, c) == FULL
    # Keys 8..15 for queries 16..23 under a 5-key window: partly visible, off the diagonal.
    assert classify(window, c, b) == PARTIAL and classify(window, c, a) == HIDDEN and classify(window, c, c) == DIAGONAL


def test_kernel_blocks_refuse_what_a_shift_does_not_move():
    from fa_gen.distributed.blocks import kernel_reasons

    with pytest.raises(UnsupportedError, match="mask expression"):
        KernelBlocks(resolve_spec("document"))
    with pytest.raises(UnsupportedError, match="score mod reads positions"):
        KernelBlocks(resolve_spec("alibi"))
    window = load_spec({"name": "w", "dtype": "bf16", "head_dim": 64, "mask": {"kind": "sliding_window", "left": 5, "right": 0}})
    # The window's diagonal and a score mod of the score alone: served.
    assert kernel_reasons(resolve_spec("softcap")) == [] and kernel_reasons(window) == []
    with pytest.raises(UnsupportedError, match="sink logit"):
        simulate_ring_attention(*_qkv(resolve_spec("sink_logit"), 1, 8, torch.Generator().manual_seed(0)),
                                "sink_logit", 2)


def test_shifted_kinds_are_rendered_where_the_shift_is_all_that_moves():
    """forward_shifted / backward_shifted: per-call kinds of the sm90 and sm80 families, refused for
    mask expressions; the kernels take the offset as their last parameter (after the spec's inputs)."""
    from fa_gen.render import render_target
    from fa_gen.target import resolve_target

    for arch, family in (("sm_90a", "sm90"), ("sm_80", "sm80")):
        for kind in ("forward_shifted", "backward_shifted"):
            target = resolve_target(resolve_spec("softcap"), arch, kind)
            assert target.family.name == family
            text = render_target(target).text
            assert "key_offset = position_shift" in text
            assert text.index("x_softcap: Float32") < text.index("position_shift: Int32")
        with pytest.raises(UnsupportedError, match="mask expression"):
            resolve_target(resolve_spec("document"), arch, "forward_shifted")


def test_bad_calls_are_refused():
    q, k, v = _qkv(resolve_spec("causal_bf16_d128"), 1, 12, torch.Generator().manual_seed(1))
    with pytest.raises(InputError, match="agree in batch and seqlen"):
        simulate_ring_attention(q, k[:, :6], v[:, :6], "causal_bf16_d128", 2)
    with pytest.raises(InputError, match="not a multiple"):
        simulate_ring_attention(q, k, v, "causal_bf16_d128", 5)
    with pytest.raises(InputError, match="needs CUDA tensors"):
        simulate_ring_attention(q, k, v, "causal_bf16_d128", 2, blocks="kernels")


def test_merge_weighs_empty_parts_zero():
    out = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    lse = torch.full((1, 1, 2), -math.inf, dtype=torch.float64)
    part = torch.ones(1, 2, 1, 4, dtype=torch.float64)
    merge_into(out, lse, part, torch.tensor([[[0.0, -math.inf]]], dtype=torch.float64))
    assert torch.equal(out[0, 0, 0], torch.ones(4)) and torch.equal(out[0, 1, 0], torch.zeros(4))
    assert lse[0, 0, 0] == 0 and lse[0, 0, 1] == -math.inf


def test_a_stuck_ring_says_so():
    def waits_forever():
        yield ("wait", 0)

    with pytest.raises(RuntimeError, match="stuck"):
        run_simulated([waits_forever(), waits_forever()])


def _rank_main(rank, world, layout, port, results):
    import torch.distributed as dist

    from fa_gen.distributed import ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = resolve_spec("causal_bf16_d128")
        q, k, v = (t.detach() for t in _qkv(spec, 1, 8 * world, torch.Generator().manual_seed(5)))
        parts = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(*parts, spec, layout=layout)
        dout = shard(torch.randn(out.shape[0], q.shape[1], *out.shape[2:], generator=torch.Generator().manual_seed(6),
                                 dtype=torch.float64), rank, world, layout)
        grads = torch.autograd.grad(out, parts, dout)
        # As bytes: a tensor in a queue lives in this process's shared memory, gone when it exits.
        buffer = io.BytesIO()
        torch.save((out.detach(), lse, [g.detach() for g in grads]), buffer)
        results.put((rank, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "contiguous")])
def test_the_same_programs_through_torch_distributed(world, layout):
    """One process per rank over gloo: the shards' outputs and gradients put together equal the
    whole sequence's reference."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank_main, args=(r, world, layout, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: torch.load(io.BytesIO(data)) for r, data in (results.get(timeout=120) for _ in range(world))}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    spec = resolve_spec("causal_bf16_d128")
    q, k, v = _qkv(spec, 1, 8 * world, torch.Generator().manual_seed(5))
    ref, ref_lse = attention_reference(q, k, v, spec)
    out = unshard([got[r][0] for r in range(world)], layout)
    lse = unshard([got[r][1] for r in range(world)], layout, dim=2)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12) and torch.allclose(lse, ref_lse, rtol=0, atol=1e-12)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for i, want in enumerate(torch.autograd.grad(ref, (q, k, v), dout)):
        assert torch.allclose(unshard([got[r][2][i] for r in range(world)], layout), want, rtol=0, atol=1e-11)
