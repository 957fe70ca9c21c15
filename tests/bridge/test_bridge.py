"""The PyTorch bridge (gradtape.client.pytorch) on its own terms: what it refuses and
why, what it restores, the model store, losses, and answers shaped like the module.
Every value is checked against PyTorch autograd in float64."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gradtape.client import BridgeError, Client, ExportMismatch, ModelNotFound, pytorch
from torch import nn
from torch.nn import functional as F

from tests.service.conftest import own_server


def quiet_export(module: nn.Module, args: tuple, **options) -> bytes:
    """torch.onnx.export as a user would call it (its defaults: the optimizer on)."""
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=["x"], output_names=["logits"], **options
        )
    return program.model_proto.SerializeToString()


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class Twins(nn.Module):
    """Two layers holding equal values (not tied: two parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            self.b.bias.copy_(self.a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Tokens(nn.Module):
    """Linear layers on (N, T, D): the optimizer stores their weights transposed."""

    def __init__(self, act=torch.tanh) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x))).mean(dim=1)


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.spare = nn.Linear(3, 2)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def perturbed(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen, dtype=b.dtype))
    return module.eval()


def torch_grads(module: nn.Module, loss: torch.Tensor) -> dict[str, np.ndarray]:
    named = dict(module.named_parameters())
    grads = torch.autograd.grad(loss, list(named.values()), materialize_grads=True)
    return {n: g.numpy() for n, g in zip(named, grads)}


