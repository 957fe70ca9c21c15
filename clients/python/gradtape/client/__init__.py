"""gradtape.client: the Python SDK of the gradtape service.

NumPy arrays in and out, remote tapes as SciPy operators, problems as exceptions:

    import numpy as np
    from gradtape.client import Client

    with Client("http://localhost:8000") as client:
        value, grads = client.gradient(
            {"variables": {"w": np.array([1.0, 2.0])}, "program": ["loss = sum(w ** 3)"]},
            "loss")
        with client.tape({"variables": {"w": np.array([1.0, 2.0])},
                          "program": ["loss = sum(w ** 3)"]}, "loss") as tape:
            tape.hvp({"w": np.array([1.0, 0.0])})       # {"w": array([6., 0.])}

`AsyncClient` is the asyncio twin. Long work (eigenvalues, trace, solve, jacobians,
Hessians) runs as a server-side job with `progress=True` (a tqdm bar; Ctrl-C cancels
it); `client.job(id)` follows a job by id.
"""

from ._client import AsyncClient, Client
from ._core import Retry
from .curvature import KFAC, PerExample, Predictive, RemoteLaplace
from .definition import Definition, dataset, function
from .errors import (
    ComputeError,
    ComputeTimeout,
    Conflict,
    DefinitionError,
    GradtapeError,
    InvalidRequest,
    JobCancelled,
    JobNotFound,
    ModelNotFound,
    NonFiniteResult,
    NotFound,
    QuotaExceeded,
    ServerError,
    ServiceBusy,
    TapeGone,
    TooLarge,
    Unauthorized,
    WorkerCrashed,
)
from .jobs import Job, JobStatus
from .models import Models
from .plots import ProgressLog
from .pytorch import BridgeError, ExportMismatch, TorchModel, TorchTape
from .results import (
    HVP,
    ApproximateWarning,
    CurvatureUsed,
    Diagonal,
    Eigenvalues,
    Execution,
    Gradient,
    Hessian,
    Influence,
    Jacobian,
    Solve,
    SpectralDensity,
    Trace,
    Unconverged,
    UnconvergedWarning,
)
from .tape import RemoteTape

__version__ = "0.1.0"

__all__ = [
    "HVP",
    "KFAC",
    "ApproximateWarning",
    "AsyncClient",
    "BridgeError",
    "Client",
    "ComputeError",
    "ComputeTimeout",
    "Conflict",
    "CurvatureUsed",
    "Definition",
    "DefinitionError",
    "Diagonal",
    "Eigenvalues",
    "Execution",
    "ExportMismatch",
    "Gradient",
    "GradtapeError",
    "Hessian",
    "Influence",
    "InvalidRequest",
    "Jacobian",
    "Job",
    "JobCancelled",
    "JobNotFound",
    "JobStatus",
    "ModelNotFound",
    "Models",
    "NonFiniteResult",
    "NotFound",
    "PerExample",
    "Predictive",
    "ProgressLog",
    "QuotaExceeded",
    "RemoteLaplace",
    "RemoteTape",
    "Retry",
    "ServerError",
    "ServiceBusy",
    "Solve",
    "SpectralDensity",
    "TapeGone",
    "TooLarge",
    "TorchModel",
    "TorchTape",
    "Trace",
    "Unauthorized",
    "Unconverged",
    "UnconvergedWarning",
    "WorkerCrashed",
    "dataset",
    "function",
]  # fmt: skip
