"""Expression variants (sm80 template) beside FlexAttention and FA4, forward only.

python bench/bench_variants.py [--seqlen 8192]: softcap + causal and a causal sliding window
(window 1024: each query sees itself and 1023 keys before it), bf16, head dim 128, b=2, h=16.
TFLOP/s count only visible (query, key) pairs. The fa_gen kind-mask kernels (sm80 family)
are listed too: what the expression costs over the fixed-function mask.
"""

from __future__ import annotations

import argparse
import math

import torch

from fa_gen.timing import make_input_sets, median_ms

SOFTCAP, WINDOW = 30.0, 1024


def visible_pairs(seqlen: int, window: int | None) -> int:
    if window is None:
        return seqlen * (seqlen + 1) // 2
    return sum(min(i + 1, window) for i in range(seqlen))


def fa_gen_impl(spec: str, family: str | None = None, inputs=None):
    from fa_gen.runtime import build

    kernel = build(spec, family=family)
    return lambda q, k, v: kernel.forward(q, k, v, inputs=inputs)


def flex_impl(seqlen: int, window: int | None):
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 1024
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 1024
    compiled = torch.compile(flex_attention)
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def score_mod(score, b, h, q_idx, kv_idx):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
        score_mod = None
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device="cuda")
    return lambda q, k, v: compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    score_mod=score_mod, block_mask=block_mask)


def fa4_impl(window: int | None):
    from flash_attn.cute import flash_attn_func

    if window is None:
        return lambda q, k, v: flash_attn_func(q, k, v, causal=True, softcap=SOFTCAP)
    return lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    args = parser.parse_args()
    batch, heads, dim, s = 2, 16, 128, args.seqlen
    input_sets = make_input_sets(3, batch, s, heads, heads, dim, dim, torch.bfloat16)
    cases = {
        "softcap+causal": (None, {
            "fa_gen softcap (expr, sm80)": lambda: fa_gen_impl("softcap", inputs={"softcap": SOFTCAP}),
            "fa_gen causal (kind, sm80)": lambda: fa_gen_impl("causal_bf16_d128", family="sm80"),
            "flex": lambda: flex_impl(s, None),
            "fa4": lambda: fa4_impl(None)}),
        f"sliding_window_causal w={WINDOW}": (WINDOW, {
            "fa_gen sliding_window_causal (expr, sm80)":
                lambda: fa_gen_impl("sliding_window_causal", inputs={"window": WINDOW}),
            "fa_gen sliding_window (kind, sm80)": lambda: fa_gen_impl("sliding_window_bf16_d128", family="sm80"),
            "flex": lambda: flex_impl(s, WINDOW),
            "fa4": lambda: fa4_impl(WINDOW)}),
    }
    print(f"bf16 d{dim} b={batch} h={heads} s={s} on {torch.cuda.get_device_name()}")
    print(f"{'case':36s} {'implementation':44s} {'ms':>8s} {'TFLOP/s':>8s}")
    for case, (window, impls) in cases.items():
        flops = 4.0 * batch * heads * visible_pairs(s, window) * dim
        for name, make in impls.items():
            try:
                fn = make()
                ms = median_ms(fn, input_sets, warmup=5, repeats=20)
                print(f"{case:36s} {name:44s} {ms:8.3f} {flops / ms / 1e9:8.1f}")
            except Exception as exc:  # one anchor failing must not hide the others
                print(f"{case:36s} {name:44s} error: {type(exc).__name__}: {str(exc)[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
