"""The code's shape, kept by tests: no file in minfer/ over 400 lines; architecture names spelled only by the
model registry (and by what writes configs: benchmark shapes, the trainer's export); no line of model/ outside
quantization/ that names a weight format; at most 10 files directly in kernels/."""
from __future__ import annotations

import re
from pathlib import Path

import minfer

ROOT = Path(minfer.__file__).parent
MAX_LINES = 400


def _sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_no_file_over_the_line_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_architecture_names_live_in_the_registry() -> None:
    allowed = {"model/registry.py", "benchmark/shapes.py", "train/export.py"}
    spelled = {str(p.relative_to(ROOT)) for p in _sources()
               if re.search(r"[\"']\w+For(CausalLM|ConditionalGeneration)[\"']", p.read_text())}
    assert spelled <= allowed, f"architecture names outside the registry: {sorted(spelled - allowed)}"


def test_model_layers_do_not_name_weight_formats() -> None:
    model = ROOT / "model"
    lines = [f"{p.relative_to(ROOT)}:{i}" for p in model.rglob("*.py") if "quantization" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"fp8|e4m3|float8", line, re.I)]
    assert not lines, f"model/ outside quantization/ names a weight format: {lines}"


def test_kernels_are_grouped() -> None:
    flat = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    assert len(flat) <= 10, f"{len(flat)} files directly in kernels/: {flat}"
