"""L0: which family renders the backward on sm_90a, and the Hopper backward's tile limits."""

from __future__ import annotations

import pytest

from fa_gen.backward import backward_family
from fa_gen.families import sm90_backward
from fa_gen.families.sm90 import Sm90Family
from fa_gen.spec_load import load_spec

SERVED = (64, 96, 128)
REFUSED = (192, 256, {"qk": 192, "v": 128})


def _spec(head_dim, mask="causal"):
    return load_spec({"name": "t", "dtype": "bf16", "head_dim": head_dim, "mask": mask})


@pytest.mark.parametrize("head_dim", SERVED)
def test_hopper_backward_serves_head_dims_up_to_128(head_dim):
    spec = _spec(head_dim)
    assert backward_family(spec, "sm_90a") == "sm90"
    assert "backward" in Sm90Family().kernel_files(spec)


@pytest.mark.parametrize("head_dim", REFUSED)
def test_larger_head_dims_fall_back_to_the_sm80_backward(head_dim):
    spec = _spec(head_dim)
    family = Sm90Family()
    reasons = family.kind_reasons(spec, "backward")
    assert reasons and "dK and dV" in reasons[0]
    # The forward stays on Hopper; only the backward moves to the next family.
    assert not family.can_implement(spec, "sm_90a")
    assert "backward" not in family.kernel_files(spec)
    assert backward_family(spec, "sm_90a") == "sm80"


@pytest.mark.parametrize("head_dim", SERVED)
def test_served_tiles_fit_registers_and_shared_memory(head_dim):
    spec = _spec(head_dim, mask="none")
    assert sm90_backward.backward_reasons(spec, "sm_90a") == []
    context = sm90_backward.kind_context(spec, "sm_90a")
    assert context["bwd_smem_bytes"] <= 227 * 1024
    assert 128 % context["bwd"]["tile_m"] == 0
    # The pre-pass splits each row of O / dO evenly over its lanes.
    assert (head_dim // 8) % context["bwd_prepare_lanes"] == 0