def assert_grads(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for n, value in want.items():
        np.testing.assert_allclose(np.asarray(got[n]), value, rtol=1e-9, atol=1e-12, err_msg=n)


# ------------------------------------------------------------------- refusals


def test_batchnorm_folded_by_the_exporter_is_refused_naming_the_weights() -> None:
    model = perturbed(ConvBN())
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    folded = quiet_export(model, (x,))  # optimize=True folds BN into conv.weight/bias
    with pytest.raises(BridgeError) as caught:
        pytorch.export(model, x, onnx_model=folded)
    message = str(caught.value)
    assert "conv.weight: the export's initializer 'conv.weight' holds other values" in message
    assert "folded" in message
    assert "bn.weight: no initializer holds its values" in message


def test_equal_weights_merged_by_the_exporter_are_refused() -> None:
    model = Twins().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(BridgeError, match=r"b\.weight: merged with 'a\.weight'"):
        pytorch.export(model, x, onnx_model=quiet_export(model, (x,)))
    # The bridge's own export keeps both.
    exported = pytorch.export(model, x)
    assert exported.trainable == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert {p.how for p in exported.parameters} == {"kept"}


def test_transposed_weights_are_restored_and_agree(server) -> None:
    model = perturbed(Tokens())
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    exported = pytorch.export(model, x, onnx_model=quiet_export(model, (x,)))
    hows = {p.name: p.how for p in exported.parameters}
    assert hows["a.weight"].startswith("transposed in the export as ")
    assert hows["a.bias"] == "kept"
    y = torch.randn(2, 3, dtype=torch.float64)
    with Client(server.base_url) as client:
        pytorch.verify(client, exported)
        with client.tape(exported, loss="mse", data=(x, y)) as tape:
            assert_grads(tape.gradients, torch_grads(model, F.mse_loss(model(x), y)))


def test_a_module_in_training_mode_is_refused() -> None:
    model = perturbed(ConvBN()).train()
    with pytest.raises(BridgeError, match=r"bn \(BatchNorm2d\) is in training mode"):
        pytorch.export(model, torch.randn(2, 2, 5, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    "normed",
    [nn.utils.parametrizations.spectral_norm, nn.utils.spectral_norm],
    ids=["parametrization", "hook"],
)
def test_spectral_norm_in_training_mode_is_refused(normed) -> None:
    """While training, spectral norm runs a power-iteration step under no_grad (and
    updates its vectors) on every forward; the export would differentiate through that
    step, a gradient torch does not have."""
    model = nn.Sequential(normed(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(BridgeError, match="is in training mode"):
        pytorch.export(model.train(), x)
    assert pytorch.export(model.eval(), x).trainable  # eval mode: the vectors are constants


def test_a_forward_that_differs_is_an_export_mismatch_naming_the_output(server) -> None:
    tanh = perturbed(Tokens(torch.tanh))
    relu = copy.deepcopy(tanh)
    relu.act = torch.relu
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    # Same parameters, another graph: mapped by value, then caught by the check.
    exported = pytorch.export(tanh, x, onnx_model=quiet_export(relu, (x,), optimize=False))
    with Client(server.base_url) as client, pytest.raises(ExportMismatch) as caught:
        pytorch.verify(client, exported)
    assert "forward differs from torch's on the example inputs: output 'logits'" in str(
        caught.value
    )


# --------------------------------------------------------------- losses, shapes


@pytest.mark.parametrize("loss", ["cross_entropy", "nll", "mse", "bce_with_logits", "lines"])
def test_losses_agree_with_torch(server, loss: str) -> None:
    model = perturbed(ConvBN(), seed=1)
    if loss == "nll":
        model = nn.Sequential(model, nn.LogSoftmax(dim=1)).eval()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 2, 5, 5, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, 4, (6,), generator=gen)
    targets = torch.rand(6, 4, dtype=torch.float64, generator=gen)
    out = model(x)
    spec, y, want = {
        "cross_entropy": ("cross_entropy", labels, F.cross_entropy(out, labels)),
        "nll": ("nll", labels, F.nll_loss(out, labels)),
        "mse": ("mse", targets, F.mse_loss(out, targets)),
        "bce_with_logits": (
            "bce_with_logits",
            targets,
            F.binary_cross_entropy_with_logits(out, targets),
        ),
        "lines": (
            ["err = logits - y", "loss = sum(err ** 4) / 6"],
            targets,
            ((out - targets) ** 4).sum() / 6,
        ),
    }[loss]
    with Client(server.base_url) as client, client.tape(model, loss=spec, data=(x, y)) as tape:
        np.testing.assert_allclose(tape.value, want.item(), rtol=1e-12)
        assert_grads({n: g.numpy() for n, g in tape.gradients.items()}, torch_grads(model, want))


def test_answers_are_shaped_like_the_module(server) -> None:
    model = perturbed(WithUnused(), seed=2)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    want = torch_grads(model, F.cross_entropy(model(x), y))
    data = (x.numpy(), y.numpy())
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=data) as tape,
    ):
        assert tape.model.unused == ["spare.weight", "spare.bias"]
        assert tape.names == ["fc.weight", "fc.bias"]
        grads = tape.gradients  # NumPy in, NumPy out; the unused layer's are zeros
        assert all(isinstance(g, np.ndarray) for g in grads.values())
        assert_grads(grads, want)
        # Flat vectors in parameters_to_vector order, over every parameter.
        assert tape.size == sum(p.numel() for p in model.parameters())
        v = torch.randn(tape.size, dtype=torch.float64)
        as_dict = tape.unflatten(v)
        assert list(as_dict) == [n for n, _ in model.named_parameters()]
        torch.testing.assert_close(
            torch.nn.utils.parameters_to_vector(as_dict.values()), v, rtol=0, atol=0
        )
        flat_hvp = tape.hvp(v)
        dict_hvp = tape.hvp(as_dict)
        torch.testing.assert_close(flat_hvp, tape.vector(dict_hvp), rtol=0, atol=0)
        assert not dict_hvp["spare.weight"].any()
        # H v by double backward in torch.
        named = dict(model.named_parameters())
        loss = F.cross_entropy(model(x), y)
        g = torch.autograd.grad(loss, list(named.values()), create_graph=True, allow_unused=True)
        dot = sum((gi * as_dict[n]).sum() for gi, n in zip(g, named) if gi is not None)
        hv = torch.autograd.grad(dot, [named["fc.weight"], named["fc.bias"]])
        torch.testing.assert_close(dict_hvp["fc.weight"], hv[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dict_hvp["fc.bias"], hv[1], rtol=1e-10, atol=1e-12)
        # An eigenvector loads into the module.
        top = tape.eigenvalues(1, eigenvectors=True, tol=1e-10)
        direction = tape.state_dict(top.eigenvectors[0])
        model.load_state_dict(direction, strict=False)
        torch.testing.assert_close(model.fc.bias.detach(), direction["fc.bias"])


# ------------------------------------------------------------------- the store


def test_stored_module_serves_any_batch_size_and_big_data_goes_up_as_a_dataset(
    server, monkeypatch
) -> None:
    model = perturbed(ConvBN(), seed=3)
    x = torch.randn(9, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (9,))
    with Client(server.base_url) as client:
        net = client.models.put_torch("bridge-convbn", model, x[:2])
        assert net.verified and net.stored == "bridge-convbn"
        info = client.models.get("bridge-convbn")
        assert info["trainable"] == [n for n, _ in model.named_parameters()]
        assert "bridge-convbn" in [m["name"] for m in client.models.list()]
        monkeypatch.setattr(pytorch, "UPLOAD_BYTES", 0)  # every batch is "large"
        with client.tape(net, loss="cross_entropy", data=(x, y)) as tape:
            assert_grads(
                {n: g.numpy() for n, g in tape.gradients.items()},
                torch_grads(model, F.cross_entropy(model(x), y)),
            )
        # (gone once the tape was recorded: test_big_data_stays_with_the_tape_alone)
        assert not [d for d in client.list_datasets() if d["name"].startswith("torch-data-")]
        client.models.delete("bridge-convbn")
        with pytest.raises(ModelNotFound):
            client.models.get("bridge-convbn")


def test_big_data_stays_with_the_tape_alone(tmp_path, monkeypatch) -> None:
    """Data above UPLOAD_BYTES goes up as a dataset of the recording's own, deleted once
    the tape is recorded: nothing stays against the key's dataset quota (it stayed until
    the caller deleted it), and the tape keeps the arrays it was bound to: a worker
    killed under it is replaced and the tape rebuilt from them, with the same numbers."""
    model = perturbed(ConvBN(), seed=4)
    x = torch.randn(7, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (7,))
    want = torch_grads(model, F.cross_entropy(model(x), y))
    monkeypatch.setattr(pytorch, "UPLOAD_BYTES", 0)  # every batch is "large"
    with own_server(tmp_path, workers="1") as srv, Client(srv.base_url) as client:
        with client.tape(model, loss="cross_entropy", data=(x, y)) as tape:
            assert client.list_datasets() == []
            assert_grads({n: g.numpy() for n, g in tape.gradient().gradients.items()}, want)
            (before,) = srv.wait_ready()["workers"]
            os.kill(before["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 300  # a guard against a hang, not a time limit
            while srv.wait_ready()["workers"][0]["generation"] == before["generation"]:
                assert time.monotonic() < deadline, "the worker was never replaced"
                time.sleep(0.05)
            rebuilt = tape.gradient()  # on the new worker: recorded again from the blobs
            assert_grads({n: g.numpy() for n, g in rebuilt.gradients.items()}, want)
        assert client.list_datasets() == []


class TwoHeads(nn.Module):
    """Several outputs: logits and the features they come from."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.body(x))
        return self.head(features), features


def test_a_module_with_several_outputs(server) -> None:
    model = perturbed(TwoHeads(), seed=4)
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    logits, features = model(x)
    want = F.cross_entropy(logits, y) + 0.1 * (features**2).mean()
    lines = ["loss = softmax_cross_entropy(out0, y) + 0.1 * mean(out1 ** 2)"]
    with Client(server.base_url) as client, client.tape(model, loss=lines, data=(x, y)) as tape:
        assert tape.model.outputs == ["out0", "out1"]
        np.testing.assert_allclose(tape.value, want.item(), rtol=1e-12)
        assert_grads({n: g.numpy() for n, g in tape.gradients.items()}, torch_grads(model, want))


def test_a_float32_module_runs_in_float32(server) -> None:
    model = perturbed(ConvBN(), seed=6).float()
    x = torch.randn(5, 2, 5, 5)
    y = torch.randint(0, 4, (5,))
    want = torch_grads(model, F.cross_entropy(model(x), y))
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        assert tape.model.dtype == np.float32
        for n, g in tape.gradients.items():
            assert g.dtype == torch.float32
            scale = float(np.abs(want[n]).max())
            np.testing.assert_allclose(g.numpy(), want[n], rtol=1e-4, atol=1e-5 * scale, err_msg=n)


def test_an_export_is_reused_while_the_module_is_unchanged(server) -> None:
    model = perturbed(Tokens(), seed=7)
    x = torch.randn(4, 5, 4, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    with Client(server.base_url) as client:
        with client.tape(model, loss="mse", data=(x, y)) as first:
            pass
        with client.tape(model, loss="mse", data=(x, y)) as again:
            assert again.model is first.model  # not exported a second time
        with torch.no_grad():
            model.b.bias.add_(1.0)  # new values: a new export, and answers at them
        with client.tape(model, loss="mse", data=(x, y)) as moved:
            assert moved.model is not first.model
            assert_grads(
                {n: g.numpy() for n, g in moved.gradients.items()},
                torch_grads(model, F.mse_loss(model(x), y)),
            )


def test_the_model_store_takes_definitions_and_onnx_files(server) -> None:
    from gradtape.client import Conflict

    definition = {
        "variables": {"w": np.array([1.0, -2.0])},
        "inputs": {"x": np.array([[1.0, 2.0], [3.0, 4.0]])},
        "program": ["loss = sum((x @ w) ** 2)"],
    }
    onnx_file = (Path(__file__).resolve().parent / "fixtures" / "conv1d.onnx").read_bytes()
    with Client(server.base_url) as client:
        info = client.models.put("store-quad", definition, description="a quadratic")
        assert info["trainable"] == ["w"] and info["description"] == "a quadratic"
        with pytest.raises(Conflict):
            client.models.put("store-quad", definition, replace=False)
        value, grads = client.gradient(model="store-quad", target="loss")
        x, w = definition["inputs"]["x"], definition["variables"]["w"]
        np.testing.assert_allclose(value, np.sum((x @ w) ** 2))
        np.testing.assert_allclose(grads["w"], 2 * x.T @ (x @ w))
        stored = client.models.put_onnx("store-conv1d", onnx_file)
        assert stored["trainable"][:2] == ["conv1.weight", "conv1.bias"]
        names = {m["name"] for m in client.models.list()}
        assert {"store-quad", "store-conv1d"} <= names
        client.models.delete("store-quad")
        client.models.delete("store-conv1d")
        assert not {"store-quad", "store-conv1d"} & {m["name"] for m in client.models.list()}


# --------------------------------------------------- matching by value: what it must not do


class AnchoredToInit(nn.Module):
    """A penalty towards the initial weights, kept as a plain tensor attribute (the
    exporter lifts it to an initializer named `w0`, holding the parameter's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
        self.w0 = self.w.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + torch.tanh(x @ self.w0) + ((self.w - self.w0) ** 2).sum()


def test_a_constant_equal_to_a_parameter_stays_a_constant(server) -> None:
    # The parameter keeps its own initializer; the constant holding equal values is not
    # a second copy of it (the gradient through x @ w0 must not land on w).
    model = AnchoredToInit().eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    exported = pytorch.export(model, x)
    assert [(p.name, p.how) for p in exported.parameters] == [("w", "kept")]
    with Client(server.base_url) as client, client.tape(model, loss="mse", data=(x, y)) as tape:
        assert_grads(
            {n: g.numpy() for n, g in tape.gradients.items()},
            torch_grads(model, F.mse_loss(model(x), y)),
        )


class Symmetric(nn.Module):
    """A square weight equal to its transpose: a renamed copy of it may be the weight or
    its transpose, and the two give different gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)
        with torch.no_grad():
            self.a.weight.copy_(2 * torch.eye(3) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).mean(dim=1)


class TiedInit(nn.Module):
    """A decoder initialized to the encoder's transpose (two parameters): the exporter's
    transposed copy of one holds the other's values."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.dec = nn.Linear(4, 3)
        with torch.no_grad():
            self.dec.weight.copy_(self.enc.weight.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x))).mean(dim=1)


@pytest.mark.parametrize(
    ("module", "refused"),
    [(Symmetric, "a.weight"), (TiedInit, "enc.weight")],
    ids=["symmetric", "transpose-of-another"],
)
def test_a_renamed_initializer_that_could_be_two_things_is_refused(module, refused) -> None:
    model = module().double().eval()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    optimized = quiet_export(model, (x,))  # Linear weights stored transposed, renamed
    with pytest.raises(BridgeError) as caught:
        pytorch.export(model, x, onnx_model=optimized)
    assert f"{refused}: " in str(caught.value)
    assert "ambiguous" in str(caught.value)
    # The bridge's own export keeps every parameter under its name: nothing to guess.
    exported = pytorch.export(model, x)
    assert {p.how for p in exported.parameters} == {"kept"}


def test_a_put_torch_that_fails_its_check_leaves_the_stored_model_alone(server) -> None:
    tanh = perturbed(Tokens(torch.tanh), seed=8)
    relu = copy.deepcopy(tanh)
    relu.act = torch.relu
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    wrong = quiet_export(relu, (x,), optimize=False)  # the other graph: caught by the check
    with Client(server.base_url) as client:
        good = client.models.put_torch("bridge-keep", tanh, x)
        before = client.models.get("bridge-keep")
        with pytest.raises(ExportMismatch):
            client.models.put_torch("bridge-keep", tanh, x, onnx_model=wrong)
        # The model stored before is still there, the same one.
        assert client.models.get("bridge-keep") == before
        y = torch.randn(2, 3, dtype=torch.float64)
        with client.tape(good, loss="mse", data=(x, y)) as tape:
            assert_grads(
                {n: g.numpy() for n, g in tape.gradients.items()},
                torch_grads(tanh, F.mse_loss(tanh(x), y)),
            )
        client.models.delete("bridge-keep")


class MaskedLogits(nn.Module):
    """Logits with a class masked out (-inf), as a constrained classifier writes them."""

    def __init__(self, act=torch.tanh) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.act = act
        self.register_buffer("masked", torch.tensor([False, True, False]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x))).masked_fill(self.masked, float("-inf"))


def test_outputs_holding_infinities_are_checked_on_their_finite_part(server) -> None:
    model = perturbed(MaskedLogits(), seed=9)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.tensor([0, 2, 2, 0, 2])
    with Client(server.base_url) as client:
        # -inf where torch has -inf is agreement, not a mismatch (the tape itself asks
        # for the infinite logits the loss then handles).
        tape = client.tape(model, loss="cross_entropy", data=(x, y), allow_nonfinite=True)
        with tape:
            assert_grads(
                {n: g.numpy() for n, g in tape.gradients.items()},
                torch_grads(model, F.cross_entropy(model(x), y)),
            )
        # And an infinity does not make every finite difference pass: a graph with
        # another activation is still caught.
        relu = copy.deepcopy(model)
        relu.act = torch.relu
        wrong = quiet_export(relu, (x,), optimize=False)
        exported = pytorch.export(model, x, onnx_model=wrong)
        with pytest.raises(ExportMismatch, match="output 'logits'"):
            pytorch.verify(client, exported)


def test_a_cached_export_is_not_reused_once_the_forward_changed(server) -> None:
    # Parameters and buffers unchanged, the function not: another activation (or a
    # temperature, a mask held as a plain attribute) must not answer from the old file.
    model = perturbed(Tokens(torch.tanh), seed=10)
    x = torch.randn(4, 5, 4, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    with Client(server.base_url) as client:
        with client.tape(model, loss="mse", data=(x, y)) as first:
            pass
        model.act = torch.relu
        with client.tape(model, loss="mse", data=(x, y)) as moved:
            assert moved.model is not first.model
            assert_grads(
                {n: g.numpy() for n, g in moved.gradients.items()},
                torch_grads(model, F.mse_loss(model(x), y)),
            )


def test_data_of_another_float_dtype_than_the_module_is_a_named_error(server) -> None:
    # NumPy's float64 data with a float32 module: a BridgeError saying which, not torch's
    # "mat1 and mat2 must have the same dtype" from inside the export.
    model = nn.Linear(3, 2).eval()
    x, y = np.random.default_rng(0).standard_normal((4, 3)), np.array([0, 1, 1, 0])
    with Client(server.base_url) as client, pytest.raises(BridgeError) as caught:
        client.tape(model, loss="cross_entropy", data=(x, y))
    assert "input 0 is float64 and the module's parameters are float32" in str(caught.value)


def test_a_cached_export_is_not_reused_once_parameters_are_frozen(server) -> None:
    """Freezing a layer (requires_grad_(False): fine-tuning the head only) changes what
    the tape differentiates and the flat vector's layout, not the values or the forward:
    the cached export must not keep the frozen parameters trainable."""
    model = perturbed(Tokens(), seed=8)
    x = torch.randn(4, 5, 4, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    with Client(server.base_url) as client:
        with client.tape(model, loss="mse", data=(x, y)) as everything:
            assert everything.names == ["a.weight", "a.bias", "b.weight", "b.bias"]
        model.a.requires_grad_(False)
        with client.tape(model, loss="mse", data=(x, y)) as head:
            assert head.names == ["b.weight", "b.bias"]
            assert head.size == 3 * 6 + 3  # parameters_to_vector over requires_grad ones
            loss = F.mse_loss(model(x), y)
            head_params = [model.b.weight, model.b.bias]
            want = torch.autograd.grad(loss, head_params)
            got = head.gradients
            assert list(got) == ["b.weight", "b.bias"]
            for g, w in zip(got.values(), want, strict=True):
                np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "labels",
    [
        torch.tensor([0, 1, 4, 2, 3, 1]),  # 4 of 4 classes: torch raises
        torch.tensor([0, 1, -100, 2, 3, 1]),  # torch's ignore_index: not ignored here
        torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0, 1.0], dtype=torch.float64),  # not classes
        torch.tensor([[0, 1, 2], [3, 1, 0]]),  # not one label per example
    ],
)
def test_nll_labels_that_are_not_class_indices_are_a_named_error(server, labels) -> None:
    """'nll' turns labels into one-hot rows; a label outside [0, C) (torch raises, or
    with ignore_index drops it from the mean) would be a zero row, a smaller loss and no
    error."""
    model = nn.Sequential(perturbed(ConvBN(), seed=1), nn.LogSoftmax(dim=1)).eval()
    x = torch.randn(6, 2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with Client(server.base_url) as client, pytest.raises(BridgeError, match="nll"):
        client.tape(model, loss="nll", data=(x, labels))


# ---------------------------------------------- every method shaped like the module


def flat_hessian(model: nn.Module, loss_of) -> torch.Tensor:
    """torch's dense Hessian over parameters_to_vector(model.parameters())."""
    named = [(n, p) for n, p in model.named_parameters()]
    point = torch.nn.utils.parameters_to_vector([p for _, p in named]).detach()

    def of_flat(flat: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for n, p in named:
            params[n] = flat[start : start + p.numel()].view_as(p)
            start += p.numel()
        return loss_of(params)

    return torch.autograd.functional.hessian(of_flat, point)


def test_every_method_answers_over_every_parameter_like_torch(server) -> None:
    """solve, diagonal, influence, kfac, per_example, linear_operator, fun/jac/hessp:
    keyed and ordered like named_parameters() with zeros (or b / damping) for the
    unused layer, tensors in and out, flat vectors in parameters_to_vector order; each
    against torch's Hessian, gradients and per-example gradients."""
    from torch.func import functional_call, grad, jacrev, vmap

    model = perturbed(WithUnused(), seed=8)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(7, 3, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 2, (7,), generator=gen)
    x_test = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    y_test = torch.randint(0, 2, (3,), generator=gen)
    names = [n for n, _ in model.named_parameters()]

    def loss_on(xs, ys):
        return lambda params: F.cross_entropy(functional_call(model, params, (xs,)), ys)

    H = flat_hessian(model, loss_on(x, y))  # 16 x 16, zero rows for spare.*
    params = {n: p.detach() for n, p in model.named_parameters()}
    g_test = torch.nn.utils.parameters_to_vector(grad(loss_on(x_test, y_test))(params).values())
    b = torch.randn(16, dtype=torch.float64, generator=gen)  # nonzero on spare.* too
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        assert tape.size == 16 and tape.model.unused == ["spare.weight", "spare.bias"]
        # The operator over parameters_to_vector order, unused rows and columns zero.
        dense = tape.linear_operator() @ np.eye(tape.size)
        np.testing.assert_allclose(dense, H.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(tape.linear_operator().matvec(b.numpy()), (H @ b).numpy())
        # hessp / jac at the recorded point (flat, every parameter).
        point = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        np.testing.assert_allclose(tape.hessp(point, b.numpy()), (H @ b).numpy(), atol=1e-12)
        want_grad = grad(loss_on(x, y))(params)
        np.testing.assert_allclose(
            tape.jac(point), torch.cat([g.reshape(-1) for g in want_grad.values()]), atol=1e-12
        )
        assert tape.fun(point) == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-12)
        np.testing.assert_allclose(tape.gradient(flat=True).gradients.numpy(), tape.jac(point))
        many = tape.hvp_many([b, tape.unflatten(2 * b)])
        torch.testing.assert_close(many[0], H @ b, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(tape.vector(many[1]), 2 * H @ b, atol=1e-12, rtol=1e-10)
        # The exact diagonal, by torch name.
        diag = tape.diagonal(method="exact").diagonal
        assert list(diag) == names and isinstance(diag["fc.weight"], torch.Tensor)
        torch.testing.assert_close(
            torch.nn.utils.parameters_to_vector(diag.values()), torch.diagonal(H)
        )
        # solve: b flat (a tensor) -> x flat; on spare.* x = b / damping.
        eye = torch.eye(16, dtype=torch.float64)
        x_flat = tape.solve(b, damping=0.5, tol=1e-13).solution
        assert isinstance(x_flat, torch.Tensor) and x_flat.shape == (16,)
        torch.testing.assert_close(x_flat, torch.linalg.solve(H + 0.5 * eye, b), atol=1e-10, rtol=0)
        with pytest.raises(BridgeError, match=r"spare.weight.*damping"):
            tape.solve(b)
        newton = tape.solve(damping=0.5, tol=1e-13).solution  # b = the gradient
        assert list(newton) == names and not newton["spare.bias"].any()
        by_name = tape.solve(tape.unflatten(b), damping=0.5, tol=1e-13).solution
        torch.testing.assert_close(tape.vector(by_name), x_flat, atol=1e-10, rtol=0)
        # influence: s_test = (GGN + damping I)^-1 grad L_test (a linear model: GGN = H).
        found = tape.influence({"x": x_test, "y": y_test}, damping=0.1, tol=1e-13)
        assert list(found.s_test) == names
        torch.testing.assert_close(
            tape.vector(found.s_test),
            torch.linalg.solve(H + 0.1 * eye, g_test),
            atol=1e-9,
            rtol=0,
        )
        # Per-example gradients (example i's loss alone), N first, zeros for spare.*.
        per = tape.per_example(gradients=True)
        one = vmap(grad(lambda p, xi, yi: loss_on(xi[None], yi[None])(p)), in_dims=(None, 0, 0))(
            params, x, y
        )
        assert list(per.gradients) == names
        for n in names:
            torch.testing.assert_close(per.gradients[n], one[n], atol=1e-12, rtol=1e-10)
        assert per.gradients["spare.weight"].shape == (7, 2, 3)
        torch.testing.assert_close(per.mean["fc.bias"], one["fc.bias"].mean(0))
        assert not per.norms_by_source["spare.bias"].any()
        # KFAC's product with a flat vector; its inverse is b / damping on spare.*.
        used = tape._kept()
        product = tape.kfac(b).product
        remote = tape.remote.kfac(
            {n: a.numpy() for n, a in tape.unflatten(b).items() if n in tape.names}
        )
        assert product.shape == (16,) and not product[8:].any()
        np.testing.assert_allclose(product[used].numpy(), tape.remote.flatten(remote.product))
        inverse = tape.kfac(b, inverse=True, damping=0.25).product
        torch.testing.assert_close(inverse[8:], b[8:] / 0.25)
        # Laplace draws by torch name, tensors (the fit covers the parameters used).
        draws = tape.laplace(structure="full", prior_precision=1.0).sample(3, seed=0)
        assert list(draws) == ["fc.weight", "fc.bias"]
        assert draws["fc.weight"].shape == (3, 2, 3) and draws["fc.weight"].dtype == torch.float64
        # The update takes tensors by torch name (the unused layer's are ignored).
        moved = {n: p.detach() + 0.1 for n, p in model.named_parameters()}
        tape.update(moved)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(moved[n])
        assert tape.value == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-12)
        # Pass-throughs answer; what would be keyed otherwise says where it is.
        assert tape.trace(method="exact").trace == pytest.approx(
            float(torch.trace(flat_hessian(model, loss_on(x, y)))), rel=1e-10
        )
        with pytest.raises(AttributeError, match=r"tape\.remote\.sources"):
            tape.sources  # noqa: B018
        # The output's jacobian over every parameter (torch.func.jacrev).
        jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
        got = tape.jacobian(tape.output).jacobians
        assert list(got) == names and got["spare.weight"].shape == (7, 2, 2, 3)
        for n in names:
            torch.testing.assert_close(got[n], jac[n], atol=1e-12, rtol=1e-10)
        dense = tape.jacobian(tape.output, flat=True).jacobians
        torch.testing.assert_close(
            dense, torch.cat([jac[n].reshape(14, -1) for n in names], dim=1), atol=1e-12, rtol=0
        )


def test_answers_come_back_in_the_callers_dtype(server) -> None:
    """A float32 module: a float32 vector in, a float32 answer out (p.grad takes it)."""
    model = perturbed(WithUnused(), seed=9).float()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 3, generator=gen)
    y = torch.randint(0, 2, (6,), generator=gen)
    v = torch.randn(16, generator=gen)
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        hv = tape.hvp(v)
        assert hv.dtype == torch.float32 and hv.shape == (16,)
        named = dict(model.named_parameters())
        g = torch.autograd.grad(
            F.cross_entropy(model(x), y), list(named.values()), create_graph=True, allow_unused=True
        )
        vs = tape.unflatten(v)
        dot = sum((gi * vs[n]).sum() for gi, n in zip(g, named) if gi is not None)
        want = torch.autograd.grad(
            dot, list(named.values()), allow_unused=True, materialize_grads=True
        )
        torch.testing.assert_close(
            hv, torch.cat([w.reshape(-1) for w in want]), rtol=1e-4, atol=1e-5
        )
        as_dicts = [
            tape.gradients,
            tape.hvp(vs),
            tape.unflatten(hv),
            tape.diagonal(method="exact").diagonal,
            tape.solve(damping=0.5).solution,
            tape.eigenvalues(1, eigenvectors=True).eigenvectors[0],
            tape.per_example().mean,
        ]
        for answer in as_dicts:
            for n, p in named.items():
                p.grad = answer[n]  # raises on a dtype mismatch
                assert answer[n].dtype == torch.float32
        for answer in (tape.vector(tape.gradients), tape.solve(v, damping=0.5).solution):
            assert answer.dtype == torch.float32
            torch.nn.utils.vector_to_parameters(answer, model.parameters())
        assert tape.hvp(v.double()).dtype == torch.float64  # the caller's dtype


def test_a_builtin_loss_on_several_outputs_needs_output(server) -> None:
    """With several outputs a built-in loss took the first silently; now it asks which,
    and reads the one named."""
    model = perturbed(TwoHeads(), seed=10)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    z = torch.randn(6, 5, dtype=torch.float64, generator=gen)
    with Client(server.base_url) as client:
        with pytest.raises(BridgeError, match=r"out0, out1.*output="):
            client.tape(model, loss="cross_entropy", data=(x, y))
        with pytest.raises(BridgeError, match=r"'logits' is not an output.*out0, out1"):
            client.tape(model, loss="cross_entropy", data=(x, y), output="logits")
        for output, target, want in (
            ("out0", y, F.cross_entropy(model(x)[0], y)),
            ("out1", z, F.mse_loss(model(x)[1], z)),
        ):
            with client.tape(
                model,
                loss="mse" if output == "out1" else "cross_entropy",
                data=(x, target),
                output=output,
            ) as tape:
                np.testing.assert_allclose(tape.value, want.item(), rtol=1e-12)
                assert_grads(
                    {n: g.numpy() for n, g in tape.gradients.items()},
                    torch_grads(model, want),
                )


def test_parameters_another_output_holds_are_zeros_in_every_answer(server) -> None:
    """A loss on out1 (the features) of TwoHeads: head.* feed only out0, so the service
    answers them null (unconnected "none") on the tape's gradient and jacobian calls.
    They came back as one 0-d NaN each (a flat vector 10 entries short); now zeros of
    the parameter's shape, as torch's materialized gradients."""
    model = perturbed(TwoHeads(), seed=11).float()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 4, generator=gen)
    z = torch.randn(6, 5, generator=gen)
    want = torch_grads(model, F.mse_loss(model(x)[1], z))
    flat_want = np.concatenate([g.reshape(-1) for g in want.values()])
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="mse", data=(x, z), output="out1") as tape,
    ):
        named = tape.gradient().gradients
        assert {n: tuple(g.shape) for n, g in named.items()} == {
            n: g.shape for n, g in want.items()
        }
        for n, g in want.items():
            assert named[n].dtype == torch.float32, n
            np.testing.assert_allclose(named[n].numpy(), g, rtol=1e-4, atol=1e-6, err_msg=n)
        flat = tape.gradient(flat=True).gradients
        np.testing.assert_allclose(flat.numpy(), flat_want, rtol=1e-4, atol=1e-6)
        jac = tape.jacobian().jacobians  # of the scalar loss: the gradient again
        for n, g in want.items():
            np.testing.assert_allclose(np.asarray(jac[n]), g, rtol=1e-4, atol=1e-6, err_msg=n)
        full = tape.jacobian(flat=True).jacobians
        np.testing.assert_allclose(np.asarray(full).reshape(-1), flat_want, rtol=1e-4, atol=1e-6)


