"""Cold-compile and warm-load times of one spec, each in a fresh process.

    python bench/load_time.py [SPEC] [--profile]

Run 1 uses an empty cache directory (render + compile + store); run 2 uses the same
directory in a new process (load from disk); run 3 does so with FA_GEN_FAST_LOAD=1 (the object
linked into a shared library and loaded through TVM-FFI, the CuTe DSL not imported; the first
such load links it, so run 3 loads twice and reports the second). Each reports the import of
fa_gen (torch and the CUDA context come first, outside the timings: they are not fa_gen's), the
build and the first call (which includes loading the module onto the GPU), and their total.
Bytecode goes to a cache of its own (PYTHONPYCACHEPREFIX, written by the cold run), as an
installed package has its modules compiled: a kit unpacked without it would recompile every
module in every process. --profile adds a fifth run under cProfile (its top functions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
torch.zeros(1, device="cuda")                       # torch and the CUDA context outside the timings
t0 = time.perf_counter()
import fa_gen
t1 = time.perf_counter()
if len(sys.argv) > 2:                               # where the build's time goes: top functions
    import cProfile, pstats, io
    profile = cProfile.Profile()
    kernel = profile.runcall(fa_gen.build, sys.argv[1])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue(), file=sys.stderr)
else:
    kernel = fa_gen.build(sys.argv[1])
t2 = time.perf_counter()
q, k, v = (torch.randn(1, 256, 8, kernel.spec.head_dim_qk, device="cuda", dtype=kernel._dtype) for _ in range(3))
v = torch.randn(1, 256, 8, kernel.spec.head_dim_v, device="cuda", dtype=kernel._dtype)
kernel(q, k, v); torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "first_call_s": t3 - t2,
                  "compiled": kernel.info.compiled}))
"""


def run_child(spec: str, cache_dir: str, fast: bool = False, profile: bool = False) -> dict:
    env = dict(os.environ, FA_GEN_CACHE_DIR=cache_dir, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               FA_GEN_FAST_LOAD="1" if fast else "0", PYTHONPYCACHEPREFIX=str(Path(cache_dir) / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    args = [sys.executable, "-c", CHILD, spec] + (["profile"] if profile else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    if profile:
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--profile"]
    spec = args[0] if args else "causal_bf16_d128"
    with tempfile.TemporaryDirectory() as cache_dir:
        runs = [("cold (compile)", False), ("warm (disk cache)", False), ("warm, link", True),
                ("warm, fast load", True)] + ([("profiled", True)] if "--profile" in sys.argv else [])
        for label, fast in runs:
            r = run_child(spec, cache_dir, fast, profile=label == "profiled")
            total = r["import_s"] + r["build_s"] + r["first_call_s"]
            print(f"{spec} {label:18s}: import fa_gen {r['import_s']:.3f} s, build {r['build_s']:.3f} s, "
                  f"first call {r['first_call_s']:.3f} s, total {total:.3f} s, compiled={r['compiled']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
