"""Pictures of the results that are pictures, drawn with matplotlib (`pip install
'gradtape-client[plot]'`), which is imported only when a plot is asked for.

Each result's `.plot()` lands here and answers the matplotlib objects it drew on, so a
notebook can restyle them: `(figure, axes)` (a list of axes for a diagonal over several
sources). Pass `ax=` to draw into axes of your own. A result that is approximate or was
stopped early says so in its title, as the result itself does.

    density = tape.spectral_density(probes=8, steps=40)
    fig, ax = density.plot()                 # the density with its +-2 standard errors
    log = ProgressLog()
    tape.trace(method="hutchinson", max_hvps=400, progress=log)
    fig, ax = log.plot()                     # the estimate as the HVPs were spent
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .jobs import JobStatus
    from .results import (
        Diagonal,
        Eigenvalues,
        Hessian,
        Influence,
        Solve,
        SpectralDensity,
    )

# Colours of the two signs of an influence score (matplotlib's tab palette).
HARMFUL, HELPFUL = "tab:red", "tab:blue"


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the installation
        raise ImportError("plots need matplotlib: pip install 'gradtape-client[plot]'") from None
    return plt


def _axes(ax: Axes | None) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax  # type: ignore[return-value]
    fig, new = _pyplot().subplots(layout="constrained")
    return fig, new


def _status(converged: bool, stopped: str) -> str:
    """The title's note on how the estimate ended ('' when it is complete)."""
    return "" if converged else f" (not converged: stopped by {stopped})"


# ----------------------------------------------------------------------- estimators


def spectral_density(
    result: SpectralDensity, ax: Axes | None = None, *, band: bool = True, log: bool = False
) -> tuple[Figure, Axes]:
    """The smoothed density on its grid, and (band=True, with two or more probes) the band
    density +- 2 standard errors across probes; log=True draws the y axis logarithmic."""
    fig, ax = _axes(ax)
    ax.plot(result.grid, result.density, color="tab:blue", label="density")
    if band and result.stderr is not None:
        low = result.density - 2 * result.stderr
        if log:  # a log axis cannot show the band below zero
            low = np.maximum(low, np.min(result.density[result.density > 0], initial=1e-300))
        ax.fill_between(
            result.grid,
            low,
            result.density + 2 * result.stderr,
            color="tab:blue",
            alpha=0.25,
            linewidth=0,
            label="\u00b12 standard errors",
        )
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density")
    ax.set_title(
        f"Spectral density: {result.probes} probes, {result.steps} steps, "
        f"sigma {result.sigma:.3g}" + _status(result.converged, result.stopped)
    )
    ax.legend()
    return fig, ax


def eigenvalues(result: Eigenvalues, ax: Axes | None = None) -> tuple[Figure, Axes]:
    """The eigenvalues in the order the result holds them, each with its residual
    ||H y - theta y|| as an error bar (zero length once converged)."""
    fig, ax = _axes(ax)
    index = np.arange(1, len(result.eigenvalues) + 1)
    ax.errorbar(
        index,
        result.eigenvalues,
        yerr=result.residuals,
        fmt="o",
        color="tab:blue",
        capsize=3,
        label="eigenvalue \u00b1 residual",
    )
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_xticks(index)
    ax.set_xlabel("index")
    ax.set_ylabel("eigenvalue")
    ax.set_title(
        f"Eigenvalues ({result.method}, {result.hvps} HVPs)"
        + _status(result.converged, result.stopped)
    )
    ax.legend()
    return fig, ax


