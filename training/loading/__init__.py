"""Loading in the rank: shards -> tensors in the node cache (one mapped copy per node, ``node_cache.py``),
where they live (``placement.py``) and one rank's exact batches (``batches.py``). Imports ``training.core``,
``training.kinds`` and ``training.distributed``.
"""
