"""A/B of the Hopper backward's register-lean schedule (BackwardTileConfig.lean) in one run:
fa_gen_sm90_alt is fa_gen_sm90 with `lean` flipped on every narrow tile config.

    python bench/ab_backward_lean.py --head-dims 64,96,128 --seqlens 4096,16384 \
        --impls fa_gen_sm90,fa_gen_sm90_alt,fa4 --commit abc1234 --out bench/results

Takes bench_backward_sm90.py's arguments.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import bench_backward_sm90 as b  # noqa: E402
from fa_gen.families import sm90_backward as sb  # noqa: E402

ALT = {dims: [dataclasses.replace(c, lean=not c.lean) for c in cfgs]
       for dims, cfgs in sb._TILES.items() if not cfgs[0].wide}


def flip_lean():
    saved = dict(sb._TILES)
    sb._TILES.update(ALT)

    def undo():
        sb._TILES.clear()
        sb._TILES.update(saved)
    return undo


b.IMPLEMENTATIONS["fa_gen_sm90_alt"] = b.fa_gen_sm90_patched(flip_lean)
b.main()
