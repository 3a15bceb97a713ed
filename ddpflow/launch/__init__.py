"""How the ranks of a training run are started, watched and stopped (plain Python, no Prefect)."""
