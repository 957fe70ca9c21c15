"""RemoteTape's curvatures and influence functions (issue 15) against the live server:
a logistic regression recorded with `output="z"`, whose GGN X^T diag(p(1-p)) X / N,
empirical Fisher X^T diag((p-y)^2) X / N and influence scores -g_i . (GGN + lam I)^-1
g_test have closed forms."""

from __future__ import annotations

import warnings

import httpx
import numpy as np
import pytest
from gradtape.client import (
    ApproximateWarning,
    Client,
    CurvatureUsed,
    Definition,
    Influence,
    InvalidRequest,
)
from scipy.sparse.linalg import eigsh


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
    p = 1 / (1 + np.exp(-(X @ w)))
    ggn = (X.T * (p * (1 - p))) @ X / n
    per_example = X * (p - y)[:, None]  # g_i
    return definition, X, y, w, ggn, per_example


def test_curvature_products_and_estimates(client: Client, rng: np.random.Generator) -> None:
    definition, X, _, _, ggn, g = logistic(rng)
    empirical = g.T @ g / len(X)
    with client.tape(definition, "loss", output="z") as tape:
        assert tape.info()["output"] == "z"
        v = rng.standard_normal((3, 4))
        for curvature, matrix in (("ggn", ggn), ("fisher", ggn), ("empirical_fisher", empirical)):
            np.testing.assert_allclose(
                tape.hvp({"w": v[0]}, curvature=curvature)["w"], matrix @ v[0], rtol=1e-10
            )
            many = tape.hvp_many([{"w": row} for row in v], curvature=curvature)
            np.testing.assert_allclose(np.stack([h["w"] for h in many]), v @ matrix, rtol=1e-10)
        top = tape.eigenvalues(2, curvature="empirical_fisher", tol=1e-10)
        np.testing.assert_allclose(
            top.eigenvalues, np.linalg.eigvalsh(empirical)[::-1][:2], rtol=1e-8
        )
        assert tape.trace(curvature="ggn").trace == pytest.approx(np.trace(ggn), rel=1e-10)
        diagonal = tape.diagonal(curvature="empirical_fisher").diagonal["w"]
        np.testing.assert_allclose(diagonal, np.diag(empirical), rtol=1e-10)
        density = tape.spectral_density(curvature="ggn", probes=1, steps=4)
        np.testing.assert_allclose(np.sort(density.nodes[0]), np.linalg.eigvalsh(ggn), rtol=1e-8)
        step = tape.solve(curvature="ggn", damping=0.01, tol=1e-12)
        np.testing.assert_allclose(
            step.solution["w"], np.linalg.solve(ggn + 0.01 * np.eye(4), g.mean(0)), rtol=1e-8
        )
        top = eigsh(tape.linear_operator(curvature="ggn"), k=1)[0]
        np.testing.assert_allclose(top, np.linalg.eigvalsh(ggn)[-1:], rtol=1e-8)
        mc = tape.hvp({"w": v[0]}, curvature="fisher", samples=4000, fisher_seed=1)["w"]
        assert np.linalg.norm(mc - ggn @ v[0]) < 0.1 * np.linalg.norm(ggn @ v[0])


