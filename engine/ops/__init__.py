"""The op families. Importing this package registers every primitive and public op."""

from engine.ops import conv, creation, elementwise, linalg, nn, operators, reduce, shape

__all__ = ["conv", "creation", "elementwise", "linalg", "nn", "operators", "reduce", "shape"]
