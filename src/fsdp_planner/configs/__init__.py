"""Training-job configs read into the settings the planner has (torch-free, checked before anything is traced):
``job_config.py`` reads a torchtitan job TOML or an Accelerate FSDP YAML into a ``JobConfig``;
``torchtitan_registry.py`` reads torchtitan's Python ``config_registry`` jobs (statically, never run) into the dict
a TOML parse gives."""
