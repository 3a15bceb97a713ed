"""Offline preparation, run once per dataset: resolve a source, check its columns, split by hash, fit the
encoders on train, write Parquet shards and publish them with their manifest (``dataset.py: prepare_dataset``).
The training ranks never import it (``training.train``'s imports do not reach it); a scoring rank reads its
source through ``sources.py`` and ``image_folder.py``. Imports ``training.core`` and ``training.kinds``.
"""
