"""The Hessian spectrum of a trained PyTorch CNN, through the Python SDK.

A small convolutional network is trained in PyTorch on a toy task (bars: horizontal or
vertical), exported to ONNX, and sent to gradtape with its batch. On the server a tape
records the loss once; Lanczos then finds the top eigenvalues of the Hessian over every
parameter, and stochastic Lanczos quadrature its spectral density, through
Hessian-vector products alone (the Hessian itself, n x n, is never formed). The top
eigenvector is checked against PyTorch's own Hessian-vector product.

    gradtape serve                                   # in another terminal
    python examples/cnn_hessian_spectrum.py --plot spectrum.png

Needs torch (the dev extra has it) and the SDK (pip install './clients/python[plot]').
"""

from __future__ import annotations

import argparse
import io
import json
import warnings

import numpy as np
import torch
from gradtape.client import Client
from torch import nn


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3)  # 12x12 -> 10x10
        self.pool = nn.MaxPool2d(2)  # -> 5x5
        self.fc = nn.Linear(4 * 5 * 5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def bars(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n noisy 12x12 images of a horizontal (label 0) or vertical (label 1) bar."""
    y = rng.integers(0, 2, n)
    x = 0.3 * rng.standard_normal((n, 1, 12, 12)).astype(np.float32)
    where = rng.integers(2, 10, n)
    for i in range(n):
        if y[i] == 0:
            x[i, 0, where[i], :] += 1.0
        else:
            x[i, 0, :, where[i]] += 1.0
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--plot", help="draw the spectral density into this file")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    torch.manual_seed(0)

    # 1. Train in PyTorch, as usual.
    x, y = bars(args.examples, rng)
    model = CNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(40):  # trained, not to zero loss: a flat minimum has a dull spectrum
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
    model.eval()

    # 2. Export to ONNX (the parameters travel as initializers, named as in PyTorch).
    buffer = io.BytesIO()
    # dynamo=False: the TorchScript exporter (no onnxscript needed); it warns that it is
    # the older one, which is no news here.
    warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
    torch.onnx.export(
        model, (torch.from_numpy(x[:1]),), buffer, dynamo=False,
        input_names=["x"], dynamic_axes={"x": {0: "batch"}},
    )  # fmt: skip

    # 3. One tape on the server; every question below reuses it.
    definition = {
        "models": {"net": {"onnx": buffer.getvalue()}},
        "inputs": {"x": x, "y": y},
        "program": ["logits = net(x)", "loss = softmax_cross_entropy(logits, y)"],
    }
    with Client(args.url) as client, client.tape(definition, "loss", output="logits") as tape:
        top = tape.eigenvalues(k=3, tol=1e-6, max_hvps=200, eigenvectors=True)
        density = tape.spectral_density(probes=4, steps=40)
        print(f"loss {float(tape.value):.4f}, {tape.size} parameters")
        print("top Hessian eigenvalues:", np.round(top.eigenvalues, 4))

    # 4. PyTorch's own Hessian-vector product with the top eigenvector: H v = lambda v.
    names = [name for name, _ in model.named_parameters()]
    v = [torch.from_numpy(np.asarray(top.eigenvectors[0][n], dtype=np.float32)) for n in names]
    params = tuple(p.detach() for p in model.parameters())

    def loss_of(*p: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(
            model, dict(zip(names, p, strict=True)), (torch.from_numpy(x),)
        )
        return nn.functional.cross_entropy(out, torch.from_numpy(y))

    _, hv = torch.autograd.functional.hvp(loss_of, params, tuple(v))
    hv_flat = torch.cat([h.reshape(-1) for h in hv]).double().numpy()
    v_flat = torch.cat([t.reshape(-1) for t in v]).double().numpy()
    rayleigh = float(v_flat @ hv_flat / (v_flat @ v_flat))
    print(f"PyTorch's v.Hv / v.v = {rayleigh:.4f} (gradtape: {top.eigenvalues[0]:.4f})")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        figure, _ = density.plot(log=True)  # log: the outliers beside the bulk
        figure.savefig(args.plot, dpi=120)
        print("drew", args.plot)
    print(json.dumps({
        "parameters": int(density.parameters), "top": top.eigenvalues.tolist(),
        "converged": top.converged, "pytorch_rayleigh": rayleigh,
        "density_mass": float(np.sum(density.density) * (density.grid[1] - density.grid[0])),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
