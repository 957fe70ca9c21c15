"""The SDK's plots (issue 31): each result that is a picture is drawn (Agg) from a real
server's answer, and what the figure holds (line data, bar heights, image pixels, labels,
titles) is compared with the result's numbers and with closed forms."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display here

import matplotlib.pyplot as plt
import numpy as np
import pytest
from gradtape.client import Client, Definition, ProgressLog
from matplotlib.collections import PolyCollection
from matplotlib.image import AxesImage

from tests.client.test_curvature import logistic


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def two_layer(rng: np.random.Generator) -> tuple[Definition, dict[str, np.ndarray]]:
    """A tanh layer of a 3 x 2 matrix W and a bias b: 8 parameters, a dense Hessian."""
    params = {"W": rng.standard_normal((3, 2)) * 0.5, "b": rng.standard_normal(2) * 0.5}
    definition = Definition(
        "loss = sum(tanh(X @ W + b) ** 2)",
        variables=params,
        inputs={"X": rng.standard_normal((5, 3))},
    )
    return definition, params


def band_of(ax) -> np.ndarray:
    """The (x, y) vertices of the axes' one filled band."""
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    return np.concatenate([p.vertices for p in band.get_paths()])


def test_spectral_density_with_its_band(client: Client, rng: np.random.Generator) -> None:
    definition, *_, ggn, _ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        density = tape.spectral_density(curvature="ggn", probes=4, steps=4)
    fig, ax = density.plot()
    assert fig is ax.figure
    (line,) = ax.lines
    np.testing.assert_array_equal(line.get_xdata(), density.grid)
    np.testing.assert_array_equal(line.get_ydata(), density.density)
    # The band spans density -+ 2 standard errors.
    vertices = band_of(ax)
    assert vertices[:, 1].min() == pytest.approx(np.min(density.density - 2 * density.stderr))
    assert vertices[:, 1].max() == pytest.approx(np.max(density.density + 2 * density.stderr))
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("eigenvalue", "density")
    assert "4 probes" in ax.get_title() and "not converged" not in ax.get_title()
    # The density's mass lies over the GGN's eigenvalues (4 steps: each probe exact).
    peak = density.grid[np.argmax(density.density)]
    assert np.min(np.abs(np.linalg.eigvalsh(ggn) - peak)) < 3 * density.sigma
    # log=True: a log y axis, the band kept above zero.
    _, ax = density.plot(log=True)
    assert ax.get_yscale() == "log" and band_of(ax)[:, 1].min() > 0


