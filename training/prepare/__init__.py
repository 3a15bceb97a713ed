"""Offline preparation, run once per dataset: resolve a source, check its columns, split by hash, fit the
encoders on train, write Parquet shards and publish them with their manifest (``dataset.py: prepare_dataset``).
Never imported by a rank. Imports ``training.core`` and ``training.kinds``.
"""