def test_influence(client: Client, server, rng: np.random.Generator) -> None:
    definition, X, _, w, ggn, g = logistic(rng)
    x_test, y_test = rng.standard_normal((2, 4)), np.array([1.0, 0.0])
    p_test = 1 / (1 + np.exp(-(x_test @ w)))
    g_test = x_test.T @ (p_test - y_test) / 2
    want = -g @ np.linalg.solve(ggn + 0.1 * np.eye(4), g_test)
    with client.tape(definition, "loss", output="z") as tape:
        found = tape.influence(
            {"X": x_test, "y": y_test}, curvature="ggn", damping=0.1, tol=1e-12, top_k=3
        )
        assert isinstance(found, Influence) and found.converged
        np.testing.assert_allclose(found.scores, want, rtol=1e-8)
        np.testing.assert_allclose(found.removal, -want / len(X), rtol=1e-8)
        assert list(found.helpful) == list(np.argsort(want)[:3])
        assert list(found.harmful) == list(np.argsort(-want)[:3])
        scores, helpful, harmful = found  # unpacks as (scores, helpful, harmful)
        assert scores is found.scores and list(helpful) == list(found.helpful)
        assert list(harmful) == list(found.harmful)
        by_rows = tape.influence(
            rows=[0, 1], curvature="ggn", damping=0.1, tol=1e-12, progress=True
        )
        g_rows = g[:2].mean(0)
        np.testing.assert_allclose(
            by_rows.scores, -g @ np.linalg.solve(ggn + 0.1 * np.eye(4), g_rows), rtol=1e-8
        )
        # The SDK has no dataset method: stored with a plain PUT.
        tensors = {
            k: {"dtype": "float64", "shape": list(v.shape), "data": v.ravel().tolist()}
            for k, v in {"X": x_test, "y": y_test}.items()
        }
        put = httpx.put(f"{server.base_url}/v1/datasets/influence-test", json=tensors)
        assert put.status_code in (200, 201), put.text
        stored = tape.influence(
            {"dataset": "influence-test"}, curvature="ggn", damping=0.1, tol=1e-12
        )
        np.testing.assert_allclose(stored.scores, want, rtol=1e-8)
        with pytest.raises(InvalidRequest, match="missing 'y'"):
            tape.influence({"X": x_test})


def test_a_monte_carlo_fisher_answer_says_so_and_warns(
    client: Client, rng: np.random.Generator
) -> None:
    """An exact trace of a Monte-Carlo Fisher is the sampled matrix's: the result states
    the curvature it used (samples, seed, approximate, why) and warns once, as an
    unconverged answer does; the exact Fisher's neither claims nor warns."""
    definition, _, _, _, ggn, _ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            exact = tape.trace(curvature="fisher", method="exact")
        assert not [w for w in seen if issubclass(w.category, ApproximateWarning)]
        assert exact.trace == pytest.approx(np.trace(ggn), rel=1e-10)
        assert exact.curvature_used == CurvatureUsed(kind="fisher")

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mc = tape.trace(curvature="fisher", samples=2000, fisher_seed=5, method="exact")
        approximate = [w for w in seen if issubclass(w.category, ApproximateWarning)]
        assert len(approximate) == 1 and approximate[0].filename == __file__
        assert "the trace is approximate: a Monte-Carlo Fisher: 2000 target" in str(
            approximate[0].message
        )
        assert mc.method == "exact" and mc.stderr == 0  # exact over the sampled matrix
        used = mc.curvature_used
        assert used is not None and used.approximate and (used.samples, used.seed) == (2000, 5)
        assert used.kind == "fisher" and "stderr" in (used.reason or "")
        assert mc.trace == pytest.approx(np.trace(ggn), rel=0.03)  # near the exact one
        assert mc.trace != exact.trace

        # Products and the dict answers warn too; silenced the way any warning is.
        with pytest.warns(ApproximateWarning, match="the product is approximate"):
            tape.hvp({"w": np.ones(4)}, curvature="fisher", samples=8)
        with pytest.warns(ApproximateWarning, match="the frobenius norm is approximate"):
            answer = tape.frobenius_norm(curvature="fisher", samples=8, max_hvps=32)
        assert answer["curvature_used"]["samples"] == 8
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApproximateWarning)
            with pytest.raises(ApproximateWarning):
                tape.diagonal(curvature="fisher", samples=8)
            warnings.simplefilter("ignore", ApproximateWarning)
            quiet = tape.diagonal(curvature="fisher", samples=8, method="exact")
        assert quiet.curvature_used is not None and quiet.curvature_used.samples == 8

        # A KFAC is one by name: stated, not warned; its Monte-Carlo Fisher is warned.
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApproximateWarning)
            fitted = tape.kfac()
            on_kfac = tape.eigenvalues(1, curvature="kfac")
        assert fitted.curvature_used == CurvatureUsed(
            kind="ggn", structure="kfac", approximate=True, reason=fitted.curvature_used.reason
        )
        assert on_kfac.curvature_used is not None and on_kfac.curvature_used.structure == "kfac"
        with pytest.warns(ApproximateWarning, match="KFAC is approximate: KFAC approximation"):
            sampled = tape.kfac(curvature="fisher", samples=4)
        assert sampled.curvature_used is not None and sampled.curvature_used.kind == "fisher"
        la = tape.laplace(structure="diag")
        assert la.curvature_used is not None and la.curvature_used.structure == "diagonal"


