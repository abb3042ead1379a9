"""Two source trees of fa_gen, one GPU, one call: the same benchmark run from each in turn.

Speed differences between builds are a few percent, and so is the spread between machines (one
session's H200s read the same contiguous decode kernel at 133.8 and 138.0 us). A comparison is
only worth its numbers when both builds run on one machine, interleaved. This tool does that:

    python bench/ab_sources.py prepare COMMIT            # here: COMMIT's sources into .ab/COMMIT/
    python bench/ab_sources.py run .ab/COMMIT . [--rounds 3] [--bench decode] [-- BENCH ARGS]

`prepare` writes the commit's fa_gen/, templates/, specs/, bench/*.py and pyproject.toml into
.ab/COMMIT/ (untracked, not ignored: the device call carries it). `run` alternates the trees
(A B A B ...), each round a subprocess of the benchmark from that tree (its own fa_gen on
PYTHONPATH, its JSON into a temporary folder), then prints per cell and implementation the
median over rounds of each tree and the ratio B / A. Only fa_gen's implementations differ
between trees; the anchors' rows show the machine's drift between rounds.

--bench decode runs bench/bench_decode.py (GB/s; pass e.g. `-- --parts paged --cells ...`);
--bench forward runs bench/bench_forward.py (TFLOP/s; e.g. `-- --seqlens 512,1024 --impls fa_gen,fa4`).
--bench backward runs bench/bench_backward_sm90.py, --bench varlen_backward bench/bench_varlen_backward.py
(TFLOP/s per implementation column; e.g. `-- --impls fa_gen_sm80,fa4`).
--metric picks another result field, e.g. tflops_back_to_back with `-- --backward ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("fa_gen", "templates", "specs", "bench", "pyproject.toml")
BENCHES = {"decode": ("bench/bench_decode.py", "gbps"), "forward": ("bench/bench_forward.py", "tflops"),
           "backward": ("bench/bench_backward_sm90.py", "tflops"),
           "varlen_backward": ("bench/bench_varlen_backward.py", "tflops")}
ROW_KEYS = {"head_dim", "causal", "seqlen", "batch", "heads", "dtype", "cell", "documents"}


def prepare(commit: str, root: Path = ROOT, into: Path | None = None) -> Path:
    """COMMIT's sources (no results, no generated/) under `into` (root/.ab) / COMMIT; returns the folder."""
    target = (into or root / ".ab") / commit
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *PARTS], cwd=root, check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as handle:
        handle.write(archive)
        handle.seek(0)
        with tarfile.open(fileobj=handle) as tar:
            members = [m for m in tar.getmembers() if not m.name.startswith("bench/results")]
            tar.extractall(target, members=members)
    return target


def rows(report: dict, metric: str) -> dict[tuple[str, str], float]:
    """(cell, impl) -> metric for every timed result of a bench_decode or bench_forward report."""
    cells = [{**cell, "name": f"{cell['dtype']}_d{cell['head_dim']}_{'causal' if cell['causal'] else 'full'}"
                              f"_s{cell['seqlen']}"} for cell in report.get("cells", []) if "dtype" in cell]
    for part in ("decode", "paged"):
        cells += report.get(part) or []
    varlen = report.get("varlen") or {}
    cells += varlen.get("cells", []) if isinstance(varlen, dict) else []
    out = {}
    for row in report.get("rows", []):  # bench_backward_sm90 / bench_varlen_backward: one number per impl key
        name = row.get("cell") or (f"{row['dtype']}_d{row['head_dim']}_{'causal' if row['causal'] else 'full'}"
                                   f"_s{row['seqlen']}")
        for impl, value in row.items():
            if impl not in ROW_KEYS and "/" not in impl and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                out[(name, impl)] = float(value)
    for cell in cells:
        for result in cell.get("results", []):
            value = result.get(metric, result.get("tflops"))
            if isinstance(value, (int, float)):
                out[(cell["name"], result["impl"])] = float(value)
    return out


def run_once(tree: Path, script: str, args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree.resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(tree.resolve() / script), "--commit", tree.resolve().name, "--out", str(out), *args]
    subprocess.run(command, cwd=tree, env=env, check=True)
    reports = sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        raise SystemExit(f"{tree}: the benchmark wrote no JSON into {out}")
    return json.loads(reports[-1].read_text())


def compare(trees: list[Path], bench: str, rounds: int, args: list[str], metric: str | None = None) -> dict:
    script, default_metric = BENCHES[bench]
    metric = metric or default_metric
    values: dict[int, dict[tuple[str, str], list[float]]] = {0: {}, 1: {}}
    with tempfile.TemporaryDirectory(prefix="ab_sources_") as workdir:
        for r in range(rounds):
            for i, tree in enumerate(trees):
                out = Path(workdir) / f"{i}-{r}"
                out.mkdir()
                for key, value in rows(run_once(tree, script, args, out), metric).items():
                    values[i].setdefault(key, []).append(value)
    table = {}
    for key in sorted(set(values[0]) & set(values[1])):
        a, b = statistics.median(values[0][key]), statistics.median(values[1][key])
        table[f"{key[0]} {key[1]}"] = {"a": a, "b": b, "b/a": b / a if a else None,
                                       "a_rounds": values[0][key], "b_rounds": values[1][key]}
    return table


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("commit")
    run = sub.add_parser("run")
    run.add_argument("a", type=Path)
    run.add_argument("b", type=Path)
    run.add_argument("--rounds", type=int, default=3)
    run.add_argument("--bench", choices=sorted(BENCHES), default="decode")
    run.add_argument("--json", type=Path, help="also write the table here")
    run.add_argument("--metric", default=None,
                     help="the result field compared (default gbps / tflops; e.g. tflops_back_to_back for "
                          "bench_forward.py --backward, the GPU's time without the per-call host time)")
    options = parser.parse_args(argv)
    if options.command == "prepare":
        print(prepare(options.commit))
        return
    table = compare([options.a, options.b], options.bench, options.rounds, extra, options.metric)
    print(f"{'cell impl':60s} {'A':>10s} {'B':>10s} {'B/A':>6s}   (A = {options.a}, B = {options.b})")
    for name, row in table.items():
        print(f"{name:60s} {row['a']:10.1f} {row['b']:10.1f} {row['b/a']:6.3f}")
    if options.json:
        options.json.write_text(json.dumps({"a": str(options.a), "b": str(options.b), "rounds": options.rounds,
                                            "metric": options.metric or BENCHES[options.bench][1],
                                            "args": extra, "table": table}, indent=1))


if __name__ == "__main__":
    main()
