"""End-to-end benchmark: prefill and decode tokens/s of a Llama-style ~1B model in transformers,
attn_implementation="fa_gen" against "sdpa" in the same run, on the same weights.

    python bench/bench_e2e.py --commit $(git rev-parse --short HEAD) --out bench/results
    python bench/bench_e2e.py --profile            # also: share of device time in attention
    python bench/bench_e2e.py --batch 4 --prompt 512 --new-tokens 32 --layers 2   # a quick look

The model (random weights, bf16; MODEL below, the shape of Llama-3.2-1B with a 32k vocabulary):
16 layers, hidden 2048, 32 query heads / 8 KV heads, head dim 64. Two scenarios:
  uniform     batch 16, every prompt 2048 tokens (no padding: fa_gen's fixed-length path);
  left_padded batch 16, prompt lengths drawn in [prompt/4, prompt] (seeded), left-padded to the
              longest, as generate() pads (fa_gen's varlen path, unpadded on the device).
Per scenario and implementation:
  prefill  one forward of the whole batch with a fresh cache and logits of the last position only
           (what generate()'s first step runs): median of REPEATS CUDA-event timings after WARMUP;
           tokens/s counts the real (non-padding) prompt tokens;
  decode   one greedy generate() of NEW_TOKENS tokens (min_new_tokens = max_new_tokens, so every
           row runs all of them), a CUDA event recorded at every step (a logits processor): decode
           time is first step to last step, i.e. NEW_TOKENS - 1 forwards with their sampling and
           cache work; tokens/s = batch * (NEW_TOKENS - 1) / that time. The same run's prefill
           (start to first step, host work included) is kept as generate_prefill_ms.
The cache is transformers' DynamicCache, which both implementations serve (a static cache hands
the attention every slot of it; fa_gen's integration trims them only under a padding mask).
Ratios are fa_gen / sdpa (> 1: fa_gen faster). An implementation that fails records its error and
the run goes on.

--profile: per scenario and implementation, one prefill forward and a short generate() under
torch.profiler; device kernel time summed by kernel name, attention kernels picked by name
(ATTENTION_KERNELS: fa_gen's CuTe DSL FlashAttention*/MergeStates kernels, PyTorch's flash/
efficient/cuDNN SDPA kernels); reports each phase's attention share and the top kernels. The
padding work of fa_gen's varlen path (gather/scatter, index kernels) counts as "rest".

Writes <out>/<date>-<commit>-e2e.json with commit, date, device and versions, and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa_gen.timing import median_ms  # noqa: E402

IMPLS = ("fa_gen", "sdpa")
SCENARIOS = ("uniform", "left_padded")
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True)
WARMUP = 2
REPEATS = 5
SEED = 0
PROFILE_NEW_TOKENS = 8
ATTENTION_KERNELS = re.compile(r"FlashAttention|MergeStates|flash_fwd|flash_bwd|fmha|pytorch_flash|"
                               r"efficient_attention|cudnn.*(attn|sdpa)|sdpa|attention", re.IGNORECASE)
TOP_KERNELS = 12


# ---- arguments and the report (pure Python) -----------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ",".join(IMPLS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ",".join(SCENARIOS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (the longest, when padded)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    parser.add_argument("--head-dim", type=int, default=MODEL["head_dim"], choices=(64, 128))
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--profile", action="store_true", help="also: share of device time in attention")
    args = parser.parse_args(argv)
    for option, chosen, allowed in (("--impls", args.impls, IMPLS), ("--scenarios", args.scenarios, SCENARIOS)):
        names = [n for n in chosen.split(",") if n]
        unknown = sorted(set(names) - set(allowed))
        if unknown or not names:
            parser.error(f"{option}: unknown {unknown or 'empty'}; known: {', '.join(allowed)}")
    for option, value, least in (("--batch", args.batch, 1), ("--prompt", args.prompt, 4),
                                 ("--new-tokens", args.new_tokens, 2), ("--layers", args.layers, 1),
                                 ("--repeats", args.repeats, 1)):
        if value < least:
            parser.error(f"{option} must be >= {least}; got {value}")
    return args


def model_config(args) -> dict:
    """The transformers LlamaConfig fields of the benchmarked model: hidden 2048 either way; head dim
    128 halves the heads (16 query, 4 KV: the same GQA ratio)."""
    config = dict(MODEL, num_hidden_layers=args.layers, head_dim=args.head_dim)
    config["num_attention_heads"] = config["hidden_size"] // args.head_dim
    config["num_key_value_heads"] = config["num_attention_heads"] // 4
    return config


def prompt_lengths(scenario: str, batch: int, prompt: int, seed: int = SEED) -> list[int]:
    """Real tokens per row: all `prompt`, or drawn in [prompt // 4, prompt] with the longest = prompt."""
    if scenario == "uniform":
        return [prompt] * batch
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt // 4, prompt + 1, (batch,), generator=generator).tolist()
    lengths[0] = prompt
    return lengths


def tokens_per_s(tokens: int, ms: float | None) -> float | None:
    return None if not ms else tokens / (ms / 1e3)


def summarize(result: dict, batch: int, new_tokens: int, real_tokens: int) -> dict:
    """Adds tokens/s to one implementation's timings (where it has them)."""
    if "prefill_ms" in result:
        result["prefill_tokens_per_s"] = tokens_per_s(real_tokens, result["prefill_ms"])
    if "decode_ms" in result:
        result["decode_tokens_per_s"] = tokens_per_s(batch * (new_tokens - 1), result["decode_ms"])
    return result


def ratios(results: dict) -> dict:
    """fa_gen / sdpa of each tokens/s (None where either is missing)."""
    ours, theirs = results.get("fa_gen", {}), results.get("sdpa", {})
    out = {}
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        a, b = ours.get(key), theirs.get(key)
        out[key.replace("_tokens_per_s", "")] = a / b if a and b else None
    return out


def make_report(args, argv: list[str], device: str, scenarios: list[dict], versions: dict) -> dict:
    return {
        "commit": args.commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        **versions,
        "mode": "e2e",
        "command": "python bench/bench_e2e.py " + " ".join(argv),
        "model": model_config(args),
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "cache": "dynamic",
        "repeats": args.repeats,
        "scenarios": scenarios,
    }


def write_report(report: dict, out_dir) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report['date'][:10]}-{report['commit']}-e2e.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def _number(x, digits=0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(scenarios: list[dict]) -> str:
    lines = [f"{'scenario':<12} {'impl':<7} {'prefill tok/s':>14} {'decode tok/s':>13}  note"]
    for s in scenarios:
        for impl, r in s["results"].items():
            lines.append(f"{s['name']:<12} {impl:<7} {_number(r.get('prefill_tokens_per_s')):>14} "
                         f"{_number(r.get('decode_tokens_per_s')):>13}  {r.get('error', '')[:60]}")
        q = s["ratios"]
        lines.append(f"{s['name']:<12} {'ratio':<7} {_number(q['prefill'], 3):>14} {_number(q['decode'], 3):>13}"
                     "  fa_gen / sdpa")
    return "\n".join(lines)


def attention_share(kernels: dict[str, float]) -> dict:
    """{attention_ms, total_ms, share, top}: device time summed over kernels (name -> ms), those
    matching ATTENTION_KERNELS counted as attention."""
    total = sum(kernels.values())
    attention = sum(ms for name, ms in kernels.items() if ATTENTION_KERNELS.search(name))
    top = sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {"attention_ms": attention, "total_ms": total, "share": attention / total if total else None,
            "top": [{"name": name[:160], "ms": ms, "attention": bool(ATTENTION_KERNELS.search(name))}
                    for name, ms in top]}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


# ---- the GPU run ---------------------------------------------------------------------------------

def build_model(args):
    import transformers

    import fa_gen.integrations.transformers as fa_hf

    fa_hf.register()
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**model_config(args))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.bfloat16)
    return model.eval()


