"""A neural reference beside boosting: RealMLP with its published defaults (pytabkit's ``RealMLP_TD_*``, "Better
by Default", Holzmüller et al., NeurIPS 2024), fitted in this process on ddpflow's own train split, its
best epoch chosen on ddpflow's own val split (what ddpflow's early stopping sees), scored on its test split.

Numeric columns go in as floats with a train-mean imputation and a 0/1 missing column for an input whose train
split held nulls (RealMLP takes no NaN), categoricals as pandas categoricals (``cat_col_names``: RealMLP
one-hot encodes the small ones and embeds the rest). ``random_state`` is the run's seed; one torch thread.
``pytabkit`` is in the ``bench`` extra; without it ``available()`` is False and the figure is left out.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.harness.results import Timer
from bench.workloads.beside_boosting import BINARY, REGRESSION, Table, numeric_values, score, split_frames

NAME = "RealMLP-TD"


def available() -> bool:
    return importlib.util.find_spec("pytabkit") is not None


def features(frame, inputs: dict[str, str], categories: dict[str, list], means: dict[str, float]):
    """RealMLP's input frame: floats (a date as ``numeric_values`` gives it; nulls
    as the train mean, with a missing column where ``means`` says the
    train split held nulls) and pandas categoricals of the train split's categories."""
    import numpy as np
    import pandas as pd

    columns = {}
    for name, kind in inputs.items():
        if kind == "categorical":
            columns[name] = pd.Categorical(frame[name].astype(object), categories=categories[name])
            continue
        values = numeric_values(frame[name], kind)
        if name in means:
            columns[f"{name}.missing"] = values.isna().astype(np.float64)
            values = values.fillna(means[name])
        columns[name] = values
    return pd.DataFrame(columns, index=frame.index)


def run_realmlp(spec: Table, dataset: Path, inputs: dict[str, str], seed: int) -> dict:
    """RealMLP-TD (defaults) on ddpflow's train split, validated on its val split, scored on its test split."""
    import torch
    from pytabkit import RealMLP_TD_Classifier, RealMLP_TD_Regressor

    frames = split_frames(dataset, inputs, ("train", "val", "test"))
    train, categories = frames["train"], frames["categories"]
    means = {
        name: float(numeric_values(train[name], kind).mean())
        for name, kind in inputs.items()
        if kind != "categorical" and train[name].isna().any()
    }
    x = {split: features(frames[split], inputs, categories, means) for split in ("train", "val", "test")}
    y = {split: frames[split][spec.label].to_numpy() for split in ("train", "val", "test")}
    model_class = RealMLP_TD_Regressor if spec.task == REGRESSION else RealMLP_TD_Classifier
    model = model_class(random_state=seed, n_threads=1, device="cpu", verbosity=0)
    threads = torch.get_num_threads()
    try:
        with Timer() as fit:
            model.fit(
                x["train"],
                y["train"],
                X_val=x["val"],
                y_val=y["val"],
                cat_col_names=[name for name, kind in inputs.items() if kind == "categorical"],
            )
    finally:
        torch.set_num_threads(threads)
    if spec.task == BINARY:
        predicted = model.predict_proba(x["test"])[:, list(model.classes_).index(1)]
    else:
        predicted = model.predict(x["test"])
    return {"metric": score(spec.task, y["test"], predicted), "seconds": fit.seconds}
