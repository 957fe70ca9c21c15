"""Per-example gradients, KFAC and Laplace fits on a tape (issue 30), through the real
app and workers: answers against the engine's own (which tests/engine/
test_kfac_laplace.py checks against curvlinops, laplace-torch and torch) and against
dense truth computed here; models that mix examples refused naming the line; unknown
fits a 404."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

import engine as gt
from engine.curvature import Curvature
from engine.kfac import kfac
from engine.laplace import Laplace
from tests.service.wire import arr, post, problem, t

rng = np.random.default_rng(30)
N, D, H, C = 12, 3, 4, 3
SHAPES = {"w1": (D, H), "b1": (H,), "w2": (H, C)}
VALUES = {name: rng.standard_normal(shape) * 0.8 for name, shape in SHAPES.items()}
X = rng.standard_normal((N, D))
Y = rng.integers(0, C, N)
X_TEST = rng.standard_normal((4, D))
PROGRAM = ["h = tanh(x @ w1 + b1)", "logits = h @ w2", "loss = softmax_cross_entropy(logits, y)"]
DEFN = {
    "variables": {name: t(v, "float64") for name, v in VALUES.items()},
    "inputs": {"x": t(X, "float64"), "y": t(Y, "int64")},
    "program": PROGRAM,
}


def model(p, x):
    return gt.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def loss(out, y):
    return gt.softmax_cross_entropy(out, y)


def recording() -> Curvature:
    params = {k: gt.Tensor(v) for k, v in VALUES.items()}
    return Curvature(model, loss, params, gt.Tensor(X), gt.Tensor(Y))


def flat(tensors: dict) -> np.ndarray:
    return np.concatenate([arr(tensors[k]).reshape(-1) for k in SHAPES])


@pytest.fixture(scope="module")
def tape_id(client) -> str:
    response = client.post(
        "/v1/tapes", json={"definition": DEFN, "target": "loss", "output": "logits"}
    )
    assert response.status_code == 201, response.text
    return response.json()["tape_id"]


def test_per_example_gradients_and_statistics(client, tape_id) -> None:
    answer = post(client, f"/v1/tapes/{tape_id}/per-example", {"gradients": True})
    params = {k: gt.Tensor(v) for k, v in VALUES.items()}
    loop = {k: [] for k in SHAPES}
    for i in range(N):
        one = Curvature(model, loss, params, gt.Tensor(X[i : i + 1]), gt.Tensor(Y[i : i + 1]))
        for k in SHAPES:
            loop[k].append(one.grad[k].numpy())
    norms = np.zeros(N)
    for k in SHAPES:
        stacked = np.stack(loop[k])
        np.testing.assert_allclose(arr(answer["gradients"][k]), stacked, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(arr(answer["mean"][k]), stacked.mean(0), atol=1e-13)
        np.testing.assert_allclose(arr(answer["variance"][k]), stacked.var(0), atol=1e-13)
        np.testing.assert_allclose(arr(answer["sum_squares"][k]), (stacked**2).sum(0), atol=1e-12)
        norms += (stacked.reshape(N, -1) ** 2).sum(1)
    np.testing.assert_allclose(answer["norms"], np.sqrt(norms), rtol=1e-12)
    assert answer["examples"] == N and answer["scale"] == pytest.approx(1 / N)
    light = post(client, f"/v1/tapes/{tape_id}/per-example", {})
    assert light["gradients"] is None
    np.testing.assert_allclose(light["norms"], answer["norms"], rtol=1e-13)
    # The same of the definition itself, no tape kept.
    stateless = post(
        client,
        "/v1/per-example",
        {"definition": DEFN, "target": "loss", "output": "logits", "gradients": True},
    )
    for k in SHAPES:
        np.testing.assert_allclose(
            arr(stateless["gradients"][k]), arr(answer["gradients"][k]), rtol=1e-13
        )


def test_a_model_that_mixes_examples_is_refused_naming_the_line(client) -> None:
    defn = {
        **DEFN,
        "program": [
            "h = tanh(x @ w1 + b1)",
            "centred = h - mean(h, axis=0)",
            "logits = centred @ w2",
            "loss = softmax_cross_entropy(logits, y)",
        ],
    }
    created = client.post(
        "/v1/tapes", json={"definition": defn, "target": "loss", "output": "logits"}
    )
    assert created.status_code == 201, created.text
    tape = created.json()["tape_id"]
    response = client.post(f"/v1/tapes/{tape}/per-example", json={})
    found = problem(response, 422)
    assert found["type"].endswith("batch-dependence")
    assert "at line 'centred'" in found["detail"] and "mixes examples" in found["detail"]
    response = client.post(f"/v1/tapes/{tape}/laplace", json={})
    assert "at line 'centred'" in problem(response, 422)["detail"]


def test_kfac_equals_the_engines_and_runs_the_estimators(client, tape_id) -> None:
    v = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/kfac",
        {"vector": {k: t(x, "float64") for k, x in v.items()}, "factors": True},
    )
    fitted = kfac(recording(), "ggn", names=list(SHAPES))
    assert [(layer["weight"], layer["bias"]) for layer in answer["layers"]] == [
        ("w1", "b1"),
        ("w2", None),
    ]
    for layer, ours in zip(answer["layers"], fitted.layers, strict=True):
        np.testing.assert_allclose(arr(layer["A"]), ours.A, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(arr(layer["G"]), ours.G, rtol=1e-12, atol=1e-14)
    product = fitted.apply([v[k][None] for k in SHAPES])
    np.testing.assert_allclose(
        flat(answer["product"]), np.concatenate([p.ravel() for p in product]), rtol=1e-12
    )
    assert answer["trace"] == pytest.approx(fitted.trace(), rel=1e-12)
    assert answer["logdet"] is None  # the softmax's G is singular: -inf, sent as null
    # The estimators on curvature kfac: its eigenvalues and trace.
    dense = np.concatenate(
        [
            np.concatenate([p.reshape(1, -1) for p in fitted.apply(list(unit))], axis=1)
            for unit in _units()
        ]
    )
    top = post(client, f"/v1/tapes/{tape_id}/eigenvalues", {"k": 2, "curvature": "kfac"})
    np.testing.assert_allclose(top["eigenvalues"], np.linalg.eigvalsh(dense)[::-1][:2], rtol=1e-8)
    trace = post(client, f"/v1/tapes/{tape_id}/trace", {"curvature": "kfac", "method": "exact"})
    assert trace["trace"] == pytest.approx(np.trace(dense), rel=1e-10)


def _units():
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    eye = np.eye(n)
    for row in eye:
        out, start = [], 0
        for shape in SHAPES.values():
            size = int(np.prod(shape))
            out.append(row[start : start + size].reshape((1, *shape)))
            start += size
        yield out


def test_laplace_fit_evidence_predictive_and_samples(client, tape_id) -> None:
    fit = post(
        client,
        f"/v1/tapes/{tape_id}/laplace",
        {"structure": "full", "tune": True},
    )
    ours = Laplace(recording(), structure="full", names=list(SHAPES))
    tuned = ours.tune_prior_precision()
    assert fit["tuned"] and fit["prior_precision"] == pytest.approx(tuned, rel=1e-12)
    assert fit["log_marginal_likelihood"] == pytest.approx(
        ours.log_marginal_likelihood(), rel=1e-10
    )
    lid = fit["laplace_id"]
    again = post(
        client,
        f"/v1/tapes/{tape_id}/laplace/{lid}/log-marginal-likelihood",
        {"prior_precision": 2.0},
    )
    assert again["log_marginal_likelihood"] == pytest.approx(
        ours.log_marginal_likelihood(2.0), rel=1e-10
    )
    ours.prior_precision = 2.0
    pred = post(
        client,
        f"/v1/tapes/{tape_id}/laplace/{lid}/predictive",
        {"test_inputs": {"x": t(X_TEST, "float64")}},
    )
    expected = ours.predictive(model, {"x": gt.Tensor(X_TEST)}["x"])
    np.testing.assert_allclose(arr(pred["mean"]), expected.mean, rtol=1e-12)
    np.testing.assert_allclose(arr(pred["variance"]), expected.variance, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(arr(pred["probabilities"]), expected.probabilities, rtol=1e-10)
    drawn = post(client, f"/v1/tapes/{tape_id}/laplace/{lid}/samples", {"count": 3, "seed": 5})
    expected_draws = ours.sample(3, seed=5)
    got = np.concatenate([arr(drawn["samples"][k]).reshape(3, -1) for k in SHAPES], axis=1)
    np.testing.assert_allclose(got, expected_draws, rtol=1e-12)
    missing = client.post(f"/v1/tapes/{tape_id}/laplace/0123456789abcdef/samples", json={})
    found = problem(missing, 404, "laplace-not-found")
    assert "'0123456789abcdef'" in found["detail"] and found["errors"][0]["field"] == "laplace_id"


def test_a_tapes_laplace_fits_are_listed_read_and_deleted(client) -> None:
    """GET /v1/tapes/{id}/laplace lists the fits, GET .../{lid} describes one, DELETE
    frees its memory (a full fit holds parameters^2 values); an unknown fit is a 404
    naming it. Before, GET and DELETE answered 404 'no such path' and a fit stayed in
    the worker until the tape changed."""
    r = client.post("/v1/tapes", json={"definition": DEFN, "target": "loss", "output": "logits"})
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    base = f"/v1/tapes/{tape}/laplace"
    assert client.get(base).json() == {"fits": []}
    diag = post(client, base, {"structure": "diag"})
    full = post(client, base, {"structure": "full", "prior_precision": 0.5})
    listed = client.get(base)
    assert listed.status_code == 200, listed.text
    fits = listed.json()["fits"]
    # Oldest first; each what its fit answered, with its bytes and when it was made.
    assert [f["laplace_id"] for f in fits] == [diag["laplace_id"], full["laplace_id"]]
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    for fit, made in zip(fits, (diag, full), strict=True):
        # (all but the fit answer's deprecated `curvature`: curvature_used says it)
        assert {k: fit[k] for k in made if k != "curvature"} == {
            k: v for k, v in made.items() if k != "curvature"
        }, fit
        assert "curvature" not in fit
        assert fit["parameters"] == n and fit["subset"] == "all"
        assert datetime.fromisoformat(fit["created_at"]) <= datetime.now(UTC)
    assert fits[0]["structure"] == "diag" and fits[1]["structure"] == "full"
    # A full fit holds its n x n eigenvectors; a diagonal one O(n).
    assert fits[1]["bytes"] >= n * n * 8 > fits[0]["bytes"] > 0, fits
    full_id = full["laplace_id"]
    one = client.get(f"{base}/{full_id}")
    assert one.status_code == 200 and one.json() == fits[1], one.text
    # Read after a change of prior precision: the description follows it.
    post(client, f"{base}/{full_id}/log-marginal-likelihood", {"prior_precision": 2.0})
    now = client.get(f"{base}/{full_id}").json()
    ours = Laplace(recording(), structure="full", names=list(SHAPES), prior_precision=2.0)
    assert now["prior_precision"] == 2.0 and not now["tuned"]
    assert now["log_marginal_likelihood"] == pytest.approx(ours.log_marginal_likelihood(), 1e-10)
    # Deleting frees the fit's memory: the tape holds that much less.
    held = client.get(f"/v1/tapes/{tape}").json()["bytes"]
    r = client.delete(f"{base}/{full_id}")
    assert r.status_code == 204, r.text
    after = client.get(f"/v1/tapes/{tape}").json()["bytes"]
    assert held - after >= n * n * 8, (held, after)
    assert [f["laplace_id"] for f in client.get(base).json()["fits"]] == [diag["laplace_id"]]
    for gone in (
        client.get(f"{base}/{full_id}"),
        client.delete(f"{base}/{full_id}"),
        client.post(f"{base}/{full_id}/samples", json={"count": 2}),
    ):
        found = problem(gone, 404, "laplace-not-found")
        assert repr(full_id) in found["detail"], found
        assert found["errors"][0]["field"] == "laplace_id", found
    # The others stay usable.
    post(client, f"{base}/{diag['laplace_id']}/samples", {"count": 2})
    # A fit lives with the recording: new values drop them all.
    patched = client.patch(f"/v1/tapes/{tape}", json={"variables": {"b1": [0.0] * H}})
    assert patched.status_code == 200, patched.text
    assert client.get(base).json() == {"fits": []}
    problem(client.get(f"{base}/{diag['laplace_id']}"), 404, "laplace-not-found")
    # An unknown tape is the tape's 404, a malformed fit id a 422 naming it.
    problem(client.get("/v1/tapes/nope/laplace"), 404, "tape-not-found")
    bad = problem(client.delete(f"{base}/not-an-id"), 422)
    assert "laplace_id" in bad["detail"], bad
    client.delete(f"/v1/tapes/{tape}")


def test_backprop_diagonal_is_the_ggns(client, tape_id) -> None:
    answer = post(
        client,
        f"/v1/tapes/{tape_id}/diagonal",
        {"curvature": "ggn", "method": "backprop"},
    )
    exact = post(client, f"/v1/tapes/{tape_id}/diagonal", {"curvature": "ggn", "method": "exact"})
    np.testing.assert_allclose(
        flat(answer["diagonal"]), flat(exact["diagonal"]), rtol=1e-11, atol=1e-15
    )
    assert answer["method"] == "backprop" and answer["hvps"] == 0
    refused = client.post(f"/v1/tapes/{tape_id}/diagonal", json={"method": "backprop"})
    assert problem(refused, 422)["detail"].startswith("method 'backprop' is the diagonal")


def test_influence_preconditioned_by_kfac_answers_the_same(client, tape_id) -> None:
    body = {"rows": [0, 1], "curvature": "ggn", "damping": 1e-2, "tol": 1e-10}
    plain = post(client, f"/v1/tapes/{tape_id}/influence", body)
    for kind in ("kfac", "ekfac"):
        found = post(client, f"/v1/tapes/{tape_id}/influence", {**body, "preconditioner": kind})
        assert found["converged"]
        np.testing.assert_allclose(found["scores"], plain["scores"], rtol=1e-7, atol=1e-10)


def test_a_laplace_fit_runs_as_a_job(client, tape_id) -> None:
    r = client.post(f"/v1/tapes/{tape_id}/laplace", json={"structure": "diag", "async": True})
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    with client.stream("GET", f"{location}/events") as events:
        names = [
            line.split(": ", 1)[1] for line in events.iter_lines() if line.startswith("event: ")
        ]
    assert names[-1] == "succeeded"
    result = client.get(f"{location}/result").json()
    ours = Laplace(recording(), structure="diag", names=list(SHAPES))
    assert result["log_marginal_likelihood"] == pytest.approx(
        ours.log_marginal_likelihood(), rel=1e-10
    )
    # the fit the job made is held by the tape
    again = post(
        client, f"/v1/tapes/{tape_id}/laplace/{result['laplace_id']}/log-marginal-likelihood", {}
    )
    assert again["log_marginal_likelihood"] == result["log_marginal_likelihood"]


def test_square_root_columns_beyond_the_memory_budget_are_refused_before_allocating(
    client,
) -> None:
    """1,000 examples of 200 classes: the exact GGN's square-root columns (the backprop
    diagonal, KFAC, a diag or kron Laplace fit) hold 200 x 5 x 1,000 x 200 x 8 bytes =
    1.6 GB, above the test server's 1 GiB request budget: a named 422 before anything is
    allocated (it used to build them all, N R^2 entries at a time, however large)."""
    wide = {
        "variables": {"w": t(np.ones((2, 200)) * 0.01, "float64")},
        "inputs": {"x": t(np.ones((1000, 2)), "float64"), "y": t(np.zeros(1000), "int64")},
        "program": ["logits = x @ w", "loss = softmax_cross_entropy(logits, y)"],
    }
    r = client.post("/v1/tapes", json={"definition": wide, "target": "loss", "output": "logits"})
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    for path, body in (
        ("diagonal", {"curvature": "ggn", "method": "backprop"}),
        ("kfac", {}),
        ("laplace", {"structure": "diag"}),
        ("laplace", {"structure": "kron"}),
    ):
        found = problem(client.post(f"/v1/tapes/{tape}/{path}", json=body), 422, "too-large")
        assert "200 columns of the output [1000, 200]" in found["detail"], found["detail"]
        assert "above this server's" in found["detail"]
    # the empirical Fisher's one column fits
    post(
        client,
        f"/v1/tapes/{tape}/diagonal",
        {"curvature": "empirical_fisher", "method": "backprop"},
    )


def test_predictive_test_inputs_as_bare_numbers_keep_the_tapes_precision(client, tape_id) -> None:
    """test_inputs sent as plain JSON lists take the tape input's dtype (float64 here), as
    every other endpoint's bare numbers do: they were read as float32 first, which moved
    the predictive variance of this float64 tape by ~1e-7. A batch of one point answers
    that point's row of a larger batch."""
    fit = post(
        client, f"/v1/tapes/{tape_id}/laplace", {"structure": "kron", "prior_precision": 0.5}
    )
    base = f"/v1/tapes/{tape_id}/laplace/{fit['laplace_id']}/predictive"
    ours = Laplace(recording(), structure="kron", prior_precision=0.5, names=list(SHAPES))
    expected = ours.predictive(model, gt.Tensor(X_TEST))
    bare = post(client, base, {"test_inputs": {"x": X_TEST.tolist()}})
    np.testing.assert_allclose(arr(bare["mean"]), expected.mean, rtol=1e-12)
    np.testing.assert_allclose(arr(bare["variance"]), expected.variance, rtol=1e-10, atol=1e-14)
    one = post(client, base, {"test_inputs": {"x": X_TEST[2:3].tolist()}})
    np.testing.assert_allclose(arr(one["variance"])[0], expected.variance[2], rtol=1e-10)
    np.testing.assert_allclose(arr(one["probabilities"])[0], expected.probabilities[2], rtol=1e-12)


