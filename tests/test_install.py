"""A plain, non-editable `pip install .` carries the templates and shipped specs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to copy the tracked tree")
def test_wheel_finds_templates_and_specs(tmp_path):
    target = tmp_path / "site"
    # --no-deps: the dependencies are already here; this checks packaging only.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                    "--target", str(target), str(ROOT)], check=True)
    code = ("import fa_gen.paths as p, fa_gen.generate as g, fa_gen.render as r;"
            "assert '_data' in str(p.templates_dir()), p.templates_dir();"
            "specs = g.shipped_specs(); assert specs;"
            "print(len(specs), len(r.render(specs[0], specs[0].archs[0]).text))")
    # Run from an unrelated directory so the checkout cannot be imported by accident.
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(target)))
    assert out.returncode == 0, out.stderr
    count, length = map(int, out.stdout.split())
    assert count == len(list((ROOT / "specs").glob("*.yaml"))) and length > 1000
