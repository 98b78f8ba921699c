"""Validation of one rank: the held-out loss and greedy samples of the model being trained.

Both are collective (the model's forward is sharded): every rank calls them at the same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from rayllm.config import TrainConfig
from rayllm.data import tokenizer as tokenizers
from rayllm.data.order import rank_slice
from rayllm.loop.metrics import all_sum, plain
from rayllm.model.sampling import greedy_continuations
from rayllm.parallel.cp import sequence_parts
from rayllm.parallel.layout import Layout
from rayllm.parallel.pipeline import Pipeline
from rayllm.parallel.tp import loss_context

if TYPE_CHECKING:
    from rayllm.loop.session import Session


class Validator:
    """The validation loss over this rank's data-parallel slice of the validation batches, and
    greedy continuations of ``train.sample_prompts``.

    Of the session it reads the plans (the validation data, the tokenizer: the training data's)
    and the device. ``model`` gives the model at each use; the rows and the tokenizer are read
    on first use.
    """

    def __init__(
        self,
        config: TrainConfig,
        session: Session,
        model: Callable[[], torch.nn.Module],
        layout: Layout,
        data_rank: int,
        pipeline: Pipeline | None = None,
        cp_mesh: DeviceMesh | None = None,
    ):
        self.config, self.session, self.pipeline, self.cp_mesh = config, session, pipeline, cp_mesh
        self.val_spec, self.train_spec = session.val_spec, session.train_spec
        self.model, self.device, self.layout, self.data_rank = model, session.device, layout, data_rank
        self._rows: list[np.ndarray] | None = None
        self._tokenizer = None
        self._eos: int | None = None

    def _load_rows(self) -> list[np.ndarray]:
        return [rank_slice(rows, self.data_rank, self.layout.dp) for rows in self.session.validation_batches()]

    @torch.no_grad()
    def loss(self) -> float | None:
        """Collective (unless the run has no validation data, then None): the mean validation loss
        over all ranks' rows."""
        if self.val_spec is None:
            return None
        if self._rows is None:
            self._rows = self._load_rows()
        t, model = self.config.train, self.model()
        model.eval()
        total, count = 0.0, 0
        for rows in self._rows:
            batch = torch.from_numpy(np.ascontiguousarray(rows["tokens"])).to(self.device, dtype=torch.long)
            if self.pipeline is not None:  # every micro-batch through the stages, forward only
                total += self.pipeline.eval_loss(batch[:, :-1], batch[:, 1:]).item() * len(batch)
                count += len(batch)
                continue
            for rows_i in batch.split(t.micro_batch_size):
                parts = sequence_parts(self.cp_mesh, [model], rows_i[:, :-1], rows_i[:, 1:])
                with loss_context(model), parts as (tokens, targets):  # under CP: this rank's part's mean
                    total += plain(model(tokens, targets)).item() * len(rows_i)
                count += len(rows_i)
        model.train()
        total, count = all_sum([total, count], self.device)
        return total / count if count else None

    def samples(self) -> list[dict[str, str]]:
        """Collective: greedy continuations of train.sample_prompts, decoded (rank 0 reports them);
        none under TP or CP (decoding one position at a time cannot be split along the sequence) or
        a pipeline (its schedule runs whole batches of fixed shape)."""
        t = self.config.train
        if (
            t.sample_tokens <= 0
            or not t.sample_prompts
            or self.layout.tp * self.layout.cp > 1
            or self.pipeline is not None
        ):
            return []
        if self._tokenizer is None:
            source = self.train_spec.sources[0]
            self._tokenizer = tokenizers.load(source.tokenizer_json, "the run's tokenizer")
            self._eos = tokenizers.eos_id(self._tokenizer)
        prompts = [self._tokenizer.encode(p, add_special_tokens=False).ids for p in t.sample_prompts]
        model = self.model()
        outputs = greedy_continuations(model, prompts, t.sample_tokens, self.config.data.seq_len, self.device)
        results = []
        for prompt, ids in zip(t.sample_prompts, outputs, strict=True):
            if self._eos in ids:
                ids = ids[: ids.index(self._eos)]
            results.append({"prompt": prompt, "text": prompt + self._tokenizer.decode(ids)})
        return results
