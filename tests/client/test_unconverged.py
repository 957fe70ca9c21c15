"""Issue 27, item 1: an answer whose `converged` is false never passes silently. Building
it warns (`UnconvergedWarning`, naming why it stopped and what to raise); under
`Client(strict=True)` (or `AsyncClient(strict=True)`) it raises `Unconverged`, carrying
the partial answer. Influence uses the GGN by default, which converges where the
Hessian of a trained non-convex model stops at negative curvature."""

from __future__ import annotations

import asyncio
import warnings

import httpx
import numpy as np
import pytest
from gradtape.client import (
    ApproximateWarning,
    AsyncClient,
    Client,
    Definition,
    Unconverged,
    UnconvergedWarning,
)


def quadratic(n: int = 12) -> Definition:
    """loss = x^T A x / 2 with A positive definite and well spread: CG needs n steps."""
    rng = np.random.default_rng(27)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = (q * np.linspace(1.0, 50.0, n)) @ q.T
    return Definition(
        "loss = 0.5 * sum(x * (A @ x))", variables={"x": rng.standard_normal(n)}, inputs={"A": a}
    )


def indefinite() -> Definition:
    """A two-layer tanh regression at a point where its Hessian is indefinite."""
    rng = np.random.default_rng(3)
    return Definition(
        """
        out  = tanh(X @ w1) @ w2
        loss = mean((out - y) ** 2)
        """,
        variables={"w1": rng.standard_normal((3, 6)) * 2, "w2": rng.standard_normal((6, 1)) * 2},
        inputs={"X": rng.standard_normal((20, 3)), "y": rng.standard_normal((20, 1))},
    )


def test_an_unconverged_answer_warns_naming_why(client: Client) -> None:
    with client.tape(quadratic(), "loss") as tape:
        with pytest.warns(
            UnconvergedWarning,
            match="Solve did not converge: stopped "
            "'max_iterations' after 1 HVPs.*raise `max_iterations`",
        ):
            step = tape.solve(max_iterations=1, tol=1e-12)
        assert not step.converged and step.stopped == "max_iterations"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tape.solve(max_iterations=1, tol=1e-12)
        assert seen[0].filename == __file__  # it points at the caller's line, not the SDK
        with pytest.warns(UnconvergedWarning, match="Eigenvalues.*'max_hvps'"):
            tape.eigenvalues(1, max_hvps=2, tol=1e-12)
        # A converged answer says nothing.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tape.solve(max_iterations=100, tol=1e-10).converged


def test_strict_mode_raises_with_the_partial_answer(server) -> None:
    with Client(server.base_url, strict=True) as client, client.tape(quadratic(), "loss") as tape:
        with pytest.raises(Unconverged, match="stopped 'max_iterations'") as raised:
            tape.solve(max_iterations=1, tol=1e-12)
        assert raised.value.result.iterations == 1 and not raised.value.result.converged
        assert tape.solve(max_iterations=100, tol=1e-10).converged  # no error when it is

    async def main() -> None:
        async with AsyncClient(server.base_url, strict=True) as client:
            tape = await client.tape(quadratic(), "loss")
            async with tape:
                with pytest.raises(Unconverged):
                    await tape.solve(max_iterations=1, tol=1e-12)
        async with AsyncClient(server.base_url) as client:  # strict is per client
            tape = await client.tape(quadratic(), "loss")
            async with tape:
                with pytest.warns(UnconvergedWarning):
                    await tape.solve(max_iterations=1, tol=1e-12)

    asyncio.run(main())


def test_influence_uses_the_ggn_and_the_hessian_warns_at_negative_curvature(
    client: Client,
) -> None:
    dense = client.hessian(indefinite(), "loss").matrix()
    assert np.linalg.eigvalsh(dense)[0] < -1e-2  # indefinite, well beyond the damping
    with client.tape(indefinite(), "loss", output="out") as tape:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            found = tape.influence(rows=[0, 1, 2], damping=1e-3, max_iterations=200)
        used = found.curvature_used
        assert used is not None and used.kind == "ggn" and found.converged
        with pytest.warns(UnconvergedWarning, match="negative_curvature.*raise `damping`"):
            hessian = tape.influence(rows=[0, 1, 2], curvature="hessian", damping=1e-3)
        assert hessian.stopped == "negative_curvature"


