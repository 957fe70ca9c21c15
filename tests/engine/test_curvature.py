"""engine.curvature against dense truth on small models (float64).

Every product against the dense matrix built independently: the Hessian as gt.hessian
of the loss (the jacobian of the gradient), the GGN as J^T H_L J from the model's dense
jacobian and the loss's dense Hessian on the output, the empirical Fisher from
per-example gradients taken one example at a time. Lanczos eigenvalues of the GGN
against eigh, CG solves against numpy, the Monte-Carlo Fisher against the exact one,
and influence scores against leave-one-out retraining of an L2-regularised logistic
regression solved by Newton's method to convergence."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import replay
from engine.curvature import Curvature, CurvatureError, top_by_sign
from engine.hessian_algorithms import (
    FlatOperator,
    conjugate_gradient,
    exact_diagonal,
    exact_trace,
    hutchinson_trace,
    hutchpp_trace,
    lanczos,
    power_iteration,
    spectral_density,
)

KINDS = ("hessian", "ggn", "fisher", "empirical_fisher")


# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------


def mlp_case(
    seed: int = 0, n: int = 12, d: int = 4, h: int = 5, classes: int = 3, int_labels: bool = True
):
    """A 2-layer tanh MLP with softmax cross-entropy (mean over examples)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    labels = rng.integers(0, classes, n)
    y = labels if int_labels else np.eye(classes)[labels]
    params = {
        "w1": rng.standard_normal((d, h)) * 0.7,
        "b1": rng.standard_normal(h) * 0.1,
        "w2": rng.standard_normal((h, classes)) * 0.7,
        "b2": np.zeros(classes),
    }

    def model(p, x):
        return gt.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss(out, y):
        return gt.softmax_cross_entropy(out, y)

    return model, loss, params, x, y


def logistic_case(seed: int = 1, n: int = 20, d: int = 3, reduction: str = "mean"):
    """Logistic regression with sigmoid cross-entropy."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    w_true = rng.standard_normal(d)
    y = (rng.random(n) < 1 / (1 + np.exp(-x @ w_true))).astype(np.float64)
    params = {"w": rng.standard_normal(d) * 0.3, "b": np.array(0.1)}

    def model(p, x):
        return x @ p["w"] + p["b"]

    def loss(out, y):
        return gt.sigmoid_cross_entropy(out, y, reduction=reduction)

    return model, loss, params, x, y


def regression_case(seed: int = 2, n: int = 10, d: int = 3, k: int = 2):
    """A tanh layer and mean squared error over every element (a Gaussian likelihood)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    y = rng.standard_normal((n, k))
    params = {"w": rng.standard_normal((d, k)), "v": rng.standard_normal((k, k)) * 0.5}

    def model(p, x):
        return gt.tanh(x @ p["w"]) @ p["v"]

    def loss(out, y):
        return gt.mean((out - y) ** 2)

    return model, loss, params, x, y


CASES = {
    "mlp": mlp_case,
    "mlp_onehot": lambda: mlp_case(int_labels=False),
    "logistic": logistic_case,
    "logistic_sum": lambda: logistic_case(reduction="sum"),
    "regression": regression_case,
}


def flat_params(params: dict) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in params.values()])


def unflat(theta: np.ndarray, like: dict) -> dict:
    out, start = {}, 0
    for k, v in like.items():
        size = np.asarray(v).size
        out[k] = gt.constant(theta[start : start + size].reshape(np.shape(v)))
        start += size
    return out


def dense_truth(model, loss, params, x, y) -> dict[str, np.ndarray]:
    """The four matrices, each from its definition with dense jacobians and Hessians."""
    theta = flat_params(params)
    n = theta.size

    def total(t):
        return loss(model(unflat_tensor(t, params), x), y)

    hessian = gt.hessian(total)(gt.constant(theta)).numpy()
    out = model({k: gt.constant(v) for k, v in params.items()}, x)
    jac = gt.jacrev(lambda t: model(unflat_tensor(t, params), x))(gt.constant(theta)).numpy()
    jac = jac.reshape(-1, n)
    h_out = gt.hessian(lambda o: loss(o, y))(out).numpy().reshape(jac.shape[0], jac.shape[0])
    ggn = jac.T @ h_out @ jac
    # Per-example gradients one example at a time: l_i is the loss of example i alone.
    per_example = np.stack(
        [
            gt.grad(
                lambda t, i=i: loss(model(unflat_tensor(t, params), x[i : i + 1]), y[i : i + 1])
            )(gt.constant(theta)).numpy()
            for i in range(len(x))
        ]
    )
    total_loss = float(total(gt.constant(theta)).numpy())
    losses = [float(loss(out[i : i + 1], y[i : i + 1]).numpy()) for i in range(len(x))]
    scale = total_loss / sum(losses)  # 1/N for a mean, 1 for a sum
    empirical = scale * per_example.T @ per_example
    return {
        "hessian": hessian,
        "ggn": ggn,
        "fisher": ggn,
        "empirical_fisher": empirical,
        "per_example": per_example,
        "scale": scale,
    }


