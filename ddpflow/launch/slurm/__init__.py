"""The Slurm launcher (``train.launcher: slurm``; docs/slurm.md): the train stage's contract through ``sbatch``.

    commands.py   the Slurm commands: preflight, ``sbatch``, ``scontrol show job``, ``scancel``
    script.py     the batch script and the sbatch argv, and where the job's files go
    output.py     the job's lines, labelled by node and rank, and how it ended
    launcher.py   ``run_training_on_slurm(request)``: submit or reattach, follow the job, end it on every way out

Imports run up this list; what it shares with the local launcher (the stage contract, process trees,
signal forwarding, failure analysis) is in ddpflow/launch/.
"""