def use(model, impl: str) -> None:
    """Switch the model's attention implementation in place (the weights stay)."""
    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        raise RuntimeError(f"attn_implementation is {model.config._attn_implementation!r}, not {impl!r}")


def batch_inputs(lengths: list[int], vocab: int):
    """(input_ids, attention_mask) on the GPU, left-padded to the longest."""
    generator = torch.Generator().manual_seed(SEED + 1)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.cuda(), mask.cuda()


def prefill(model, ids, mask):
    import transformers

    return model(input_ids=ids, attention_mask=mask, past_key_values=transformers.DynamicCache(config=model.config),
                 use_cache=True, logits_to_keep=1)


def step_events():
    """A logits processor recording a CUDA event at each generate() step (its .events)."""
    import transformers

    class StepEvents(transformers.LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
            return scores

    return StepEvents()


def generate_timed(model, ids, mask, new_tokens: int) -> dict:
    import transformers

    steps = step_events()
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, logits_processor=transformers.LogitsProcessorList([steps]))
    start = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    out = model.generate(ids, **options)
    torch.cuda.synchronize()
    if out.shape[1] != ids.shape[1] + new_tokens or len(steps.events) != new_tokens:
        raise RuntimeError(f"generate() ran {len(steps.events)} steps, {out.shape[1] - ids.shape[1]} tokens")
    return {"generate_prefill_ms": start.elapsed_time(steps.events[0]),
            "decode_ms": steps.events[0].elapsed_time(steps.events[-1])}


