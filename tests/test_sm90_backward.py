"""L0: the Hopper backward serves every head dim the Hopper forward does, within its tile limits."""

from __future__ import annotations

import pytest

from fa_gen.backward import backward_family
from fa_gen.families import base, sm90_backward
from fa_gen.families.sm90 import Sm90Family
from fa_gen.spec_load import load_spec

SERVED = (64, 96, 128, 192, 256, {"qk": 192, "v": 128})
WIDE = (192, 256, {"qk": 192, "v": 128})


def _spec(head_dim, mask="causal"):
    return load_spec({"name": "t", "dtype": "bf16", "head_dim": head_dim, "mask": mask})


@pytest.mark.parametrize("head_dim", SERVED, ids=str)
def test_hopper_backward_serves_every_hopper_forward_head_dim(head_dim):
    spec = _spec(head_dim)
    assert backward_family(spec, "sm_90a") == "sm90"
    assert "backward" in Sm90Family().kernel_files(spec)


@pytest.mark.parametrize("head_dim", SERVED, ids=str)
def test_served_tiles_fit_registers_and_shared_memory(head_dim):
    spec = _spec(head_dim, mask="none")
    assert sm90_backward.backward_reasons(spec, "sm_90a") == []
    context = sm90_backward.kind_context(spec, "sm_90a")
    assert context["bwd_smem_bytes"] <= 227 * 1024
    assert 128 % context["bwd"]["tile_m"] == 0
    # The pre-pass splits each row of O / dO evenly over its lanes.
    assert (spec.head_dim_v // 8) % context["bwd_prepare_lanes"] == 0
    cfg = sm90_backward.backward_tile_config(spec, "sm_90a")
    assert cfg.accumulators(spec.head_dim_qk, spec.head_dim_v) <= 192


@pytest.mark.parametrize("head_dim", WIDE, ids=str)
def test_large_head_dims_split_dk_dv_across_warpgroups(head_dim):
    """Whole-head-dim dK and dV of 64 keys would need 192-256 fp32 registers per thread."""
    spec = _spec(head_dim)
    cfg = sm90_backward.backward_tile_config(spec, "sm_90a")
    assert cfg.wide and cfg.tile_n == (96 if spec.head_dim_qk == 192 else 64)
    narrow = sm90_backward.BackwardTileConfig(64, 2)
    assert narrow.accumulators(spec.head_dim_qk, spec.head_dim_v) > 192


def test_d256_gives_up_dO_and_dQ_buffers_before_shared_memory_overflows():
    spec = _spec(256)
    cfg = sm90_backward.backward_tile_config(spec, "sm_90a")
    assert (cfg.num_stages, cfg.dO_stages, cfg.dq_buffers) == (2, 1, 1)
    # The preferred configs (more buffers) would not fit.
    for better in sm90_backward._TILES[(256, 256)][:-1]:
        assert better.smem_bytes(256, 256) > 227 * 1024



def test_d64_runs_the_register_lean_schedule():
    """tile_m 128 fits the registers only in the lean order (tests/test_sm90_registers.py)."""
    cfg = sm90_backward.backward_tile_config(_spec(64), "sm_90a")
    assert (cfg.tile_m, cfg.lean, cfg.wide) == (128, True, False)
    assert sm90_backward.kind_context(_spec(64), "sm_90a")["bwd"]["lean"]


@pytest.mark.parametrize("kwargs", [dict(wide=True, lean=True), dict(lean=True, tile_m=32)],
                         ids=["wide", "tile_m-32"])
def test_lean_schedule_is_refused_where_the_template_cannot_run_it(kwargs):
    args = {"tile_m": 64, "num_stages": 2, **kwargs}
    with pytest.raises(ValueError, match="lean"):
        sm90_backward.BackwardTileConfig(**args)


@pytest.mark.parametrize("head_dim", (192, {"qk": 192, "v": 128}), ids=str)
def test_d192_puts_96_keys_on_the_wgmma_n_axis(head_dim):
    """96-key tiles (the wide layout's 64 is L2-bound at d192) fit only with keys on N."""
    spec = _spec(head_dim)
    cfg = sm90_backward.backward_tile_config(spec, "sm_90a")
    assert (cfg.keys_on_n, cfg.tile_n, cfg.PdS_stages) == (True, 96, 1)
    assert cfg.accumulators(spec.head_dim_qk, spec.head_dim_v) <= 192
    assert sm90_backward.kind_context(spec, "sm_90a")["bwd"]["pds_stages"] == 1


@pytest.mark.parametrize("kwargs", [dict(keys_on_n=True), dict(pds_stages=1), dict(wide=True, pds_stages=1)],
                         ids=["narrow", "narrow-pds1", "wide-pds1"])
def test_keys_on_n_and_single_pds_buffer_are_refused_outside_their_layout(kwargs):
    with pytest.raises(ValueError):
        sm90_backward.BackwardTileConfig(64, 2, **kwargs)


def _cta_order(head_dim: int, mask, seqlen_q: int, group: int, shape: tuple[int, int, int], arch: str = "sm_90a",
               kind: str = "backward"):
    """Run the rendered backward's order_grid and key_tile_of_cta (templates/common/backward.j2)
    on the CPU for `shape` = (key tiles, K/V heads, batch): [(n_block, head_kv, batch), ...] of
    the CTAs with work, in launch order; None where the kernel keeps the grid's own order."""
    import types

    from fa_gen.render import render_target
    from fa_gen.target import resolve_target

    spec = load_spec({"name": f"order_{head_dim}", "dtype": "bf16", "head_dim": head_dim, "mask": mask})
    text = render_target(resolve_target(spec, arch, kind)).text
    if "\ndef key_tile_of_cta" not in text:
        return None
    num_n, heads_kv, batch = shape
    current = {}
    arch = types.SimpleNamespace(block_idx=lambda: current["idx"], grid_dim=lambda: current["grid"])
    namespace = {"cute": types.SimpleNamespace(arch=arch),
                 "cutlass": types.SimpleNamespace(max=max, min=min), "Int32": int}
    for name in ("order_grid", "key_tile_of_cta"):
        exec(f"def {name}" + text.split(f"\ndef {name}", 1)[1].split("\n\n", 1)[0], namespace)
    grid = current["grid"] = namespace["order_grid"](num_n, seqlen_q, heads_kv * group, heads_kv, batch)
    order = []
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                current["idx"] = (x, y, z)
                n_block, head, b = namespace["key_tile_of_cta"](heads_kv)
                if b < batch:  # the kernel's work.live
                    order.append((n_block, head, b))
    return order


@pytest.mark.parametrize("head_dim,seqlen_q,group,shape", [
    (128, 2048, 1, (16, 16, 8)),      # 12 heads fit: 11 groups of 12 (four empty slots)
    (128, 8192, 4, (64, 2, 5)),       # one K/V head a group (budget below one head)
    (64, 4000, 2, (8, 3, 7)),         # 6 fit: 21 (batch, head) pairs in 4 groups of 6 (three empty)
    (256, 16384, 1, (256, 16, 1)),
])
def test_causal_backward_orders_key_tiles_slow_within_l2_groups_of_heads(head_dim, seqlen_q, group, shape):
    order = _cta_order(head_dim, "causal", seqlen_q, group, shape)
    num_n, heads_kv, batch = shape
    # Every key tile of every head exactly once.
    assert sorted(order) == sorted((n, h, b) for b in range(batch) for h in range(heads_kv) for n in range(num_n))
    # Within a head the key tiles start in order (the deterministic dQ adds wait on lower ones).
    for b in range(batch):
        for h in range(heads_kv):
            assert [n for n, hh, bb in order if (hh, bb) == (h, b)] == list(range(num_n))
    # Groups of heads whose Q, dO and dQ rows fit the L2 budget walk their key tiles in step:
    # the first CTAs are key tile 0 of as many heads as fit (groups of equal size, at most that).
    row_bytes = head_dim * 2 * 2 + head_dim * 4
    most = max(min(base.CAUSAL_L2_HEADS_MB * 2**20 // row_bytes // (seqlen_q * group), heads_kv * batch), 1)
    groups = -(-heads_kv * batch // most)
    group_heads = -(-heads_kv * batch // groups)
    first = order[:group_heads]
    assert {n for n, _, _ in first} == {0} and len({(h, b) for _, h, b in first}) == len(first)
    assert order[group_heads][0] == (1 if num_n > 1 else 0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("kind", ["backward", "backward_varlen"])
def test_backward_grid_order_stays_head_by_head_without_a_causal_mask(arch, kind):
    assert _cta_order(128, "none", 2048, 1, (16, 2, 2), arch, kind) is None
    window = {"kind": "sliding_window", "left": 1023, "right": 0}
    assert _cta_order(128, window, 2048, 1, (16, 2, 2), arch, kind) is None
    # Where the L2 groups measured slower (sm80 kernels, packed batches), causal keeps it too.
    if arch == "sm_80" or kind == "backward_varlen":
        assert _cta_order(128, "causal", 2048, 1, (16, 2, 2), arch, kind) is None
