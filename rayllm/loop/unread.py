"""Each step's loss and gradient norm, left on the device until a log line, a checkpoint or the
end needs them: read every step, they would make the host wait for the GPU once a step, and
the GPU would idle while the host prepares the next step. Read together, one wait per log line."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rayllm.errors import RayllmError


@dataclass(frozen=True)
class StepValues:
    """One step's numbers, read."""

    step: int
    loss: float
    grad_norm: float

    @property
    def finite(self) -> bool:
        """Whether the step was trained (a NaN or inf loss or norm: skipped on the device)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class UnreadSteps:
    """The steps not yet read, in order."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._values: list[torch.Tensor] = []

    def add(self, step: int, values: torch.Tensor) -> None:
        """``values``: (2,) on the device: the step's loss and gradient norm."""
        self._steps.append(step)
        self._values.append(values)

    def read(self) -> list[StepValues]:
        """Every unread step, oldest first (one device-to-host copy), and forget them."""
        if not self._values:
            return []
        rows = torch.stack(self._values).tolist()  # (steps, 2)
        read = [StepValues(step, loss, norm) for step, (loss, norm) in zip(self._steps, rows, strict=True)]
        self._steps, self._values = [], []
        return read

    def __len__(self) -> int:
        return len(self._steps)


def diverged(in_row: int, step: int, latest: str | None) -> RayllmError:
    """The error that ends a run at train.max_nonfinite_steps non-finite steps in a row."""
    where = f" ({latest})" if latest else ""
    return RayllmError(
        f"the loss or gradient norm was NaN or infinite at {in_row} steps in a row, up to step {step} "
        f"(train.max_nonfinite_steps); those steps were skipped and the run stopped. The latest checkpoint{where} "
        "is the last finite one: lower train.lr, raise train.warmup_steps, or check the data at these steps"
    )
