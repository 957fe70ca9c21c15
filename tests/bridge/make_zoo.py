"""Export the zoo (tests/bridge/zoo.py) through the PyTorch bridge, with PyTorch's own
answers beside each model. Run from the repository root (torch from the dev extra):

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/clients/python python tests/bridge/make_zoo.py

For each model: fixtures/<name>.onnx, the file `gradtape.client.pytorch.export` makes
(parameters under their torch names, buffers and exporter constants as Constant nodes),
and fixtures/<name>.npz holding the batch (x, y), PyTorch's float64 loss, the gradient of
every named_parameters() entry (grad/<torch name>), a direction (v/<torch name>) and the
Hessian-vector product along it (hvp/<torch name>, by double backward), and `names`, the
parameters in named_parameters() order. The tests rebuild each nn.Module from zoo.py and
check that the export still matches these files before trusting them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from gradtape.client import pytorch  # noqa: E402

from tests.bridge import zoo  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def answers(name: str) -> dict[str, np.ndarray]:
    """PyTorch's float64 loss, gradient and HVP of the model on its batch."""
    model, x, y, loss = zoo.build(name)
    named = dict(model.named_parameters())
    names = list(named)
    gen = torch.Generator().manual_seed(3000 + sorted(zoo.MODELS).index(name))
    v = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in named.items()}
    # The math kernel of scaled_dot_product_attention: the fused CPU kernels have no
    # double backward (nn.MultiheadAttention calls it).
    with sdpa_kernel([SDPBackend.MATH]):
        value = zoo.torch_loss(model, x, y, loss)
        grads = torch.autograd.grad(value, list(named.values()), create_graph=True)
        dot = sum((g * v[n]).sum() for g, n in zip(grads, names))
        hvps = torch.autograd.grad(dot, list(named.values()))
    out = {
        "x": x.numpy(),
        "y": y.numpy(),
        "loss": np.array(value.item()),
        "names": np.array(names),
        "kind": np.array(loss),
    }
    for n, g, h in zip(names, grads, hvps):
        out[f"grad/{n}"] = g.detach().numpy()
        out[f"v/{n}"] = v[n].numpy()
        out[f"hvp/{n}"] = h.numpy()
    return out


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    FIXTURES.mkdir(exist_ok=True)
    for name in names:
        model, x, _, _ = zoo.build(name)
        exported = pytorch.export(model, x)
        (FIXTURES / f"{name}.onnx").write_bytes(exported.onnx)
        np.savez_compressed(FIXTURES / f"{name}.npz", **answers(name))
        print(f"{name}: {len(exported.trainable)} parameters, {len(exported.onnx):,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:] or list(zoo.MODELS))
