"""Convolution, pooling, embedding and attention against PyTorch's answers (values and
gradients), stored in fixtures/torch_conv.npz by fixtures/make_torch_conv.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine as gt

STORED = np.load(Path(__file__).parent / "fixtures" / "torch_conv.npz")
IDS = gt.constant(np.array([[0, 3], [3, 1]], np.int32))

CASES = {
    "conv2d": lambda x, w, b: gt.conv2d(
        x, w, b, stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2
    ),
    "conv1d": lambda x, w: gt.conv1d(x, w, stride=3, padding=2, dilation=2),
    "conv1d_same": lambda x, w: gt.conv1d(x, w, padding="same", dilation=2),
    "conv3d": lambda x, w: gt.conv(x, w, pads=1, groups=3),
    "max_pool2d": lambda x: gt.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
    "max_pool2d_dilated": lambda x: gt.max_pool2d(
        x, (2, 3), stride=(2, 1), padding=(1, 1), dilation=(2, 1)
    ),
    "avg_pool2d_include": lambda x: gt.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg_pool2d_exclude": lambda x: gt.avg_pool(
        x, (3, 3), strides=2, pads=1, count_include_pad=False, ceil_mode=True
    ),
    "sdpa_causal": lambda q, k, v: gt.scaled_dot_product_attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: gt.scaled_dot_product_attention(q, k, v),
    "embedding": lambda table: gt.embedding(table, IDS),
}


def _inputs(name: str) -> dict[str, np.ndarray]:
    prefix = f"{name}/in/"
    return {k[len(prefix) :]: STORED[k] for k in STORED.files if k.startswith(prefix)}


def test_every_stored_case_is_replayed() -> None:
    assert {k.split("/")[0] for k in STORED.files} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_and_gradients_match_pytorch(name: str) -> None:
    inputs = _inputs(name)
    args = {k: gt.constant(v) for k, v in inputs.items()}
    with gt.GradientTape() as tape:
        tape.watch(list(args.values()))
        value = CASES[name](**args)
        loss = gt.sum(value * gt.constant(STORED[f"{name}/r"]))
    np.testing.assert_allclose(value.numpy(), STORED[f"{name}/value"], rtol=1e-10, atol=1e-12)
    grads = tape.gradient(loss, args)
    for k in inputs:
        np.testing.assert_allclose(
            grads[k].numpy(), STORED[f"{name}/grad/{k}"], rtol=1e-10, atol=1e-12, err_msg=k
        )
