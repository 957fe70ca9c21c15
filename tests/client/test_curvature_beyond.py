"""RemoteTape's per-example gradients, KFAC and Laplace fits (issue 30) against the
live server, on a logistic regression recorded with `output="z"`, whose per-example
gradients x_i (p_i - y_i), KFAC (X^T X / N) * mean p(1 - p), GGN of the summed NLL
X^T diag(p(1-p)) X, marginal likelihood and probit predictive have closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradtape.client import Client, Definition, NotFound, RemoteLaplace


def logistic(rng: np.random.Generator, n: int = 30, d: int = 4) -> tuple:
    X = rng.standard_normal((n, d))
    y = (rng.random(n) < 0.5).astype(np.float64)
    w = rng.standard_normal(d) * 0.5
    definition = Definition(
        """
        z    = X @ w
        loss = sigmoid_cross_entropy(z, y)
        """,
        variables={"w": w},
        inputs={"X": X, "y": y},
    )
    return definition, X, y, w


def test_per_example_kfac_and_laplace(client: Client, rng: np.random.Generator) -> None:
    definition, X, y, w = logistic(rng)
    n, d = X.shape
    p = 1 / (1 + np.exp(-(X @ w)))
    g = X * (p - y)[:, None]
    with client.tape(definition, "loss", output="z") as tape:
        found = tape.per_example(gradients=True)
        np.testing.assert_allclose(found.gradients["w"], g, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(found.norms, np.linalg.norm(g, axis=1), rtol=1e-10)
        np.testing.assert_allclose(found.variance["w"], g.var(0), rtol=1e-9, atol=1e-15)
        assert found.scale == pytest.approx(1 / n)
        stateless = client.per_example(definition, "loss", output="z", gradients=True)
        np.testing.assert_allclose(stateless.gradients["w"], g, rtol=1e-10, atol=1e-14)

        kfac = (X.T @ X / n) * np.mean(p * (1 - p))
        v = rng.standard_normal(d)
        fitted = tape.kfac({"w": v}, factors=True)
        assert [(layer.kind, layer.weight) for layer in fitted.layers] == [("linear", "w")]
        np.testing.assert_allclose(fitted.product["w"], kfac @ v, rtol=1e-10)
        assert fitted.trace == pytest.approx(np.trace(kfac), rel=1e-10)
        inverse = tape.kfac({"w": v}, inverse=True, damping=0.1)
        np.testing.assert_allclose(
            inverse.product["w"], np.linalg.solve(kfac + 0.1 * np.eye(d), v), rtol=1e-10
        )
        top = tape.eigenvalues(1, curvature="kfac", tol=1e-12)
        assert top.eigenvalues[0] == pytest.approx(np.linalg.eigvalsh(kfac)[-1], rel=1e-8)

        # Laplace over w, full GGN of the summed negative log-likelihood, prior lam I.
        h = (X.T * (p * (1 - p))) @ X
        nll = -np.sum(y * np.log(p) + (1 - y) * np.log(1 - p))
        lam = 0.5
        la = tape.laplace(structure="full", prior_precision=lam)
        assert isinstance(la, RemoteLaplace) and la.likelihood == "bernoulli"
        posterior = h + lam * np.eye(d)
        lml = -nll - 0.5 * (np.linalg.slogdet(posterior)[1] - d * math.log(lam) + lam * w @ w)
        assert la.log_marginal_likelihood_value == pytest.approx(lml, rel=1e-10)
        x_test = rng.standard_normal((3, d))
        pred = la.predictive({"X": x_test})
        f = x_test @ w
        var = np.einsum("md,de,me->m", x_test, np.linalg.inv(posterior), x_test)
        np.testing.assert_allclose(pred.mean[:, 0], f, rtol=1e-10)
        np.testing.assert_allclose(pred.variance[:, 0, 0], var, rtol=1e-9)
        kappa = 1 / np.sqrt(1 + math.pi / 8 * var)
        np.testing.assert_allclose(
            pred.probabilities[:, 0], 1 / (1 + np.exp(-kappa * f)), rtol=1e-9
        )
        # The exact optimum of the marginal likelihood: its derivative is zero there.
        tuned = la.log_marginal_likelihood("tune")
        best = la.prior_precision
        e = np.linalg.eigvalsh(h)
        assert np.sum(e / (best * (e + best))) == pytest.approx(w @ w, rel=1e-10)
        assert tuned > la.log_marginal_likelihood(best * 1.01)
        draws = la.sample(4, seed=3)
        assert draws["w"].shape == (4, d)

        # The tape's fits, listed, read again and deleted (freeing the server's memory).
        diag = tape.laplace(structure="diag")
        listed = tape.laplaces()
        assert [f.id for f in listed] == [la.id, diag.id]
        assert listed[0].prior_precision == pytest.approx(best * 1.01, rel=1e-12)  # (kept)
        assert listed[0].bytes >= d * d * 8 and listed[0].created_at
        assert la.bytes is None  # (its fit's answer says nothing of its memory)
        assert la.refresh() is la and la.bytes == listed[0].bytes
        again = tape.laplace_fit(diag.id)
        assert again.structure == "diag" and again.log_marginal_likelihood_value == pytest.approx(
            diag.log_marginal_likelihood_value, rel=1e-12
        )
        la.delete()
        assert [f.id for f in tape.laplaces()] == [diag.id]
        with pytest.raises(NotFound) as gone:
            la.refresh()
        assert gone.value.type == "/problems/laplace-not-found" and la.id in gone.value.detail