def diagonal(
    result: Diagonal, sources: list[str] | None = None, *, cmap: str = "viridis"
) -> tuple[Figure, list[Axes]]:
    """One heatmap per source of its diagonal entries in the source's own shape (a vector
    as one row, a scalar as one cell; more than two axes flattened to rows of the last);
    `sources` picks and orders them. An exact run stopped early (`diagonal` None) draws
    its `partial` entries as one row, the unknown rest blank."""
    plt = _pyplot()
    if result.diagonal is None:
        values = {"entries reached": np.asarray(result.partial, dtype=np.float64)}
    elif isinstance(result.diagonal, dict):
        values = {k: np.asarray(v, dtype=np.float64) for k, v in result.diagonal.items()}
    else:
        values = {"diagonal": np.asarray(result.diagonal, dtype=np.float64)}
    names = list(values) if sources is None else sources
    unknown = [n for n in names if n not in values]
    if unknown:
        raise KeyError(f"no source {unknown[0]!r} in the diagonal; it has {sorted(values)}")
    fig, axes = plt.subplots(len(names), 1, layout="constrained", squeeze=False)
    drawn = []
    for name, ax in zip(names, axes[:, 0], strict=True):
        grid = _as_grid(values[name])
        image = ax.imshow(grid, cmap=cmap, aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax)
        ax.set_title(name)
        drawn.append(ax)
    fig.suptitle(f"Hessian diagonal ({result.method})" + _status(result.converged, result.stopped))
    return fig, drawn


def _as_grid(values: np.ndarray) -> np.ndarray:
    if values.ndim == 0:
        return values.reshape(1, 1)
    if values.ndim == 1:
        return values.reshape(1, -1)
    return values.reshape(-1, values.shape[-1])


MAX_HEATMAP = 4096  # rows of a Hessian heatmap: beyond that the picture says nothing


