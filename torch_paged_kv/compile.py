"""torch.compile helpers: one compiled step for every batch size."""

from __future__ import annotations

import torch

from .collection import StepTensors


def mark_step_dynamic(step: StepTensors, *row_tensors: torch.Tensor) -> None:
    """Mark dim 0 of the step tensors and of `row_tensors` (tokens, q, k, v: one row per new token)
    as unbacked, before calling a compiled step.

    Dynamo specialises a backed size of 0 or 1, so a step first compiled at batch 1 would compile
    again at batch 2; unbacked sizes are never specialised, and the ops' shape checks become
    runtime asserts. Cheap enough to call every step.
    """
    for t in (*step, *row_tensors):
        torch._dynamo.decorators.mark_unbacked(t, 0)