def test_answers_as_dicts_warn_too(client: Client, server) -> None:
    """`tape.frobenius_norm` and `tape.call` answer the JSON dict: one whose `converged`
    is false warns as the typed results do (and raises under strict)."""
    with client.tape(quadratic(), "loss") as tape:
        with pytest.warns(UnconvergedWarning, match="frobenius-norm.*'max_hvps'.*raise"):
            norm = tape.frobenius_norm(max_hvps=4, batch_size=2, rtol=1e-12)
        assert not norm["converged"] and norm["stopped"] == "max_hvps"
        with pytest.warns(UnconvergedWarning, match="trace.*'max_hvps'"):
            assert not tape.call("trace", method="hutchinson", max_hvps=4, rtol=1e-12)["converged"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tape.call("trace", method="exact")["converged"]
    with Client(server.base_url, strict=True) as strict, strict.tape(quadratic(), "loss") as tape:
        with pytest.raises(Unconverged, match="frobenius-norm") as raised:
            tape.frobenius_norm(max_hvps=4, batch_size=2, rtol=1e-12)
        assert raised.value.result["hvps"] == 4


def test_a_job_answered_as_a_dict_warns(client: Client, server) -> None:
    """`client.job(id).wait()` on a job started elsewhere (a 202's Location) answers the
    dict: a trace cut short by its HVP budget says so by a warning."""
    with client.tape(quadratic(), "loss") as tape:
        started = httpx.post(
            f"{server.base_url}/v1/tapes/{tape.id}/trace",
            json={"method": "hutchinson", "max_hvps": 4, "rtol": 1e-12, "async": True},
        )
        assert started.status_code == 202, started.text
        with pytest.warns(UnconvergedWarning, match="job .*'max_hvps'"):
            answer = client.job(started.json()["job_id"]).wait()
        assert answer["method"] == "hutchinson" and answer["stopped"] == "max_hvps"


def test_a_trace_or_diagonal_the_server_chose_to_estimate_warns(client: Client, server) -> None:
    """method "auto" (the default) is exact when max_hvps covers the parameters, else a
    stochastic estimate with a standard error (Hutch++ for a trace, Hutchinson for a
    diagonal) that the request did not ask for: it warns, naming the estimate and how to
    get the exact value. An estimate asked for by name, and an exact answer, do not."""
    with client.tape(quadratic(200), "loss") as tape:
        with pytest.warns(
            ApproximateWarning, match=r"the trace is a hutchpp estimate \(standard error"
        ):
            estimated = tape.trace(max_hvps=120)
        assert estimated.method == "hutchpp" and estimated.stderr > 0
        with pytest.warns(
            ApproximateWarning, match="the diagonal is a hutchinson estimate.*'exact'"
        ):
            assert tape.diagonal(max_hvps=60).method == "hutchinson"
        with pytest.warns(ApproximateWarning, match="the trace is a hutchpp estimate"):
            assert tape.call("trace", max_hvps=120)["method"] == "hutchpp"
        # Said in the HTTP answer too, so a job followed by id (the answer as a dict) warns
        started = httpx.post(
            f"{server.base_url}/v1/tapes/{tape.id}/trace",
            json={"max_hvps": 120, "async": True},
        )
        assert started.status_code == 202, started.text
        with pytest.warns(ApproximateWarning, match="job .* is a hutchpp estimate"):
            assert client.job(started.json()["job_id"]).wait()["auto_estimated"] is True
        with warnings.catch_warnings():
            warnings.simplefilter("error", ApproximateWarning)
            named = tape.call("trace", method="hutchpp", max_hvps=120)
            assert named["method"] == "hutchpp" and named["auto_estimated"] is False
            assert tape.trace(method="hutchpp", max_hvps=120).method == "hutchpp"
            assert tape.diagonal(method="hutchinson", max_hvps=60).method == "hutchinson"
            exact = tape.trace()  # the default budget covers the 200 unit vectors
            assert exact.method == "exact"
            assert abs(estimated.trace - exact.trace) < 5 * estimated.stderr
