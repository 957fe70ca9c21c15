"""The model zoo: small real architectures as researchers write them in PyTorch, each
built the same way every time (fixed seeds) so that a test can rebuild the `nn.Module`
that tests/bridge/make_zoo.py exported and recorded.

Every model is float64, in eval mode, with its weights and BatchNorm statistics moved
away from their defaults (`perturb`): a zero bias, a unit LayerNorm or a BatchNorm at
mean 0 / variance 1 would hide a parameter mapped to the wrong value.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# The residual block and the multi-head self-attention of the engine's ONNX fixtures
# (one definition of each for the fixtures, the zoo and bench/onnx_models.py).
import engine as gt
from engine.language import as_definition, compile_definition
from tests.engine.onnx.fixtures.export import Attention, Block

BATCH = 4
CLASSES = 3


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 2 * 2, 8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)  # 10 -> 8 -> 4
        x = F.avg_pool2d(torch.relu(self.conv2(x)), 2)  # 4 -> 4 -> 2
        return self.fc2(torch.tanh(self.fc1(torch.flatten(x, 1))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.block = Block(4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(torch.relu(self.bn(self.stem(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class DepthwiseSeparable(nn.Module):
    """MobileNet's block: a depthwise 3x3 (groups = channels), BN, ReLU6, a pointwise 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(2, 6, 1)
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.pointwise = nn.Conv2d(6, 4, 1)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn(self.depthwise(torch.relu(self.expand(x)))))
        return self.head(self.pointwise(x).mean(dim=(2, 3)))


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv1d(4, 4, 3, dilation=2)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool1d(torch.relu(self.conv1(x)), 2)  # 12 -> 12 -> 6
        x = torch.tanh(self.conv2(x))  # 6 -> 2
        return self.head(x.mean(dim=2))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out.mean(dim=1))


class PreNormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, 2)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Patches (a strided conv), a class token, learned positions, one encoder block:
    pre-norm (our block) or post-norm (nn.TransformerEncoderLayer, norm_first=False)."""

    def __init__(self, post_norm: bool) -> None:
        super().__init__()
        d = 8
        self.patch = nn.Conv2d(1, d, 4, stride=4)  # 8x8 -> 2x2 = 4 tokens
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, 5, d))
        self.block: nn.Module
        if post_norm:
            self.block = nn.TransformerEncoderLayer(
                d, 2, dim_feedforward=16, dropout=0.0, batch_first=True, norm_first=False
            )
        else:
            self.block = PreNormBlock(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        cls = self.cls.expand(x.shape[0], -1, -1)
        h = self.block(torch.cat([cls, tokens], dim=1) + self.pos)
        return self.head(self.norm(h[:, 0]))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 8), nn.GELU(), nn.Linear(8, tokens))
        self.ln2 = nn.LayerNorm(d)
        self.channel_mlp = nn.Sequential(nn.Linear(d, 8), nn.GELU(), nn.Linear(8, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class MLPMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 6, 2, stride=2)  # 8x8 -> 4x4 = 16 tokens
        self.block = MixerBlock(16, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.patch(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(h).mean(dim=1))


class MaskedAttention(nn.Module):
    """Token ids (0 = padding) through nn.MultiheadAttention with a key-padding mask
    computed from the ids and a causal mask; the mean over the real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=None)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        t = ids.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        padding = ids == 0
        h, _ = self.attn(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)
        keep = (~padding).to(h.dtype).unsqueeze(-1)
        return self.head((h * keep).sum(dim=1) / keep.sum(dim=1))


