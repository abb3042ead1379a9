"""The ring: what one rank computes, as a program that asks for its K/V exchanges, and the two
drivers that run such programs (torch.distributed point-to-point, or N ranks simulated in one
process, which runs the very same programs).

A rank program is a generator. It yields ("start", tensors) to send `tensors` to the next rank
while receiving the previous rank's, and gets back a handle; later it yields ("wait", handle)
and gets the received tensors. Between the two it computes, so on NCCL the exchange overlaps
the local attention. It returns its results.

Forward, rank r, step t = 0 .. N-1: the K/V shard of rank (r - t) mod N is at hand; every
(query chunk, key chunk) pair of the two shards is attended (fa_gen.distributed.blocks) and
merged into the running (out, LSE) by the LSE rule. Backward: the K/V shards travel the same
way with their dK/dV accumulators, each rank adding its share; after the last step one more hop
brings every accumulator home. Sums run in a fixed order (the ring's), so with deterministic
blocks the gradients are bitwise reproducible.
"""

from __future__ import annotations

import math

import torch

from .layout import Layout


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """(out, lse) <- their LSE merge with (part_out, part_lse), in place; out (b, L, h, d) fp32/64,
    lse (b, h, L); -inf LSEs (no key seen) weigh 0."""
    new = torch.logaddexp(lse, part_lse.to(lse.dtype))
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    keep = torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.exp(lse - safe))
    take = torch.where(torch.isinf(part_lse), torch.zeros_like(new), torch.exp(part_lse.to(lse.dtype) - safe))
    out.mul_(keep.transpose(1, 2).unsqueeze(-1)).add_(part_out.to(out.dtype) * take.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def _block_pairs(layout: Layout, rank: int, source: int):
    """(query chunk, key chunk, its rows in the query shard, its rows in the K/V shard) for every
    chunk of rank `rank`'s queries against every chunk of rank `source`'s keys."""
    for qc in layout.chunks(rank):
        for kc in layout.chunks(source):
            yield qc, kc, slice(qc.offset, qc.offset + qc.length), slice(kc.offset, kc.offset + kc.length)


def forward_program(rank: int, layout: Layout, blocks, q, k, v, accumulate=torch.float32):
    """Rank `rank`'s forward: (out (b, Lq, hq, dv), lse (b, hq, Lq)), both in `accumulate`."""
    batch, length, heads, _ = q.shape
    out = torch.zeros(batch, length, heads, v.shape[-1], dtype=accumulate, device=q.device)
    lse = torch.full((batch, heads, length), -math.inf, dtype=accumulate, device=q.device)
    kv = (k, v)
    for step in range(layout.world):
        last = step + 1 == layout.world
        handle = None if last else (yield ("start", kv))
        for qc, kc, rows, keys in _block_pairs(layout, rank, (rank - step) % layout.world):
            part = blocks.forward(q[:, rows], kv[0][:, keys], kv[1][:, keys], qc, kc)
            if part is not None:
                merge_into(out[:, rows], lse[:, :, rows], *part)
        if not last:
            kv = yield ("wait", handle)
    return out, lse


def backward_program(rank: int, layout: Layout, blocks, q, k, v, out, lse, dout, accumulate=torch.float32):
    """Rank `rank`'s backward: (dq, dk, dv) of its shards in `accumulate`, given the forward's
    merged out and LSE of its query rows and the upstream gradient."""
    dq = torch.zeros(q.shape, dtype=accumulate, device=q.device)
    dkv = (torch.zeros(k.shape, dtype=accumulate, device=k.device), torch.zeros(v.shape, dtype=accumulate,
                                                                                device=v.device))
    kv = (k, v)
    for step in range(layout.world):
        last = step + 1 == layout.world
        kv_handle = None if last else (yield ("start", kv))
        source = (rank - step) % layout.world
        for qc, kc, rows, keys in _block_pairs(layout, rank, source):
            grads = blocks.backward(dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows],
                                    lse[:, :, rows], qc, kc)
            if grads is not None:
                dq[:, rows] += grads[0]
                dkv[0][:, keys] += grads[1]
                dkv[1][:, keys] += grads[2]
        # dK/dV of shard `source` go on with it; after the last step the hop takes them home.
        dkv_handle = yield ("start", dkv)
        if not last:
            kv = yield ("wait", kv_handle)
        dkv = yield ("wait", dkv_handle)
    return dq, dkv[0], dkv[1]


def run_simulated(programs: list):
    """Run N rank programs in one process, rank r's sends reaching rank r + 1 (mod N); returns
    their results in rank order. Each sent tensor is copied, as a transfer would."""
    world = len(programs)
    mailbox: list[dict] = [{} for _ in range(world)]
    sent = [0] * world
    reply: list = [None] * world
    waiting: dict[int, int] = {}
    results: list = [None] * world
    active = list(range(world))
    while active:
        progressed = False
        for rank in list(active):
            if rank in waiting:
                if waiting[rank] not in mailbox[rank]:
                    continue
                reply[rank] = mailbox[rank].pop(waiting.pop(rank))
            try:
                kind, payload = programs[rank].send(reply[rank])
            except StopIteration as done:
                results[rank] = done.value
                active.remove(rank)
                progressed = True
                continue
            progressed = True
            if kind == "start":
                handle = sent[rank]
                sent[rank] += 1
                mailbox[(rank + 1) % world][handle] = tuple(t.clone() for t in payload)
                reply[rank] = handle
            else:
                waiting[rank] = payload
                reply[rank] = None
        if not progressed:
            raise RuntimeError(f"the simulated ring is stuck: ranks {sorted(waiting)} wait for messages never sent")
    return results


def run_distributed(program, group=None):
    """Run this process's rank program over torch.distributed: each exchange is a batch of
    isend (to the next rank) and irecv (from the previous) issued at "start" and waited at
    "wait", so the computation between them overlaps the transfer."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [(rank + 1) % world, (rank - 1) % world]
    if group is not None:
        peers = [dist.get_global_rank(group, p) for p in peers]
    handles: dict[int, tuple] = {}
    reply = None
    while True:
        try:
            kind, payload = program.send(reply)
        except StopIteration as done:
            return done.value
        if kind == "start":
            tensors = [t.contiguous() for t in payload]
            received = [torch.empty_like(t) for t in tensors]
            ops = [dist.P2POp(dist.isend, t, peers[0], group) for t in tensors]
            ops += [dist.P2POp(dist.irecv, t, peers[1], group) for t in received]
            handle = len(handles)
            handles[handle] = (dist.batch_isend_irecv(ops), received)
            reply = handle
        else:
            works, received = handles.pop(payload)
            for work in works:
                work.wait()
            reply = tuple(received)