def test_update_takes_some_parameters_by_name_and_any_float_dtype(server) -> None:
    """update({name: value}) changes the parameters named (it asked for every one the
    loss uses); a float64 point (a SciPy optimizer's) updates a float32 module, cast as
    load_state_dict casts (it was a 422 naming each initializer's dtype)."""
    model = perturbed(WithUnused(), seed=12).float()
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 3, generator=gen)
    y = torch.randint(0, 2, (6,), generator=gen)
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        bias = torch.tensor([0.25, -0.5])
        tape.update({"fc.bias": bias})
        moved = copy.deepcopy(model)
        with torch.no_grad():
            moved.fc.bias.copy_(bias)
        np.testing.assert_allclose(tape.value, F.cross_entropy(moved(x), y).item(), rtol=1e-5)
        point = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double() * 1.1
        tape.update(point=point.numpy())
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(point.float(), moved.parameters())
        np.testing.assert_allclose(tape.value, F.cross_entropy(moved(x), y).item(), rtol=1e-5)
        assert tape.gradients["fc.weight"].dtype == torch.float32


def test_lines_over_several_outputs_name_the_curvatures_output_or_none(server) -> None:
    """A loss written as lines over out0 and out1: without output= the tape took out0 as
    the curvatures' output, so its GGN left out1's term out (78% off torch's J^T H J
    over both); a loss over out1 alone was a 422 about out0, never named. Now no output
    is guessed (the Hessian's methods answer; a curvature asks for output=), and
    output= names it."""
    model = perturbed(TwoHeads(), seed=13)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    z = torch.randn(6, 5, dtype=torch.float64, generator=gen)
    both = ["loss = softmax_cross_entropy(out0, y) + mean_squared_error(out1, z)"]
    data = {"x": x, "y": y, "z": z}
    want = F.cross_entropy(model(x)[0], y) + F.mse_loss(model(x)[1], z)

    def outputs(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.functional_call(model, params, (x,))

    def loss_of(params: dict) -> torch.Tensor:
        out0, out1 = outputs(params)
        return F.cross_entropy(out0, y) + F.mse_loss(out1, z)

    hessian = flat_hessian(model, loss_of).numpy()
    named = dict(model.named_parameters())
    point = torch.nn.utils.parameters_to_vector(named.values()).detach()

    def out1_of(flat: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for n, p in named.items():
            params[n] = flat[start : start + p.numel()].view_as(p)
            start += p.numel()
        return outputs(params)[1].reshape(-1)

    j1 = torch.autograd.functional.jacobian(out1_of, point).numpy()
    ggn_out1 = j1.T @ j1 * (2.0 / z.numel())  # mean squared error's Hessian: 2/n I
    v = np.random.default_rng(13).standard_normal(hessian.shape[0])
    with Client(server.base_url) as client:
        with client.tape(model, loss=both, data=data, example_inputs=(x,)) as tape:
            assert tape.output is None
            np.testing.assert_allclose(tape.value, want.item(), rtol=1e-12)
            np.testing.assert_allclose(tape.hvp(v), hessian @ v, rtol=1e-9, atol=1e-12)
            with pytest.raises(Exception, match="output"):
                tape.hvp(v, curvature="ggn")
        only_out1 = ["loss = mean_squared_error(out1, z)"]
        with client.tape(model, loss=only_out1, data=data, example_inputs=(x,)) as tape:
            np.testing.assert_allclose(tape.value, F.mse_loss(model(x)[1], z).item(), rtol=1e-12)
        with client.tape(
            model, loss=only_out1, data=data, example_inputs=(x,), output="out1"
        ) as tape:
            assert tape.output == "out1"
            np.testing.assert_allclose(
                tape.hvp(v, curvature="ggn"), ggn_out1 @ v, rtol=1e-9, atol=1e-12
            )


class Gated(nn.Module):
    """Tensor.split by a size: the exporter writes SplitToSequence read by SequenceAt."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).split(3, dim=-1)  # a GLU
        first, *_ = x.split(1, dim=1)
        return self.head(value * torch.sigmoid(gate)) + first


def test_split_by_a_size_goes_through_the_bridge(server) -> None:
    """`x.split(size, dim)` exports (dynamo, optimize=False: the bridge's export) as a
    SplitToSequence read back by SequenceAt: it was refused as an unsupported op (the
    attention of tests/engine/onnx/fixtures' transformer splits its q, k, v so)."""
    model = perturbed(Gated().double(), seed=3).eval()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 4, dtype=torch.float64, generator=gen)
    y = torch.randn(5, 2, dtype=torch.float64, generator=gen)
    want = F.mse_loss(model(x), y)
    with Client(server.base_url) as client, client.tape(model, loss="mse", data=(x, y)) as tape:
        np.testing.assert_allclose(tape.value, want.item(), rtol=1e-12)
        assert_grads({n: g.numpy() for n, g in tape.gradients.items()}, torch_grads(model, want))


class BodyOnly(nn.Module):
    """TwoHeads' features alone: the peer of a loss on TwoHeads' out1."""

    def __init__(self, body: nn.Linear) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))


def test_kfac_of_a_loss_on_one_output_answers_its_layers_and_names_the_unreached(
    server,
) -> None:
    """A loss on out1 (the features) of TwoHeads: head.* feed only out0. KFAC refused
    them as "in no matmul or convolution layer of their own"; they are in a layer, one
    the loss never reaches, where the curvature is exactly zero. Now the KFAC answers:
    body.*'s blocks those of the same body alone (BodyOnly, the peer), head.* listed as
    unreached, their products zero and their damped inverse v / damping."""
    model = perturbed(TwoHeads(), seed=14)
    peer = BodyOnly(copy.deepcopy(model.body))
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    z = torch.randn(7, 5, dtype=torch.float64, generator=gen)
    v = {
        n: torch.randn(p.shape, dtype=torch.float64, generator=gen)
        for n, p in model.named_parameters()
    }
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="mse", data=(x, z), output="out1") as tape,
        client.tape(peer, loss="mse", data=(x, z)) as alone,
    ):
        fitted = tape.kfac(v)
        want = alone.kfac({n: v[n] for n in ("body.weight", "body.bias")})
        assert sorted(fitted.unreached) == ["head.bias", "head.weight"] and not fitted.others
        assert [(layer.weight, layer.bias) for layer in fitted.layers] == [
            ("body.weight", "body.bias")
        ]
        np.testing.assert_allclose(fitted.trace, want.trace, rtol=1e-10)
        np.testing.assert_allclose(
            fitted.layers[0].eigenvalues, want.layers[0].eigenvalues, rtol=1e-10, atol=1e-14
        )
        for n in ("body.weight", "body.bias"):
            np.testing.assert_allclose(fitted.product[n], want.product[n], rtol=1e-10)
        for n in ("head.weight", "head.bias"):
            assert not np.asarray(fitted.product[n]).any(), n
        inverse = tape.kfac(v, inverse=True, damping=0.5)
        for n in ("head.weight", "head.bias"):
            np.testing.assert_allclose(inverse.product[n], v[n] / 0.5, rtol=1e-12)
        # The estimators on it too: its trace (exact, by products) is KFAC's.
        on_kfac = tape.trace(curvature="kfac", method="exact")
        assert on_kfac.trace == pytest.approx(want.trace, rel=1e-9)


