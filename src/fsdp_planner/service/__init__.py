"""The planning service: one use case, "plan this job", for every front end. The command line, ``fsdp_planner.plan``,
``fit`` and the job-config readers each build a ``PlanJob`` (``job.py``) through the one validator
(``validate.py``) and run it (``planning.py``), which returns a ``PlanOutcome`` (``outcome.py``) they format."""
