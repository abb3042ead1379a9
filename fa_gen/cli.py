"""The `fa-gen` command line. User errors print one line, never a traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import FaGenError


def _cmd_list(args) -> int:
    from .generate import shipped_specs

    for spec in shipped_specs():
        dims = str(spec.head_dim_qk) if spec.head_dim_qk == spec.head_dim_v else f"{spec.head_dim_qk}/{spec.head_dim_v}"
        print(f"{spec.name:32s} {spec.dtype.value:5s} d={dims:8s} mask={spec.mask.value:15s} "
              f"archs={','.join(spec.archs)}")
    from .families import REGISTRY

    print("\nhead dims each family serves (qk, or qk/v; a spec takes the first family that serves it):")
    for family in REGISTRY:
        print(f"  {family.name:8s} {','.join(family.archs):40s} {family.served_head_dims()}")
    print("\nhow each (family, arch) was verified:")
    for family in REGISTRY:
        for archs, how in family.verification():
            print(f"  {family.name:8s} {','.join(archs):40s} {how}")
    return 0


def _cmd_generate(args) -> int:
    from . import generate
    from .runtime import resolve_spec

    specs = [resolve_spec(s) for s in args.specs] if args.specs else generate.shipped_specs()
    root = Path(args.out) if args.out else None
    for spec in specs:
        for path in generate.write(spec, root):
            print(path)
    return 0


def _build_archs(spec, args) -> list[str]:
    import torch

    from . import env
    from .runtime import current_arch

    if args.arch:
        return [args.arch]
    if env.target_arch() or torch.cuda.is_available():
        return [current_arch()]
    return list(spec.archs)   # no GPU: compile for every arch the spec names


def _cmd_build(args) -> int:
    import torch

    from .runtime import build, resolve_spec

    spec = resolve_spec(args.spec)
    print(f"spec {spec.name}: {spec.dtype.value}, head_dim qk {spec.head_dim_qk} v {spec.head_dim_v}, "
          f"mask {spec.mask.value} (window {spec.window_left}, {spec.window_right}, {spec.alignment.value})")
    for arch in _build_archs(spec, args):
        kernel = build(spec, arch, family=args.family)
        info = kernel.info
        how = "compiled" if info.compiled else "loaded from cache"
        print(f"  {arch}: family {info.family}, {how} in {info.seconds:.2f} s")
        if info.entry_dir is not None:
            print(f"    source: {info.entry_dir / 'source.py'}")
            print(f"    entry:  {info.entry_dir}")
        on_device = torch.cuda.is_available() and not args.arch
        if on_device and not args.no_check:
            if _check_and_time(kernel) != 0:
                return 1
    return 0


def _check_and_time(kernel) -> int:
    from .check import Shape, check_kernel
    from .timing import time_forward

    shapes = [Shape(2, 1000, 1000, 8, 2), Shape(1, 777, 1531, 4, 4), Shape(3, 129, 65, 6, 1)]
    results = [check_kernel(kernel, shape, seed=i) for i, shape in enumerate(shapes)]
    for result in results:
        print(f"    check: {result}")
    if not all(r.ok for r in results):
        return 1
    tflops, ms = time_forward(kernel, batch=2, seqlen=8192, heads=2048 // kernel.spec.head_dim_qk)
    print(f"    speed: {tflops:.0f} TFLOP/s ({ms:.3f} ms) at b=2 s=8192 h={2048 // kernel.spec.head_dim_qk}")
    return 0


def _cmd_check(args) -> int:
    import torch

    from .check import Shape, check_kernel
    from .runtime import build

    if not torch.cuda.is_available():
        print("fa-gen check needs a CUDA GPU", file=sys.stderr)
        return 2
    kernel = build(args.spec, args.arch)
    gen = torch.Generator().manual_seed(args.seed)
    failures = 0
    for i in range(args.trials):
        def draw(lo, hi):
            return int(torch.randint(lo, hi + 1, (1,), generator=gen))
        heads_kv = draw(1, 4)
        shape = Shape(draw(1, 4), draw(1, 2048), draw(1, 2048), heads_kv * draw(1, 8), heads_kv)
        result = check_kernel(kernel, shape, seed=args.seed * 1000 + i)
        print(result)
        failures += not result.ok
    print(f"{args.trials - failures} passed, {failures} failed")
    return 1 if failures else 0


def _cmd_schema(args) -> int:
    import json

    from .schema import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_cache(args) -> int:
    from . import env
    from .cache import default_cache

    cache = default_cache()
    if args.action == "clear":
        cache.clear()
        print(f"cleared {cache.root}")
        return 0
    for name, value in env.describe().items():
        print(f"{name}={value}")
    entries = cache.entries()
    print(f"cache root: {cache.root} ({len(entries)} entries)")
    for path, _meta in entries:
        print(f"  {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa-gen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="shipped specs and their archs").set_defaults(func=_cmd_list)
    p = sub.add_parser("generate", help="write renders to generated/<spec>/<arch>/")
    p.add_argument("specs", nargs="*", help="spec files or shipped names (default: every shipped spec)")
    p.add_argument("--out", help="root directory (default: the checkout's generated/)")
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("build", help="render and compile a spec; on a GPU also check and time it")
    p.add_argument("spec")
    p.add_argument("--arch", help="compile target (e.g. sm_80, sm_90a); default: this GPU, else all of the spec's")
    p.add_argument("--no-check", action="store_true", help="on a GPU, skip the exactness check and timing")
    p.add_argument("--family", help="a template family by name (e.g. the opt-in sm100); default: the arch's preferred")
    p.set_defaults(func=_cmd_build)
    p = sub.add_parser("check", help="exactness against the float64 reference on random inputs (GPU)")
    p.add_argument("spec")
    p.add_argument("--arch")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("schema", help="print (or write) the JSON Schema of the spec format")
    p.add_argument("--out")
    p.set_defaults(func=_cmd_schema)
    p = sub.add_parser("cache", help="show or clear the kernel cache")
    p.add_argument("action", nargs="?", choices=["info", "clear"], default="info")
    p.set_defaults(func=_cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        status = args.func(args)
    except FaGenError as exc:
        print(f"fa-gen: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "build" and status == 0:
        print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