def test_a_monte_carlo_backprop_diagonal_is_an_estimate_with_its_standard_error(
    client, tape_id
) -> None:
    """method backprop with `samples` estimates the Fisher's diagonal from Monte-Carlo
    draws: it used to answer error 0 and converged (the marks of an exact answer). Now
    the draws' standard error per entry (from 30 draws), their RMS as `error`, converged
    only when a tolerance is met; the exact diagonal lies within it."""
    body = {"curvature": "fisher", "method": "backprop", "samples": 60, "fisher_seed": 2}
    answer = post(client, f"/v1/tapes/{tape_id}/diagonal", body)
    draws = np.array(
        [np.concatenate([d.ravel() for d in draw]) for draw in _draws(60, 2)]
    )  # (60, n), each draw's own estimate of diag(F)
    np.testing.assert_allclose(flat(answer["diagonal"]), draws.mean(0), rtol=1e-10)
    stderr = draws.std(0, ddof=1) / np.sqrt(60)
    np.testing.assert_allclose(flat(answer["stderr"]), stderr, rtol=1e-8)
    assert answer["error"] == pytest.approx(np.sqrt(np.mean(stderr**2)), rel=1e-8)
    assert answer["error"] > 0 and not answer["converged"]
    exact = post(client, f"/v1/tapes/{tape_id}/diagonal", {"curvature": "ggn", "method": "exact"})
    off = np.abs(flat(answer["diagonal"]) - flat(exact["diagonal"]))
    assert np.mean(off <= 3 * stderr + 1e-15) >= 0.9
    loose = post(client, f"/v1/tapes/{tape_id}/diagonal", {**body, "rtol": 10.0})
    assert loose["converged"] and loose["stopped"] == "tolerance"
    few = post(client, f"/v1/tapes/{tape_id}/diagonal", {**body, "samples": 3})
    assert few["stderr"] is None and few["error"] is None and not few["converged"]


