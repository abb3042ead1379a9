"""bench/clock_power.py on CPU: the nvidia-smi samples it averages (the GPU part runs on the device)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import clock_power  # noqa: E402


def test_clock_power_reads_nvidia_smi_samples_and_skips_the_rest():
    text = "1980, 312.45\n1755, 640.10\n[N/A], 120.0\nWARNING: something\n1500, 6"
    assert clock_power.parse_samples(text) == [(1980.0, 312.45), (1755.0, 640.1), (1500.0, 6.0)]
    assert clock_power.parse_samples("") == []
