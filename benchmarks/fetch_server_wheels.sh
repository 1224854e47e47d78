#!/usr/bin/env bash
# Download the server's dependencies and structured outputs' (xgrammar, apache-tvm-ffi, jsonschema) as
# cp312 manylinux wheels into .whl/ (git-ignored), for the GPU machine, which has no network and none of
# them (it has torch, triton, transformers, numpy, safetensors, tokenizers). Carry `.whl` with the device
# call (~10 MB): the device scripts install it (benchmarks/device_call.sh).
# `--test` adds what the gpu tests import beyond that (openai, schemathesis, compressed-tensors and theirs,
# and transformers 5.25 with its hub client: the device's 5.17 lacks Gemma 4 and Qwen 3.5; ~26 MB more),
# so `pytest -m gpu` there skips only the tests that need 2 GPUs. Playwright's wheel (53 MB,
# past what a call carries) is not among them: the web-page test imports it inside the test, not at collection.
# `--min` (after `--test`) also copies into .whl_min/ only what `pytest -m gpu` and transformers 5.25 need
# (~26 MB): .whl (47 MB) with the working tree passes the device's 64 MiB carry. Use it with WHEEL_DIR=.whl_min.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn h11 click anyio
      sniffio prometheus-client annotated-doc opentelemetry-api typing-extensions idna fastapi-offline
      xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs)
if [ "${1:-}" = "--test" ]; then
    pkgs+=(openai httpx2 httpcore2 truststore jiter distro schemathesis harfile hypothesis-graphql graphql-core
           "jsonschema-rs<0.61" pyrate-limiter hypothesis compressed-tensors loguru pytest-timeout
           "transformers==5.25.0" huggingface-hub hf-xet typer typer-slim shellingham fsspec filelock tqdm regex
           "kernels<0.20" tomlkit "tokenizers>=0.23.1,<0.24" "safetensors>=0.8.0")
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "${pkgs[@]}"
# Every requirement of every wheel (extras aside) must be in the set or on the device already: it has no network.
python3 - <<'PY'
import re, zipfile
from pathlib import Path
from packaging.requirements import Requirement
device = {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.12", "extra": ""}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = list(Path(".whl").glob("*.whl"))
on_device = {"torch", "triton", "transformers", "numpy", "safetensors", "tokenizers",  # and, for --test:
             "pytest", "pyyaml", "requests", "rich", "werkzeug", "psutil", "sortedcontainers", "h11", "certifi",
             "packaging"}
have = {norm(w.name.split("-")[0]) for w in wheels} | on_device
missing = set()
for w in wheels:
    z = zipfile.ZipFile(w)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line[len("Requires-Dist:"):].strip())
        if (req.marker is None or req.marker.evaluate(device)) and norm(req.name) not in have:
            missing.add(f"{req.name} (for {w.name})")
if missing:
    raise SystemExit("missing wheels: " + ", ".join(sorted(missing)))
print(f"{len(wheels)} wheels, dependencies closed")
PY
du -sh .whl
if [ "${2:-}" = "--min" ]; then
    rm -rf .whl_min && mkdir -p .whl_min
    for p in transformers huggingface_hub hf_xet tokenizers safetensors kernels tomlkit typer typer_slim shellingham \
             fsspec filelock tqdm regex click pytest_timeout httpx2 httpcore2 anyio sniffio idna h11 truststore; do
        cp .whl/"$p"-[0-9]*.whl .whl_min/
    done
    du -sh .whl_min
fi
