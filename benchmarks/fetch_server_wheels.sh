#!/usr/bin/env bash
# Download the server's pure-Python dependencies as wheels into .whl/ (git-ignored), for the GPU
# machine, which has no network and no fastapi/uvicorn/pydantic. Carry `.whl` with the device call
# and start its command with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn h11 click anyio
      sniffio prometheus-client annotated-doc opentelemetry-api typing-extensions idna fastapi-offline)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "${pkgs[@]}"
# Every requirement of every wheel (extras aside) must be in the set: the device has no network.
python3 - <<'PY'
import re, zipfile
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = list(Path(".whl").glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels}
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
