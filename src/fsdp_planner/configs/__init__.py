"""Readers of the training configs users already have (torchtitan, Accelerate): torch-free, checked before tracing."""
