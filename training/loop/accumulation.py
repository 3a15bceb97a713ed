"""Which micro-batches form an optimizer step (``train.grad_accum``): the one rule the loop, the step and the
step checkpoints read.

An epoch of ``micro_batches`` micro-batches (this rank's batches of ``TrainBatches``) is cut into optimizer
steps of ``grad_accum`` micro-batches each, ``[k * grad_accum, (k + 1) * grad_accum)``, the last one short
when ``grad_accum`` does not divide the epoch. ``steps_optimizer(i)`` says whether micro-batch i ends its
optimizer step: ``TrainStep`` all-reduces and updates there, and only there ``Trainer.run_epoch`` does what
happens between optimizer steps (a step checkpoint when training/checkpoint/steps.py's ``StepSchedule`` says
so). The learning-rate schedule and the step curves count ``steps_per_epoch``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSteps:
    grad_accum: int
    micro_batches: int  # in one epoch, this rank's

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.micro_batches // self.grad_accum)

    def group(self, index: int) -> range:
        """The micro-batches ``[first, stop)`` of micro-batch ``index``'s optimizer step."""
        first = (index // self.grad_accum) * self.grad_accum
        return range(first, min(first + self.grad_accum, self.micro_batches))

    def steps_optimizer(self, index: int) -> bool:
        """Whether micro-batch ``index`` is the last of its optimizer step: the one that all-reduces and updates."""
        return index == self.group(index)[-1]

    def step_of(self, index: int) -> int:
        """The optimizer step (0-based, in its epoch) micro-batch ``index`` belongs to."""
        return index // self.grad_accum
