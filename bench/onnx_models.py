"""The issue-sized ONNX models of the benchmarks (issue 28): the reference fixtures in
tests/engine/onnx/fixtures are tiny (4-8 channels, d=16) so that tests run fast; the
speed targets are on models of a realistic width, exported here in memory with PyTorch's
TorchScript exporter (as the fixtures are):

- lenet: the fixture's LeNet (1x16x16 inputs, 4 and 8 channels) as it is;
- resnet: a ResNet of 16, 32 and 64 channels on 3x32x32 inputs: a 3x3 stem, one
  residual block per width (two 3x3 convolutions with batch norm, in eval mode), a
  stride-2 3x3 convolution between widths, global average pooling and a linear head;
- transformer: 2 pre-norm encoder layers, d=64, 4 heads, sequences of 16 tokens of a
  vocabulary of 100, GELU feed-forward of 256, mean pooling and a linear head.

`model(name)` -> (onnx bytes, the torch module in eval mode with the same weights, the
names of the frozen initializers); `batch(name, n, rng)` -> (x, y)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _modules():
    import torch
    from torch import nn
    from torch.nn import functional as F

    # The fixtures' residual block and self-attention (one definition of each).
    from tests.engine.onnx.fixtures.export import Attention, Block

    class Down(nn.Module):
        def __init__(self, c_in: int, c_out: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(c_out)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(16)
            self.body = nn.Sequential(Block(16), Down(16, 32), Block(32), Down(32, 64), Block(64))
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            x = torch.relu(self.bn(self.stem(x)))
            x = self.body(x)
            return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))

    class Layer(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = Attention(d, heads)
            self.ln2 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, 4 * d)
            self.ff2 = nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))

    class Transformer(nn.Module):
        def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, t: int = 16) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(0.1 * torch.randn(t, d))
            self.layers = nn.Sequential(Layer(d, heads), Layer(d, heads))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, 10)

        def forward(self, tokens):
            x = self.layers(self.embed(tokens) + self.pos)
            return self.head(self.ln(x).mean(dim=1))

    return ResNet, Transformer


def batch(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, 10, n).astype(np.int64)
    if name == "lenet":
        return rng.standard_normal((n, 1, 16, 16)).astype(np.float32), y
    if name == "resnet":
        return rng.standard_normal((n, 3, 32, 32)).astype(np.float32), y
    return rng.integers(0, 100, (n, 16)).astype(np.int64), y


def model(name: str):
    """(onnx bytes, torch module in eval mode with the same weights, frozen names)."""
    import torch
    from onnx import load_model_from_string, numpy_helper

    if name == "lenet":
        from tests.engine.onnx.fixtures import export
        from tests.engine.onnx.graphs import fixture

        data, record = fixture("lenet")
        module = export.LeNet()
        weights = {
            i.name: torch.from_numpy(numpy_helper.to_array(i).copy())
            for i in load_model_from_string(data).graph.initializer
        }
        state = module.state_dict()
        module.load_state_dict({k: weights.get(k, v) for k, v in state.items()})
        return data, module.eval(), [str(f) for f in record["frozen"]]
    ResNet, Transformer = _modules()
    torch.manual_seed(0)
    module = {"resnet": ResNet, "transformer": Transformer}[name]()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no two parameters equal (the exporter would alias them)
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    for buf_name, buf in module.named_buffers():  # batch norm: non-trivial statistics
        if buf_name.endswith("running_mean"):
            buf.copy_(0.2 * torch.randn(buf.shape, generator=gen))
        elif buf_name.endswith("running_var"):
            buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))
    module.eval()
    x, _ = batch(name, 2, np.random.default_rng(0))
    out = io.BytesIO()
    torch.onnx.export(
        module,
        (torch.from_numpy(x),),
        out,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        do_constant_folding=False,
    )
    data = out.getvalue()
    params = {k for k, _ in module.named_parameters()}
    frozen = [
        i.name
        for i in load_model_from_string(data).graph.initializer
        if numpy_helper.to_array(i).dtype.kind == "f" and i.name not in params
    ]
    return data, module, frozen
