"""The answers' old `curvature` string (deprecated: service.core.operations.
CURVATURE_DEPRECATED) says what their `curvature_used` says, on every answer that has
both: each response schema the contract marks so is asked here, on an unsharded and a
sharded tape and as a job, with every curvature it takes (Monte-Carlo and KFAC among
them). Real server, real workers."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.service.conftest import ROOT
from tests.service.test_jobs import wait
from tests.service.test_tape_shards import record
from tests.service.wire import post

PROGRAM = ["h = tanh(x @ w1 + b1)", "out = h @ w2", "loss = mean((out - y) ** 2)"]
CONTRACT = json.loads((ROOT / "openapi" / "openapi.json").read_text())

# (curvature fields asked, the curvature_used they make: kind, samples, structure)
CHOICES: list[tuple[dict[str, Any], tuple[str, int | None, str | None]]] = [
    ({"curvature": "hessian"}, ("hessian", None, None)),
    ({"curvature": "ggn"}, ("ggn", None, None)),
    ({"curvature": "fisher"}, ("fisher", None, None)),
    ({"curvature": "fisher", "samples": 4, "fisher_seed": 2}, ("fisher", 4, None)),
    ({"curvature": "empirical_fisher"}, ("empirical_fisher", None, None)),
    ({"curvature": "kfac"}, ("ggn", None, "kfac")),
    ({"curvature": "ekfac"}, ("ggn", None, "ekfac")),
]
ESTIMATORS = {
    "influence": {"rows": [0, 3], "damping": 1.0, "max_iterations": 40},
    "frobenius-norm": {"max_hvps": 16, "batch_size": 8},
}
# A Laplace fit's curvature and structure; its structure is curvature_used's (kron: kfac).
FITS = [
    ({"curvature": "ggn", "structure": "diag"}, ("ggn", None, "diagonal")),
    ({"curvature": "ggn", "structure": "kron"}, ("ggn", None, "kfac")),
    ({"curvature": "empirical_fisher", "structure": "full"}, ("empirical_fisher", None, None)),
]


def agrees(old: str, used: dict[str, Any]) -> bool:
    """The mapping the deprecated field's description states: `curvature_used.kind`,
    except for curvature kfac/ekfac on an estimator (the GGN's KFAC): its structure."""
    if old in ("kfac", "ekfac"):
        return used["kind"] == "ggn" and used["structure"] == old
    return old == used["kind"]


def response_schema(path: str) -> str:
    """The response schema the contract names for POST <path> (a tape's operation)."""
    post_ = CONTRACT["paths"][path]["post"]
    ref: str = post_["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[1]


def check(answer: dict[str, Any], expected: tuple[str, int | None, str | None]) -> None:
    used = answer["curvature_used"]
    assert (used["kind"], used["samples"], used["structure"]) == expected, used
    assert used["approximate"] == (expected[1] is not None or expected[2] is not None), used
    assert agrees(answer["curvature"], used), (answer["curvature"], used)


@pytest.fixture(scope="module")
def tapes(client) -> Any:
    plain = record(client, program=PROGRAM, output="out")
    sharded = record(client, program=PROGRAM, output="out", shards=3)
    yield plain["tape_id"], sharded["tape_id"]
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_every_answer_with_both_says_the_same(client, tapes) -> None:
    plain, sharded = tapes
    asked: set[str] = set()
    for path, body in ESTIMATORS.items():
        asked.add(response_schema(f"/v1/tapes/{{tape_id}}/{path}"))
        for choice, expected in CHOICES:
            check(post(client, f"/v1/tapes/{plain}/{path}", {**body, **choice}), expected)
            if choice["curvature"] not in ("kfac", "ekfac"):  # KFAC: unsharded tapes only
                check(post(client, f"/v1/tapes/{sharded}/{path}", {**body, **choice}), expected)
    asked.add(response_schema("/v1/tapes/{tape_id}/laplace"))
    asked.add(response_schema("/v1/tapes/{tape_id}/laplace/{laplace_id}/log-marginal-likelihood"))
    for fit, expected in FITS:
        answer = post(client, f"/v1/tapes/{plain}/laplace", fit)
        check(answer, expected)
        evidence = f"/v1/tapes/{plain}/laplace/{answer['laplace_id']}/log-marginal-likelihood"
        check(post(client, evidence, {"prior_precision": "tune"}), expected)
    # Every answer the contract marks as carrying the deprecated field was asked above.
    marked = {
        name
        for name, schema in CONTRACT["components"]["schemas"].items()
        if schema.get("properties", {}).get("curvature", {}).get("deprecated")
    }
    assert marked == asked, marked ^ asked


def test_a_jobs_result_says_the_same(client, tapes) -> None:
    plain, _ = tapes
    for path, body in ESTIMATORS.items():
        for choice, expected in (CHOICES[3], CHOICES[5]):  # Monte-Carlo, KFAC
            r = client.post(f"/v1/tapes/{plain}/{path}", json={**body, **choice, "async": True})
            assert r.status_code == 202, r.text
            job = wait(client, r.headers["location"], ("succeeded", "failed"), timeout=120)
            assert job["state"] == "succeeded", job
            check(job["result"], expected)
            assert job["result"] == client.get(f"/v1/jobs/{job['job_id']}/result").json()


def test_the_same_curvature_gives_the_same_answer_whichever_field_is_read(client, tapes) -> None:
    """The two fields are one statement: the deprecated string never names a matrix the
    answer was not computed on (the KFAC influence differs from the GGN's)."""
    plain, _ = tapes
    body = ESTIMATORS["influence"]
    ggn = post(client, f"/v1/tapes/{plain}/influence", {**body, "curvature": "ggn"})
    kfac = post(client, f"/v1/tapes/{plain}/influence", {**body, "curvature": "kfac"})
    assert not np.allclose(ggn["scores"], kfac["scores"], rtol=1e-9, atol=0)
    assert (ggn["curvature"], kfac["curvature"]) == ("ggn", "kfac")
