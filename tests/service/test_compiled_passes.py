"""Whether the worker ran an answer's passes compiled, in the answer (issue 28's target
"the three ONNX models' passes compiled, status says so, through the service").

A stored ONNX model's gradient, HVP and jacobian requests of one layout run dynamically
the first time, under a capture the second, and replay the captured pass afterwards:
`execution` says which, with the engine's reason when dynamic; the replayed answers are
the dynamic ones (bit for bit against the same worker's dynamic answer at the same point,
and against the engine's dynamic pass in this process). A definition whose pass cannot be
captured stays dynamic and says why, in the engine's words. (The SDK's results:
tests/client/test_execution.py.)

One worker (a module server): every request of a layout reaches the worker that compiled
it, so the order of the states is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import engine as gt
from engine import replay
from engine.language import as_definition, compile_definition
from tests.engine.onnx.test_reference_models import program
from tests.service.conftest import Server, own_server
from tests.service.wire import arr, post, t

ONNX = {"content-type": "application/onnx"}
# The reference fixtures (tests/engine/onnx/fixtures: 4-8 channels, d=16, batch 4) of the
# three models bench/onnx_models.py measures at full width.
MODELS = ["lenet", "resnet", "transformer"]
HEAD_BIAS = {"lenet": "fc2.bias", "resnet": "head.bias", "transformer": "head.bias"}
# The states of one layout's passes, request by request: dynamic, captured, replayed.
FIRST, SECOND = replay.NOT_YET, replay.CAPTURED


@pytest.fixture(scope="module")
def solo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker: every request of a layout reaches the worker that compiles it."""
    with own_server(tmp_path_factory.mktemp("compiled"), workers="1") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(solo: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=solo.base_url, timeout=120.0) as c:
        yield c


def definition(name: str, record: Any) -> dict[str, Any]:
    """The reference program over the model stored as `name`."""
    x = record["x"]
    return {
        "models": {"net": {"stored": name, "frozen": [str(f) for f in record["frozen"]]}},
        "inputs": {"x": t(x, str(x.dtype)), "y": t(record["y"], "int64")},
        "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
    }


def at_point(leaves: dict, sources: dict[str, str], point: np.ndarray) -> dict:
    """The leaves with the sources' values taken from a flat point (as the server does)."""
    out, offset = dict(leaves), 0
    for name in sources.values():
        shape = leaves[name].shape
        size = int(np.prod(shape))
        out[name] = gt.constant(point[offset : offset + size].reshape(shape).astype(np.float32))
        offset += size
    return out


def flat_values(leaves: dict, sources: dict[str, str]) -> np.ndarray:
    return np.concatenate([leaves[n].numpy().reshape(-1) for n in sources.values()])


def close(got: Any, want: Any, what: str) -> None:
    want = np.asarray(want)
    np.testing.assert_allclose(
        got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())), err_msg=what
    )


def states(answers: list[dict]) -> list[tuple[bool, str | None]]:
    return [(a["execution"]["compiled"], a["execution"]["reason"]) for a in answers]


