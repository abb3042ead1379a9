"""The persistent forwards' tile order (templates/common/tile_scheduler.j2) on the CPU: the
rendered tile_coords run over every tile of a grid with its host-made divisors (here plain
integers, which divmod treats the same), as host_grid sizes them."""
import types

import pytest

from fa_gen.render import render_target
from fa_gen.spec_load import load_spec
from fa_gen.target import resolve_target


def _tile_coords(mask: str, family: str):
    spec = load_spec({"name": f"sched_{mask}", "dtype": "bf16", "head_dim": 128, "mask": mask})
    arch = {"sm90": "sm_90a", "sm100": "sm_100a"}[family]
    text = render_target(resolve_target(spec, arch, "forward", family=family)).text
    source = "def tile_coords" + text.split("\ndef tile_coords", 1)[1].split("\n\n\n", 1)[0]
    namespace = {"Int32": int, "const_expr": bool, "LONGEST_FIRST": mask == "causal",
                 "cutlass": types.SimpleNamespace(max=max, min=min)}
    exec(source, namespace)
    return namespace["tile_coords"]


def _divisors(num_m_blocks: int, group_heads: int, num_bh: int, heads_q: int):
    """host_grid's tile_divisors."""
    num_groups = -(-num_bh // group_heads)
    return (max(group_heads * num_m_blocks, 1), group_heads, max(num_bh - (num_groups - 1) * group_heads, 1),
            max(heads_q, 1))


@pytest.mark.parametrize("family", ["sm90", "sm100"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("num_m_blocks,heads_q,batch,group_heads", [
    (8, 16, 2, 4),      # groups of four heads, none short
    (5, 6, 3, 4),       # 18 (batch, head) pairs: four groups of 4, a last of 2
    (1, 3, 7, 32),      # one group larger than the batch's pairs
    (13, 1, 1, 1),
])
def test_tile_coords_visits_every_tile_once_in_l2_groups(family, mask, num_m_blocks, heads_q, batch, group_heads):
    tile_coords = _tile_coords(mask, family)
    num_bh = heads_q * batch
    group_heads = min(group_heads, num_bh)
    divisors = _divisors(num_m_blocks, group_heads, num_bh, heads_q)
    order = [tile_coords(t, num_m_blocks, group_heads, num_bh, divisors) for t in range(num_m_blocks * num_bh)]
    assert sorted(order) == sorted((m, h, b) for b in range(batch) for h in range(heads_q) for m in range(num_m_blocks))
    # Within a group the query-tile rank is the slow index: the group's pairs take rank 0 first
    # (causal: the longest query tile, the last), in (batch, head) order.
    first = order[:group_heads]
    assert [b * heads_q + h for _, h, b in first] == list(range(group_heads))
    assert {m for m, _, _ in first} == {num_m_blocks - 1 if mask == "causal" else 0}
    # The next group starts only after this one's every tile.
    span = group_heads * num_m_blocks
    assert {b * heads_q + h for _, h, b in order[:span]} == set(range(min(group_heads, num_bh)))
