"""The training loop's parts: an epoch's pass over its micro-batches, one step of the exact update, what is due
between two optimizer steps and the exact validation pass (``step.py``); what the pass counts and records (which
micro-batches form an optimizer step, the epoch's running sums and coverage certificate, progress lines, the step
curves and metrics.jsonl: ``counting.py``); what is decided at an epoch's end (which epoch model.pt holds, early
stopping, the stop a sweep's pruner asks for: ``selection.py``); the optimizer and its schedule, the non-finite
error, the test hooks and the stop signal's flag and record (``preemption.py``). The Trainer
(``training/train.py``) builds them and runs the epochs.
"""
