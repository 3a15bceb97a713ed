"""Using a trained model: exact streamed evaluation of a split (``evaluate.py``; a language model's token
scoring in ``token_scoring.py``), raw columns -> predictions (``predict.py``), the misclassified rows
(``wrong_rows.py``) and the MLflow pyfunc model (``serving.py``, with the file MLflow executes,
``serving_model.py``).
"""
