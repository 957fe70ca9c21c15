"""KFAC on a loss with one term per position (an output (N, T, C), a softmax cross-
entropy per position): the convention engine/kfac.py documents, checked against dense
references written out here (no PyTorch), and, where curvlinops is installed, against
its KFACLinearOperator: equal for "expand", different by its cross-position terms for
"reduce" (the module doc says why the engine does not copy them)."""

import numpy as np
import pytest

import engine as gt
from engine.curvature import Curvature
from engine.kfac import kfac

N, T, D, H, C = 4, 3, 5, 6, 3


def _setup(seed=0):
    gen = np.random.default_rng(seed)
    params = {
        "a_b": gen.normal(size=H),
        "a_w": gen.normal(size=(D, H)) / np.sqrt(D),
        "b_b": gen.normal(size=C),
        "b_w": gen.normal(size=(H, C)) / np.sqrt(H),
    }
    x = gen.normal(size=(N, T, D))
    y = gen.integers(0, C, size=(N, T))
    return params, x, y


def model(p, x):
    return gt.tanh(x @ p["a_w"] + p["a_b"]) @ p["b_w"] + p["b_b"]


def loss(o, y):
    return gt.mean(gt.softmax_cross_entropy(o, y))


def _curvature(params, x, y):
    tensors = {k: gt.Tensor(v) for k, v in params.items()}
    return Curvature(model, loss, tensors, gt.Tensor(x), gt.Tensor(y))


