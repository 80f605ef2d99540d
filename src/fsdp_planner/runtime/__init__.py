"""Step 5 of the pipeline: running for real, timing ops on this machine and verifying plans on torchrun jobs."""