def hessian(
    result: Hessian, ax: Axes | None = None, *, cmap: str = "RdBu_r"
) -> tuple[Figure, Axes]:
    """The dense Hessian over the flattened sources as a heatmap, coloured symmetrically
    about zero, with lines between the sources' blocks."""
    matrix = result.matrix()
    if matrix.shape[0] > MAX_HEATMAP:
        raise ValueError(
            f"a {matrix.shape[0]} x {matrix.shape[0]} Hessian is too large to draw "
            f"(at most {MAX_HEATMAP}); plot its diagonal or spectrum instead"
        )
    fig, ax = _axes(ax)
    limit = float(np.max(np.abs(matrix), initial=0.0)) or 1.0
    image = ax.imshow(matrix, cmap=cmap, vmin=-limit, vmax=limit, interpolation="nearest")
    fig.colorbar(image, ax=ax)
    edge = 0
    names = list(result.blocks)
    ticks = []
    for name in names:
        block = result.blocks[name][name]
        size = int(np.prod(block.shape[: block.ndim // 2]))
        ticks.append(edge + (size - 1) / 2)
        edge += size
        if edge < matrix.shape[0]:
            ax.axhline(edge - 0.5, color="k", linewidth=0.6)
            ax.axvline(edge - 0.5, color="k", linewidth=0.6)
    ax.set_xticks(ticks, names)
    ax.set_yticks(ticks, names)
    ax.set_title(f"Hessian ({matrix.shape[0]} parameters)")
    return fig, ax


def influence(
    result: Influence, ax: Axes | None = None, *, top_k: int | None = None
) -> tuple[Figure, Axes]:
    """Influence scores per training example as bars, harmful (positive) in red, helpful
    (negative) in blue; top_k: only the result's `harmful` and `helpful` examples (at most
    top_k of each), most harmful first, labelled by example index."""
    fig, ax = _axes(ax)
    scores = np.asarray(result.scores, dtype=np.float64)
    if top_k is None:
        index = np.arange(len(scores))
        ax.set_xlabel("training example")
    else:
        index = np.concatenate([result.harmful[:top_k], result.helpful[:top_k][::-1]])
        ax.set_xlabel("training example (most harmful to most helpful)")
    chosen = scores[index.astype(int)]
    colours = [HARMFUL if s > 0 else HELPFUL for s in chosen]
    positions = np.arange(len(index)) if top_k is not None else index
    ax.bar(positions, chosen, color=colours)
    if top_k is not None:
        ax.set_xticks(positions, [str(int(i)) for i in index])
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_ylabel("influence score (+ harmful, \u2212 helpful)")
    ax.set_title(
        f"Influence on the test loss {result.test_loss:.4g} ({result.curvature_used or result._curvature})"
        + _status(result.converged, result.stopped)
    )
    return fig, ax


def solve(result: Solve, ax: Axes | None = None) -> tuple[Figure, Axes]:
    """The CG solve's relative residual per iteration, on a log axis."""
    fig, ax = _axes(ax)
    ax.semilogy(np.arange(len(result.residuals)), result.residuals, marker=".")
    ax.set_xlabel("CG iteration")
    ax.set_ylabel("relative residual")
    ax.set_title(f"Solve ({result.rhs})" + _status(result.converged, result.stopped))
    return fig, ax


# ------------------------------------------------------------------------- progress


@dataclass
class ProgressLog:
    """A job's progress, kept as it is reported: pass it as `progress=` to an estimator
    (`tape.trace(..., progress=log)`), then `log.plot()` draws how the estimate moved as
    the work was spent. Each point is (done, estimate, error) from one poll; `then`, if
    given, is called with each status too (e.g. a jobs.TqdmReporter)."""

    then: Any = None
    points: list[tuple[int, Any, Any]] = field(default_factory=list)
    unit: str = "hvps"
    operation: str = ""

    def __call__(self, status: JobStatus) -> None:
        self.operation = status.operation or self.operation
        p = status.progress
        if p is not None and p.get("estimate") is not None:
            self.unit = p.get("unit") or self.unit
            point = (int(p["done"]), p["estimate"], p.get("error"))
            self._add(point)
        if status.state == "succeeded":
            # The workers report every so often, not at the end: the answer is the last point.
            final = _final_point(status.document.get("result") or {})
            if final is not None:
                self._add(final)
        if self.then is not None:
            self.then(status)

    def _add(self, point: tuple[int, Any, Any]) -> None:
        if self.points and self.points[-1][0] == point[0]:
            self.points[-1] = point  # the same work reported again: the newer wins
        else:
            self.points.append(point)

    def plot(self, ax: Axes | None = None) -> tuple[Figure, Axes]:
        """The estimate against the work done; a scalar estimate (a trace) with a band of
        +- 2 standard errors where known, a list (Ritz values) as one line each."""
        if not self.points:
            raise ValueError("no progress with an estimate was reported (the job ended first?)")
        fig, ax = _axes(ax)
        done = np.array([p[0] for p in self.points], dtype=np.float64)
        if isinstance(self.points[-1][1], list):
            width = max(len(p[1]) for p in self.points)
            table = np.full((len(done), width), np.nan)
            for row, (_, estimate, _) in enumerate(self.points):
                table[row, : len(estimate)] = [np.nan if e is None else e for e in estimate]
            for column in range(width):
                ax.plot(done, table[:, column], marker=".", label=f"estimate {column + 1}")
        else:
            estimate = np.array([p[1] for p in self.points], dtype=np.float64)
            error = np.array(
                [np.nan if p[2] is None else p[2] for p in self.points], dtype=np.float64
            )
            ax.plot(done, estimate, marker=".", color="tab:blue", label="estimate")
            known = ~np.isnan(error)
            if known.any():
                ax.fill_between(
                    done[known],
                    (estimate - 2 * error)[known],
                    (estimate + 2 * error)[known],
                    color="tab:blue",
                    alpha=0.25,
                    linewidth=0,
                    label="\u00b12 standard errors",
                )
        ax.set_xlabel(f"{self.unit} done")
        ax.set_ylabel("estimate")
        ax.set_title(f"Convergence: {self.operation}" if self.operation else "Convergence")
        ax.legend()
        return fig, ax


def _final_point(result: dict[str, Any]) -> tuple[int, Any, Any] | None:
    """(hvps, estimate, error) of a finished estimator's answer, as the progress reports
    give them: a trace and its standard error, or Ritz values and their residuals."""
    if "trace" in result:
        return (int(result["hvps"]), float(result["trace"]), result.get("stderr"))
    if "eigenvalues" in result:
        return (int(result["hvps"]), list(result["eigenvalues"]), list(result["residuals"]))
    return None


__all__ = [
    "ProgressLog",
    "diagonal",
    "eigenvalues",
    "hessian",
    "influence",
    "solve",
    "spectral_density",
]