def _dense(params, x):
    """Per position: the layers' inputs (with the bias's 1) and the Jacobians of the
    logits by each layer's output, and the softmax's Hessian, in NumPy."""
    h = np.tanh(x @ params["a_w"] + params["a_b"])
    z = h @ params["b_w"] + params["b_b"]
    pi = np.exp(z - z.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    hess = np.einsum("ntc,cd->ntcd", pi, np.eye(C)) - np.einsum("ntc,ntd->ntcd", pi, pi)
    # d logits / d (first layer's output): W2^T diag(1 - h^2), per position
    jac_a = np.einsum("hc,nth->ntch", params["b_w"], 1 - h**2)
    jac_b = np.broadcast_to(np.eye(C), (N, T, C, C))
    return {"a": (x, jac_a), "b": (h, jac_b)}, hess


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_per_position_kfac_factors_equal_the_dense_reference(sharing):
    """A: the inputs' second moment (expand: over every row; reduce: of each example's
    mean row). G: sum over examples and positions of J_p^T H_pp J_p / (N T) for both
    modes (reduce sums the cotangents over positions per column of the example's whole
    loss-Hessian square root, whose columns each seed one position, so no cross-position
    products appear); a position-wise network has the same G in both modes."""
    params, x, y = _setup()
    fitted = kfac(_curvature(params, x, y), "ggn", sharing=sharing, names=list(params))
    dense, hess = _dense(params, x)
    assert [layer.name for layer in fitted.layers] == ["a_w+a_b", "b_w+b_b"]
    for layer, key in zip(fitted.layers, "ab", strict=True):
        a, jac = dense[key]
        if sharing == "expand":
            rows = a.reshape(-1, a.shape[-1])
            want_a = rows.T @ rows / (N * T)
        else:
            mean = a.mean(axis=1)
            want_a = mean.T @ mean / N
        want_g = np.einsum("ntcj,ntcd,ntdk->jk", jac, hess, jac) / (N * T)
        np.testing.assert_allclose(layer.A, want_a, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(layer.G, want_g, rtol=1e-10, atol=1e-15)


def test_per_position_reduce_is_what_the_monte_carlo_fisher_estimates():
    """The type-2 "reduce" G is the expectation of the Monte-Carlo one (labels drawn
    per position from the model, the cotangents summed over positions): computed here
    exactly, by every label configuration of one example weighted by its probability."""
    params, x, y = _setup(1)
    x, y = x[:1], y[:1]
    curv = _curvature(params, x, y)
    type2 = kfac(curv, "ggn", sharing="reduce", names=list(params))
    dense, _ = _dense(params, x)
    h = np.tanh(x @ params["a_w"] + params["a_b"])
    z = h @ params["b_w"] + params["b_b"]
    pi = np.exp(z - z.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    configs = np.stack(np.meshgrid(*[np.arange(C)] * T, indexing="ij"), -1).reshape(-1, T)
    for layer, key in zip(type2.layers, "ab", strict=True):
        _, jac = dense[key]
        want = np.zeros_like(layer.G)
        for labels in configs:
            prob = np.prod(pi[0, np.arange(T), labels])
            # d loss / d logits for these labels (mean over T positions), by the layer's
            # output, summed over positions
            score = (pi[0] - np.eye(C)[labels]) / T
            g = np.einsum("tcj,tc->j", jac[0], score)
            want += prob * np.outer(g, g)
        # The Monte-Carlo G is w sum_s gsum gsum^T with w = 1 / (k S), k = 1 / (N T)
        # the likelihood's scale (N = 1 here): T times the mean of g g^T over draws.
        np.testing.assert_allclose(layer.G, want * T, rtol=1e-10, atol=1e-15)


def test_expand_equals_curvlinops_and_reduce_differs_by_its_cross_position_terms():
    torch = pytest.importorskip("torch")
    curvlinops = pytest.importorskip("curvlinops")
    params, x, y = _setup(2)
    fitted = {
        s: kfac(_curvature(params, x, y), "ggn", sharing=s, names=list(params))
        for s in ("expand", "reduce")
    }
    with torch.random.fork_rng():
        torch.set_default_dtype(torch.float64)
        try:
            net = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, C))
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        net[0].weight.copy_(torch.as_tensor(params["a_w"].T))
        net[0].bias.copy_(torch.as_tensor(params["a_b"]))
        net[2].weight.copy_(torch.as_tensor(params["b_w"].T))
        net[2].bias.copy_(torch.as_tensor(params["b_b"]))

    class ClassesSecond(torch.nn.Module):  # torch's cross-entropy: classes on axis 1
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, data):
            return self.inner(data).transpose(1, 2)

    wrapped = ClassesSecond(net)
    data = [(torch.as_tensor(x), torch.as_tensor(y))]
    for sharing in ("expand", "reduce"):
        # The empirical Fisher: one gradient per example of its loss (the mean over its T
        # positions) here, one per position there: G is theirs / T.
        ours = kfac(_curvature(params, x, y), "empirical_fisher", sharing=sharing)
        theirs = curvlinops.KFACLinearOperator(
            wrapped,
            torch.nn.CrossEntropyLoss(),
            list(wrapped.parameters()),
            data,
            fisher_type="empirical",
            kfac_approx=sharing,
            check_deterministic=False,
        )
        theirs.compute_kronecker_factors()
        for layer, name in zip(ours.layers, theirs._input_covariances, strict=True):
            their_g = theirs._gradient_covariances[name].numpy()
            np.testing.assert_allclose(layer.G, their_g / T, rtol=1e-10, atol=1e-15)
    for sharing, ours in fitted.items():
        theirs = curvlinops.KFACLinearOperator(
            wrapped,
            torch.nn.CrossEntropyLoss(),
            list(wrapped.parameters()),
            data,
            fisher_type="type-2",
            kfac_approx=sharing,
            check_deterministic=False,
        )
        theirs.compute_kronecker_factors()
        for layer, name in zip(ours.layers, theirs._input_covariances, strict=True):
            their_a = theirs._input_covariances[name].numpy()
            their_g = theirs._gradient_covariances[name].numpy()
            np.testing.assert_allclose(layer.A, their_a, rtol=1e-12, atol=1e-15)
            if sharing == "expand":
                np.testing.assert_allclose(layer.G, their_g, rtol=1e-10, atol=1e-15)
            else:
                # curvlinops pairs column c of each position's square root with column
                # c of every other position's: products S_p S_q^T (p != q) the engine
                # does not have.
                assert np.abs(layer.G - their_g).max() > 1e-2 * np.abs(their_g).max()


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_per_position_ekfac_eigenvalues_are_the_exact_ggn_in_the_kfac_eigenbasis(sharing):
    """EKFAC's eigenvalues are the exact GGN's diagonal in each weight block's Kronecker
    eigenbasis: (q_a (x) q_g)^T GGN (q_a (x) q_g) for every pair of eigenvectors, with
    the GGN's products taken from the curvature operator (no Kronecker structure)."""
    from engine.hessian_algorithms import FlatOperator

    params, x, y = _setup(3)
    curv = _curvature(params, x, y)
    fitted = kfac(curv, "ggn", sharing=sharing, names=list(params), ekfac=True)
    ggn = FlatOperator(curv.operator("ggn"))
    names = list(params)  # the flat order: the dict's
    offsets = np.cumsum([0, *(params[n].size for n in names)])
    for layer in fitted.layers:
        qa, qg = layer.eig_a[1], layer.eig_g[1]
        w = names.index(layer.name.split("+")[0])
        basis = np.einsum("ka,mb->abkm", qa, qg).reshape(-1, qa.shape[0] * qg.shape[0])
        vectors = np.zeros((basis.shape[0], ggn.n))
        vectors[:, offsets[w] : offsets[w + 1]] = basis
        want = np.einsum("ij,ij->i", vectors, ggn.matvec(vectors)).reshape(layer.corrected.shape)
        np.testing.assert_allclose(layer.corrected, want, rtol=1e-9, atol=1e-14)
