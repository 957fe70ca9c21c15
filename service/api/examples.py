"""One example request body per operation, put into the OpenAPI document (each
operation's `application/json` content, where Swagger UI's "Try it out" picks it up).
Each answers 2xx when posted as-is, in the order of this table, to a fresh server:
tests/service/test_openapi_examples.py posts every one. Path parameters take the names
given here ({name}), and {tape_id} is the tape that create_tape's example records.

The tape is a logistic regression recorded with its output, so that every question to a
tape answers on it: the curvatures (GGN, Fisher) and influence need the output."""

from __future__ import annotations

from typing import Any

# A logistic regression over four examples of two features (3 parameters).
_X = [[0.5, 1.0], [-1.0, 0.3], [1.5, -0.5], [0.2, 0.2]]
_Y = [1.0, 0.0, 1.0, 0.0]
_LOGISTIC = {
    "variables": {"w": [0.3, -0.2], "b": 0.1},
    "inputs": {"X": _X, "y": _Y},
    "program": ["z = X @ w + b", "loss = sigmoid_cross_entropy(z, y)"],
}
_CUBIC = {"variables": {"w": [1.0, 2.0, -1.0]}, "program": ["loss = sum(w ** 3)"]}
_SQUARE = {"variables": {"w": [1.0, 2.0, -1.0]}, "program": ["y = w * w"]}

# Path parameters of the examples (besides {tape_id}).
PATH_VALUES: dict[str, str] = {"name": "example"}

# operationId -> (summary, body). Order matters: the dataset and the tape come first.
EXAMPLES: dict[str, tuple[str, Any]] = {
    "put_dataset": (
        "Two arrays: features X and labels y",
        {"X": _X, "y": _Y},
    ),
    "create_model": (
        "A logistic regression whose data are the stored dataset 'example'",
        {
            "name": "example",
            "description": "logistic regression on the dataset 'example'",
            "definition": {
                "variables": {"w": [0.3, -0.2], "b": 0.1},
                "inputs": {"dataset": "example"},
                "program": _LOGISTIC["program"],
            },
        },
    ),
    "compute_gradient": (
        "Gradient of a logistic loss",
        {"definition": _LOGISTIC, "target": "loss"},
    ),
    "compute_jacobian": (
        "Jacobian of y = w * w over w",
        {"definition": _SQUARE, "target": "y", "sources": "w"},
    ),
    "compute_hessian": (
        "Hessian of sum(w ** 3) (diag(6 w))",
        {"definition": _CUBIC, "target": "loss"},
    ),
    "compute_hvp": (
        "One Hessian-vector product",
        {"definition": _CUBIC, "target": "loss", "vector": {"w": [1.0, 0.0, 0.0]}},
    ),
    "create_tape": (
        "Record a logistic regression, naming its output (for curvatures and influence)",
        {"definition": _LOGISTIC, "target": "loss", "output": "z"},
    ),
    "update_tape": (
        "Record the tape again at new weights",
        {"variables": {"w": [0.25, -0.1]}},
    ),
    "compute_tape_hvp": (
        "H v from the recording (no forward pass)",
        {"vector": {"w": [1.0, 0.0], "b": 0.0}},
    ),
    "compute_tape_gradient": (
        "The gradient of the output's sum over the inputs X",
        {"target": "z", "sources": ["X"]},
    ),
    "compute_tape_jacobian": (
        "Per-example jacobians of the logits over X",
        {"target": "z", "sources": ["X"], "batch": True},
    ),
    "compute_tape_eigenvalues": (
        "The two largest eigenvalues of the GGN",
        {"k": 2, "curvature": "ggn", "tol": 1e-8},
    ),
    "estimate_tape_trace": ("The exact trace (3 HVPs)", {"method": "exact"}),
    "estimate_tape_diagonal": ("The exact diagonal", {"method": "exact"}),
    "estimate_tape_spectral_density": (
        "Stochastic Lanczos quadrature with 2 probes",
        {"probes": 2, "steps": 3},
    ),
    "solve_tape": ("The damped Newton step", {"damping": 0.01, "tol": 1e-10}),
    "compute_tape_influence": (
        "Influence of every example on the loss of examples 0 and 1 (on the GGN)",
        {"rows": [0, 1], "damping": 0.01, "top_k": 2},
    ),
    "estimate_tape_frobenius_norm": (
        "The Hessian's Frobenius norm, estimated from 64 HVPs",
        {"batch_size": 4, "max_hvps": 64},
    ),
    "compute_tape_per_example": (
        "Every example's gradient and their statistics",
        {"gradients": True},
    ),
    "compute_per_example": (
        "Per-example gradients of a logistic regression, without a tape",
        {"definition": _LOGISTIC, "target": "loss", "output": "z", "gradients": True},
    ),
    "compute_tape_kfac": ("The Kronecker-factored curvature of the tape", {}),
    "fit_tape_laplace": ("A Laplace approximation of the tape's posterior", {}),
    "compute_laplace_evidence": (
        "The log marginal likelihood at another prior precision",
        {"prior_precision": 2.0},
    ),
    "compute_laplace_predictive": (
        "The predictive at two new points",
        {"test_inputs": {"X": [[0.1, 0.2], [1.0, -1.0]]}},
    ),
    "sample_laplace_posterior": ("Two draws of the parameters", {"count": 2, "seed": 0}),
}

# Path parameters that earlier answers name: {tape_id} from create_tape's answer,
# {laplace_id} from fit_tape_laplace's.
ANSWER_IDS: dict[str, str] = {"create_tape": "tape_id", "fit_tape_laplace": "laplace_id"}


def add_to(document: dict[str, Any]) -> None:
    """Put EXAMPLES into the document's operations (their application/json content)."""
    for path in document.get("paths", {}).values():
        for operation in path.values():
            found = EXAMPLES.get(operation.get("operationId", ""))
            content = operation.get("requestBody", {}).get("content", {})
            if found is None or "application/json" not in content:
                continue
            summary, value = found
            content["application/json"]["examples"] = {
                "example": {"summary": summary, "value": value}
            }
