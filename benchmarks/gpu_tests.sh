#!/usr/bin/env bash
# Every gpu-marked test on the accelerator machine, in one device call, with what they import carried as
# wheels (`bash benchmarks/fetch_server_wheels.sh --test` first, then carry `.whl`): only the tests that need
# 2 GPUs may skip. Writes $OUT/gpu_tests.md (counts, skips with reasons, failures) and the junit XML.
#   FILES  the test paths (default: the whole suite); WORKERS  pytest-xdist workers (default 8)
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
[ "$WHEELS" = 1 ] || echo "warning: no .whl carried: the server and FP8-checkpoint tests will skip" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
read -r -a files <<< "${FILES:-tests}"
timeout "$(cap 560)" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${WORKERS:-8}" -rsfE \
    --junitxml="$OUT/gpu_tests.xml" "${files[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
python3 - "$OUT" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
try:
    suite = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite")
except (OSError, ET.ParseError) as exc:
    sys.exit(f"no junit report ({exc}): the run did not finish")
rows, counts = [], {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for case in suite.iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    kind = next((c.tag for c in case if c.tag in ("failure", "skipped", "error")), "passed")
    counts["failed" if kind == "failure" else kind] += 1
    if kind != "passed":
        rows.append(f"| {kind} | `{name}` | {(case.find(kind).get('message') or '')[:200]} |")
lines = [f"# pytest -m gpu: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
         f"{counts['skipped']} skipped ({float(suite.get('time', 0)):.0f} s)", "", "| result | test | message |",
         "|---|---|---|", *rows]
(out / "gpu_tests.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
