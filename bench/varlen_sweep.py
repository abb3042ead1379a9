"""Where the varlen prefill time goes: fa_gen's varlen forward against FlashAttention-4's, with
the same documents run as fixed-length batches (is the gap varlen's or the kernel's?) and with
the tile schedule pinned (persistent snake or one CTA per tile).

    python bench/varlen_sweep.py --out DIR [--commit SHA]

Cells: (documents, causal, head dim). "mixed" is bench_decode's 8 seeded documents summing to
16k; "equal" is 8 x 2048, which also runs as a fixed (8, 2048) batch. TFLOP/s counts the
useful FLOPs of each document only. Timing: bench_decode.Timer (L2 flushed, host hidden).
Writes <out>/<date>-<commit>-varlen-sweep.json and prints one line per (cell, implementation).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import Timer, cu_seqlens, document_lengths  # noqa: E402
from fa_gen.timing import attention_flops  # noqa: E402

HEADS = 16
DOCUMENT_SETS = {"mixed": document_lengths(), "equal": [2048] * 8}
# (name suffix, sm90 tuning): the family's default schedule, and one CTA per query tile.
SCHEDULES = (("default", {}), ("cta_per_tile", {"persist_m_blocks": 1}))


def spec_for(causal: bool, head_dim: int, tuning: dict):
    from fa_gen.spec_load import load_spec

    fields = {"name": f"sweep_{'causal' if causal else 'full'}_d{head_dim}_{'t' if tuning else 'd'}",
              "dtype": "bf16", "head_dim": head_dim, "mask": "causal" if causal else "none"}
    if tuning:
        fields["tuning"] = {"sm90": tuning}
    return load_spec(fields)


def implementations(causal: bool, head_dim: int, docs: list[int], q, k, v, cu, longest: int) -> dict:
    import fa_gen
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    impls = {}
    for label, tuning in SCHEDULES:
        spec = spec_for(causal, head_dim, tuning)
        impls[f"fa_gen_varlen_{label}"] = (
            lambda spec=spec: fa_gen.attention_varlen(q, k, v, cu, cu, longest, longest, spec))
    impls["fa4_varlen"] = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         max_seqlen_q=longest, max_seqlen_k=longest,
                                                         causal=causal)
    if len(set(docs)) == 1:
        shape = (len(docs), docs[0], *q.shape[1:])
        qb, kb, vb = (t.view(shape) for t in (q, k, v))
        for label, tuning in SCHEDULES:
            kernel = fa_gen.build(spec_for(causal, head_dim, tuning))
            impls[f"fa_gen_fixed_{label}"] = lambda kernel=kernel: kernel(qb, kb, vb)
        impls["fa4_fixed"] = lambda: flash_attn_func(qb, kb, vb, causal=causal)
    return impls


def run_cell(timer: Timer, docs_name: str, causal: bool, head_dim: int) -> list[dict]:
    docs = DOCUMENT_SETS[docs_name]
    total = sum(docs)
    q, k, v = (torch.randn(total, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens(docs, "cuda")
    flops = sum(attention_flops(1, HEADS, n, n, head_dim, head_dim, causal=causal) for n in docs)
    rows = []
    for name, fn in implementations(causal, head_dim, docs, q, k, v, cu, max(docs)).items():
        row = {"docs": docs_name, "causal": causal, "head_dim": head_dim, "impl": name}
        try:
            ms = timer.median_ms(fn)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as exc:  # one failing implementation does not end the sweep
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args(argv)
    timer = Timer()
    rows = [row for docs_name in DOCUMENT_SETS for causal in (True, False) for head_dim in (128, 64)
            for row in run_cell(timer, docs_name, causal, head_dim)]
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{date}-{args.commit}-varlen-sweep.json").write_text(json.dumps({
        "commit": args.commit, "date": date, "device": torch.cuda.get_device_name(),
        "documents": DOCUMENT_SETS, "heads": HEADS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
