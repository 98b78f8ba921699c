"""A rank's share of a pipeline: its stages of the plain Llama, each laid out like a whole model
(TP, activation checkpointing, compile, FSDP on the stage's ranks), and torch's schedule over them.

torch.distributed.pipelining does the sending, the micro-batching and the schedules; rayllm adds
the split (rayllm.parallel.pp), the stage modules under the plain model's names (so optimizer
state and checkpoints are keyed as without a pipeline, and reshard across layouts), and the
step's numbers every rank needs: the loss from the last stage, the gradient norm over all stages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class
from torch.distributed.tensor import DTensor

from rayllm.model import Llama, ModelArgs
from rayllm.parallel.cp import sequence_parts
from rayllm.parallel.pp import ONE_STAGE, PipelinePlan, keep_stage, split_stages
from rayllm.parallel.tp import loss_context


class RankModel(nn.Module):
    """The stages one rank holds, as one module under the plain model's names: what the optimizer
    steps and the checkpoints save (a stage's parts are shared, not copied). It has no forward of
    its own: the schedule runs the stages."""

    def __init__(self, parts: list[nn.Module], args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict({key: block for part in parts for key, block in part.layers.items()})
        self.norm = next((p.norm for p in parts if p.norm is not None), None)
        self.output = next((p.output for p in parts if p.output is not None), None)

    def forward(self, *_args, **_kwargs):
        raise RuntimeError("a pipeline's stages run through its schedule (Pipeline.train_step), not the rank's model")


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    plan: PipelinePlan
    schedule: _PipelineSchedule
    model: RankModel
    first: bool  # holds stage 0: it is fed the tokens
    last: bool  # holds the last stage: it is fed the targets and computes the loss
    group: dist.ProcessGroup  # one rank per stage: the loss and the gradient norm are summed over it
    stages: list[nn.Module]  # this rank's stage models, in schedule order (their rotary tables)
    cp: DeviceMesh | None  # parallel.cp: the ranks that split every sequence with this one

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of this rank's rows, (B, T) each; the gradients
        are the mean over micro-batches (scale_grads). Returns the mean loss on every rank, 0-dim."""
        return self._run(tokens, targets, train=True)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's rows, forward only, on every rank of the pipeline."""
        return self._run(tokens, targets, train=False)

    def _run(self, tokens: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        parts = sequence_parts(self.cp, self.stages, tokens, targets)  # under CP: (B, T / cp) each
        with loss_context(self.model), parts as (tokens, targets):  # TP: loss_parallel over the vocabulary
            inputs = (tokens,) if self.first else ()
            target = targets if self.last else None
            if train:
                self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.eval(*inputs, target=target, losses=losses)
        if self.last:
            mean = torch.stack([_whole(loss.detach()) for loss in losses]).float().mean()
        else:
            mean = torch.zeros((), device=tokens.device)
        dist.all_reduce(mean, group=self.group)  # only the last stage's rank adds a loss
        return mean


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_pipeline(
    args: ModelArgs,
    plan: PipelinePlan,
    mesh: DeviceMesh,
    device: torch.device,
    parallelize,
    cp: DeviceMesh | None = None,
) -> Pipeline:
    """Collective: this rank's stages, each built on ``meta`` as a reduced plain Llama, then laid out
    and materialised by ``parallelize(stage_model)`` (rayllm.parallel.apply's, on ``mesh``); under
    context parallelism (``cp``) every step runs with the sequences split over its ranks."""
    pp_mesh = mesh["pp"]
    parts = split_stages(args, plan.n_stages, args.max_seq_len)
    indices = plan.stages_of(pp_mesh.get_local_rank())
    modules, stages = [], []
    for index in indices:
        with torch.device("meta"):
            module = keep_stage(Llama(args), parts[index])
        module = parallelize(module)
        modules.append(module)
        stages.append(PipelineStage(module, index, plan.n_stages, device, group=pp_mesh.get_group()))
    last_module = modules[indices.index(plan.n_stages - 1)] if plan.n_stages - 1 in indices else modules[-1]
    schedule_class = get_schedule_class(plan.schedule)
    schedule = schedule_class(
        stages[0] if plan.schedule in ONE_STAGE else stages,
        n_microbatches=plan.microbatches,
        loss_fn=last_module.loss_fn,  # each micro-batch's mean cross-entropy (compiled with the blocks)
        scale_grads=True,  # the stage's gradients divided by the micro-batches: the mean, as without a pipeline
    )
    return Pipeline(
        plan=plan,
        schedule=schedule,
        model=RankModel(modules, args),
        first=0 in indices,
        last=plan.n_stages - 1 in indices,
        group=pp_mesh.get_group(),
        stages=modules,
        cp=cp,
    )


def clip_gradients(
    parameters: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The gradient norm over the whole model, and the gradients clipped to ``max_norm`` by it.

    ``group``: the pipeline's, whose ranks each hold some stages: the local norm is squared and
    summed over it (torchtitan's way). Without one this is ``clip_grad_norm_``. DTensor gradients
    (FSDP, TP) give their whole norm (``full_tensor``).
    """
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
    norm = _whole(norm)
    if group is not None:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
