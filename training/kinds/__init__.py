"""Input kinds: how a raw column of each kind (numeric, categorical, hashed, vector, image, text) is checked,
fitted, stored and turned into batch tensors.

The contract is ``Codec`` (``base.py``), the built-in kinds sit beside it (``tabular.py``, ``image.py``,
``text.py``) and the registry that names them (``registry.py``) sits above them. Also here: what a model is told
about its inputs (``inputs.py``), ragged storage (``ragged.py``), train statistics (``stats.py``), value hashing
(``hashing.py``) and the one normalisation (``normalisation.py``). Imports only ``training.core``.
"""
