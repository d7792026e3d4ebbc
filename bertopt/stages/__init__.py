"""Stages: each module is one job, ``run(input, config, out_dir, overwrite=False) -> Artifact``."""