def _draws(samples: int, seed: int) -> list:
    from engine.kfac import fisher_diagonal_draws

    return list(fisher_diagonal_draws(recording(), samples, seed))


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("kfac", {"curvature": "hessian"}, "curvature"),
        ("per-example", {"curvature": "ggn"}, "curvature"),
        ("laplace", {"curvature": "fisher"}, "curvature"),
        ("trace", {"curvature": "ggn", "samples": 3}, "samples"),
        ("hvp", {"flat_vector": [1.0] * 28, "curvature": "ggn", "samples": 3}, "samples"),
        # One pass, nothing partial to answer at max_seconds: refused, not ignored (the
        # document said "it then stops and answers what it has").
        ("kfac", {"max_seconds": 5.0}, "max_seconds"),
        ("per-example", {"max_seconds": 5.0}, "max_seconds"),
        ("laplace", {"max_seconds": 5.0}, "max_seconds"),
    ],
)
def test_options_that_contradict_each_other_name_the_field(client, tape_id, path, body, field):
    """An option the row's own checks refuse is named, as a field pydantic refuses is
    (it was `body: Value error, ...` with the field `body`)."""
    found = problem(client.post(f"/v1/tapes/{tape_id}/{path}", json=body), 422, "validation")
    assert found["errors"][0]["field"] == field, found
    assert found["detail"].startswith(f"{field}: "), found