def unflat_tensor(t, like: dict) -> dict:
    """Split a flat parameter tensor into the parameters (differentiably)."""
    out, start = {}, 0
    for k, v in like.items():
        size = np.asarray(v).size
        out[k] = gt.reshape(t[start : start + size], np.shape(v))
        start += size
    return out


def dense_of(op) -> np.ndarray:
    flat = FlatOperator(op)
    return flat.matvec(np.eye(flat.n))


# ----------------------------------------------------------------------------------------
# Products against dense truth
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_product_matches_its_dense_matrix(case: str) -> None:
    model, loss, params, x, y = CASES[case]()
    truth = dense_truth(model, loss, params, x, y)
    curv = Curvature(model, loss, params, x, y)
    for kind in KINDS:
        dense = dense_of(curv.operator(kind))
        np.testing.assert_allclose(dense, truth[kind], rtol=1e-9, atol=1e-11, err_msg=kind)
    assert curv.scale() == pytest.approx(truth["scale"], rel=1e-12)
    # The GGN of a convex loss is positive semi-definite; the Hessian here is not.
    assert np.linalg.eigvalsh(truth["ggn"]).min() > -1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_hvp_and_hvp_many_answer_in_the_parameters_structure(kind: str) -> None:
    model, loss, params, x, y = mlp_case()
    curv = Curvature(model, loss, params, x, y)
    truth = dense_truth(model, loss, params, x, y)[kind]
    op = curv.operator(kind)
    rng = np.random.default_rng(5)
    vs = rng.standard_normal((3, op.size))
    batched = {k: np.stack([np.asarray(unflat(v, params)[k]) for v in vs]) for k in params}
    (many,) = op.hvp_many(batched)
    assert set(many) == set(params)
    got = np.concatenate([many[k].numpy().reshape(3, -1) for k in params], axis=1)
    np.testing.assert_allclose(got, vs @ truth.T, rtol=1e-9, atol=1e-11)
    (one,) = op.hvp(unflat(vs[1], params))
    assert one["w1"].shape == params["w1"].shape
    np.testing.assert_allclose(
        flat_params({k: one[k].numpy() for k in params}), got[1], rtol=1e-12, atol=1e-14
    )


def test_max_batch_splits_the_passes_and_joins_the_same_products() -> None:
    model, loss, params, x, y = mlp_case()
    whole = dense_of(Curvature(model, loss, params, x, y).operator("ggn"))
    split = dense_of(Curvature(model, loss, params, x, y, max_batch=4).operator("ggn"))
    np.testing.assert_allclose(split, whole, rtol=1e-12, atol=1e-14)


def test_per_example_gradients_in_one_pass_match_one_at_a_time() -> None:
    model, loss, params, x, y = mlp_case()
    truth = dense_truth(model, loss, params, x, y)["per_example"]
    curv = Curvature(model, loss, params, x, y)
    for chunk in (None, 5):
        grads = curv.per_example_gradients(chunk_size=chunk)
        got = np.concatenate([grads[k].numpy().reshape(len(x), -1) for k in params], axis=1)
        np.testing.assert_allclose(got, truth, rtol=1e-10, atol=1e-12)
    # Their scaled sum is the gradient of the mean loss.
    np.testing.assert_allclose(
        curv.scale() * truth.sum(0),
        flat_params({k: v.numpy() for k, v in curv.grad.items()}),
        rtol=1e-10,
        atol=1e-12,
    )