class AutoEncoder(nn.Module):
    """A strided conv down, a transposed conv and a nearest upsample back up."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 4, 3, stride=2, padding=1)  # 8 -> 4
        self.mid = nn.Conv2d(4, 4, 3, stride=2, padding=1)  # 4 -> 2
        self.up1 = nn.ConvTranspose2d(4, 4, 2, stride=2)  # 2 -> 4
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")  # 4 -> 8
        self.out = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(torch.relu(self.down(x))))
        return self.out(self.up2(torch.relu(self.up1(h))))


class GroupNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.gn2 = nn.GroupNorm(4, 4)  # one channel per group: instance norm
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.gn(self.conv(x)))
        x = F.silu(self.gn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class Activations(nn.Module):
    """HardSwish, HardSigmoid, SiLU, Mish, Softplus, clamp and where in one MLP.

    `double_backward = True` writes hardsigmoid as clamp(x / 6 + 1/2, 0, 1), the same
    function, because PyTorch has no double backward for F.hardsigmoid: the HVPs the
    fixtures hold are computed so; the export keeps F.hardsigmoid (ONNX HardSigmoid)."""

    double_backward = False

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.hardswish(self.fc1(x)) + F.silu(self.fc1(x))
        h = F.mish(self.fc2(h))
        h = F.softplus(self.fc3(h)).clamp(min=0.2, max=3.0)
        gate = (h / 6 + 0.5).clamp(0, 1) if self.double_backward else F.hardsigmoid(h)
        h = torch.where(h > 1.0, h * h, gate)
        return self.head(h)


def _ids(gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, 10, (BATCH, 6), generator=gen)
    ids[1, 4:] = 0  # padding at the end of two sequences; never a whole row
    ids[3, 3:] = 0
    return ids


# name -> (constructor, example input, loss)
MODELS = {
    "lenet": (LeNet, lambda g: torch.randn(BATCH, 1, 10, 10, generator=g), "cross_entropy"),
    "resnet_bn": (ResNet, lambda g: torch.randn(BATCH, 3, 6, 6, generator=g), "cross_entropy"),
    "depthwise": (
        DepthwiseSeparable,
        lambda g: torch.randn(BATCH, 2, 6, 6, generator=g),
        "cross_entropy",
    ),
    "conv1d": (Conv1dNet, lambda g: torch.randn(BATCH, 2, 12, generator=g), "cross_entropy"),
    "lstm": (LSTMClassifier, lambda g: torch.randn(BATCH, 5, 3, generator=g), "cross_entropy"),
    "gru": (GRUClassifier, lambda g: torch.randn(BATCH, 5, 3, generator=g), "cross_entropy"),
    "vit_prenorm": (
        lambda: ViT(post_norm=False),
        lambda g: torch.randn(BATCH, 1, 8, 8, generator=g),
        "cross_entropy",
    ),
    "vit_postnorm": (
        lambda: ViT(post_norm=True),
        lambda g: torch.randn(BATCH, 1, 8, 8, generator=g),
        "cross_entropy",
    ),
    "mixer": (MLPMixer, lambda g: torch.randn(BATCH, 1, 8, 8, generator=g), "cross_entropy"),
    "masked_attention": (MaskedAttention, _ids, "cross_entropy"),
    "autoencoder": (AutoEncoder, lambda g: torch.randn(BATCH, 1, 8, 8, generator=g), "mse"),
    "groupnorm": (
        GroupNormNet,
        lambda g: torch.randn(BATCH, 2, 5, 5, generator=g),
        "cross_entropy",
    ),
    "activations": (Activations, lambda g: torch.randn(BATCH, 5, generator=g), "cross_entropy"),
}


def perturb(model: nn.Module, gen: torch.Generator) -> None:
    """Move every parameter and BatchNorm statistic off its default (no two equal)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=gen, dtype=buf.dtype))
            elif name.endswith("running_var"):
                buf.copy_(0.5 + torch.rand(buf.shape, generator=gen, dtype=buf.dtype))


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, str]:
    """The model (float64, eval, perturbed), its batch (inputs, targets) and its loss,
    the same on every call."""
    make, data, loss = MODELS[name]
    seed = sorted(MODELS).index(name)
    torch.manual_seed(1000 + seed)
    model = make().double()
    gen = torch.Generator().manual_seed(2000 + seed)
    perturb(model, gen)
    model.eval()
    x = data(gen)
    if x.is_floating_point():
        x = x.double()
    if loss == "mse":
        y = x + 0.1 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
    else:
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return model, x, y, loss


def torch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """The loss as PyTorch computes it, in a form it can differentiate twice."""
    for m in model.modules():
        if isinstance(m, Activations):
            m.double_backward = True
    out = model(x)
    return F.mse_loss(out, y) if loss == "mse" else F.cross_entropy(out, y)


def engine_pass(definition: dict, vectors: dict) -> tuple[list[str], tuple]:
    """The loss of `definition` through the engine alone (no server): its sources'
    names, and (value, gradients, HVP of `vectors`) by name, as NumPy."""
    defn = as_definition(definition)
    program = compile_definition(defn)
    request = program.check_request("loss")
    names = list(request.sources.values())
    op = program.hessian_operator(request, program.leaves(defn))
    hvps = op.hvp(*[gt.constant(vectors[n]) for n in names])
    grads = {n: g.numpy() for n, g in zip(names, op.grad)}
    return names, (float(op.value.numpy()), grads, {n: h.numpy() for n, h in zip(names, hvps)})