def test_eigenvalues_with_residuals(client: Client, rng: np.random.Generator) -> None:
    definition, *_, ggn, _ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        top = tape.eigenvalues(3, curvature="ggn", tol=1e-10)
    _fig, ax = top.plot()
    points = ax.lines[0]
    np.testing.assert_array_equal(points.get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(points.get_ydata(), np.linalg.eigvalsh(ggn)[::-1][:3], rtol=1e-8)
    assert ax.get_ylabel() == "eigenvalue" and "lanczos" in ax.get_title()
    assert ax.get_legend().get_texts()[0].get_text() == "eigenvalue \u00b1 residual"


def test_unconverged_eigenvalues_say_so(client: Client, rng: np.random.Generator) -> None:
    definition, *_ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SDK may warn of it too: the plot is tested
        top = tape.eigenvalues(3, curvature="ggn", tol=1e-14, max_hvps=3)
    assert not top.converged
    _, ax = top.plot()
    assert f"not converged: stopped by {top.stopped}" in ax.get_title()


def test_diagonal_heatmaps(client: Client, rng: np.random.Generator) -> None:
    definition, _ = two_layer(rng)
    full = client.hessian(definition, "loss", ["W", "b"]).matrix()
    with client.tape(definition, "loss", ["W", "b"]) as tape:
        diagonal = tape.diagonal(method="exact")
    fig, axes = diagonal.plot()
    assert [ax.get_title() for ax in axes] == ["W", "b"]
    images = [next(a for a in ax.get_children() if isinstance(a, AxesImage)) for ax in axes]
    # Each source's entries in its own shape: W's as a 3 x 2 picture, b's as one row.
    np.testing.assert_allclose(images[0].get_array(), np.diag(full)[:6].reshape(3, 2))
    np.testing.assert_allclose(images[1].get_array(), np.diag(full)[6:].reshape(1, 2))
    assert "exact" in fig.get_suptitle()
    _, (only,) = diagonal.plot(["b"])
    assert only.get_title() == "b"
    with pytest.raises(KeyError, match="no source 'c'"):
        diagonal.plot(["c"])


def test_hessian_heatmap(client: Client, rng: np.random.Generator) -> None:
    definition, _ = two_layer(rng)
    hessian = client.hessian(definition, "loss", ["W", "b"])
    _fig, ax = hessian.plot()
    (image,) = ax.images
    np.testing.assert_array_equal(image.get_array(), hessian.matrix())
    limit = np.abs(hessian.matrix()).max()
    assert image.get_clim() == (-limit, limit)  # symmetric about zero
    assert [t.get_text() for t in ax.get_xticklabels()] == ["W", "b"]
    np.testing.assert_allclose(ax.get_xticks(), [2.5, 6.5])  # the blocks' middles
    assert "8 parameters" in ax.get_title()


def test_influence_bars(client: Client, rng: np.random.Generator) -> None:
    definition, *_ = logistic(rng)
    x_test, y_test = rng.standard_normal((2, 4)), np.array([1.0, 0.0])
    with client.tape(definition, "loss", output="z") as tape:
        found = tape.influence(
            {"X": x_test, "y": y_test}, curvature="ggn", damping=0.1, tol=1e-12, top_k=3
        )
    _fig, ax = found.plot()
    heights = np.array([bar.get_height() for bar in ax.patches])
    np.testing.assert_allclose(heights, found.scores)
    red, blue = matplotlib.colors.to_rgba("tab:red"), matplotlib.colors.to_rgba("tab:blue")
    colours = [bar.get_facecolor() for bar in ax.patches]
    assert colours == [red if s > 0 else blue for s in found.scores]
    assert ax.get_xlabel() == "training example"
    # top_k: the harmful then the helpful examples, labelled by index.
    _, ax = found.plot(top_k=2)
    labels = [int(t.get_text()) for t in ax.get_xticklabels()]
    assert labels == [*found.harmful[:2], *found.helpful[:2][::-1]]
    np.testing.assert_allclose([b.get_height() for b in ax.patches], found.scores[labels])


def test_solve_residuals(client: Client, rng: np.random.Generator) -> None:
    definition, *_ = logistic(rng)
    with client.tape(definition, "loss", output="z") as tape:
        step = tape.solve(curvature="ggn", damping=0.01, tol=1e-12)
    _, ax = step.plot()
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), step.residuals)
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "CG iteration"


def test_trace_convergence_from_a_job(client: Client, rng: np.random.Generator) -> None:
    """A ProgressLog passed as progress= keeps the job's reports; its plot draws them."""
    definition, *_, ggn, _ = logistic(rng, n=40, d=30)
    seen = []
    log = ProgressLog(then=seen.append)
    with client.tape(definition, "loss", output="z") as tape:
        trace = tape.trace(
            method="hutchinson", curvature="ggn", batch_size=4, max_hvps=200, progress=log
        )
    assert seen and seen[-1].state == "succeeded"  # `then` saw every status
    assert log.points and log.unit == "hvps" and "trace" in log.operation
    done, estimate, error = (np.array(c, dtype=float) for c in zip(*log.points, strict=True))
    assert np.all(np.diff(done) > 0) and done[-1] <= trace.hvps
    _fig, ax = log.plot()
    (line,) = ax.lines
    np.testing.assert_array_equal(line.get_xdata(), done)
    np.testing.assert_array_equal(line.get_ydata(), estimate)
    assert ax.get_xlabel() == "hvps done"
    # The last point is the answer itself, its band +- 2 standard errors.
    assert (done[-1], estimate[-1], error[-1]) == (trace.hvps, trace.trace, trace.stderr)
    band = band_of(ax)
    assert band[:, 1].max() == pytest.approx(np.nanmax(estimate + 2 * error))
    assert abs(trace.trace - np.trace(ggn)) < 5 * trace.stderr


def test_into_axes_of_your_own_and_a_hessian_too_large_to_draw(
    client: Client, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    definition, _ = two_layer(rng)
    hessian = client.hessian(definition, "loss", ["W", "b"])
    figure, (left, right) = plt.subplots(1, 2)
    assert hessian.plot(ax=left) == (figure, left) and len(left.images) == 1
    assert not right.images  # drawn where asked, nowhere else
    from gradtape.client import plots

    monkeypatch.setattr(plots, "MAX_HEATMAP", 4)
    with pytest.raises(ValueError, match="8 x 8 Hessian is too large to draw"):
        hessian.plot()
