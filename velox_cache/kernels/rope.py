"""Re-rotating cached keys to new positions: RoPE rotations compose.

A key rotated at position ``p`` and then rotated by ``d`` equals the key rotated
at ``p + d`` (``d`` may be negative), because RoPE turns each pair of feature
dimensions by an angle linear in the position. Streaming compression uses it
to move kept keys to contiguous positions, so that a document longer than the
model's context can be read.

``RotaryShift.from_module`` reads the rotation from the model's own RoPE
module: mlx's ``nn.RoPE`` and mlx-lm's frequency-table variants (Llama 3,
YaRN, Su-scaled, proportional). Only the rotation is re-applied, never an input
scaling some variants fold in (YaRN's ``mscale``). A RoPE whose frequencies
depend on the sequence length (dynamic NTK) does not compose and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn


class RopeError(ValueError):
    """The model's positional encoding cannot be re-rotated."""


@dataclass(frozen=True)
class RotaryShift:
    """The rotation part of one RoPE: ``dims`` rotated features, ``base`` or ``freqs``."""

    dims: int
    traditional: bool
    base: Optional[float] = 10000.0
    scale: float = 1.0
    freqs: Optional[mx.array] = None

    @classmethod
    def from_module(cls, rope) -> "RotaryShift":
        """The rotation of an mlx / mlx-lm RoPE module (raises ``RopeError`` when it does not compose)."""
        name = type(rope).__name__
        if name == "DynamicNTKScalingRoPE":
            raise RopeError(f"{name}: its frequencies change with the sequence length, so rotations do not compose")
        if isinstance(rope, nn.RoPE):
            return cls(rope.dims, rope.traditional, base=rope.base, scale=rope.scale)
        freqs = getattr(rope, "_freqs", None)
        dims = getattr(rope, "dims", getattr(rope, "dim", None))
        if freqs is None or dims is None:
            raise RopeError(f"{name}: not a RoPE module Velox knows how to re-rotate")
        return cls(dims, getattr(rope, "traditional", False), base=None, scale=1.0, freqs=freqs)

    @classmethod
    def from_model(cls, model) -> "RotaryShift":
        """The rotation of the first RoPE module found in ``model`` (raises ``RopeError`` if none)."""
        for _, module in model.named_modules():
            if isinstance(module, nn.RoPE) or type(module).__name__.endswith("RoPE"):
                return cls.from_module(module)
        raise RopeError(f"{type(model).__name__}: no RoPE module found; positions cannot be re-rotated")

    def shift(self, keys: mx.array, delta: mx.array) -> mx.array:
        """``keys`` ``[B, H, T, D]`` rotated by ``delta`` ``[B, H, T]`` positions each (any sign)."""
        batch, heads, tokens, dim = keys.shape
        one_per_row = keys.reshape(batch * heads * tokens, 1, 1, dim)  # every token its own "sequence"
        rotated = mx.fast.rope(
            one_per_row,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=delta.reshape(-1).astype(mx.int32),
            freqs=self.freqs,
        )
        return rotated.reshape(batch, heads, tokens, dim)