def test_a_scalar_test_input_is_refused_naming_its_shape(client, tape_id) -> None:
    fit = post(client, f"/v1/tapes/{tape_id}/laplace", {"structure": "diag"})
    url = f"/v1/tapes/{tape_id}/laplace/{fit['laplace_id']}/predictive"
    found = problem(client.post(url, json={"test_inputs": {"x": 1.0}}), 422)
    assert found["errors"][0]["field"] == "test_inputs.x", found
    assert "has shape []" in found["detail"] and "[M, 3]" in found["detail"], found


def test_a_laplace_fits_refusals_name_the_option(client, tape_id) -> None:
    refused = problem(client.post(f"/v1/tapes/{tape_id}/laplace", json={"sigma_noise": 2.0}), 422)
    assert refused["errors"][0]["field"] == "sigma_noise", refused  # it said "curvature"
    assert "regression" in refused["detail"]
    fit = post(client, f"/v1/tapes/{tape_id}/laplace", {"structure": "diag"})
    url = f"/v1/tapes/{tape_id}/laplace/{fit['laplace_id']}/log-marginal-likelihood"
    for bad in (-1.0, 0.0):
        found = problem(client.post(url, json={"prior_precision": bad}), 422, "validation")
        assert found["errors"][0]["field"] == "prior_precision", found  # it said "body"
        assert found["detail"].startswith("prior_precision: must be a positive"), found


