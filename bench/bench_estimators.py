"""The curvature estimators on a real HessianOperator (an MLP with softmax cross-entropy),
run by hand: `python -m bench.bench_estimators [--hidden 32]`.

- exact trace: the unit vectors in batched passes against one HVP per unit vector (what
  a client looping over /hvp, or Hutchinson-style code with batch 1, would do);
- Hutchinson against Hutch++: HVPs each needs to bring its standard error within rtol,
  and the real error of what it answers (the exact trace is the reference);
- the spectral density: probes side by side (one pass per step) against one probe at a
  time.
Prints one JSON document per measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import engine as gt
from engine.hessian_algorithms import (
    FlatOperator,
    exact_trace,
    hutchinson_trace,
    hutchpp_trace,
    spectral_density,
)


def mlp(hidden: int, seed: int = 0) -> FlatOperator:
    rng = np.random.default_rng(seed)
    x = gt.constant(rng.standard_normal((256, 20)))
    labels = rng.integers(0, 10, 256)
    y = gt.constant(np.eye(10)[labels])
    w1 = gt.Variable(rng.standard_normal((20, hidden)) / np.sqrt(20))
    w2 = gt.Variable(rng.standard_normal((hidden, 10)) / np.sqrt(hidden))

    def loss(w1: gt.Tensor, w2: gt.Tensor) -> gt.Tensor:
        logits = gt.tanh(x @ w1) @ w2
        shifted = logits - gt.max(logits, axis=1, keepdims=True)
        log_p = shifted - gt.log(gt.sum(gt.exp(shifted), axis=1, keepdims=True))
        return -gt.mean(gt.sum(y * log_p, axis=1))

    return FlatOperator(gt.hessian_operator(loss, w1, w2))


def timed(f, *args, **kwargs):
    started = time.perf_counter()
    out = f(*args, **kwargs)
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--rtol", type=float, default=0.01)
    args = parser.parse_args()
    flat = mlp(args.hidden)
    n = flat.n
    batched, batched_s = timed(exact_trace, flat.matvec, n)
    single, single_s = timed(exact_trace, flat.matvec, n, batch_size=1)
    assert abs(batched.trace - single.trace) <= 1e-9 * abs(single.trace)
    print(
        json.dumps(
            {
                "what": "exact trace",
                "n": n,
                "passes": batched.batches,
                "batched_s": round(batched_s, 3),
                "one_at_a_time_s": round(single_s, 3),
                "speedup": round(single_s / batched_s, 1),
            }
        )
    )
    truth = batched.trace
    for estimator in (hutchinson_trace, hutchpp_trace):
        out, seconds = timed(estimator, flat.matvec, n, max_hvps=50 * n, rtol=args.rtol, seed=1)
        print(
            json.dumps(
                {
                    "what": estimator.__name__,
                    "n": n,
                    "rtol": args.rtol,
                    "stopped": out.stopped,
                    "hvps": out.hvps,
                    "stderr_rel": round(out.stderr / abs(out.trace), 5),
                    "error_rel": round(abs(out.trace - truth) / abs(truth), 5),
                    "seconds": round(seconds, 3),
                }
            )
        )
    together, together_s = timed(spectral_density, flat.matvec, n, probes=8, steps=48)
    apart_s = 0.0
    for seed in range(8):
        apart_s += timed(spectral_density, flat.matvec, n, probes=1, steps=48, seed=seed)[1]
    print(
        json.dumps(
            {
                "what": "spectral density",
                "n": n,
                "probes": 8,
                "steps": 48,
                "hvps": together.hvps,
                "side_by_side_s": round(together_s, 3),
                "one_probe_at_a_time_s": round(apart_s, 3),
                "speedup": round(apart_s / together_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
