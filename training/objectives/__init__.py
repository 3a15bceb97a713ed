"""Objectives: the one loss contract (``base.py``), the built-in objectives beside it (``builtin.py``,
``next_token.py``), the registry that builds them (``registry.py``), and the exact metric tallies
(``metrics.py``). Imports ``training.core`` and ``training.kinds`` (the next-token objective takes the text
kind's token ids).
"""
