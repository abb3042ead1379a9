"""Everything the benchmark can time, behind one signature: make(case) -> fn(q, k, v).

q, k, v arrive as (batch, seqlen, heads, dim), the layout of flash_attn_func and fa_gen.
Anchors that want (batch, heads, seqlen, dim) get transposed views of the same memory.
An implementation that cannot run a case raises; the benchmark records the error.
With `case.backward`, fn must be differentiable (its first output carries the graph):
the benchmark times autograd's backward through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    dtype: str          # "bf16" | "fp16"
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    backward: bool = False
    head_dim_v: int | None = None   # V's head dim where it differs from q/k's (e.g. 192 / 128)

    @property
    def dim_v(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]


def case_spec(case: Case):
    """The fa_gen spec of a benchmark case: its dtype, head dim and mask, nothing else."""
    from fa_gen.spec_load import load_spec

    return load_spec({"name": f"bench_{'causal' if case.causal else 'full'}_{case.dtype}_d{case.head_dim}",
                      "dtype": case.dtype, "head_dim": case.head_dim, "mask": "causal" if case.causal else "none"})


def fa_gen_impl(family: str | None):
    def make(case: Case):
        from fa_gen.runtime import build

        spec = case_spec(case)
        if case.backward:
            # The differentiable path: custom op forward, then the backward kernel of the
            # family that renders one (`family` picks forward kernels only).
            from fa_gen.api import attention

            return lambda q, k, v: attention(q, k, v, spec)
        kernel = build(spec, family=family)
        return lambda q, k, v: kernel.forward(q, k, v)
    return make


def _sdpa(backend_name: str):
    def make(case: Case):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=case.causal)
        return run
    return make


def _flex(case: Case):
    from variants import FlexMods, flex_program

    from fa_gen.check import Shape

    mods = FlexMods(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if case.causal else FlexMods()
    shape = Shape(case.batch, case.seqlen, case.seqlen, case.heads, case.heads)
    run = flex_program(mods, shape, "cuda")
    return lambda q, k, v: run(q, k, v)[0]


def _fa4(case: Case):
    from flash_attn.cute import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, causal=case.causal)


IMPLEMENTATIONS = {
    "fa_gen": fa_gen_impl(None),          # the family the registry prefers on this GPU
    "fa_gen_sm80": fa_gen_impl("sm80"),   # the Ampere-class family, for comparison on newer GPUs
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "flex": _flex,
    "fa4": _fa4,
}
ANCHORS = ("sdpa_flash", "sdpa_cudnn", "flex", "fa4")
# What --backward times by default (fa_gen_sm80 would time the same backward kernel as fa_gen).
BACKWARD_IMPLEMENTATIONS = ("fa_gen", "sdpa_flash", "sdpa_cudnn", "fa4")
