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
      sniffio prometheus-client annotated-doc)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "${pkgs[@]}"
ls .whl
du -sh .whl