def test_the_bridge_runs_over_the_json_transport(server) -> None:
    """transport="json" sends the exported ONNX file base64-encoded (the API's form for
    bytes in JSON); it once failed in json.dumps before any request was made."""
    model = perturbed(ConvBN(), seed=11)
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (4,))
    want = torch_grads(model, F.cross_entropy(model(x), y))
    with (
        Client(server.base_url, transport="json") as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        assert_grads({n: g.numpy() for n, g in tape.gradients.items()}, want)


def test_influence_takes_test_data_in_the_form_the_tape_took_data(server) -> None:
    """`tape.influence((x_test, y_test))`, as `data=(x, y)` was given: the same answer as
    the dict by input name and "y" (a tuple once failed with an AttributeError)."""
    model = perturbed(WithUnused(), seed=12)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(8, 3, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 2, (8,), generator=gen)
    x_test, y_test = x[:3] + 0.1, y[:3]
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        by_name = tape.influence({tape.model.inputs[0]: x_test, "y": y_test}, damping=0.1)
        as_data = tape.influence((x_test, y_test), damping=0.1)
        np.testing.assert_array_equal(as_data.scores, by_name.scores)
        assert as_data.test_loss == by_name.test_loss
        with pytest.raises(BridgeError, match="data has 3 arrays"):
            tape.influence((x_test, y_test, y_test))


def test_vectors_in_torch_habits_are_refused_saying_what_to_pass(server) -> None:
    """A tuple of per-parameter tensors (torch.autograd.grad's answer), a module after
    an optimizer step, a block of vectors: each a named error saying what the tape takes
    (NumPy's "inhomogeneous shape", or a flat vector "of 3 entries" for a module, or
    an (n, 2) block read as one vector of 2n entries "got 86", before). One column
    (n, 1) is still a flat vector."""
    model = perturbed(WithUnused(), seed=13)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    with (
        Client(server.base_url) as client,
        client.tape(model, loss="cross_entropy", data=(x, y)) as tape,
    ):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), [model.fc.weight])
        with pytest.raises(TypeError, match=r"not a tuple: pass dict\(zip\(tape.names"):
            tape.hvp(grads)
        with pytest.raises(TypeError, match="not a module"):
            tape.update(model)
        with pytest.raises(ValueError, match=r"1-D; got shape \(16, 2\): hvp_many"):
            tape.hvp(torch.ones(tape.size, 2, dtype=torch.float64))
        column = torch.randn(tape.size, 1, dtype=torch.float64)
        torch.testing.assert_close(tape.hvp(column), tape.hvp(column[:, 0]), rtol=0, atol=0)


