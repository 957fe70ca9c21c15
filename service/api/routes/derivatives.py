"""The stateless derivative routes: each request carries its definition (or names a
stored model), runs in any free worker and leaves nothing behind. One table row per
route: its request body becomes a worker payload (service/api/payloads.py), the worker's
handler of the same kind computes (service/worker/compute.py); `job` routes may run as
jobs ("async": true or Prefer: respond-async)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import payloads
from service.api.bodies import GatedRoute
from service.api.deps import ComputeDep
from service.api.routes._compute import (
    Operation,
    as_job,
    register,
    respond,
    stored_definition,
)
from service.api.schemas import (
    GradientRequest,
    GradientResponse,
    HessianRequest,
    HessianResponse,
    HVPRequest,
    HVPResponse,
    JacobianRequest,
    JacobianResponse,
    ShardOptions,
)
from service.pool import Reply

router = APIRouter(tags=["derivatives"], route_class=GatedRoute)


def _derivative(name: str, kind: str, *rest: Any, **options: Any) -> Operation:
    return Operation(name, f"/v1/{kind}", kind, *rest, **options)


def _add(op: Operation) -> None:
    async def endpoint(request: Request, body: Any, compute: ComputeDep) -> Response:
        owner, services = compute.owner, compute.services
        as_job(request, body, op)
        stored = await stored_definition(body, owner, services.models)
        prepared = op.build(body, services.settings, stored)
        sharding = (
            payloads.sharding(body, services.settings) if isinstance(body, ShardOptions) else None
        )
        await services.datasets.bind_prepared(owner, prepared)

        def call() -> Awaitable[Reply]:
            if sharding is not None:  # a sharded tape for this request (domain/shards.py)
                return services.tapes.sharding.stateless(
                    owner, op.kind, prepared.payload, prepared.time_limit, sharding
                )
            return services.pool.submit(op.kind, prepared.payload, time_limit=prepared.time_limit)

        return await respond(
            request, body, compute.negotiated, prepared, owner=owner, call=call, job=op.job
        )

    register(router, op, endpoint)


DERIVATIVES = (
    _derivative(
        "compute_gradient",
        "gradient",
        GradientRequest,
        GradientResponse,
        payloads.gradient,
        "Value and gradients",
        """Run the definition and answer the target's value and its gradient with respect to
        each source (a non-scalar target is differentiated as its sum, as tf.GradientTape
        does).

        `sources` is a list of names (answers keyed by name), a mapping alias -> name
        (answers keyed by alias), a single name, or absent (every trainable variable). A
        source the target does not depend on answers `null`, or zeros with
        `"unconnected": "zero"`.

        With `shards`, the batch is split over that many workers and their parts summed
        (`shard_reduction`), as a sharded tape does (the target must then be a scalar,
        and unconnected sources answer zeros).""",
    ),
    _derivative(
        "compute_jacobian",
        "jacobian",
        JacobianRequest,
        JacobianResponse,
        payloads.jacobian,
        "Jacobians, full or per example",
        """The jacobian of the target with respect to each source, shape
        `target.shape + source.shape`, computed in batched backward passes of the server's
        chunk size.

        With `"batch": true`, per-example jacobians of shape
        `target.shape + source.shape[1:]` (tf.GradientTape.batch_jacobian). The server checks
        that the examples are independent and answers 422 (batch-dependence) when they are
        not, e.g. with batch normalization between the layers.""",
        job=True,
    ),
    _derivative(
        "compute_hessian",
        "hessian",
        HessianRequest,
        HessianResponse,
        payloads.hessian,
        "Hessian and damped Newton step",
        """The Hessian of a scalar target over the sources, as blocks: `hessian[a][b]` has
        shape `a.shape + b.shape`. Refused (422, too-large) above the server's
        `hessian_max_size` parameters: ask /v1/hvp for Hessian-vector products instead.

        With `newton`, also the damped Newton step `(H + damping I)^-1 g` per source (subtract
        it from the sources to take the step).""",
        job=True,
    ),
    _derivative(
        "compute_hvp",
        "hvp",
        HVPRequest,
        HVPResponse,
        payloads.hvp,
        "Hessian-vector products",
        """H @ v for a scalar target, with `vector` (one tensor per source, keyed like the
        gradients) or `vectors` (a list of them). The forward pass and the gradient are
        recorded once and all vectors are answered in one batched second-order pass.

        With `shards`, the batch is split over that many workers and their parts summed
        (`shard_reduction`), as a sharded tape does.""",
    ),
)
for _operation in DERIVATIVES:
    _add(_operation)
