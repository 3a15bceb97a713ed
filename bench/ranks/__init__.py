"""Programs the families start in child processes (``python -m bench.ranks.NAME``, often under torchrun):
``ddp`` (one rank of a DDP throughput measurement), ``memory_probe`` (memory of one job in a fresh process).
They report to the parent through files or ``BENCH {json}`` lines (bench/harness/processes.py)."""
