"""Checkpoints: ``load_model`` (reference or Hugging Face naming, FP8/FP4 dequantized at load)
and ``save_random_checkpoint`` (seeded random weights, for tests with no downloads). The pieces
live in ``dsv4.weights``."""

from .weights.loader import CheckpointError, load_model
from .weights.saver import save_random_checkpoint

__all__ = ["CheckpointError", "load_model", "save_random_checkpoint"]