@pytest.mark.parametrize("name", MODELS)
def test_a_stored_onnx_models_passes_compile_and_say_so(http: httpx.Client, name: str) -> None:
    data, record, prog, leaves = program(name)
    stored = f"{name}-compiled"
    assert http.put(f"/v1/models/{stored}", content=data, headers=ONNX).status_code in (200, 201)
    defn = definition(stored, record)
    request = prog.check_request("loss")
    sources = dict(request.sources)
    rng = np.random.default_rng(28)
    base = flat_values(leaves, sources)
    noise = rng.standard_normal(base.shape)
    # New parameter values on every request (one layout), the first point again last.
    points = [base + 0.01 * k * noise for k in (0, 1, 2, 0)]
    vector = {k: rng.standard_normal(leaves[n].shape) for k, n in sources.items()}
    head = HEAD_BIAS[name]
    jac_request = prog.check_request("logits", [head], allow_unused=True)
    jac_base = leaves[head].numpy().reshape(-1)

    gradients, hvps, jacobians = [], [], []
    for k, point in enumerate(points):
        common = {"definition": defn, "target": "loss", "point": t(point)}
        gradients.append(post(http, "/v1/gradient", common))
        body = {**common, "vector": {key: t(v) for key, v in vector.items()}}
        hvps.append(post(http, "/v1/hvp", body))
        jac_point = jac_base + 0.01 * k * noise[: jac_base.size]
        jacobians.append(
            post(
                http,
                "/v1/jacobian",
                {
                    "definition": defn,
                    "target": "logits",
                    "sources": [head],
                    "point": t(jac_point if k < 3 else jac_base),
                    "allow_unused": True,  # (the loss line is not needed for the logits)
                },
            )
        )
        # The engine's dynamic passes at the same point, here.
        now = at_point(leaves, sources, point)
        value, grads = prog.value_and_gradients(request, now, compiled=False)
        close(arr(gradients[-1]["value"]), value.numpy(), f"{name} value {k}")
        for key, g in grads.items():
            assert g is not None
            close(arr(gradients[-1]["gradients"][key]), g.numpy(), f"{name} gradient {key} {k}")
        stacked = [gt.constant(vector[key][None].astype(np.float32)) for key in sources]
        _, _, products = prog.hessian_vector_products(request, now, stacked, compiled=False)
        for key, p in zip(sources, products, strict=True):
            close(arr(hvps[-1]["hvp"][key]), p.numpy()[0], f"{name} hvp {key} {k}")
        jac_now = at_point(leaves, {head: head}, jac_point if k < 3 else jac_base)
        y, jac = prog.jacobians(jac_request, jac_now, compiled=False)
        close(arr(jacobians[-1]["value"]), y.numpy(), f"{name} logits {k}")
        close(arr(jacobians[-1]["jacobians"][head]), jac[head].numpy(), f"{name} jacobian {k}")

    for kind, answers in (("gradient", gradients), ("hvp", hvps), ("jacobian", jacobians)):
        expected = [(False, FIRST), (False, SECOND), (True, None), (True, None)]
        assert states(answers) == expected, (name, kind)
    # The replayed answer at the first point is the first (dynamic) answer, bit for bit.
    for key in sources:
        np.testing.assert_array_equal(
            arr(gradients[3]["gradients"][key]), arr(gradients[0]["gradients"][key])
        )
        np.testing.assert_array_equal(arr(hvps[3]["hvp"][key]), arr(hvps[0]["hvp"][key]))
    np.testing.assert_array_equal(
        arr(jacobians[3]["jacobians"][head]), arr(jacobians[0]["jacobians"][head])
    )


def test_a_tapes_hvps_compile_per_vector_layout_and_say_so(http: httpx.Client) -> None:
    """A tape of the stored transformer: its reused HVP passes compile like the stateless
    ones (per vector layout, on the tape's own operator)."""
    data, record, prog, leaves = program("transformer")
    assert http.put("/v1/models/tape-net", content=data, headers=ONNX).status_code in (200, 201)
    r = http.post(
        "/v1/tapes", json={"definition": definition("tape-net", record), "target": "loss"}
    )
    assert r.status_code == 201, r.text
    tape = r.json()["tape_id"]
    request = prog.check_request("loss")
    sources = dict(request.sources)
    operator = prog.hessian_operator(request, leaves)
    operator.compiled = False  # the engine's dynamic products, here
    rng = np.random.default_rng(6)
    answers = []
    for _ in range(3):  # one vector each: one layout
        vector = {k: rng.standard_normal(leaves[n].shape) for k, n in sources.items()}
        answers.append(
            post(http, f"/v1/tapes/{tape}/hvp", {"vector": {k: t(v) for k, v in vector.items()}})
        )
        want = operator.hvp(*[gt.constant(vector[k].astype(np.float32)) for k in sources])
        for key, w in zip(sources, want, strict=True):
            close(arr(answers[-1]["hvp"][key]), w.numpy(), f"tape hvp {key}")
    assert states(answers) == [(False, FIRST), (False, SECOND), (True, None)]
    two = post(
        http,
        f"/v1/tapes/{tape}/hvp",
        {"vectors": [{k: t(np.ones(leaves[n].shape)) for k, n in sources.items()}] * 2},
    )
    assert states([two]) == [(False, FIRST)]  # another layout: two vectors per pass


# A pass that cannot be captured: sort's rule reads the data on the host.
UNCAPTURABLE = {
    "variables": {"w": np.arange(12.0).reshape(3, 4).tolist()},
    "inputs": {"x": (np.arange(15.0).reshape(5, 3) / 7).tolist()},
    "program": ["z = x @ w", "loss = sum(sort(z) * z)"],
}


def test_a_pass_that_stays_dynamic_says_why(http: httpx.Client) -> None:
    defn = as_definition(UNCAPTURABLE)
    prog = compile_definition(defn)
    request = prog.check_request("loss")
    leaves = prog.leaves(defn)
    reasons = []
    for _ in range(3):  # the engine's own account of the same passes
        with replay.observe() as seen:
            prog.value_and_gradients(request, leaves)
        reasons.append(seen.summary().reason)
    assert reasons[0] == FIRST and reasons[1] == reasons[2] != SECOND

    answers = [
        post(http, "/v1/gradient", {"definition": UNCAPTURABLE, "target": "loss"}) for _ in range(4)
    ]
    assert states(answers) == [(False, FIRST)] + [(False, reasons[2])] * 3
    assert "host" in reasons[2]  # "a rule read a value of the pass on the host ..."
