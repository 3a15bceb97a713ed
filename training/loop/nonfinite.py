"""A NaN or infinite loss or gradient norm stops the run at that optimizer step, before the update.

``TrainStep`` checks each optimizer step once, with the one device->host copy it makes
anyway (the step's loss sum and gradient norm together: ``training/loop/step.py``), and raises
``NonFiniteStep``; the Trainer turns it into ``NonFiniteTrainingError``, naming the rank, the
epoch and the step, and what usually causes it.

Why every rank stops at the same step: the gradient norm is taken after DDP's all-reduce, and
a NaN or inf in one rank's gradients is NaN or inf in the all-reduced gradients of every rank,
so the norm check fires on all ranks together (they then gather which ranks had a non-finite
loss, so each names the same origin). A loss that is non-finite on one rank while its
gradients stay finite (an overflow of the sum alone) stops that rank only; the others then fail
at their next collective, and the launcher reports the first failure, this one. The checkpoints
of the epochs before stay on disk; no model.pt is written, so nothing is registered and
@champion does not move.
"""

from __future__ import annotations

import math

ADVICE = (
    "this usually means the learning rate is too high for this model (lower train.lr, add train.warmup_steps "
    "or train.grad_clip), or inputs or a target far from unit scale (a feature or target left unnormalised, a "
    "custom model that skips the normalisation), or a row with extreme values"
)


WHAT = "non-finite training values"  # in every message: how a launcher's error is recognised as this one


def is_non_finite_failure(message: str) -> bool:
    """A launch failed because training diverged: resuming from last.pt would diverge again at the same step
    (a resume is bit-exact), so the train task does not retry it."""
    return WHAT in message


class NonFiniteStep(FloatingPointError):
    """This rank's optimizer step over micro-batches ``steps`` has a NaN or inf loss sum or gradient norm."""

    def __init__(self, steps: range, loss: float, grad_norm: float):
        super().__init__(f"steps {steps.start}-{steps.stop - 1}: loss sum {loss}, gradient norm {grad_norm}")
        self.steps, self.loss, self.grad_norm = steps, loss, grad_norm

    @property
    def everywhere(self) -> bool:
        """The gradient norm is over all ranks' gradients: when it is non-finite, every rank raised here."""
        return not math.isfinite(self.grad_norm)


class NonFiniteTrainingError(RuntimeError):
    """Training diverged (NaN or inf) at a named rank, epoch and step."""


def non_finite_error(bad: NonFiniteStep, rank: int, epoch: int, loss_ranks: list[int] | None) -> NonFiniteTrainingError:
    """The error for ``bad`` on ``rank``; ``loss_ranks``: the ranks whose loss was non-finite, when known."""
    steps = bad.steps
    where = f"step {steps.start}" if len(steps) == 1 else f"steps {steps.start}-{steps.stop - 1}"
    if loss_ranks:
        origin = f"the loss was non-finite on rank(s) {loss_ranks}"
    elif loss_ranks is not None:
        origin = "every rank's loss was finite: the gradients overflowed"
    else:
        origin = f"the loss sum on this rank was {bad.loss}"
    return NonFiniteTrainingError(
        f"rank {rank}: {WHAT} at epoch {epoch} {where} (counted from 0; one optimizer step): "
        f"gradient norm {bad.grad_norm}, "
        f"{origin}; stopped before the update (the checkpoints of earlier epochs stay, nothing is registered): "
        f"{ADVICE}"
    )
