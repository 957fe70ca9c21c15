"""The reference ONNX models' passes compiled (issue 28, item 1): a stored model's
gradient, fresh HVP, jacobian and reused HVPs are captured on their second call and
replayed afterwards, with answers equal to the dynamic passes' (float64 copies of the
models, bit for bit: the replay makes the same NumPy calls on the same operands), and
gt.jit compiles the model's loss too. Every call has new parameter values."""

from __future__ import annotations

import numpy as np
import pytest

import engine as gt
from engine import replay
from engine.language.compile import Request
from tests.engine.onnx.test_reference_models import MODELS, program


def _same(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _fresh(leaves, names, rng):
    """The leaves with new values for the parameters `names` (a later request's)."""
    out = dict(leaves)
    for n in names:
        v = leaves[n].numpy()
        out[n] = gt.constant(v + 0.01 * rng.standard_normal(v.shape).astype(v.dtype))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_gradient_hvp_and_jacobian_passes_replay_exactly(name: str) -> None:
    _, _, prog, leaves = program(name, "float64")
    request = prog.check_request("loss")
    names = list(request.sources.values())
    rng = np.random.default_rng(7)
    for _ in range(3):  # dynamic, captured, replayed
        now = _fresh(leaves, names, rng)
        value, grads = prog.value_and_gradients(request, now)
        value0, grads0 = prog.value_and_gradients(request, now, compiled=False)
        _same(value.numpy(), value0.numpy())
        for k in grads:
            _same(grads[k].numpy(), grads0[k].numpy())

        vectors = [gt.constant(rng.standard_normal((2, *now[n].shape))) for n in names]
        v, g, hv = prog.hessian_vector_products(request, now, vectors)
        v0, g0, hv0 = prog.hessian_vector_products(request, now, vectors, compiled=False)
        _same(v.numpy(), v0.numpy())
        for a, b in zip([*g, *hv], [*g0, *hv0], strict=True):
            _same(a.numpy(), b.numpy())

        one = Request("loss", dict(list(request.sources.items())[:1]))
        y, jac = prog.jacobians(one, now)
        y0, jac0 = prog.jacobians(one, now, compiled=False)
        _same(y.numpy(), y0.numpy())
        for k in jac:
            _same(jac[k].numpy(), jac0[k].numpy())

    passes = {**prog.gradient_passes(), **prog.request_passes()}
    assert len(passes) == 3, passes
    assert all(isinstance(p, replay.Schedule) for p in passes.values()), passes


@pytest.mark.parametrize("name", MODELS)
def test_reused_hvps_and_jit_compile(name: str) -> None:
    _, _, prog, leaves = program(name, "float64")
    request = prog.check_request("loss")
    names = list(request.sources.values())
    compiled = prog.hessian_operator(request, leaves)
    dynamic = prog.hessian_operator(request, leaves)
    dynamic.compiled = False
    rng = np.random.default_rng(8)
    for _ in range(3):
        vectors = [gt.constant(rng.standard_normal(leaves[n].shape)) for n in names]
        for a, b in zip(compiled.hvp(*vectors), dynamic.hvp(*vectors), strict=True):
            _same(a.numpy(), b.numpy())
    assert set(compiled.replay_status().values()) == {"compiled"}, compiled.replay_status()

    f = prog.function("loss", names, leaves)
    jitted = gt.jit(f)
    nums = tuple(range(len(names)))
    for _ in range(3):
        params = [_fresh(leaves, [n], rng)[n] for n in names]
        value, grads = jitted.value_and_grad(nums)(*params)
        value0, grads0 = gt.value_and_grad(f, nums)(*params)
        _same(value.numpy(), value0.numpy())
        for a, b in zip(grads, grads0, strict=True):
            _same(a.numpy(), b.numpy())
    assert set(jitted.status().values()) == {"compiled"}, jitted.status()
