"""A/B of the Hopper backward's register-lean schedule (BackwardTileConfig.lean) in one run:
fa_gen_sm90_alt is fa_gen_sm90 with `lean` flipped on every narrow tile config.

    python bench/ab_backward_lean.py --head-dims 64,96,128 --seqlens 4096,16384 \
        --impls fa_gen_sm90,fa_gen_sm90_alt,fa4 --commit abc1234 --out bench/results

Takes bench_backward_sm90.py's arguments.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_backward_sm90 as b  # noqa: E402


def flip_lean(dims, cfgs):
    if cfgs[0].wide:
        return cfgs
    return [dataclasses.replace(c, lean=not c.lean) for c in cfgs]


b.IMPLEMENTATIONS["fa_gen_sm90_alt"] = b.fa_gen_sm90_tiles(flip_lean)
b.main()
