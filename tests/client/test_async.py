"""AsyncClient: the same methods, awaited; many requests at once under asyncio.gather
over one connection pool, and an async remote tape."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from gradtape.client import AsyncClient, DefinitionError, TapeGone

from tests.client.conftest import TRANSPORTS
from tests.service.conftest import Server


def cubic(w: np.ndarray) -> dict:
    return {"variables": {"w": w}, "program": ["loss = sum(w * w * w)"]}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gather_many_requests(server: Server, transport: str) -> None:
    rng = np.random.default_rng(3)
    points = [rng.standard_normal(6) for _ in range(48)]

    async def main() -> list:
        async with AsyncClient(server.base_url, transport=transport) as client:
            return await asyncio.gather(*(client.gradient(cubic(w), "loss") for w in points))

    answers = asyncio.run(main())
    assert len(answers) == len(points)
    for w, (value, grads) in zip(points, answers, strict=True):
        assert value == pytest.approx(np.sum(w**3), rel=1e-13)
        np.testing.assert_allclose(grads["w"], 3 * w**2, rtol=1e-13)


def test_async_methods_and_tape(server: Server) -> None:
    w = np.array([1.0, 2.0, -1.0])

    async def main() -> None:
        async with AsyncClient(server.base_url) as client:
            hessian, jacobian, hvp = await asyncio.gather(
                client.hessian(cubic(w), "loss", "w"),
                client.jacobian({"variables": {"w": w}, "program": ["y = w * w"]}, "y", "w"),
                client.hvp(cubic(w), "loss", {"w": np.ones(3)}),
            )
            np.testing.assert_allclose(hessian.hessian, np.diag(6 * w))
            np.testing.assert_allclose(jacobian.jacobians, np.diag(2 * w))
            np.testing.assert_allclose(hvp.hvp["w"], 6 * w)
            async with await client.tape(cubic(w), "loss") as tape:
                vs = [np.eye(3)[i] for i in range(3)]
                hvps = await asyncio.gather(*(tape.hvp({"w": v}) for v in vs))
                np.testing.assert_allclose(np.stack([h["w"] for h in hvps]), np.diag(6 * w))
                await tape.update(w=2 * w)
                np.testing.assert_allclose(tape.gradients["w"], 12 * w**2)
                top = await tape.eigenvalues(1)
                assert top.eigenvalues[0] == pytest.approx(24.0)
                with pytest.raises(TypeError, match="synchronous"):
                    tape.linear_operator()
            with pytest.raises(TapeGone):
                await tape.hvp({"w": np.ones(3)})
            with pytest.raises(DefinitionError):
                await client.gradient({"variables": {"w": w}, "program": ["loss = q"]}, "loss")

    asyncio.run(main())
