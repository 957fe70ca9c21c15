#!/usr/bin/env bash
# The GPU check of issue 28 (item 7): on an NVIDIA machine with Python 3.12, CuPy
# (cupy-cuda13x), NumPy, PyTorch (CUDA) and JAX installed and no package index, run
#   1. every GPU-marked test (pytest -m gpu over the files that carry the mark: the
#      engine on CuPy, and the service with `--device cuda`), and
#   2. the GPU benchmark rows (bench/bench_gpu.py: the MLPs and the ONNX models;
#      gradient, fresh and reused HVP; CuPy vs PyTorch CUDA eager vs JAX jit),
# within a time budget (8 minutes by default), writing everything to ONE file.
#
#   bash bench/gpu_check.sh [results file]        # default gpu_check_results.md
#
# Whatever is missing degrades to a line saying so, never a failed run: a peer without
# a GPU (its bench cells are n/a with the reason), the onnx package (no ONNX rows),
# pytest (no tests, unless a wheelhouse provides it: below). Python packages the check
# needs beyond what the machine has travel as wheels: bench/wheels/ (pytest and its
# dependencies, committed, pure Python) and $GRADTAPE_WHEELS (default bench/wheels/).
# The onnx package (the ONNX rows) and the service's packages (the GPU service tests:
# fastapi, uvicorn, pydantic, pydantic-settings, msgspec, orjson, fastapi-offline and
# what they need) are binaries and are not committed; fetch them on a machine with an
# index, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_17_x86_64 -d .whl onnx fastapi ...
# and point GRADTAPE_WHEELS at that folder. They are installed with --no-index into a throwaway virtualenv that sees the
# machine's own packages (--system-site-packages), never into the system.
#
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (small sizes): how the script is
# checked on a machine without a GPU; its figures are not GPU figures.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-gpu_check_results.md}")"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
DEVICE="${GPU_CHECK_DEVICE:-gpu}"
WHEELS="${GRADTAPE_WHEELS:-$ROOT/bench/wheels}"
PYTHON="${PYTHON:-python3}"
START=$(date +%s)
cd "$ROOT" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The benchmarks' conventions (bench/RESULTS.md); the GPU does the work, but keep host
# BLAS single-threaded and OpenBLAS's core detection on its own.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
# JAX would otherwise take 75% of the GPU's memory at start, leaving CuPy and torch little.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "$*" | tee -a "$OUT"; }

: >"$OUT"
say "# gpu_check.sh ($(date -u '+%Y-%m-%d %H:%M UTC'), device $DEVICE, budget ${BUDGET}s)"
say ""
say "## Environment"
say ""
say '```'
{
  echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  "$PYTHON" - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version(), platform.machine())
for name in ("numpy", "cupy", "torch", "jax", "onnx", "pytest", "scipy"):
    try:
        module = importlib.import_module(name)
        extra = ""
        if name == "cupy":
            extra = f", {module.cuda.runtime.getDeviceCount()} device(s)"
        if name == "torch":
            extra = f", cuda available: {module.cuda.is_available()}"
        if name == "jax":
            extra = f", devices: {module.devices()}"
        print(f"{name} {module.__version__}{extra}")
    except Exception as exc:  # what is missing is reported, not fatal
        print(f"{name}: not usable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
EOF
} | tee -a "$OUT"
say '```'

# Missing packages from the wheelhouses, unpacked into a throwaway folder put first on
# PYTHONPATH (never into the system; a virtualenv would not do: the machine's Python may
# itself be a virtualenv, whose packages a new one does not see): pytest, onnx, and the
# service's own (the GPU service tests start `gradtape serve --device cuda`); each as
# "import name:distribution". The wheels go in with --no-deps (no index to resolve
# against): a wheelhouse holds a package's dependencies beside it.
MISSING=()
for pair in pytest:pytest onnx:onnx fastapi:fastapi uvicorn:uvicorn pydantic:pydantic \
  pydantic_settings:pydantic-settings msgspec:msgspec orjson:orjson msgpack:msgpack \
  prometheus_client:prometheus-client fastapi_offline:fastapi-offline; do
  "$PYTHON" -c "import ${pair%%:*}" >/dev/null 2>&1 || MISSING+=("$pair")
