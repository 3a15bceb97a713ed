"""ddpflow's API for a user's own training script (``train.script``, docs/scripts.md), imported by its ranks.

    import ddpflow
    ddpflow.report({"test_accuracy": 0.91}, step=epoch)   # metrics into the run's MLflow run (rank 0's)
    ddpflow.log_model(model, input_example=x)             # the model to register behind the champion gate
    if ddpflow.should_stop(): save(); return              # collective: a preemption, a pruned trial, a cancel
    ddpflow.checkpoint_dir()                              # survives restarts and the re-run of a stopped run
    ddpflow.dataset("train")                              # the prepared split, with a data section
    ddpflow.params()                                      # train.script_params

``run.py`` finds the run (``$DDPFLOW_JOB``); each other module holds one call. Under a bare torchrun (no ddpflow
run) the same script runs unchanged: ``report`` and ``log_model`` record nothing and say so once on rank 0.
No module here imports Prefect or MLflow; torch only where the call needs it.
"""
