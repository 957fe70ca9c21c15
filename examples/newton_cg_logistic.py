"""Newton-CG logistic regression, with the loss, gradient and Hessian-vector products
of a tape on the server.

SciPy's `minimize(method="Newton-CG")` asks for f(x), its gradient and Hessian-vector
products H(x) p. A `RemoteTape` answers all three: `tape.fun`, `tape.jac` and
`tape.hessp` re-record the tape when x moves (one request) and reuse the recording for
every product at that x (one request each, no forward pass again). The answer is
checked against SciPy's L-BFGS on the same loss written in NumPy.

    gradtape serve                                   # in another terminal
    python examples/newton_cg_logistic.py
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from gradtape.client import Client, Definition
from scipy.optimize import minimize

L2 = 1e-2


def numpy_loss(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The same loss and gradient in NumPy, for the check."""
    z = X @ w
    p = 1 / (1 + np.exp(-z))
    loss = np.mean(np.logaddexp(0, z) - y * z) + 0.5 * L2 * w @ w
    return float(loss), X.T @ (p - y) / len(y) + L2 * w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--features", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(2)
    X = rng.standard_normal((args.examples, args.features))
    w_true = rng.standard_normal(args.features)
    y = (rng.random(args.examples) < 1 / (1 + np.exp(-X @ w_true))).astype(np.float64)

    # The loss as a program: the data are inputs, w the one variable (the source).
    definition = Definition(
        """
        z    = X @ w
        loss = sigmoid_cross_entropy(z, y) + 0.5 * l2 * sum(w * w)
        """,
        variables={"w": np.zeros(args.features)},
        inputs={"X": X, "y": y, "l2": np.float64(L2)},
    )
    with Client(args.url) as client, client.tape(definition, "loss") as tape:
        x0 = np.zeros(tape.size)
        newton = minimize(
            tape.fun, x0, jac=tape.jac, hessp=tape.hessp, method="Newton-CG",
            options={"xtol": 1e-10},
        )  # fmt: skip
    print(f"Newton-CG: {newton.nit} iterations, {newton.nhev} Hessian-vector products")

    check = minimize(numpy_loss, x0, args=(X, y), jac=True, method="L-BFGS-B",
                     options={"gtol": 1e-12, "ftol": 1e-15})  # fmt: skip
    difference = float(np.max(np.abs(newton.x - check.x)))
    gradient = float(np.max(np.abs(numpy_loss(newton.x, X, y)[1])))
    print(f"largest difference from L-BFGS in NumPy: {difference:.2e}; |gradient| {gradient:.1e}")
    print(json.dumps({
        "success": bool(newton.success), "iterations": int(newton.nit),
        "difference": difference, "gradient": gradient,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
