"""Which training points pushed a test prediction: influence functions, checked by
leaving the points out and training again.

A logistic regression is trained (in NumPy) on two clusters, with one training label
flipped on purpose. gradtape's influence functions (Koh and Liang, 2017) score every
training point at once from one tape: s_test = (GGN + damping I)^-1 grad L_test by
conjugate gradient on the server, then -g_i . s_test per point. The points the server
calls most harmful are then really removed, the model trained again without each, and the
test loss's actual change set beside the predicted one.

    gradtape serve                                    # in another terminal
    python examples/influence_training_points.py --plot influence.png
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from gradtape.client import Client, Definition

# The model is trained with an L2 penalty l2/2 |w|^2; the tape records the data loss
# alone (the loss after the output may read only the output and the inputs), and the
# damping adds the penalty's Hessian back: (H_data + l2 I) is the trained loss's Hessian.
L2 = 0.01


def train(X: np.ndarray, y: np.ndarray, l2: float) -> np.ndarray:
    """Newton's method on the mean logistic loss + l2/2 |w|^2 (a few steps suffice)."""
    w = np.zeros(X.shape[1])
    for _ in range(25):
        p = 1 / (1 + np.exp(-X @ w))
        gradient = X.T @ (p - y) / len(y) + l2 * w
        hessian = (X.T * (p * (1 - p))) @ X / len(y) + l2 * np.eye(len(w))
        w -= np.linalg.solve(hessian, gradient)
    return w


def test_loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    z = x @ w
    return float(np.mean(np.logaddexp(0, z) - y * z))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--plot", help="draw the scores into this file")
    args = parser.parse_args()
    rng = np.random.default_rng(1)

    # Two Gaussian clusters in 2-d (plus a bias column); training point 0 sits deep in
    # cluster 1 but is labelled 0.
    n = 40
    y = (np.arange(n) % 2).astype(np.float64)
    X = np.c_[rng.standard_normal((n, 2)) + 1.5 * (2 * y[:, None] - 1), np.ones(n)]
    X[0, :2], y[0] = [2.5, 2.5], 0.0
    x_test, y_test = np.array([[2.0, 2.0, 1.0]]), np.array([1.0])
    w = train(X, y, L2)

    definition = Definition(
        """
        z    = X @ w
        loss = sigmoid_cross_entropy(z, y)
        """,
        variables={"w": w},
        inputs={"X": X, "y": y},
    )
    with Client(args.url) as client, client.tape(definition, "loss", output="z") as tape:
        found = tape.influence(
            {"X": x_test, "y": y_test}, curvature="hessian", damping=L2, tol=1e-10, top_k=3
        )
    print("most harmful training points:", found.harmful.tolist())
    print("most helpful training points:", found.helpful.tolist())

    # Leave each of those points out, train again: did the test loss change as predicted?
    base = test_loss(w, x_test, y_test)
    rows = []
    for i in [*found.harmful, *found.helpful]:
        keep = np.arange(n) != i
        actual = test_loss(train(X[keep], y[keep], L2), x_test, y_test) - base
        rows.append({"point": int(i), "predicted": float(found.removal[i]), "actual": actual})
        print(f"  leave out {i:>2}: predicted {found.removal[i]:+.4f}, actual {actual:+.4f}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        figure, _ = found.plot()
        figure.savefig(args.plot, dpi=120)
        print("drew", args.plot)
    print(json.dumps({"harmful": found.harmful.tolist(), "leave_out": rows}))


if __name__ == "__main__":
    main()