def run_impl(model, impl: str, ids, mask, args) -> dict:
    """One implementation's timings on one batch; an error is recorded, never raised."""
    try:
        use(model, impl)
        with torch.no_grad():
            generate_timed(model, ids, mask, 4)  # warm-up: compiles / loads every kernel
            result = {"prefill_ms": median_ms(lambda: prefill(model, ids, mask), [()], WARMUP, args.repeats)}
            result.update(generate_timed(model, ids, mask, args.new_tokens))
            if args.profile:
                result["profile"] = profile(model, ids, mask)
        return result
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        traceback.print_exc()
        return {"error": _error(exc)}
    finally:
        torch.cuda.empty_cache()


def _kernel_ms(prof) -> dict[str, float]:
    kernels = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us and getattr(event, "device_type", torch.autograd.DeviceType.CUDA) == torch.autograd.DeviceType.CUDA:
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3
    return kernels


def profile(model, ids, mask) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    phases = {}
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(model, ids, mask)
        torch.cuda.synchronize()
    phases["prefill"] = attention_share(_kernel_ms(prof))
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, attention_mask=mask, max_new_tokens=PROFILE_NEW_TOKENS, min_new_tokens=PROFILE_NEW_TOKENS,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    phases[f"generate_{PROFILE_NEW_TOKENS}"] = attention_share(_kernel_ms(prof))
    return phases


def run_scenario(model, name: str, impls: list[str], args) -> dict:
    lengths = prompt_lengths(name, args.batch, args.prompt)
    ids, mask = batch_inputs(lengths, model.config.vocab_size)
    results = {}
    for impl in impls:
        results[impl] = summarize(run_impl(model, impl, ids, mask, args), args.batch, args.new_tokens, sum(lengths))
    return {"name": name, "lengths": lengths, "real_tokens": sum(lengths), "results": results,
            "ratios": ratios(results)}


def versions() -> dict:
    import fa_gen

    try:
        import transformers
        found = transformers.__version__
    except ImportError:
        found = None
    return {"torch": torch.__version__, "transformers": found, "python": platform.python_version(),
            "fa_gen": fa_gen.__version__}


def _print_profile(scenarios: list[dict]) -> None:
    for s in scenarios:
        for impl, r in s["results"].items():
            for phase, p in r.get("profile", {}).items():
                share = "-" if p["share"] is None else f"{100 * p['share']:.1f}%"
                print(f"{s['name']} {impl} {phase}: attention {p['attention_ms']:.2f} of {p['total_ms']:.2f} ms "
                      f"device time ({share})")


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_model(args)
    scenarios = [run_scenario(model, name, args.impls.split(","), args) for name in args.scenarios.split(",")]
    report = make_report(args, argv, torch.cuda.get_device_name(), scenarios, versions())
    print(f"wrote {write_report(report, args.out)}")
    print(table(scenarios))
    if args.profile:
        _print_profile(scenarios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
