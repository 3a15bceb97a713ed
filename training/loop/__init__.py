"""The training loop's parts: one step of the exact update and the exact validation pass (``step.py``), which
micro-batches form an optimizer step (``accumulation.py``), an epoch's running sums (``epoch_sums.py``), the
optimizer and its schedule, model selection, the coverage certificate, the non-finite error, progress lines,
metrics.jsonl, the test hooks and the stop a sweep's pruner asks for (``stop_request.py``). The Trainer
(``training/train.py``) puts them together.
"""
