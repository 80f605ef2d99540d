"""Training-job configs read into the settings the planner has (torch-free, checked before anything is traced):
``job_config.py`` reads a torchtitan job TOML or an Accelerate FSDP YAML into a ``JobConfig``. A reader of another
source of the same job (torchtitan's Python config registry) produces the dict a TOML parse gives and hands it to
``job_config.from_data``."""
