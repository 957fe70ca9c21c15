"""Seeded random tensors: gt.random.normal and gt.random.uniform."""

from engine.ops.creation import random_normal as normal
from engine.ops.creation import random_uniform as uniform

__all__ = ["normal", "uniform"]
