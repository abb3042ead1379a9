"""Per-call classification of every (query tile, key tile) pair under a mask expression.

For each tile the mask is NEVER true (skip it: no load, no MMA), ALWAYS true (no
element mask) or MAYBE (apply the element mask). One interval walk over the whole
grid decides every tile at once: q_idx and kv_idx are the tiles' index ranges, b
and h are single values where the mask depends on them (else their full range),
sizes and scalars are this call's values. Data-dependent masks read tensor inputs;
for those, the per-tile minimum and maximum of each input (over the rows of the
tile along seqlen dimensions, over everything along fixed-size ones) is the cheap
metadata the walk uses, computed here once per call.

Rows past seqlen_q and keys past seqlen_k are not part of any tile's range: the
kernel bounds-checks those separately, as it always does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .bind import bind_inputs
from .inputs import InputDecl, find_input
from .intervals import Interval, Tri, bounds, tri_codes
from .tree import Node, Type, names_used

_F64 = torch.float64
# Canonical axes of the classification grid: (batch, head, query tile, key tile).
_AXIS = {"batch": 0, "heads_q": 1, "seqlen_q": 2, "seqlen_k": 3}


def classify_tiles(mask: Node, decls: tuple[InputDecl, ...], inputs: Mapping | None, *, batch: int,
                   heads_q: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
                   device=None) -> torch.Tensor:
    """int8 Tri codes of shape (batch or 1, heads_q or 1, ceil(seqlen_q / tile_m), ceil(seqlen_k / tile_n)).

    The batch (head) axis has size 1 when the mask does not depend on b (h).
    """
    assert mask.type is Type.BOOL, "classify_tiles takes a mask"
    sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    values = bind_inputs(decls, inputs, sizes)
    used = names_used(mask)
    per_batch, per_head = "b" in used, "h" in used
    env = _index_env(sizes, tile_m, tile_n, per_batch, per_head, device)
    for name in used:
        decl = find_input(decls, name)
        if decl is None:
            continue
        if decl.is_scalar:
            env[name] = Interval.point(values[name])
        else:
            env[name] = tile_bounds(values[name], decl, tile_m, tile_n, per_batch, per_head)
    codes = tri_codes(bounds(mask, env))
    grid = (batch if per_batch else 1, heads_q if per_head else 1,
            _num_tiles(seqlen_q, tile_m), _num_tiles(seqlen_k, tile_n))
    return torch.broadcast_to(codes.to(device) if device else codes, grid).contiguous()


def _num_tiles(length: int, tile: int) -> int:
    return -(-length // tile)


def _index_env(sizes: dict, tile_m: int, tile_n: int, per_batch: bool, per_head: bool, device) -> dict:
    env = {"seqlen_q": Interval.point(sizes["seqlen_q"]), "seqlen_k": Interval.point(sizes["seqlen_k"]),
           "heads_q": Interval.point(sizes["heads_q"])}
    env["q_idx"] = _tile_ranges(sizes["seqlen_q"], tile_m, axis=2, device=device)
    env["kv_idx"] = _tile_ranges(sizes["seqlen_k"], tile_n, axis=3, device=device)
    env["b"] = _each_or_all(sizes["batch"], per_batch, axis=0, device=device)
    env["h"] = _each_or_all(sizes["heads_q"], per_head, axis=1, device=device)
    return env


def _grid_view(x: torch.Tensor, axis: int) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[axis] = x.numel()
    return x.view(shape)


def _tile_ranges(length: int, tile: int, axis: int, device) -> Interval:
    """Index range of each tile, [t * tile, min((t + 1) * tile, length) - 1], along grid `axis`."""
    lo = torch.arange(_num_tiles(length, tile), dtype=_F64, device=device) * tile
    hi = torch.clamp(lo + tile, max=length) - 1
    return Interval(_grid_view(lo, axis), _grid_view(hi, axis))


def _each_or_all(count: int, each: bool, axis: int, device) -> Interval:
    if each:
        values = _grid_view(torch.arange(count, dtype=_F64, device=device), axis)
        return Interval(values, values)
    return Interval.of(0, max(count - 1, 0))


def tile_bounds(tensor: torch.Tensor, decl: InputDecl, tile_m: int, tile_n: int,
                per_batch: bool, per_head: bool) -> Interval:
    """Bounds of a tensor input's elements per grid cell, shaped to broadcast against the grid.

    A seqlen_q (seqlen_k) dimension reduces per query (key) tile; batch and heads_q dimensions stay
    per entry when the mask reads b / h pointwise; every other dimension reduces whole.
    """
    lo = hi = tensor.to(_F64)
    axes = []
    for dim, size in enumerate(decl.shape):
        if size in ("seqlen_q", "seqlen_k"):
            tile = tile_m if size == "seqlen_q" else tile_n
            lo, hi = _tile_reduce(lo, dim, tile, torch.amin), _tile_reduce(hi, dim, tile, torch.amax)
            axes.append(_AXIS[size])
        elif (size == "batch" and per_batch) or (size == "heads_q" and per_head):
            axes.append(_AXIS[size])
        else:
            lo, hi = lo.amin(dim, keepdim=True), hi.amax(dim, keepdim=True)
            axes.append(None)
    return Interval(_to_grid(lo, axes), _to_grid(hi, axes))


def _tile_reduce(x: torch.Tensor, dim: int, tile: int, reduce) -> torch.Tensor:
    """Reduce `dim` in blocks of `tile` (the last block may be short: padding never wins)."""
    length = x.shape[dim]
    pad = _num_tiles(length, tile) * tile - length
    if pad:
        fill = float("inf") if reduce is torch.amin else float("-inf")
        pad_shape = list(x.shape)
        pad_shape[dim] = pad
        x = torch.cat([x, torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)], dim=dim)
    blocks = x.shape[:dim] + (_num_tiles(length, tile), tile) + x.shape[dim + 1:]
    return reduce(x.reshape(blocks), dim=dim + 1)


def _to_grid(x: torch.Tensor, axes: list) -> torch.Tensor:
    """Move each kept dimension to its grid axis; reduced (size-1) dimensions drop out."""
    kept = [(axis, dim) for dim, axis in enumerate(axes) if axis is not None]
    x = x.reshape([x.shape[dim] for _, dim in kept]) if kept else x.reshape(())
    order = sorted(range(len(kept)), key=lambda i: kept[i][0])
    x = x.permute(order)
    shape = [1, 1, 1, 1]
    for i in order:
        shape[kept[i][0]] = x.shape[order.index(i)]
    return x.reshape(shape)


# Columns of a key-tile list row before the tile indices: (masked tiles, all visited tiles).
LIST_HEADER = 2
# -1 entries after the last key tile's column: a kernel reads the entries one and two places
# ahead of the tile it is on (its prefetches) without bounds checks.
LIST_PAD = 2


def key_tile_lists(codes: torch.Tensor, seqlen_k: int, tile_n: int) -> torch.Tensor:
    """int32 (batch or 1, heads_q or 1, query tiles, 2 + key tiles): per query tile, the key tiles
    a kernel visits, from `classify_tiles` codes.

    Row layout: [n_masked, n_visit, tile_0, tile_1, ..., -1, ...]. tile_0 .. tile_{n_masked-1} take the
    element mask (MAYBE), highest index first; tile_{n_masked} .. tile_{n_visit-1} are ALWAYS
    visible (no element mask), highest first; NEVER tiles are left out (never loaded). Entries
    past n_visit are -1, and every row ends in LIST_PAD more. A key tile holding the seqlen_k tail is MAYBE whatever the mask
    says (its keys past seqlen_k need the bounds check), and, being the highest visited tile,
    comes first: kernels bounds-check only their first tile. The batch (head) axis keeps size 1
    when the codes do (mask independent of b / h): kernels index it with min(b, size - 1).
    """
    codes = codes.to(torch.int32)
    if seqlen_k % tile_n:
        tail = codes[..., -1]
        codes = codes.clone()
        codes[..., -1] = torch.where(tail == int(Tri.ALWAYS), int(Tri.MAYBE), tail)
    num_n = codes.shape[-1]
    masked, always = codes == int(Tri.MAYBE), codes == int(Tri.ALWAYS)
    # Sort key: masked tiles, then always-visible ones, then never-visible ones; descending index in each.
    group = torch.where(masked, 0, torch.where(always, 1, 2))
    descending = num_n - 1 - torch.arange(num_n, device=codes.device, dtype=torch.int32)
    order = torch.argsort(group * num_n + descending, dim=-1).to(torch.int32)
    n_masked = masked.sum(dim=-1, dtype=torch.int32)
    n_visit = n_masked + always.sum(dim=-1, dtype=torch.int32)
    position = torch.arange(num_n + LIST_PAD, device=codes.device, dtype=torch.int32)
    order = torch.nn.functional.pad(order, (0, LIST_PAD))
    order = torch.where(position < n_visit[..., None], order, -1)
    return torch.cat([n_masked[..., None], n_visit[..., None], order], dim=-1).to(torch.int32).contiguous()


def visit_order(lists: torch.Tensor, batch: int, heads_q: int) -> torch.Tensor:
    """int32 (batch * heads_q * query tiles,): the query tiles, as linear indices
    ((batch * heads_q + head) * query tiles + m_block), head by head, and within each head the
    ones visiting the most key tiles first.

    Head by head: the CTAs running at one time then share K/V through L2. A global longest-first
    order loses that: on an H200 (sm90, bf16, d128) it was 12-15% slower than head order for
    document, chunked-causal, prefix-LM and sink-token masks at s = 1k and 8k.
    """
    num_m = lists.shape[2]
    visits = lists[..., 1].expand(batch, heads_q, num_m).reshape(-1).to(torch.int64)
    head = torch.arange(visits.numel(), device=visits.device) // num_m
    return torch.argsort(head * (num_m * 2 + 1) - visits, stable=True).to(torch.int32)


def query_tile_lists(codes: torch.Tensor, seqlen_k: int, tile_n: int, group: int) -> torch.Tensor:
    """int32 (batch or 1, heads_kv or 1, key tiles, 1 + 2 * width), width = group * query tiles + 1:
    per key tile of one K/V head, the (query head, query tile) pairs a backward pass visits, from
    `classify_tiles` codes made with the backward's tile sizes (the transpose of key_tile_lists).

    A backward CTA owns one key tile of one K/V head and walks the query tiles of each of the
    `group` = heads_q / heads_kv query heads that share that K/V head, so one row lists them all: [n_visit, entry_0 .. entry_{width-1}, turn_0 .. turn_{width-1}], where
        entry = ((g * query tiles + m_block) << 1) | masked
    for the g-th query head of the group, with `masked` set for MAYBE tiles (they take the element
    mask), and turn = how many lower key tiles visit that (head, query tile): in deterministic
    mode a CTA adds its dQ after exactly that many others have. Per head, MAYBE tiles come first,
    then ALWAYS ones, each in ascending order; NEVER tiles are left out. Entries and turns past
    n_visit are -1 (at least one: a kernel may read one entry ahead of its last). The key tile
    holding the seqlen_k tail is MAYBE for every query tile that sees it (its keys past seqlen_k
    need the bounds check). The head axis keeps size 1 when the codes do (mask independent of h);
    kernels index it with min(head_kv, size - 1).
    """
    codes = codes.to(torch.int32)
    if seqlen_k % tile_n:
        codes = codes.clone()
        codes[..., -1] = torch.where(codes[..., -1] == int(Tri.ALWAYS), int(Tri.MAYBE), codes[..., -1])
    visit = codes != int(Tri.NEVER)
    masked = codes == int(Tri.MAYBE)
    # (.., m, n): lower key tiles that visit the same (head, query tile).
    turns = torch.cumsum(visit.to(torch.int32), dim=-1, dtype=torch.int32) - visit.to(torch.int32)
    batch, heads, num_m, num_n = codes.shape
    heads_kv, per_group = (heads // group, group) if heads > 1 else (1, 1)

    def by_key_tile(x: torch.Tensor) -> torch.Tensor:
        # (b, heads, m, n) -> (b, heads_kv, n, group * m): a key tile's candidates, head by head.
        x = x.reshape(batch, heads_kv, per_group, num_m, num_n).expand(batch, heads_kv, group, num_m, num_n)
        return x.permute(0, 1, 4, 2, 3).reshape(batch, heads_kv, num_n, group * num_m)

    visit, masked, turns = by_key_tile(visit), by_key_tile(masked), by_key_tile(turns)
    width = group * num_m
    slot = torch.arange(width, device=codes.device, dtype=torch.int64)
    head_of, m_of = slot // num_m, slot % num_m
    # Sort key: head, then masked before always-visible, then m; unvisited ones last.
    key = head_of * 2 * num_m + (~masked).to(torch.int64) * num_m + m_of
    key = torch.where(visit, key, 2 * width)
    order = torch.argsort(key, dim=-1)
    entries = ((slot << 1) | masked.to(torch.int64)).gather(-1, order)
    turns = turns.to(torch.int64).gather(-1, order)
    n_visit = visit.sum(dim=-1, dtype=torch.int32)
    listed = torch.arange(width + 1, device=codes.device) < n_visit[..., None]
    entries = torch.where(listed, torch.nn.functional.pad(entries, (0, 1)), -1)
    turns = torch.where(listed, torch.nn.functional.pad(turns, (0, 1)), -1)
    return torch.cat([n_visit[..., None], entries.to(torch.int32), turns.to(torch.int32)], dim=-1).contiguous()
