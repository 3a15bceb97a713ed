"""ddpflow's benchmarks (``python -m bench``): they measure the speed and memory targets docs/benchmarks.md proves.

Not installed with the package. The layers, each importing only those above it in this list:

    ddpflow_api.py   the one door to the product: only it imports ddpflow, training, tasks or flows
    harness/         the run's context, results and their statistics, docs/benchmarks.md, child processes
    workloads/       the data and models measured on: the tabular table, images, the small pipeline, loaders
    ranks/           programs started in child processes (under torchrun): a DDP rank, memory probes
    families/        one module per ``--only`` name (bench/__main__.py: FAMILIES), each ``run(ctx)``;
                     families never import one another
"""
