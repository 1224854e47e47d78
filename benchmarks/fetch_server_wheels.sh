#!/usr/bin/env bash
# Download the server's dependencies and structured outputs' (xgrammar, apache-tvm-ffi, jsonschema) as
# cp312 manylinux wheels into .whl/ (git-ignored), for the GPU machine, which has no network and none of
# them (it has torch, triton, transformers, numpy, safetensors, tokenizers). Carry `.whl` with the device
# call (~10 MB): the device scripts install it (benchmarks/device_call.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn h11 click anyio
      sniffio prometheus-client annotated-doc opentelemetry-api typing-extensions idna fastapi-offline
      xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "${pkgs[@]}"
# Every requirement of every wheel (extras aside) must be in the set or on the device already: it has no network.
python3 - <<'PY'
import re, zipfile
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = list(Path(".whl").glob("*.whl"))
on_device = {"torch", "triton", "transformers", "numpy", "safetensors", "tokenizers"}
have = {norm(w.name.split("-")[0]) for w in wheels} | on_device
missing = set()
for w in wheels:
    z = zipfile.ZipFile(w)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line and 'python_version < "3.11"' not in line:
            name = norm(re.split(r"[ ;<>=!~\[(]", line[len("Requires-Dist:"):].strip())[0])
            if name not in have:
                missing.add(f"{name} (for {w.name})")
if missing:
    raise SystemExit("missing wheels: " + ", ".join(sorted(missing)))
print(f"{len(wheels)} wheels, dependencies closed")
PY
du -sh .whl