def test_an_inverse_without_a_vector_is_refused(client, tape_id) -> None:
    """`inverse` multiplies `vector`: asked alone it answered 200 with no product."""
    found = problem(client.post(f"/v1/tapes/{tape_id}/kfac", json={"inverse": True}), 422)
    assert found["errors"][0]["field"] == "inverse" and "give `vector`" in found["detail"]


@pytest.mark.parametrize(("said", "named"), [("kfac", "kron"), ("diagonal", "diag")])
def test_a_laplace_structure_named_as_curvature_used_names_it(
    client, tape_id, said: str, named: str
) -> None:
    """A fit's answer states its structure in curvature_used as `kfac` or `diagonal`
    (as /kfac and `"curvature": "kfac"` do); sent back as the fit's `structure`, it was
    a 422 "String should match pattern '^(diag|kron|full)$'". It is the same fit as
    laplace-torch's name asks for, to the last bit, against the engine's."""
    fit = post(client, f"/v1/tapes/{tape_id}/laplace", {"structure": said})
    same = post(client, f"/v1/tapes/{tape_id}/laplace", {"structure": named})
    ours = Laplace(recording(), structure=named, names=list(SHAPES))
    assert fit["structure"] == named and fit["curvature_used"]["structure"] == said, fit
    assert fit["log_marginal_likelihood"] == same["log_marginal_likelihood"]
    assert fit["log_marginal_likelihood"] == pytest.approx(
        ours.log_marginal_likelihood(), rel=1e-10
    )
    assert fit["curvature_used"] == same["curvature_used"]
    # Another name is refused listing every choice, not a regular expression.
    found = problem(
        client.post(f"/v1/tapes/{tape_id}/laplace", json={"structure": "kronecker"}), 422
    )
    assert found["errors"][0]["field"] == "structure", found
    for choice in ("'diag'", "'kron'", "'full'", "'diagonal'", "'kfac'"):
        assert choice in found["detail"], found
    found = problem(client.post(f"/v1/tapes/{tape_id}/laplace", json={"subset": "last"}), 422)
    assert found["detail"] == "subset: Input should be 'all' or 'last_layer'", found