def test_the_recognised_likelihoods() -> None:
    assert Curvature(*mlp_case()).likelihood().family == "categorical"
    assert Curvature(*mlp_case(int_labels=False)).likelihood().family == "categorical"
    assert Curvature(*logistic_case()).likelihood().family == "bernoulli"
    regression = Curvature(*regression_case())
    likelihood = regression.likelihood()
    # mean over N*K elements: l_i = (1/K)|o_i - y_i|^2, the NLL of N(o_i, K/2 I).
    assert likelihood.family == "gaussian"
    assert likelihood.variance == pytest.approx(2 / 2, rel=1e-9)


def multilabel_case(seed: int = 3, n: int = 10, d: int = 4, labels: int = 3):
    """Multi-label logistic regression: sigmoid cross-entropy averaged over (N, D)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    y = (rng.random((n, labels)) < 0.5).astype(float)
    params = {"w": 0.5 * rng.standard_normal((d, labels)), "b": 0.1 * rng.standard_normal(labels)}

    def model(p, x):
        return x @ p["w"] + p["b"]

    def loss(out, y):
        return gt.sigmoid_cross_entropy(out, y, reduction="mean")

    return model, loss, params, x, y


def sequence_case(seed: int = 4, n: int = 6, steps: int = 5, d: int = 3, classes: int = 4):
    """A softmax per sequence position: cross-entropy averaged over (N, T)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, steps, d))
    y = rng.integers(0, classes, (n, steps))
    params = {"w": 0.5 * rng.standard_normal((d, classes))}

    def model(p, x):
        return gt.tanh(x) @ p["w"]

    def loss(out, y):
        return gt.softmax_cross_entropy(out, y)

    return model, loss, params, x, y


@pytest.mark.parametrize("case", [multilabel_case, sequence_case])
def test_the_fisher_of_a_mean_over_labels_or_positions_is_the_ggn(case) -> None:
    # Such losses were refused (the scale 1/(N D) is not the per-example 1/N). The Fisher
    # is the GGN, scaled like the loss (curvlinops), and the Monte-Carlo one converges to
    # the dense GGN: with the per-example scale instead it would be D (or T) times off.
    model, loss, params, x, y = case()
    curv = Curvature(model, loss, params, x, y)
    terms = y[0].size
    assert curv.likelihood().scale == pytest.approx(1 / (len(x) * terms), rel=1e-9)
    truth = dense_truth(model, loss, params, x, y)["ggn"]
    np.testing.assert_allclose(dense_of(curv.operator("fisher")), truth, rtol=1e-10, atol=1e-13)
    errors = []
    for samples in (16, 2048):
        mc = dense_of(curv.operator("fisher", samples=samples, seed=5))
        errors.append(np.linalg.norm(mc - truth) / np.linalg.norm(truth))
    assert errors[1] < 0.06 and errors[1] < errors[0] / 4, errors


