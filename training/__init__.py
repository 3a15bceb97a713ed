"""What every rank runs under torchrun, and the rules the layers above (ddpflow, tasks, flows) share.

Folders by layer, lowest first; a folder imports its own layer and the ones below, never one above
(``tests/house/test_import_direction.py: TRAINING_LAYERS``; the picture: docs/architecture.md):

    core/                                the config, the manifest, the run directory's names, small utilities
    kinds/, objectives/, distributed/    input kinds and objectives (contract < built-ins < registry), processes
    models/, loading/, prepare/          single-device models; the rank's batches; offline preparation
    loop/, checkpoint/, inference/       the training loop's parts; last.pt and step checkpoints; using a model
    train.py, preflight.py               the rank program (``python -m training.train``); the config checks
"""
