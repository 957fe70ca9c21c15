"""A HessianOperator seen as an n x n matrix on flat float64 vectors: the `matvec` and `n`
that every estimator of this package takes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine import backend, tree
from engine.tensor import Tensor
from engine.transforms import HessianOperator


class FlatOperator:
    """A HessianOperator seen as an n x n matrix on flat vectors.

    `matvec(V)` with V of shape (K, n) splits each row into the primals' shapes, casts
    to their dtype and device, runs one `hvp_many` pass (`hvp` for K = 1: the direct
    product's pass, with no batch axis) and returns H @ V as (K, n) on
    the host, in V's float dtype (float64 for anything else). Rows already in the
    primals' dtype (on the host) are not copied: each primal's block is a view of V.
    `linear_operator()` is the operator as SciPy's LinearOperator in the primals' dtype
    (eigsh, lobpcg, cg, ...): (n,) vectors in, one copy out per product. `flatten` and
    `unflatten` convert single vectors.
    """

    def __init__(self, operator: HessianOperator):
        self.operator = operator
        self.primals: list[Tensor] = tree.flatten(operator.primals)[0]
        self._treedef = tree.flatten(operator.primals)[1]
        self.shapes = [tuple(p.shape) for p in self.primals]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = np.cumsum([0, *self.sizes])
        self.n = int(self.offsets[-1])
        self._layout = list(
            zip(self.primals, self.shapes, self.offsets[:-1].tolist(), self.sizes, strict=True)
        )

    @property
    def max_batch(self) -> int | None:
        """The most vectors one pass of the operator takes (its memory bound), or None."""
        return self.operator.max_batch

    def matvec(self, vectors: np.ndarray) -> np.ndarray:
        """H @ V for V of shape (K, n), in one HVP pass."""
        vectors = np.asarray(vectors)
        if vectors.dtype.kind != "f":
            vectors = vectors.astype(np.float64)
        if vectors.ndim != 2 or vectors.shape[1] != self.n:
            raise ValueError(f"matvec: expected shape (K, {self.n}), got {vectors.shape}")
        k = vectors.shape[0]
        # One vector (what SciPy's solvers ask) goes through the operator's single
        # product, whose pass has no batch axis (its GEMMs are plain matrix products) and
        # is the one direct `hvp` calls replay.
        single = k == 1
        rows, lead = (vectors[0], ()) if single else (vectors, (k,))
        blocks = [
            self._block(rows[..., lo : lo + size].reshape(lead + shape), p)
            for p, shape, lo, size in self._layout
        ]
        vector = tree.unflatten(self._treedef, blocks)
        answer = self.operator.hvp(*vector) if single else self.operator.hvp_many(*vector)
        products = tree.flatten(answer)[0]
        if not products:
            return np.empty((k, 0), dtype=vectors.dtype)
        # one copy into the answer (and its cast, for float64 rows over float32 primals)
        return np.concatenate(
            [product.numpy().reshape(k, -1) for product in products], axis=1, dtype=vectors.dtype
        )

    @staticmethod
    def _block(block: np.ndarray, primal: Tensor) -> Tensor:
        """A primal's block of the rows, in its dtype and on its device: a view of the
        rows when they are host arrays of that dtype already."""
        return Tensor(backend.asarray(block, primal.dtype, primal.device))

    @property
    def dtype(self) -> np.dtype:
        """The primals' common dtype (float64 when they differ)."""
        dtypes = {np.dtype(p.dtype) for p in self.primals}
        return dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64)

    def linear_operator(self, dtype: Any = None) -> Any:
        """This operator as a scipy.sparse.linalg.LinearOperator (needs SciPy), in the
        primals' dtype by default: its vectors' blocks are views, not copies, and the
        products cross one copy into the answer (a float64 operator over float32
        primals pays a cast each way instead)."""
        from scipy.sparse.linalg import LinearOperator

        dtype = self.dtype if dtype is None else np.dtype(dtype)
        n = self.n

        def matvec(x: np.ndarray) -> np.ndarray:
            return self.matvec(np.asarray(x, dtype=dtype).reshape(1, n))[0]

        def matmat(x: np.ndarray) -> np.ndarray:
            return self.matvec(np.asarray(x, dtype=dtype).T).T

        return LinearOperator(
            (n, n), matvec=matvec, rmatvec=matvec, matmat=matmat, rmatmat=matmat, dtype=dtype
        )

    def flatten(self, tensors: Any) -> np.ndarray:
        """One vector in the primals' structure (tensors or arrays) -> (n,) float64."""
        leaves = tree.flatten(tensors)[0]
        if len(leaves) != len(self.primals):
            raise ValueError(f"flatten: {len(leaves)} leaves for {len(self.primals)} primals")
        return (
            np.concatenate(
                [np.asarray(backend.to_host(_raw(x)), np.float64).reshape(-1) for x in leaves]
            )
            if leaves
            else np.zeros(0)
        )

    def unflatten(self, x: np.ndarray) -> list[np.ndarray]:
        """(n,) -> one host array per primal, in the primal's shape and dtype."""
        x = np.asarray(x)
        return [
            x[lo : lo + size].reshape(shape).astype(p.dtype)
            for p, shape, lo, size in zip(
                self.primals, self.shapes, self.offsets[:-1], self.sizes, strict=True
            )
        ]

    def structured(self, x: np.ndarray) -> Any:
        """(n,) -> host arrays in the primals' own structure (as `operator.primals`): an
        eigenvector or a diagonal as tensors per parameter."""
        return tree.unflatten(self._treedef, self.unflatten(x))


def _raw(x: Any) -> Any:
    return x.value if isinstance(x, Tensor) else x
