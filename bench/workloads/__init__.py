"""What the benchmarks train and measure on, built at most once per run: ``tabular`` (the default synthetic
table, the mixed one, the workload's MLP and step), ``images`` (drawn PNGs/JPEGs), ``pipeline`` (a whole run's
config on small data), ``loaders`` (the plain PyTorch ways of feeding a step, the references)."""
