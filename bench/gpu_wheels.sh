#!/usr/bin/env bash
# Download into .whl/ the wheels trainlift needs on the lent GPU machine (CPython 3.12, manylinux x86_64)
# that its image lacks. torch, transformers, peft, numpy, safetensors, packaging and huggingface_hub are there.
#   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions): the job spec
#   pyarrow: storage, checkpoints, metrics.jsonl
#   pyyaml: specs and the catalog (transformers brings it too; pinned here all the same)
#   jsonschema (+ attrs, referencing, rpds-py, jsonschema-specifications), kubernetes-validate (+ importlib-resources):
#     imported with trainlift.render, which the command redaction of trainlift.ops.run loads the first time
#     doctor's probe runs a tool
# bench/gpu_pass.sh installs whatever lies in .whl/ before it runs, when the interpreter lacks these.
#
#   bash bench/gpu_wheels.sh        # then carry [".whl"] to the device call (see bench/gpu_pass.sh)
#
# The versions are those the project's test environment runs (`pip freeze` in its virtualenv).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  pyyaml==6.0.4
  pyarrow==26.0.1
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  attrs==26.1.0
  kubernetes-validate==1.37.0
  importlib-resources==7.1.0
)
MAX_MIB=50  # the device call carries at most 64 MiB, the working tree included

rm -rf .whl
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel"
done

# Two wheels are mostly files no path of trainlift's on the device reads: pyarrow's (55 MB) Arrow Flight, C++
# headers, sources and tests (nothing else links libarrow_flight), and kubernetes-validate's (23 MB) bundled
# Kubernetes schemas (read only to validate rendered manifests). Both are rewritten without them.
python3 - .whl <<'PY'
import re, sys, zipfile
from pathlib import Path

UNUSED = {
    "pyarrow-": re.compile(r"^pyarrow/(include/|src/|tests/|includes/|.*flight|_pyarrow_cpp_tests)", re.IGNORECASE),
    "kubernetes_validate-": re.compile(r"^kubernetes_validate/kubernetes-json-schema/"),
}


def slim(wheel: Path, unused: re.Pattern) -> None:
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if unused.match(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not unused.match(line.split(",", 1)[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    slimmed.replace(wheel)


for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    for prefix, unused in UNUSED.items():
        if wheel.name.startswith(prefix):
            slim(wheel, unused)
PY

# .whl/ travels with the working tree but is never committed.
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

total_kib=$(du -sk .whl | cut -f1)
ls -l .whl
echo "total: $((total_kib / 1024)) MiB"
if (( total_kib > MAX_MIB * 1024 )); then
  echo "the wheels exceed ${MAX_MIB} MiB: with the working tree they would not travel to the device" >&2
  exit 1
fi
