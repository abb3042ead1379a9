"""L0: the Hopper backward fits its register budget: ptxas neither spills nor serializes the
wgmma instructions (C7512: "wgmma.mma_async instructions are serialized due to insufficient
register resources"), which would run every GEMM of a step back to back.

The budget is tight by design (fa_gen/families/sm90_backward.py: up to 192 fp32 accumulators
of 240 registers per MMA thread), so ptxas' choices decide it; this compiles the kernels the
benchmarks time and reads what ptxas reports.
"""

from __future__ import annotations

import pytest

from fa_gen.backends.cute_dsl import ptxas_remarks
from fa_gen.render import render
from fa_gen.spec_load import load_spec

SERIALIZED = "C7512"
SPILLED = "RemarkPerfRegisterSpill"

# fp16 at the wide head dims: ptxas allocates the same PTX (fp16 and bf16 differ only in their
# conversion instructions) with more moves and runs out; open in issue 5.
FP16_WIDE = pytest.mark.xfail(strict=True, reason="fp16 d192/d256 backward: wgmma serialized, spills")

# d64 (tile_m 128: S^T and dP^T of 64 x 128 per warpgroup) fits only with the lean schedule
# (BackwardTileConfig.lean), and in bf16 only: fp16 spills and serializes; open in issue 5.
FP16_D64 = pytest.mark.xfail(strict=True, reason="fp16 d64 backward (tile_m 128): wgmma serialized, spills")

CASES = [
    pytest.param("bf16", 64, id="bf16-d64"),
    pytest.param("fp16", 64, id="fp16-d64", marks=FP16_D64),
    pytest.param("bf16", 128, id="bf16-d128"),
    pytest.param("fp16", 128, id="fp16-d128"),
    pytest.param("bf16", 192, id="bf16-d192"),
    pytest.param("bf16", 256, id="bf16-d256"),
    pytest.param("bf16", {"qk": 192, "v": 128}, id="bf16-qk192-v128"),
    pytest.param("fp16", {"qk": 192, "v": 128}, id="fp16-qk192-v128"),
    pytest.param("fp16", 256, id="fp16-d256", marks=FP16_WIDE),
]


@pytest.mark.parametrize("dtype,head_dim", CASES)
def test_hopper_backward_keeps_wgmma_asynchronous_without_spills(dtype, head_dim):
    spec = load_spec({"name": "t", "dtype": dtype, "head_dim": head_dim, "mask": "causal"})
    remarks = ptxas_remarks(render(spec, "sm_90a", "sm90", "backward").text, "sm_90a")
    assert "ptxas" in remarks, "no ptxas output captured: the check would pass vacuously"
    assert SERIALIZED not in remarks, "ptxas serialized the wgmma instructions (registers)"
    assert SPILLED not in remarks, "ptxas spilled registers"
