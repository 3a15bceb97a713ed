"""The process side of a rank: process groups and DDP (``context.py``), threads, cores and decode workers
(``process.py``), and DDP's gradient all-reduce hook, the stop flags carried on it and opt-in polling
(``gradient_allreduce.py``). The only folder that knows about ``torch.distributed``. Imports only ``training.core``.
"""
