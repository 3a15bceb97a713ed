"""The process side of a rank: process groups and DDP (``context.py``), threads, cores and decode workers
(``process.py``), and the CPU all-reduce polling hook (``allreduce_poll.py``). The only folder that knows
about ``torch.distributed``. Imports only ``training.core``.
"""
