"""Ad hoc: where the fp8 forward call path spends host time (per piece, then cProfile). GPU only."""
import cProfile, pstats, time, torch, io
import fa_gen
from fa_gen import fp8
from fa_gen.spec_load import load_spec
spec = load_spec({"name": "probe_fp8_d128", "dtype": "fp8_e4m3", "head_dim": 128, "mask": "none"})
kernel = fa_gen.build(spec)
q, k, v = (torch.randn(1, 256, 16, 128, device="cuda").to(fp8.E4M3) for _ in range(3))
scales = [torch.ones(1, 16, device="cuda") for _ in range(3)]
def timeit(name, fn, n=300):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n; torch.cuda.synchronize()
    print(f"{name}: {dt*1e6:.1f} us", flush=True)
timeit("call", lambda: kernel.forward(q, k, v, descales=scales))
timeit("call, descales None", lambda: kernel.forward(q, k, v))
timeit("descale_tensors", lambda: fp8.descale_tensors(scales, 1, 16, q.device))
timeit("transpose_v", lambda: fp8.transpose_v(v, kernel.arch))
vt = fp8.transpose_v(v, kernel.arch)
timeit("call with V^T", lambda: kernel.forward(q, k, vt, descales=scales))
timeit("_check", lambda: kernel._check(q, k, v))
fn = fp8._transpose_kernel(kernel.arch)
vi, vti = v.view(torch.int32), torch.empty(1, 16, 128, 256, dtype=fp8.E4M3, device="cuda").view(torch.int32)
timeit("transpose kernel launch", lambda: fn(vi, vti))
timeit("empty", lambda: torch.empty(1, 16, 128, 256, dtype=fp8.E4M3, device="cuda"))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): kernel.forward(q, k, v, descales=scales)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue())

# The 2k cells of bench/bench_fp8.py (16k tokens, heads x d = 2048): the call against the kernel
# alone, timed as the benchmark times them (events around one call, the host's time inside) and
# with the host hidden behind a queued sleep; and the host time a call.
import statistics  # noqa: E402


def event_ms(fn, hide_host: bool) -> float:
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize()
        if hide_host:
            torch.cuda._sleep(5_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


for dim, causal in ((128, False), (128, True), (256, False), (256, True)):
    spec = load_spec({"name": f"probe_fp8_d{dim}{'_causal' if causal else ''}", "dtype": "fp8_e4m3",
                      "head_dim": dim, "mask": "causal" if causal else "none"})
    kernel = fa_gen.build(spec)
    heads = 2048 // dim
    q, k, v = (torch.randn(8, 2048, heads, dim, device="cuda").to(fp8.E4M3) for _ in range(3))
    scales = [torch.ones(8, heads, device="cuda") for _ in range(3)]
    out = torch.empty(8, 2048, heads, dim, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(8, heads, 2048, dtype=torch.float32, device="cuda")
    operands = kernel._operands(q, k, v, out, lse, scales)
    fns = {"call": lambda: kernel.forward(q, k, v, descales=scales), "kernel": lambda: kernel._function(*operands),
           "transpose": lambda: fp8.transpose_v(v, kernel.arch)}
    for _ in range(5):
        [fn() for fn in fns.values()]
    row = {}
    for name, fn in fns.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host = (time.perf_counter() - t0) / 20 * 1e6
        row[name] = f"events {event_ms(fn, False) * 1e3:.0f} us, host hidden {event_ms(fn, True) * 1e3:.0f} us, host {host:.0f} us"
    print(f"d{dim}{' causal' if causal else ''} 2k:", row, flush=True)