def test_monte_carlo_fisher_converges_to_the_exact_fisher() -> None:
    for case in (mlp_case, logistic_case, regression_case):
        curv = Curvature(*case())
        exact = dense_of(curv.operator("fisher"))
        errors = []
        for samples in (16, 1024):
            mc = dense_of(curv.operator("fisher", samples=samples, seed=3))
            errors.append(np.linalg.norm(mc - exact) / np.linalg.norm(exact))
            # Each sample's term is a sum of outer products: symmetric, semi-definite.
            np.testing.assert_allclose(mc, mc.T, atol=1e-12)
            assert np.linalg.eigvalsh(mc).min() > -1e-10
        # The Monte-Carlo error falls as 1/sqrt(S): 64 times the samples, 8 times less
        # error, allowing a factor 2 for the draws.
        assert errors[1] < 0.06 and errors[1] < errors[0] / 4, (case.__name__, errors)
    # The same seed gives the same matrix; another seed another.
    curv = Curvature(*mlp_case())
    a = dense_of(curv.operator("fisher", samples=8, seed=1))
    b = dense_of(Curvature(*mlp_case()).operator("fisher", samples=8, seed=1))
    c = dense_of(curv.operator("fisher", samples=8, seed=2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


# ----------------------------------------------------------------------------------------
# The existing algorithms on the new operators
# ----------------------------------------------------------------------------------------


def test_lanczos_trace_and_cg_run_unchanged_on_the_ggn() -> None:
    model, loss, params, x, y = mlp_case()
    ggn = dense_truth(model, loss, params, x, y)["ggn"]
    exact = np.linalg.eigvalsh(ggn)
    op = Curvature(model, loss, params, x, y).operator("ggn")
    flat = FlatOperator(op)
    top = lanczos(flat.matvec, flat.n, k=3, tol=1e-10)
    assert top.converged
    np.testing.assert_allclose(top.eigenvalues, exact[::-1][:3], rtol=1e-8)
    trace = hutchinson_trace(flat.matvec, flat.n, max_hvps=256)
    assert abs(trace.trace - np.trace(ggn)) < 4 * trace.stderr
    b = np.random.default_rng(0).standard_normal(flat.n)
    solve = conjugate_gradient(flat.matvec, b, damping=0.1, tol=1e-10)
    assert solve.converged
    np.testing.assert_allclose(
        solve.x, np.linalg.solve(ggn + 0.1 * np.eye(flat.n), b), rtol=1e-7, atol=1e-9
    )


def test_scipy_adapter_gauss_newton_steps_reach_the_minimum() -> None:
    """trust-ncg with the GGN as hessp: each new point re-records the shared Curvature."""
    from scipy.optimize import minimize

    model, loss, params, x, y = logistic_case(n=40)
    op = Curvature(model, loss, params, x, y).operator("ggn")
    result = minimize(
        op.fun,
        flat_params(params),
        jac=op.jac,
        hessp=op.hessp,
        method="trust-ncg",
        options={"gtol": 1e-9},
    )
    assert result.success
    assert np.linalg.norm(op.jac(result.x)) < 1e-8
    # The operator now answers at the new point: the GGN there, from scratch.
    fresh = Curvature(model, loss, unflat(result.x, params), x, y).operator("ggn")
    np.testing.assert_allclose(dense_of(op), dense_of(fresh), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------
# Influence functions against leave-one-out retraining
# ----------------------------------------------------------------------------------------


def _newton(x, y, weights, lam, iters=50):
    """argmin (1/N) sum_i weights_i l_i(w) + (lam/2)|w|^2 for logistic regression with a
    bias (the last coordinate), by Newton's method to machine precision."""
    n = len(x)
    a = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(a.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-a @ w))
        g = a.T @ (weights * (p - y)) / n + lam * w
        h = (a * (weights * p * (1 - p))[:, None]).T @ a / n + lam * np.eye(a.shape[1])
        step = np.linalg.solve(h, g)
        w -= step
        if np.linalg.norm(step) < 1e-15:
            break
    return w


def _log_loss(x, y, w):
    z = x @ w[:-1] + w[-1]
    return float(np.mean(np.logaddexp(0, z) - y * z))


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_influence_matches_leave_one_out_retraining(curvature: str) -> None:
    """At the regularised optimum, -c * I_up,loss predicts the change in the test loss
    when one example is left out; retraining without it (Newton to convergence) gives
    the actual change. For a strongly convex model with a small step (one example of 200)
    the first-order prediction is near exact: measured, a correlation of 0.9998 and every
    prediction within 6% of the largest change (the remainder is second order in the
    1/N step; the outlier examples carry it). Asserted: 0.999 and 10%. For this linear
    model the GGN is the Hessian, so both curvatures must agree."""
    rng = np.random.default_rng(7)
    n, d, lam = 200, 3, 0.05
    x = rng.standard_normal((n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-x @ np.array([1.5, -2.0, 0.5])))).astype(float)
    x_test = rng.standard_normal((4, d))
    y_test = (rng.random(4) < 0.5).astype(float)
    w = _newton(x, y, np.ones(n), lam)
    params = {"w": w[:-1], "b": np.array(w[-1])}

    def model(p, x):
        return x @ p["w"] + p["b"]

    def loss(out, y):
        return gt.sigmoid_cross_entropy(out, y)

    curv = Curvature(model, loss, params, x, y)
    # The L2 term (lam/2)|w|^2 (on the bias too) has Hessian lam * I: the damping.
    found = curv.influence(x_test, y_test, curvature=curvature, damping=lam, tol=1e-12, top_k=5)
    assert found.solve.converged
    base = _log_loss(x_test, y_test, w)
    assert found.test_loss == pytest.approx(base, rel=1e-12)
    actual = np.empty(n)
    for i in range(n):
        weights = np.ones(n)
        weights[i] = 0.0  # the training loss without example i's term
        actual[i] = _log_loss(x_test, y_test, _newton(x, y, weights, lam)) - base
    assert np.corrcoef(found.removal, actual)[0, 1] > 0.999
    assert np.max(np.abs(found.removal - actual)) < 0.1 * np.max(np.abs(actual))
    np.testing.assert_allclose(found.removal, -found.scores / n, rtol=1e-12)
    # The top harmful examples are those whose removal lowers the test loss most.
    assert set(found.harmful[:3]) <= set(np.argsort(actual)[:5])
    assert set(found.helpful[:3]) <= set(np.argsort(-actual)[:5])


def test_helpful_and_harmful_follow_the_signs_of_the_scores() -> None:
    scores = np.array([0.5, -2.0, 3.0, 0.0, -0.1, 1.0, 2.0])
    helpful, harmful = top_by_sign(scores, 10)
    assert list(helpful) == [1, 4] and list(harmful) == [2, 6, 5, 0]  # 0.0 is neither
    helpful, harmful = top_by_sign(scores, 2)
    assert list(helpful) == [1, 4] and list(harmful) == [2, 6]
    helpful, harmful = top_by_sign(np.array([1.0, 2.0]), 5)
    assert list(helpful) == [] and list(harmful) == [1, 0]
    assert [list(x) for x in top_by_sign(scores, 0)] == [[], []]


def test_influence_of_training_rows_equals_their_data_as_test_points() -> None:
    model, loss, params, x, y = mlp_case()
    curv = Curvature(model, loss, params, x, y)
    by_rows = curv.influence(rows=[2, 5], curvature="ggn", damping=0.1, tol=1e-12)
    by_data = curv.influence(x[[2, 5]], y[[2, 5]], curvature="ggn", damping=0.1, tol=1e-12)
    np.testing.assert_allclose(by_rows.scores, by_data.scores, rtol=1e-10)
    # Against dense truth: -g_i . (GGN + 0.1 I)^-1 grad L_test.
    truth = dense_truth(model, loss, params, x, y)
    test_grad = gt.grad(lambda t: loss(model(unflat_tensor(t, params), x[[2, 5]]), y[[2, 5]]))(
        gt.constant(flat_params(params))
    ).numpy()
    s = np.linalg.solve(truth["ggn"] + 0.1 * np.eye(len(test_grad)), test_grad)
    np.testing.assert_allclose(by_rows.scores, -truth["per_example"] @ s, rtol=1e-8, atol=1e-12)
    # helpful: the negative scores, most negative first; harmful: the positive ones. With
    # top_k 10 of 12 examples they once overlapped and each held scores of both signs.
    scores = by_rows.scores
    negative, positive = np.flatnonzero(scores < 0), np.flatnonzero(scores > 0)
    assert 0 < len(negative) < 10 and 0 < len(positive) < 10  # mixed, fewer than top_k
    assert list(by_rows.helpful) == list(negative[np.argsort(scores[negative])])
    assert list(by_rows.harmful) == list(positive[np.argsort(-scores[positive])])
    assert not set(by_rows.helpful) & set(by_rows.harmful)
    # C given as an operator recorded elsewhere: here the GGN of another recording.
    other = Curvature(model, loss, params, x, y).operator("ggn")
    given = curv.influence(rows=[2, 5], operator=other, damping=0.1, tol=1e-12)
    np.testing.assert_allclose(given.scores, by_rows.scores, rtol=1e-10)


# ----------------------------------------------------------------------------------------
# What cannot be asked
# ----------------------------------------------------------------------------------------


def test_fisher_of_an_unrecognised_loss_is_refused_with_the_reason() -> None:
    model, _, params, x, y = regression_case()
    curv = Curvature(model, lambda out, y: gt.mean((out - y) ** 4), params, x, y)
    with pytest.raises(CurvatureError, match="not recognised as the negative log-likelihood"):
        curv.operator("fisher")
    curv.operator("ggn")  # the GGN needs no likelihood
    curv.operator("empirical_fisher")


def test_a_loss_that_mixes_examples_has_no_per_example_curvature() -> None:
    model, _, params, x, y = regression_case()
    curv = Curvature(model, lambda out, y: gt.sum(out - y) ** 2, params, x, y)
    with pytest.raises(CurvatureError, match="not a sum or mean of per-example terms"):
        curv.operator("empirical_fisher")
    with pytest.raises(ValueError, match="curvature must be one of"):
        curv.operator("kfac")
    with pytest.raises(ValueError, match="samples is for the Monte-Carlo Fisher"):
        curv.operator("ggn", samples=4)
    with pytest.raises(CurvatureError, match="one floating-point tensor"):
        Curvature(lambda p, x: [x @ p["w"]], lambda o, y: gt.sum(o[0]), params, x, y)


def test_float32_models_give_float32_products_near_the_float64_truth() -> None:
    model, loss, params, x, y = mlp_case()
    truth = dense_truth(model, loss, params, x, y)
    curv = Curvature(
        model, loss, {k: v.astype(np.float32) for k, v in params.items()}, x.astype(np.float32), y
    )
    assert curv.likelihood().family == "categorical"  # recognised at float32 tolerance
    for kind in KINDS:
        op = curv.operator(kind)
        (product,) = op.hvp({k: np.ones(np.shape(v), np.float32) for k, v in params.items()})
        assert product["w1"].dtype == np.float32
        got = flat_params({k: product[k].numpy() for k in params})
        np.testing.assert_allclose(got, truth[kind] @ np.ones(op.size), rtol=2e-4, atol=2e-5)


def test_dense_newton_step_and_nbytes_of_a_curvature_operator() -> None:
    """HessianOperator's dense(), newton_step() and nbytes() run on the GGN as they do
    on the Hessian: the Gauss-Newton step (GGN + damping I)^-1 g."""
    model, loss, params, x, y = mlp_case()
    truth = dense_truth(model, loss, params, x, y)["ggn"]
    op = Curvature(model, loss, params, x, y).operator("ggn")
    np.testing.assert_allclose(op.dense(chunk_size=7), truth, rtol=1e-10, atol=1e-12)
    (step,) = op.newton_step(0.1)
    grad = flat_params({k: v.numpy() for k, v in op.grad[0].items()})
    np.testing.assert_allclose(
        flat_params(step), np.linalg.solve(truth + 0.1 * np.eye(op.size), grad), rtol=1e-9
    )
    assert op.nbytes() > sum(np.asarray(v).nbytes for v in params.values())


def test_without_the_hessian_recorded_every_product_is_the_same() -> None:
    """hessian=False keeps the forward only (less held until a Hessian is asked, then
    recorded once more): the same four matrices."""
    model, loss, params, x, y = mlp_case()
    full = Curvature(model, loss, params, x, y)
    lean = Curvature(model, loss, params, x, y, hessian=False)
    for kind in ("ggn", "empirical_fisher", "fisher"):
        np.testing.assert_allclose(
            dense_of(lean.operator(kind)), dense_of(full.operator(kind)), rtol=1e-12, atol=1e-14
        )
    assert lean.operator("ggn").nbytes() < full.operator("ggn").nbytes()
    np.testing.assert_allclose(
        dense_of(lean.operator("hessian")),
        dense_of(full.operator("hessian")),
        rtol=1e-12,
        atol=1e-14,
    )
    assert float(lean.value.numpy()) == float(full.value.numpy())


def test_the_issue_12_estimators_run_on_the_curvature_operators() -> None:
    """Deflated power iteration, exact and Hutch++ traces, the exact diagonal and the SLQ
    density, unchanged, on the GGN and the empirical Fisher against their dense truth."""
    model, loss, params, x, y = mlp_case()
    truth = dense_truth(model, loss, params, x, y)
    curv = Curvature(model, loss, params, x, y)
    for kind in ("ggn", "empirical_fisher"):
        flat = FlatOperator(curv.operator(kind))
        exact = np.linalg.eigvalsh(truth[kind])
        top = power_iteration(flat.matvec, flat.n, k=2, tol=1e-9, max_hvps=4000)
        np.testing.assert_allclose(top.eigenvalues, exact[::-1][:2], rtol=1e-6)
        assert exact_trace(flat.matvec, flat.n).trace == pytest.approx(np.trace(truth[kind]))
        sketched = hutchpp_trace(flat.matvec, flat.n, batch_size=8, max_hvps=96)
        assert abs(sketched.trace - np.trace(truth[kind])) < 4 * sketched.stderr + 1e-9
        np.testing.assert_allclose(
            exact_diagonal(flat.matvec, flat.n).diagonal,
            np.diag(truth[kind]),
            rtol=1e-10,
            atol=1e-14,
        )
        # n Lanczos steps: each probe's Ritz nodes are eigenvalues of the matrix.
        density = spectral_density(flat.matvec, flat.n, probes=2, steps=flat.n)
        nodes = np.asarray(density.nodes[0])
        assert np.abs(nodes[:, None] - exact[None, :]).min(axis=1).max() < 1e-8


def test_a_curvature_operator_answers_the_operator_interface_in_full() -> None:
    """Everything a HessianOperator answers, a CurvatureOperator answers too (it is one),
    its compiled passes and their status included."""
    from engine.curvature import curvature_operator

    rng = np.random.default_rng(40)
    x, y = rng.standard_normal((8, 3)), rng.standard_normal((8, 2))
    op = curvature_operator(
        lambda w, x: x @ w, lambda o, y: gt.mean((o - y) ** 2), np.ones((3, 2)), x, y, "ggn"
    )
    (product,) = op.hvp(np.ones((3, 2)))
    # GGN of a linear model under mean squared error: (2 / (N * 2)) X^T X V per output
    np.testing.assert_allclose(product.numpy(), x.T @ x @ np.ones((3, 2)) / 8, rtol=1e-10)
    assert list(op.replay_status().values()) == [replay.NOT_YET] and op.replay_changes > 0
    for _ in range(2):
        (again,) = op.hvp(np.ones((3, 2)))
        np.testing.assert_array_equal(again.numpy(), product.numpy())
    assert list(op.replay_status().values()) == ["compiled"]


def test_test_gradients_of_row_subsets_add_up_as_the_loss_does() -> None:
    """Curvature.test_gradient on training rows is influence's right-hand side: the
    gradient of the loss on those rows; for a mean loss, subsets weighted by their share
    of the rows add up to the whole set's (what a sharded tape sums its parts' by)."""
    model, loss, params, x, y = mlp_case()
    curv = Curvature(model, loss, params, x, y)
    rows = [0, 3, 7, 3, 10]
    value, grad = curv.test_gradient(rows=rows)
    want = gt.value_and_grad(lambda p: loss(model(p, x[rows]), y[rows]))(
        {k: gt.constant(v) for k, v in params.items()}
    )
    assert float(value.numpy()) == pytest.approx(float(want[0].numpy()), rel=1e-12)
    for k in params:
        np.testing.assert_allclose(grad[k].numpy(), want[1][k].numpy(), rtol=1e-12)
    parts = [[0, 3, 3], [7, 10]]
    pieces = [curv.test_gradient(rows=r) for r in parts]
    for k in params:
        summed = sum(len(r) / len(rows) * g[k].numpy() for r, (_, g) in zip(parts, pieces))
        np.testing.assert_allclose(summed, grad[k].numpy(), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="rows"):
        curv.test_gradient(x[:2], y[:2], rows=[1])


@pytest.mark.parametrize(
    "kind, samples",
    [("hessian", None), ("ggn", None), ("fisher", None), ("fisher", 3), ("empirical_fisher", None)],
)
def test_curvature_products_replay_exactly(kind, samples) -> None:
    """Every curvature's products are compiled (issue 28): single and K-vector products,
    new vectors on every call, bit-equal to the dynamic products (compiled=False), and
    the status says "compiled" for both layouts; a new point starts over."""
    model, loss, params, x, y = mlp_case(seed=5)
    curv = Curvature(model, loss, params, x, y)
    op = curv.operator(kind, samples=samples)
    twin = Curvature(model, loss, params, x, y).operator(kind, samples=samples)
    twin.compiled = False
    rng = np.random.default_rng(6)
    for _ in range(4):
        one = {k: rng.standard_normal(v.shape) for k, v in params.items()}
        many = {k: rng.standard_normal((3, *v.shape)) for k, v in params.items()}
        for ours, theirs in (
            (op.hvp(one), twin.hvp(one)),
            (op.hvp_many(many), twin.hvp_many(many)),
        ):
            for a, b in zip(gt.tree.flatten(ours)[0], gt.tree.flatten(theirs)[0], strict=True):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert list(op.replay_status().values()) == ["compiled", "compiled"], op.replay_status()
    moved = {k: v + 0.1 for k, v in params.items()}
    curv._record(moved)  # a new point: what was compiled read the old recording
    assert op.replay_status() == {}
    one = {k: np.ones(v.shape) for k, v in params.items()}
    fresh = Curvature(model, loss, moved, x, y).operator(kind, samples=samples)
    fresh.compiled = False
    for _ in range(3):
        for a, b in zip(
            gt.tree.flatten(op.hvp(one))[0], gt.tree.flatten(fresh.hvp(one))[0], strict=True
        ):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
