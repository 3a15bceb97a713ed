"""The process side of a rank: process groups, DDP and its gradient all-reduce hook (the stop flags carried on it,
opt-in polling), collectives (``context.py``); threads, cores and decode workers (``process.py``). The only folder
that knows about ``torch.distributed``. Imports only ``training.core``."""