def test_the_old_curvature_attribute_warns_and_points_to_curvature_used(
    client: Client, rng: np.random.Generator
) -> None:
    """`Influence.curvature` and `RemoteLaplace.curvature` carry the server's deprecated
    `curvature` string: reading one still answers it (what curvature_used says), with a
    DeprecationWarning at the reader's line naming `curvature_used`; the rest of the SDK
    (results, its command line, its plots, reprs) reads it without a warning."""
    definition, *_ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # none of the SDK's own
            found = tape.influence(rows=[0, 1], curvature="kfac", damping=0.1)
            fit = tape.laplace(structure="kron")
            assert "/kron/ggn," in repr(fit) and "curvature=" not in repr(found)
        assert str(found.curvature_used) == "KFAC of the ggn"
        with pytest.warns(DeprecationWarning, match=r"Influence.curvature is deprecated") as seen:
            old = found.curvature
        assert seen[0].filename == __file__  # shown at the user's line
        assert "read .curvature_used" in str(seen[0].message) and "0.2.0" in str(seen[0].message)
        used = found.curvature_used
        assert old == "kfac" and used is not None and used.structure == "kfac"
        with pytest.warns(DeprecationWarning, match=r"RemoteLaplace.curvature is deprecated"):
            assert fit.curvature == "ggn"
        assert fit.curvature_used is not None and fit.curvature_used.kind == "ggn"
        with pytest.warns(ApproximateWarning):
            mc = tape.influence(rows=[0], curvature="fisher", samples=4, fisher_seed=2)
        assert str(mc.curvature_used) == "fisher, Monte-Carlo (4 samples, seed 2)"


def test_a_block_wider_than_hvp_max_vectors_goes_in_chunks(
    tmp_path, rng: np.random.Generator
) -> None:
    """linear_operator's matmat (and hvp_many) with more columns than the server's
    hvp_max_vectors (3 here) was a 422; the SDK now learns the limit from that refusal
    (its `limit`) and sends chunks of 3, assembling the product: equal to the dense
    matrices, and to one-column products."""
    from tests.service.conftest import own_server

    definition, X, _, w, ggn, _ = logistic(rng, n=20, d=8)
    p = 1 / (1 + np.exp(-(X @ w)))
    hessian = (X.T * (p * (1 - p))) @ X / len(X)  # (logistic regression: = the GGN)
    with (
        own_server(tmp_path, hvp_max_vectors="3", workers="1") as srv,
        Client(srv.base_url) as client,
        client.tape(definition, "loss", output="z") as tape,
    ):
        refused = httpx.post(
            f"{srv.base_url}/v1/tapes/{tape.id}/hvp",
            json={"vectors": [{"w": [0.0] * 8}] * 4},
        )
        assert refused.status_code == 422 and refused.json()["limit"] == 3
        block = rng.standard_normal((8, 7))
        op = tape.linear_operator()
        assert client._core.hvp_max_vectors is None  # not known before it is refused
        np.testing.assert_allclose(op @ block, hessian @ block, rtol=1e-10)
        assert client._core.hvp_max_vectors == 3
        ggn_op = tape.linear_operator(curvature="ggn")
        np.testing.assert_allclose(ggn_op.matmat(block), ggn @ block, rtol=1e-10)
        columns = np.stack([op.matvec(block[:, j]) for j in range(7)], axis=1)
        np.testing.assert_allclose(op @ block, columns, rtol=1e-12)
        many = tape.hvp_many([{"w": block[:, j]} for j in range(7)])
        np.testing.assert_allclose(np.stack([h["w"] for h in many], axis=1), hessian @ block)


