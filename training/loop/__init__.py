"""The training loop's parts: an epoch's pass over its micro-batches, one step of the exact update, what is due
between two optimizer steps and the exact validation pass (``step.py``); what the pass counts and records (which
micro-batches form an optimizer step, the epoch's running sums, progress lines, the step curves:
``counting.py``); the optimizer and its schedule, model selection, the coverage certificate, the non-finite
error, metrics.jsonl, the test hooks, the stop signal's flag and record (``preemption.py``) and the stop a
sweep's pruner asks for (``stop_request.py``). The Trainer (``training/train.py``) builds them and runs the
epochs.
"""
