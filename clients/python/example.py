"""Calling gradtape from Python through a client generated from openapi/openapi.json with
openapi-python-client (docs/guides/clients.md):

    openapi-python-client generate --path openapi/openapi.json --meta setup \
        --config clients/python/openapi-python-client.yaml \
        --output-path build/gradtape-openapi-client --overwrite
    pip install ./build/gradtape-openapi-client
    python clients/python/example.py http://localhost:8000

Prints a JSON summary of the answers; exits non-zero on a wrong one. The contract lets
every /v1 operation carry an API key, so the generator makes them take an
AuthenticatedClient: the token is $GRADTAPE_API_KEY, or any string when the server runs
without keys.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from gradtape_client import AuthenticatedClient
from gradtape_client.api.derivatives import compute_gradient, compute_jacobian
from gradtape_client.api.tapes import compute_tape_hvp, create_tape, delete_tape, read_tape
from gradtape_client.models import (
    Definition,
    GradientRequest,
    GradientResponse,
    JacobianRequest,
    JacobianResponse,
    NamedTensors,
    Problem,
    TapeCreateRequest,
    TapeCreateResponse,
    TapeHVPRequest,
    TapeHVPResponse,
    TapeInfo,
    TensorData,
    Variables,
    VariableSpec,
)


def values(tensor: Any) -> list[float]:
    """The elements of a tensor answered with a data list (the default for JSON)."""
    assert isinstance(tensor, TensorData), f"expected a tensor with data, got {tensor!r}"

    def flat(items: list[Any]) -> list[float]:
        return [x for item in items for x in (flat(item) if isinstance(item, list) else [item])]

    return flat(tensor.data)


def main(base_url: str) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    token = os.environ.get("GRADTAPE_API_KEY", "no-key")
    with AuthenticatedClient(base_url, token, raise_on_unexpected_status=True) as client:
        # SCENARIOS.md 15 with the typed models: s = w1*x1 + w2*x2 at w = (2, 3), x = (5, 7).
        variables = Variables()
        variables["w1"] = VariableSpec(value=2.0)
        variables["w2"] = VariableSpec(value=3.0, trainable=True)
        inputs = NamedTensors()
        inputs["x1"] = 5.0
        inputs["x2"] = 7.0
        request = GradientRequest(
            definition=Definition(
                program=["s = w1 * x1 + w2 * x2"], variables=variables, inputs=inputs
            ),
            target="s",
            sources=["w1", "w2"],
        )
        answer = compute_gradient.sync(client=client, body=request)
        assert isinstance(answer, GradientResponse), answer
        assert values(answer.value) == [31.0]
        assert values(answer.gradients["w1"]) == [5.0]
        assert values(answer.gradients["w2"]) == [7.0]
        summary["gradient"] = {
            "value": values(answer.value),
            "w1": values(answer.gradients["w1"]),
            "w2": values(answer.gradients["w2"]),
        }

        # A jacobian, the request built from a plain dict: y = w * w has jacobian diag(2w).
        jacobian = compute_jacobian.sync(
            client=client,
            body=JacobianRequest.from_dict(
                {
                    "definition": {"variables": {"w": [1.0, 2.0]}, "program": ["y = w * w"]},
                    "target": "y",
                }
            ),
        )
        assert isinstance(jacobian, JacobianResponse), jacobian
        dy = jacobian.jacobians["w"]
        assert isinstance(dy, TensorData) and dy.shape == [2, 2], dy
        assert values(dy) == [2.0, 0.0, 0.0, 4.0]
        summary["jacobian"] = values(dy)

        # A tape of loss = sum(w**3) at w = (1, 2): recorded once, then HVPs with
        # H = diag(6w) = diag(6, 12), one vector and then two in one pass.
        tape = create_tape.sync(
            client=client,
            body=TapeCreateRequest.from_dict(
                {
                    "definition": {
                        "variables": {"w": [1.0, 2.0]},
                        "program": ["loss = sum(w * w * w)"],
                    },
                    "target": "loss",
                }
            ),
        )
        assert isinstance(tape, TapeCreateResponse), tape
        assert values(tape.gradients["w"]) == [3.0, 12.0]
        one = compute_tape_hvp.sync(
            tape.tape_id,
            client=client,
            body=TapeHVPRequest.from_dict({"vector": {"w": [1.0, 0.0]}}),
        )
        two = compute_tape_hvp.sync(
            tape.tape_id,
            client=client,
            body=TapeHVPRequest.from_dict({"vectors": [{"w": [0.0, 1.0]}, {"w": [1.0, 1.0]}]}),
        )
        assert isinstance(one, TapeHVPResponse) and isinstance(two, TapeHVPResponse)
        assert one.hvp and values(one.hvp["w"]) == [6.0, 0.0]
        assert two.hvps and [values(h["w"]) for h in two.hvps] == [[0.0, 12.0], [6.0, 12.0]]
        info = read_tape.sync(tape.tape_id, client=client)
        assert isinstance(info, TapeInfo) and info.hits >= 2, info
        deleted = delete_tape.sync_detailed(tape.tape_id, client=client)
        assert deleted.status_code == 204, deleted
        gone = compute_tape_hvp.sync_detailed(
            tape.tape_id,
            client=client,
            body=TapeHVPRequest.from_dict({"vector": {"w": [1.0, 0.0]}}),
        )
        assert gone.status_code == 404 and isinstance(gone.parsed, Problem), gone
        summary["tape"] = {
            "gradient": values(tape.gradients["w"]),
            "hvp": values(one.hvp["w"]),
            "hvps": [values(h["w"]) for h in two.hvps],
            "after_delete": gone.parsed.type_,
        }

        # An error: the program uses a name it never defines. The answer is a Problem
        # (application/problem+json) with the line, column and name in its detail.
        failed = compute_gradient.sync_detailed(
            client=client,
            body=GradientRequest.from_dict(
                {
                    "definition": {
                        "variables": {"w": [1.0, 2.0]},
                        "program": ["loss = sum(w * q)"],
                    },
                    "target": "loss",
                }
            ),
        )
        problem = failed.parsed
        assert failed.status_code == 422 and isinstance(problem, Problem), failed
        assert failed.headers["content-type"] == "application/problem+json"
        summary["error"] = {
            "status": problem.status,
            "title": problem.title,
            "detail": problem.detail,
        }
    return summary


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "http://localhost:8000")))
