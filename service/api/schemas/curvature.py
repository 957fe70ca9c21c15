"""Request and response models of the curvature beyond products (issue 30): per-example
gradients, Kronecker factors, Laplace approximations kept with a tape."""

from __future__ import annotations

import math
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, model_validator

from service.api.problems import ProblemError
from service.api.schemas.base import CallOptions, DefinitionRequest, async_field
from service.api.schemas.definitions import Inputs, Tensors
from service.api.schemas.operations import (
    CurvatureUsedModel,
    curvature_used_field,
    deprecated_curvature_field,
)
from service.api.schemas.tensors import INT_MAX, Name, Tensor


class PerExampleDefinitionRequest(DefinitionRequest):
    """Per-example gradients of a definition (or a stored model) without keeping a tape:
    its `output` line cut as a tape's is (the model before it, the loss after); the
    answer is PerExampleResponse, as on a tape (POST /v1/tapes/{tape_id}/per-example)."""

    run_async: StrictBool = async_field()
    output: Name = Field(
        description="The line of the model's output (examples along its first axis); the "
        "target's lines after it are the loss."
    )
    gradients: StrictBool = Field(
        False,
        description="Also answer every example's gradient (N x the parameters: refused "
        "past the server's memory budget); the statistics alone run in chunks of examples.",
    )


class PerExampleResponse(BaseModel):
    """g_i = the gradient of example i's loss alone (the loss of a batch of it), so the
    batch gradient is `scale` * sum_i g_i (BackPACK's BatchGrad is scale * g_i)."""

    examples: int = Field(description="N, the output's first axis.")
    scale: float = Field(
        description="c: 1/N for a loss that is a mean over the examples, 1 for a sum."
    )
    norms: list[float] = Field(description="||g_i||_2 over all sources, per example.")
    norms_by_source: Tensors = Field(description="||g_i||_2 per source: (N,) each.")
    mean: Tensors = Field(description="(1/N) sum_i g_i, per source.")
    variance: Tensors = Field(
        description="(1/N) sum_i (g_i - mean)^2 elementwise, per source (BackPACK's Variance)."
    )
    sum_squares: Tensors = Field(
        description="sum_i g_i^2 elementwise, per source (BackPACK's SumGradSquared of g_i)."
    )
    gradients: Tensors | None = Field(description="(N, *shape) per source, when asked.")
    chunks: int = Field(description="Passes over the examples the statistics took.")


class KFACLayerKind(StrEnum):
    """A Kronecker-factored layer: a matrix product, or a convolution (through im2col)."""

    linear = "linear"
    conv = "conv"


class PredictiveLink(StrEnum):
    """How a classification predictive is taken: the probit approximation or Monte-Carlo."""

    probit = "probit"
    mc = "mc"


class KFACLayer(BaseModel):
    kind: KFACLayerKind = Field(description="conv: its data went through im2col.")
    weight: str = Field(description="The weight's source key.")
    bias: str | None = Field(description="The bias's source key, if one is added to its output.")
    joint: bool = Field(description="The bias is in the weight's block (separate_bias false).")
    eigenvalues: Tensor = Field(
        description="The block's eigenvalues in its Kronecker eigenbasis, (k [+1], m): "
        "outer(eig A, eig G), or EKFAC's corrected ones."
    )
    A: Tensor | None = Field(None, description="The input factor (k [+1], k [+1]), when asked.")
    G: Tensor | None = Field(None, description="The output-gradient factor (m, m), when asked.")


class KFACResponse(BaseModel):
    """A Kronecker-factored approximation of the curvature (an approximation by design:
    exact only for a linear layer without sharing on one example)."""

    layers: list[KFACLayer]
    others: list[str] = Field(description="Sources kept as an exact block (others: exact).")
    unreached: list[str] = Field(
        description="Sources the model's output (and so the loss) does not reach, such as "
        "a head feeding only another output: their curvature is exactly zero, and so is "
        "their block here (products zero, the damped inverse v / damping)."
    )
    trace: float
    logdet: float | None = Field(
        description="sum log(eigenvalue + damping); null (-inf) when a block is singular "
        "at this damping (curvlinops answers NaN there)."
    )
    damping: float
    product: Tensors | None = Field(
        description="KFAC v (or the inverse's), when `vector` is given."
    )
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]


