"""Single-device models: the built-in tabular MLP and its blocks (``tabular.py``), the built-in image and text
models beside it (``image.py``, ``text.py``), and the registry that picks and builds a model, built-in or a
user's factory (``registry.py``). Imports ``training.core`` and ``training.kinds``.
"""
