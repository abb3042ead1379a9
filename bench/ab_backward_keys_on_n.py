"""A/B of the Hopper backward's keys-on-N layout (BackwardTileConfig.keys_on_n) in one run:
fa_gen_sm90_wide is fa_gen_sm90 with the keys-on-N tile configs left out, so the head dims they
serve (192, qk192/v128) fall back to the wide layout.

    python bench/ab_backward_keys_on_n.py --head-dims 192 --seqlens 4096,16384 \
        --impls fa_gen_sm90,fa_gen_sm90_wide,fa4 --commit abc1234 --out bench/results

Takes bench_backward_sm90.py's arguments.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_backward_sm90 as b  # noqa: E402

b.IMPLEMENTATIONS["fa_gen_sm90_wide"] = b.fa_gen_sm90_tiles(
    lambda dims, cfgs: [c for c in cfgs if not c.keys_on_n])
b.main()
