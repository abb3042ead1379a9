"""L0: the Hopper backward serves every head dim the Hopper forward does, within its tile limits."""

from __future__ import annotations

import pytest

from fa_gen.backward import backward_family
from fa_gen.families import sm90_backward
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
