#!/usr/bin/env bash
# Every CPU target of issue 28 (speed round three), measured in one go against the peers
# in the same run, so that a regression shows the day it lands (the small dynamic step
# lost 7% over two sessions unseen: bench/RESULTS.md, "The small step's regression").
#
#   bash bench/targets.sh [results file]        # default targets_results.md
#
# Each row's own script prints its table (the ratios against PyTorch eager, the NumPy
# floor, the raw echo or the direct products, as the target reads); this runs them with
# the benchmarks' settings and appends everything to one file. Settings: one BLAS thread
# everywhere; OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (for the benchmarks only:
# never in tests or CI). NumPy uses its bundled OpenBLAS, PyTorch its MKL (2.2x slower on
# matrix products on an AMD CPU: say so beside the figures). About 10 minutes on a
# 2-core VM; run it on a quiet machine and read process time, not wall time, otherwise.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-targets_results.md}"
PY="${PYTHON:-python}"
run() {
    echo "" >>"$OUT"
    echo "### \`$*\` ($(date -u +%H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg))" >>"$OUT"
    echo "" >>"$OUT"
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" "$@" >>"$OUT" 2>&1 || echo "(exited $?)" >>"$OUT"
}

cd "$ROOT"
echo "# Issue 28's targets, $(date -u '+%Y-%m-%d %H:%M') UTC, $(git rev-parse --short HEAD 2>/dev/null)" >"$OUT"
# Real models: gradient, fresh and reused HVP against PyTorch eager (one model a process)
for model in resnet lenet transformer; do
    run bench/bench_onnx.py --models "$model" --rounds 5 --inner 2
done
# The small dynamic gradient against PyTorch eager
run bench/bench_small_step.py
# 16 curvature products against one, and eigsh through the flat operator
run bench/bench_curvature.py --repeat 5
run bench/bench_flat.py --rounds 5 --inner 2
# The large fresh HVP's peak against the NumPy floor's
run bench/bench_hvp_peak.py --runs 3
# The request path (small requests over HTTP against a trivial endpoint) and transport
run bench/bench_request.py --rounds 1000
run bench/bench_ipc.py --rounds 20
echo "wrote $OUT" >&2
