"""two_copies: the engine and the trainer each hold their own copy of the base (the trainer's in
FP8, quantized from the checkpoint), both resident; nothing happens around the phases."""
from __future__ import annotations

from .base import Placement


class TwoCopies(Placement):
    name = "two_copies"
    weight_source = "quantize"
