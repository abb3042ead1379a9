"""Context-parallel throughput: ring attention forward + backward at 128k tokens, causal, bf16,
on every GPU of one host, beside one GPU running the whole sequence.

    torchrun --nproc_per_node 2 bench/bench_ring.py --commit $(git rev-parse --short HEAD) [--out DIR]
    torchrun --nproc_per_node 1 bench/bench_ring.py ...      # the one-GPU row alone

Rank 0 reports:
- one GPU: fa_gen.attention forward + backward over the whole sequence (the same shape);
- the ring: fa_gen.distributed.ring_attention forward + backward on each rank's zig-zag shard;
- scaling = one GPU's time / the ring's time, efficiency = scaling / N;
- overlap: the ring's programs run once without sending (each rank's shard stands in for the
  others: the same blocks computed) and once sending without computing; overlap =
  (compute + transfer - ring) / min(compute, transfer), 1 when the transfers hide entirely.
TFLOP/s counts the causal forward's FLOPs x 3.5 (forward + backward, FlashAttention's convention).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_gen  # noqa: E402
from fa_gen.distributed import Layout, ring_attention, shard  # noqa: E402
from fa_gen.distributed.blocks import KernelBlocks  # noqa: E402
from fa_gen.distributed.ring import backward_program, forward_program, run_distributed  # noqa: E402
from fa_gen.runtime import resolve_spec  # noqa: E402
from fa_gen.timing import attention_flops  # noqa: E402


def timed(fn, repeats: int, across_ranks: bool = True) -> float:
    """Median ms of fn() (with `across_ranks`, every rank starts each run together)."""
    fn()
    times = []
    for _ in range(repeats):
        if across_ranks and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_local(program):
    """A rank program with every exchange answered by what it sent: its compute alone."""
    reply, sent = None, {}
    while True:
        try:
            kind, payload = program.send(reply)
        except StopIteration as done:
            return done.value
        if kind == "start":
            sent[len(sent)] = payload
            reply = len(sent) - 1
        else:
            reply = sent.pop(payload)


def transfers_only(rank: int, layout: Layout, tensors, backward: bool):
    """The exchanges of a forward (and backward) without the attention."""
    for step in range(layout.world):
        last = step + 1 == layout.world
        handle = None if last else (yield ("start", tensors[:2]))
        if backward:
            d_handle = yield ("start", tensors[2:])
        if not last:
            yield ("wait", handle)
        if backward:
            yield ("wait", d_handle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--heads", default="32,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl")
    spec = resolve_spec("causal_bf16_d128")
    hq, hkv = map(int, args.heads.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    whole = [torch.randn(1, args.tokens, h, 128, generator=g, device="cuda").to(torch.bfloat16) for h in (hq, hkv, hkv)]
    dout_whole = torch.randn(1, args.tokens, hq, 128, generator=g, device="cuda").to(torch.bfloat16)
    flops = 3.5 * attention_flops(1, hq, args.tokens, args.tokens, 128, 128, True)
    record = {"commit": args.commit, "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "gpus": world, "tokens": args.tokens, "heads": [hq, hkv], "head_dim": 128, "mask": "causal",
              "command": " ".join(sys.argv)}

    def one_gpu():
        leaves = [t.detach().requires_grad_() for t in whole]
        out, _ = fa_gen.attention(*leaves, spec)
        torch.autograd.grad(out, leaves, dout_whole)

    if rank == 0:
        record["one_gpu_ms"] = timed(one_gpu, args.repeats, across_ranks=False)
        record["one_gpu_tflops"] = flops / record["one_gpu_ms"] / 1e9
    if world > 1:
        layout = Layout("zigzag", world, args.tokens)
        parts = [shard(t, rank, world, "zigzag") for t in whole]
        dout = shard(dout_whole, rank, world, "zigzag")

        def ring():
            leaves = [t.detach().requires_grad_() for t in parts]
            out, _ = ring_attention(*leaves, spec, layout="zigzag")
            torch.autograd.grad(out, leaves, dout)

        blocks = KernelBlocks(spec)

        def compute():
            out, lse = run_local(forward_program(rank, layout, blocks, *parts))
            run_local(backward_program(rank, layout, blocks, *parts, out.to(torch.bfloat16), lse, dout))

        payload = [*parts[1:], torch.zeros_like(parts[1], dtype=torch.float32),
                   torch.zeros_like(parts[2], dtype=torch.float32)]

        def transfers():
            run_distributed(transfers_only(rank, layout, payload[:2], False))
            run_distributed(transfers_only(rank, layout, payload, True))

        ring_ms, compute_ms, transfer_ms = (timed(f, args.repeats) for f in (ring, compute, transfers))
        if rank == 0:
            record.update(ring_ms=ring_ms, compute_ms=compute_ms, transfer_ms=transfer_ms,
                          ring_tflops=flops / ring_ms / 1e9, scaling=record["one_gpu_ms"] / ring_ms,
                          efficiency=record["one_gpu_ms"] / ring_ms / world,
                          overlap=(compute_ms + transfer_ms - ring_ms) / min(compute_ms, transfer_ms))
    if rank == 0:
        print(json.dumps({k: v for k, v in record.items() if k != "command"}, indent=1))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{record['date']}-{args.commit}-ring-{world}gpu.json").write_text(json.dumps(record, indent=1))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
