"""Issue 27, item 7: the empirical Fisher's two conventions, each against a reference.

`empirical_fisher` (ours, the default): c sum_i g_i g_i^T with one gradient per example,
checked against per-example gradients taken one example at a time (a loop of the
engine's own gradients of the loss of a batch of one). `empirical_fisher_terms`
(curvlinops' EFLinearOperator): checked against curvlinops' own dense matrices, recorded
by fixtures/make_curvlinops_ef.py (so that this test needs no torch). On squared error
over 3 outputs curvlinops' matrix is exactly 3x ours; per position of a softmax the two
differ; where an example is one term they agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine as gt
from engine.curvature import Curvature, CurvatureError
from engine.hessian_algorithms import FlatOperator

STORED = np.load(Path(__file__).parent / "fixtures" / "curvlinops_ef.npz")
ORDER = ("w1", "b1", "w2")  # curvlinops' (torch's) parameter order

LOSSES = {
    "mse_mean": lambda o, y: gt.mean((o - y) ** 2),
    "mse_sum": lambda o, y: gt.sum((o - y) ** 2),
    "softmax_positions": lambda o, y: gt.softmax_cross_entropy(o, y),
    "sigmoid_labels": lambda o, y: gt.sigmoid_cross_entropy(o, y),
}


def model(p, x):
    return gt.tanh(x @ p[0] + p[1]) @ p[2]


def case(name: str):
    params = [STORED[f"{name}/{k}"] for k in ORDER]
    x, y = STORED[f"{name}/x"], STORED[f"{name}/y"]
    return params, x, y, LOSSES[name]


def dense(curv: Curvature, kind: str) -> np.ndarray:
    flat = FlatOperator(curv.operator(kind))
    return flat.matvec(np.eye(flat.n))


def loop_reference(params, x, y, loss) -> np.ndarray:
    """c sum_i g_i g_i^T, g_i the gradient of the loss of example i alone, one at a time;
    c = the batch's loss over the sum of the examples' losses (1/N for a mean)."""
    tensors = [gt.constant(p) for p in params]

    def alone(i: int) -> tuple[float, np.ndarray]:
        def of(*p):
            return loss(model(p, x[i : i + 1]), y[i : i + 1])

        grads = gt.grad(of, argnums=(0, 1, 2))(*tensors)
        return float(of(*tensors).numpy()), np.concatenate([g.numpy().ravel() for g in grads])

    losses, rows = zip(*(alone(i) for i in range(len(x))), strict=True)
    g = np.stack(rows)
    c = float(loss(model(tensors, x), y).numpy()) / sum(losses)
    return c * g.T @ g


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_both_conventions_against_their_references(name: str) -> None:
    params, x, y, loss = case(name)
    curv = Curvature(model, loss, [gt.constant(p) for p in params], x, y)
    ours = dense(curv, "empirical_fisher")
    np.testing.assert_allclose(ours, loop_reference(params, x, y, loss), rtol=1e-10, atol=1e-13)
    terms = dense(curv, "empirical_fisher_terms")
    np.testing.assert_allclose(terms, STORED[f"{name}/ef"], rtol=1e-10, atol=1e-13)


def test_how_the_two_conventions_relate() -> None:
    def both(name):
        params, x, y, loss = case(name)
        curv = Curvature(model, loss, [gt.constant(p) for p in params], x, y)
        return dense(curv, "empirical_fisher"), dense(curv, "empirical_fisher_terms")

    ours, terms = both("mse_mean")  # squared error averaged over 3 outputs: exactly 3x
    np.testing.assert_allclose(terms, 3 * ours, rtol=1e-10, atol=1e-13)
    ours, terms = both("mse_sum")  # each example one summed term: the same matrix
    np.testing.assert_allclose(terms, ours, rtol=1e-10, atol=1e-13)
    ours, terms = both("softmax_positions")  # per position: another matrix, not a multiple
    ratio = np.linalg.lstsq(ours.reshape(-1, 1), terms.reshape(-1), rcond=None)[0][0]
    assert np.linalg.norm(terms - ratio * ours) > 0.05 * np.linalg.norm(terms)


def test_the_terms_convention_needs_a_recognised_likelihood() -> None:
    params, x, y, _ = case("mse_mean")
    curv = Curvature(
        model, lambda o, y: gt.mean(abs(o - y)), [gt.constant(p) for p in params], x, y
    )
    with pytest.raises(CurvatureError, match="not recognised"):
        curv.operator("empirical_fisher_terms")
    assert curv.operator("empirical_fisher").size > 0  # ours needs only per-example terms
