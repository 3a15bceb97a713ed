"""Data drift, the numbers: how far a dataset's train split moved from another's, per feature, from the two
manifests alone (plain Python and numpy: no MLflow, no Prefect, no torch).

    psi.py      the arithmetic every kind shares: PSI over counts, histograms and categories; FeatureDrift
    kinds.py    the categorical, vector and image inputs' drift
    text.py     a text input's drift (token lengths, word frequencies, unknown tokens)
    report.py   ``compare(reference, current) -> DriftReport``: the numeric features, each input by its kind
                (``DRIFT_MEASURES``, by each kind's ``Codec.drift_measure``), and the label

Imports run up this list. Not to be confused with ddpflow/tracking/drift.py, the MLflow side: it finds the
champion's dataset, calls ``report.compare`` and logs the report to the run.
"""
