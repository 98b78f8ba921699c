"""The run's own state in a checkpoint (rank 0's ``train_state.json``), typed.

The loop hands it over at a checkpoint and gets it back at a restore; ``rayllm generate``,
``eval`` and ``export`` read the model's shape and step from it. The JSON keeps the names
it always had, so checkpoints written before this type load too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rayllm.data.fingerprint import DataFingerprint
from rayllm.data.order import DataState
from rayllm.errors import CheckpointError
from rayllm.io.redact import display_uri
from rayllm.model.shape import ModelArgs


@dataclass
class TrainState:
    """Everything but the tensors: where training and its data stream stand."""

    step: int
    consumed: int  # sequences of the global stream trained on
    data: DataState = field(default_factory=DataState)  # where the stream restarts
    source_counts: list[int] = field(default_factory=list)  # sequences per source, all ranks, all attempts
    metrics: dict[str, Any] = field(default_factory=dict)  # the latest logged metrics
    restarts: int = 0
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)  # the Layout it was saved at (for the record)
    model: ModelArgs | None = None  # the shape: the checkpoint alone can be loaded (generate, export)
    # What the data position means something for (data/fingerprint.py): a resume compares it with
    # the data it is given. None in checkpoints written before rayllm recorded it.
    data_fingerprint: DataFingerprint | None = None
    # Sequences trained on before the current data order began (data.on_change: restart); the
    # stream's own position is ``consumed - data_origin``.
    data_origin: int = 0
    # In memory: the step of a stored checkpoint still being written, whose ids this one holds too.
    ids_uncommitted_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = self.data.to_dict()
        if self.ids_uncommitted_step is None:
            del out["ids_uncommitted_step"]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], uri: str = "") -> TrainState:
        if "step" not in raw or "consumed" not in raw:
            raise CheckpointError(
                f"checkpoint {display_uri(uri)} has a train state without step or consumed: not rayllm's"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["data"] = DataState.from_dict(raw.get("data"))
        values["source_counts"] = list(raw.get("source_counts") or [])
        values["data_fingerprint"] = DataFingerprint.from_json(raw.get("data_fingerprint"))
        if raw.get("model"):
            shape = {f.name for f in dataclasses.fields(ModelArgs)}
            values["model"] = ModelArgs(**{k: v for k, v in raw["model"].items() if k in shape})
        return cls(**values)

    def model_args(self, uri: str) -> ModelArgs:
        """The model's shape, or the error naming why a checkpoint cannot be loaded on its own."""
        if self.model is None:
            raise CheckpointError(
                f"checkpoint {display_uri(uri)} does not say its model's shape (it predates rayllm 0.1's model record in "
                "train_state.json); resume the run for one step to write a new checkpoint"
            )
        return self.model