def test_a_non_finite_parameter_or_data_the_forward_refuses_is_named() -> None:
    """A NaN weight was refused as "folded: e.g. a BatchNorm folded into this weight"
    (NaN != NaN in the value matching), and data the module cannot take raised torch's
    RuntimeError without saying it came from the data; both are BridgeErrors naming
    what is wrong. (Refused before any request: no server.)"""
    client = Client("http://127.0.0.1:9")  # never reached
    model = perturbed(WithUnused(), seed=14)
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    with torch.no_grad():
        model.fc.weight[0, 1] = float("nan")
    with pytest.raises(BridgeError, match=r"parameter 'fc.weight' holds 1 NaN or infinite"):
        client.tape(model, loss="cross_entropy", data=(x, y))
    model = perturbed(WithUnused(), seed=14)
    with pytest.raises(
        BridgeError, match=r"forward failed on the data's first rows \(\(5, 4\) float64\)"
    ):
        client.tape(model, loss="cross_entropy", data=(torch.randn(5, 4, dtype=torch.float64), y))


class Branching(nn.Module):
    """A forward whose control flow reads the data: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def test_an_export_failure_reads_as_text() -> None:
    """torch.export's refusal is passed on without its terminal colours (the escapes
    showed as "[96m" in a notebook or a log)."""
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(BridgeError, match=r"torch\.onnx\.export failed") as refused:
        Client("http://127.0.0.1:9").tape(
            Branching().double().eval(), loss="cross_entropy", data=(x, torch.zeros(5).long())
        )
    assert "\x1b" not in str(refused.value)