class LaplaceFit(BaseModel):
    """A Laplace fit kept with its tape, as its fit answers it."""

    laplace_id: str = Field(description="The fit's id under the tape (its routes take it).")
    subset: str
    structure: str
    likelihood: str = Field(
        description="categorical, bernoulli or gaussian: recognised from the loss."
    )
    parameters: int = Field(description="The parameters the posterior is over.")
    prior_precision: float
    tuned: bool = Field(description="prior_precision is the marginal likelihood's maximiser.")
    sigma_noise: float | None
    log_marginal_likelihood: float
    log_likelihood: float
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]


class LaplaceResponse(LaplaceFit):
    curvature: str = deprecated_curvature_field()


class LaplaceInfo(LaplaceFit):
    """A Laplace fit kept with its tape (GET /v1/tapes/{tape_id}/laplace[/{laplace_id}]):
    what its fit answered (at its prior precision now), its memory and its age."""

    bytes: int = Field(
        description="Bytes of the arrays the fit holds in the tape's worker beyond the "
        "tape's recording (a full fit: parameters^2 x 8); DELETE frees them."
    )
    created_at: datetime = Field(description="When it was fitted.")


class LaplaceList(BaseModel):
    fits: list[LaplaceInfo] = Field(
        description="The tape's fits, oldest first (at most 8: a ninth drops the oldest). "
        "A fit lives with the tape's recording: an update, a rebuilt worker or an evicted "
        "tape drops them all."
    )


class LaplaceEvidenceRequest(CallOptions):
    """The log marginal likelihood at another prior precision (kept), or tuned."""

    prior_precision: StrictFloat | Literal["tune"] | None = Field(
        None, description="A new prior precision, 'tune', or null: the current one."
    )

    @model_validator(mode="after")
    def _positive(self) -> LaplaceEvidenceRequest:
        value = self.prior_precision
        if isinstance(value, float) and not (value > 0 and math.isfinite(value)):
            # Raised as the problem itself: a ValueError here names no field ("body").
            message = f"must be a positive finite number (or 'tune'), got {value!r}"
            raise ProblemError(
                "validation",
                f"prior_precision: {message}",
                errors=[{"field": "prior_precision", "message": message}],
            )
        return self


class LaplacePredictiveRequest(CallOptions):
    """The GLM-linearised predictive at new inputs."""

    run_async: StrictBool = async_field()

    test_inputs: Inputs = Field(
        description="New rows for the inputs the model reads along the examples axis."
    )
    link: PredictiveLink = Field(
        PredictiveLink.probit,
        description="Classification: the probit approximation or Monte-Carlo.",
    )
    samples: StrictInt = Field(100, ge=1, le=100_000, description="Monte-Carlo draws (link mc).")
    seed: StrictInt = Field(0, ge=0, le=INT_MAX, description="Seed of the Monte-Carlo draws.")


class LaplacePredictiveResponse(BaseModel):
    mean: Tensor = Field(description="(M, C): the model's output at the test inputs.")
    variance: Tensor = Field(description="(M, C, C): J Sigma J^T, the functional covariance.")
    noise: float | None = Field(description="Regression: sigma^2 (add it for the observations').")
    probabilities: Tensor | None = Field(
        description="Classification: (M, C) predictive probabilities."
    )
    link: str | None
    samples: int | None
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]


class LaplaceSamplesRequest(CallOptions):
    count: StrictInt = Field(10, ge=1, le=10_000, description="Posterior samples to draw.")
    seed: StrictInt = Field(0, ge=0, le=INT_MAX)


class LaplaceSamplesResponse(BaseModel):
    samples: Tensors = Field(description="(count, *shape) per source of the subset.")
    count: int
    subset: str
    curvature_used: CurvatureUsedModel = curvature_used_field()  # type: ignore[valid-type]