@pytest.mark.parametrize("transport", ["msgpack", "json"])
def test_a_block_larger_than_the_body_limit_goes_in_chunks(tmp_path, transport: str) -> None:
    """`linear_operator() @ np.eye(n)`, the dense Hessian a user builds from products:
    n vectors of n float64s were sent in one request, past the server's body limit (a
    3,000-parameter module's is 72 MB, over the default 64 MiB) and refused with a 413.
    The SDK now learns the limit from that refusal (its `limit`) and sends chunks that
    fit: here 200 parameters (320 kB of vectors, 427 kB in JSON) against 100 kB."""
    from tests.service.conftest import own_server

    n = 200
    w = np.linspace(-1.0, 1.0, n)
    cubic = Definition("loss = sum(w * w * w)", variables={"w": w})  # H = diag(6 w)
    with (
        own_server(tmp_path, max_body_bytes=str(100_000), workers="1") as srv,
        Client(srv.base_url, transport=transport) as client,
        client.tape(cubic, "loss") as tape,
    ):
        assert getattr(client._core, "max_body_bytes", None) is None  # not known yet
        dense = tape.linear_operator() @ np.eye(n)
        np.testing.assert_allclose(dense, np.diag(6 * w), rtol=1e-12, atol=0)
        assert client._core.max_body_bytes is not None
        many = tape.hvp_many([{"w": np.eye(n)[j]} for j in range(n)])  # already known
        np.testing.assert_allclose(np.stack([h["w"] for h in many], axis=1), np.diag(6 * w))


def test_the_vectors_limit_is_read_from_the_refusal() -> None:
    """From `limit`, or (a server without it) the field's "at most N"; never from another
    refusal."""
    from gradtape.client.errors import TooLarge
    from gradtape.client.tape import _vectors_limit

    def refusal(**problem: object) -> TooLarge:
        base = {"type": "/problems/too-large", "status": 422}
        return TooLarge({**base, **problem})

    vectors = [{"field": "vectors", "message": "at most 5"}]
    assert _vectors_limit(refusal(errors=vectors, limit=5)) == 5
    assert _vectors_limit(refusal(errors=vectors)) == 5
    assert _vectors_limit(refusal(errors=[{"field": "time_limit", "message": "at most 5"}])) is None


def test_an_approximate_answer_warns_alike_however_it_is_fetched(
    client: Client, rng: np.random.Generator
) -> None:
    """The same answer warns, or not, by one rule on every path: tape.call() as the typed
    method (a KFAC is one by name: not warned; tape.call("kfac") warned before), and a
    job followed by id as the call that started it (a Monte-Carlo Fisher's trace warned
    when asked directly, and not when its job was waited on by id)."""
    definition, *_ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApproximateWarning)
            by_name = tape.call("kfac")
            tape.kfac()
            tape.call("trace", curvature="kfac", method="exact")
        assert by_name["curvature_used"]["structure"] == "kfac"
        with pytest.warns(ApproximateWarning, match="the kfac is approximate: KFAC approx"):
            tape.call("kfac", curvature="fisher", samples=4)

        def job_of(path: str, body: dict) -> str:
            started = client._run(
                client._core.call("POST", f"/v1/tapes/{tape.id}/{path}", {**body, "async": True})
            )
            return started["job_id"]

        sampled = job_of("trace", {"method": "exact", "curvature": "fisher", "samples": 4})
        with pytest.warns(ApproximateWarning, match=f"job {sampled} is approximate: a Monte"):
            answer = client.job(sampled).wait()
        assert answer["curvature_used"]["samples"] == 4
        kfac = job_of("kfac", {})
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApproximateWarning)
            assert client.job(kfac).wait()["curvature_used"]["structure"] == "kfac"
