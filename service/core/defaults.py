"""Defaults that both processes need: the settings (service/core/config.py) take them
as their field defaults, and a worker started without an option (a test, a future pool
backend) falls back to the same value. Plain values, so a worker process reads them
without importing pydantic."""

from __future__ import annotations

CHUNK_SIZE = 1024  # jacobian / Hessian rows per backward pass
HESSIAN_MAX_SIZE = 2048  # n of the n x n Hessian of /v1/hessian
JACOBIAN_MAX_ELEMENTS = 1 << 24  # elements of all the jacobians of one request
HVP_MAX_VECTORS = 1024  # vectors in one /v1/hvp
LANCZOS_MAX_BASIS_BYTES = 1 << 30  # memory of the Lanczos basis
WORKER_DATASET_MEMORY = 1 << 30  # bytes of hot dataset arrays per worker
# The shortest time an algorithm (/eigenvalues, /trace, ...) may be given: a request's
# max_seconds below it is refused (422), and after a tape rebuild the algorithm still
# gets this long (a rebuild that ate the budget would otherwise leave it none).
ALGORITHM_MIN_SECONDS = 0.05
# The compute-cost guard's throughputs of a CPU worker (engine/language/cost.py), measured
# by bench/bench_cost.py on this project's 2-core VM (bench/RESULTS.md): contraction
# FLOP/s, transcendental elements/s, elementwise bytes/s. A CUDA worker has no default
# (the guard is off there unless the settings give its throughputs).
COST_FLOPS_PER_SECOND = 40e9
COST_TRANSCENDENTALS_PER_SECOND = 0.25e9
COST_BYTES_PER_SECOND = 12e9
WORKER_TUNE_ALLOCATOR = True  # engine.tune_allocator in the workers the pool starts
# Every integer option of a request is at most 2^53 - 1: what every JSON reader keeps
# exactly (the document's bounds are floats) and far inside the 64 bits a worker and NumPy
# take. A larger one is a 422 naming its field, never a 500 in the worker.
INT_MAX = 2**53 - 1
