#!/usr/bin/env bash
# The prepared GPU pass (bench/gpu_pass.py): trainlift's recipe on one H100/H200, without Ray, in <= 8 minutes.
#
# Prepare here, once: bash bench/gpu_wheels.sh   (pydantic, pyarrow, ... for CPython 3.12 into .whl/)
# Device call:        carry [".whl"], timeout_s 560, command: bash bench/gpu_pass.sh --out $OUT
# Results:            $OUT/gpu_pass.json (every figure), $OUT/gpu_pass.md (a docs/BENCHMARKS.md section),
#                     $OUT/nccl_debug.log
# On any machine:     bash bench/gpu_pass.sh --smoke --out DIR   (CPU, toy sizes, well under a minute;
#                     tests/unit/test_gpu_pass.py runs it with Ray hidden)
#
# The wheels in .whl/ are installed only when the interpreter lacks what trainlift imports.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONUNBUFFERED=1
if [[ " $* " != *" --smoke "* ]] && command -v nvidia-smi >/dev/null 2>&1; then
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi

install_wheels() {  # into $1; without pip, a wheel unpacked as it is is an install (none of these has .data/)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" .whl/*.whl \
    || "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
         "$1" .whl/*.whl
}

NEEDED="import pydantic, pyarrow.fs, yaml, jsonschema, kubernetes_validate"
if compgen -G ".whl/*.whl" >/dev/null && ! "$PYTHON" -c "$NEEDED" 2>/dev/null; then
  site="${TMPDIR:-/tmp}/trainlift-gpu-pass-site"
  install_wheels "$site"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

exec "$PYTHON" bench/gpu_pass.py "$@"
