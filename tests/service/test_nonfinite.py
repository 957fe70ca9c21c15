"""Non-finite answers are never silent (issue 18): a 422 naming the op where the first
NaN or infinity appeared, or, with allow_nonfinite, the answer with its non-finite
fields listed in `nonfinite`."""

from __future__ import annotations

import numpy as np

from tests.service.wire import arr, post, problem

LOG = {
    "variables": {"w": [1.0, 2.0, 12.0]},
    "program": ["a = w * 2.0", "loss = sum(log(w - 10.0) + a)"],
}
SQRT = {"variables": {"w": [0.0, 4.0]}, "program": ["loss = sum(sqrt(w))"]}


def test_a_non_finite_value_is_a_422_naming_line_column_and_op(client) -> None:
    body = problem(
        client.post("/v1/gradient", json={"definition": LOG, "target": "loss"}), 422, "non-finite"
    )
    (error,) = body["errors"]
    assert (error["line"], error["column"], error["op"], error["kind"]) == (
        2,
        12,
        "log",
        "nonfinite",
    )
    assert "(value holds NaN or infinite values)" in body["detail"]
    assert "program line 2, column 12" in body["detail"]
    assert "allow_nonfinite" in body["detail"]


def test_a_singular_derivative_is_a_422_naming_its_op(client) -> None:
    for path, extra in [
        ("/v1/gradient", {}),
        ("/v1/hessian", {}),
        ("/v1/jacobian", {}),
        ("/v1/hvp", {"vector": {"w": [1.0, 0.0]}}),
    ]:
        body = problem(
            client.post(path, json={"definition": SQRT, "target": "loss", **extra}),
            422,
            "non-finite",
        )
        assert body["errors"][0]["op"] == "sqrt", (path, body)
        assert "derivative" in body["errors"][0]["message"], (path, body)


def test_allow_nonfinite_answers_and_flags_the_fields(client) -> None:
    answer = post(
        client, "/v1/gradient", {"definition": SQRT, "target": "loss", "allow_nonfinite": True}
    )
    assert answer["nonfinite"] == ["gradients.w"]
    np.testing.assert_allclose(arr(answer["value"]), 2.0)
    gradient = arr(answer["gradients"]["w"])
    assert np.isinf(gradient[0]) and gradient[1] == np.float32(0.25)


def test_finite_answers_carry_no_flag(client) -> None:
    answer = post(
        client,
        "/v1/gradient",
        {
            "definition": {"variables": {"w": [4.0]}, "program": ["loss = sum(sqrt(w))"]},
            "target": "loss",
        },
    )
    assert "nonfinite" not in answer


def test_a_tape_with_a_non_finite_recording_is_refused_and_not_kept(client) -> None:
    before = client.get("/v1/tapes").json()["tapes"]
    body = problem(
        client.post("/v1/tapes", json={"definition": SQRT, "target": "loss"}), 422, "non-finite"
    )
    assert body["errors"][0]["op"] == "sqrt"
    assert client.get("/v1/tapes").json()["tapes"] == before
    created = client.post(
        "/v1/tapes", json={"definition": SQRT, "target": "loss", "allow_nonfinite": True}
    )
    assert created.status_code == 201, created.text
    tape = created.json()
    try:
        assert tape["nonfinite"] == ["gradients.w"]
        # An HVP whose product is not finite is refused on the tape too, naming sqrt.
        hvp = problem(
            client.post(f"/v1/tapes/{tape['tape_id']}/hvp", json={"vector": {"w": [1.0, 0.0]}}),
            422,
            "non-finite",
        )
        assert hvp["errors"][0]["op"] == "sqrt"
        flagged = post(
            client,
            f"/v1/tapes/{tape['tape_id']}/hvp",
            {"vector": {"w": [0.0, 1.0]}, "allow_nonfinite": True},
        )
        # H = diag(-1 / (4 w^1.5)): H[0,0] = -inf at w = 0, and -inf * 0 is NaN.
        assert flagged["nonfinite"] == ["hvp.w"]
        product = arr(flagged["hvp"]["w"])
        assert np.isnan(product[0])
        np.testing.assert_allclose(product[1], -1 / 32, rtol=1e-6)
    finally:
        client.delete(f"/v1/tapes/{tape['tape_id']}")