done
if [ ${#MISSING[@]} -gt 0 ]; then
  say ""
  SITE="$(mktemp -d)/site"
  WHEEL_FILES=()
  # pytest's committed wheels only where pytest is missing (they would shadow a newer one)
  "$PYTHON" -c "import pytest" >/dev/null 2>&1 || WHEEL_FILES+=("$ROOT"/bench/wheels/*.whl)
  if [ "$(realpath -m "$WHEELS")" != "$(realpath -m "$ROOT/bench/wheels")" ]; then
    for f in "$WHEELS"/*.whl; do [ -e "$f" ] && WHEEL_FILES+=("$f"); done
  fi
  if [ ${#WHEEL_FILES[@]} -gt 0 ] && "$PYTHON" -m pip install -q --no-index --no-deps \
    --no-compile --target "$SITE" "${WHEEL_FILES[@]}" >>"$OUT.pip.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    say "- the wheelhouse could not be installed (${#WHEEL_FILES[@]} wheels; see $OUT.pip.log)"
  fi
  for pair in "${MISSING[@]}"; do
    if "$PYTHON" -c "import ${pair%%:*}" >/dev/null 2>&1; then
      say "- ${pair#*:}: installed from the wheelhouse into $SITE"
    else
      say "- ${pair#*:}: missing, and not (usable) in the wheelhouse $WHEELS"
    fi
  done
fi

# 1. The GPU-marked tests.
say ""
say "## GPU-marked tests"
say ""
FILES=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests --include='test_*.py' | sort)
if ! "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
  say "not run: pytest is not installed (and no wheelhouse provided it)"
elif [ -z "$FILES" ]; then
  say "not run: no test file carries the gpu mark"
else
  TEST_BUDGET=$(($(left) / 2))
  say "files: $(echo "$FILES" | tr '\n' ' ')(time limit ${TEST_BUDGET}s)"
  say ""
  say '```'
  # -p no:cacheprovider: nothing written into the checkout; the tail keeps the summary.
  # shellcheck disable=SC2086  # (one word per file)
  timeout --kill-after=10 "$TEST_BUDGET" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
    $FILES >"$OUT.tests.log" 2>&1
  STATUS=$?
  tail -n 40 "$OUT.tests.log" | tee -a "$OUT"
  say '```'
  case $STATUS in
    0) say "tests: passed" ;;
    5) say "tests: none collected" ;;
    124 | 137) say "tests: STOPPED at the time limit (${TEST_BUDGET}s); full log $OUT.tests.log" ;;
    *) say "tests: FAILED (exit $STATUS); full log $OUT.tests.log" ;;
  esac
fi

# 2. The benchmark rows, in what time is left (less a margin for the summary).
say ""
say "## Benchmark rows"
say ""
BENCH_BUDGET=$(($(left) - 10))
if [ "$BENCH_BUDGET" -lt 30 ]; then
  say "not run: ${BENCH_BUDGET}s left of the budget"
else
  if [ "$DEVICE" = cpu ]; then
    ARGS=(--device cpu --rounds 3 --batch 8)
  else
    ARGS=(--device gpu --rounds 7 --batch 64)
  fi
  timeout --kill-after=10 "$BENCH_BUDGET" "$PYTHON" bench/bench_gpu.py "${ARGS[@]}" \
    --out "$OUT" >"$OUT.bench.log" 2>&1
  STATUS=$?
  case $STATUS in
    0) say "" && say "bench: done ($(($(date +%s) - START))s into the check)" ;;
    124 | 137) say "" && say "bench: STOPPED at the time limit; the rows written above are complete" ;;
    *)
      say ""
      say "bench: FAILED (exit $STATUS), the log's tail:"
      say '```'
      tail -n 30 "$OUT.bench.log" | tee -a "$OUT"
      say '```'
      ;;
  esac
fi
say ""
say "total: $(($(date +%s) - START))s of ${BUDGET}s"
