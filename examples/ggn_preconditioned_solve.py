"""A Gauss-Newton step solved by preconditioned conjugate gradient: the products come
from a tape's GGN on the server, the preconditioner from the GGN's exact diagonal.

A multi-label classifier (three yes/no labels, a sigmoid each) reads features of very different scales (1 to 100, as raw
measurements often are), so its curvature's diagonal spans four orders of magnitude and
plain CG crawls. The Gauss-Newton step solves (G + damping I) x = g, G the generalized
Gauss-Newton matrix at the recorded point (J^T H_loss J over the logits: positive
semi-definite whatever the model). Here CG runs
locally over `tape.linear_operator(curvature="ggn")` (one product request per
iteration), once plain and once with the Jacobi preconditioner 1 / (diag G + damping),
the diagonal from `tape.diagonal(curvature="ggn", method="exact")`; both are checked
against the server's own CG (`tape.solve`).

    gradtape serve                                   # in another terminal
    python examples/ggn_preconditioned_solve.py
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
from gradtape.client import Client, Definition

DAMPING = 1e-3


def pcg(
    matvec: Callable[[np.ndarray], np.ndarray],
    b: np.ndarray,
    precondition: Callable[[np.ndarray], np.ndarray] = lambda r: r,
    rtol: float = 1e-8,
    max_iterations: int = 1000,
) -> tuple[np.ndarray, int]:
    """Preconditioned conjugate gradient (the textbook loop); x and the iterations."""
    x = np.zeros_like(b)
    r = b.copy()
    z = precondition(r)
    p = z.copy()
    rz = r @ z
    for iteration in range(1, max_iterations + 1):
        Ap = matvec(p)
        alpha = rz / (p @ Ap)
        x += alpha * p
        r -= alpha * Ap
        if np.linalg.norm(r) <= rtol * np.linalg.norm(b):
            return x, iteration
        z = precondition(r)
        rz, rz_old = r @ z, rz
        p = z + (rz / rz_old) * p
    return x, max_iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--examples", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(4)
    scales = np.logspace(0, 2, 12)  # feature i measured in units 1 ... 100
    X = rng.standard_normal((args.examples, len(scales))) * scales
    Y = ((X / scales) @ rng.standard_normal((len(scales), 3)) > 0).astype(np.float64)

    definition = Definition(
        """
        logits = X @ W + b
        loss   = sigmoid_cross_entropy(logits, Y)
        """,
        variables={"W": rng.standard_normal((len(scales), 3)) * 0.01, "b": np.zeros(3)},
        inputs={"X": X, "Y": Y},
    )
    # output="logits": the model is the lines up to it, the loss the lines after it.
    with Client(args.url) as client, client.tape(definition, "loss", output="logits") as tape:
        G = tape.linear_operator(curvature="ggn")
        g = tape.flatten(tape.gradients)
        diagonal = tape.flatten(tape.diagonal(curvature="ggn", method="exact").diagonal)

        def damped(v: np.ndarray) -> np.ndarray:
            return G @ v + DAMPING * v

        plain, plain_iterations = pcg(damped, g)
        jacobi, jacobi_iterations = pcg(damped, g, lambda r: r / (diagonal + DAMPING))
        server = tape.flatten(
            tape.solve(curvature="ggn", damping=DAMPING, tol=1e-10, max_iterations=2000).solution
        )

    print(f"{tape.size} parameters; diag(G) spans {diagonal.min():.2g} to {diagonal.max():.2g}")
    print(f"CG iterations: {plain_iterations} plain, {jacobi_iterations} with diag(G)")
    scale = np.linalg.norm(server)
    differences = [float(np.linalg.norm(x - server) / scale) for x in (plain, jacobi)]
    print(
        f"relative difference from the server's solve: {differences[0]:.1e}, {differences[1]:.1e}"
    )
    print(json.dumps({
        "plain_iterations": plain_iterations, "jacobi_iterations": jacobi_iterations,
        "difference_plain": differences[0], "difference_jacobi": differences[1],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
