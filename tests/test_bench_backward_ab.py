"""L0: the Hopper backward's A/B builds (bench/bench_backward_sm90.fa_gen_sm90_tiles) see the
tile lists they ask for while they build, and leave fa_gen's own lists as they found them."""

from __future__ import annotations

import sys
from pathlib import Path

from fa_gen.families import sm90_backward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_backward_sm90 as bench  # noqa: E402


def test_tile_transform_applies_during_the_build_only(monkeypatch):
    spec = bench.spec_for(192, causal=False)
    seen = []

    def fake_backward(family):
        def make(spec, q, k, v, dout):
            seen.append(sm90_backward.backward_tile_config(spec, "sm_90a"))
            return "built"
        return make

    monkeypatch.setattr(bench, "fa_gen_backward", fake_backward)
    original = {dims: list(cfgs) for dims, cfgs in sm90_backward._TILES.items()}
    assert original[(192, 192)][0].keys_on_n  # what the A/B takes away

    make = bench.fa_gen_sm90_tiles(lambda dims, cfgs: [c for c in cfgs if not c.keys_on_n])
    assert make(spec, None, None, None, None) == "built"
    assert len(seen) == 1 and seen[0].wide and not seen[0].keys_on_n
    assert sm90_backward._TILES == original
    assert sm90_backward.backward_tile_config(spec, "sm_90a").keys_on_n
