"""The one exception type the CLI turns into a single clear line and a non-zero exit."""


class PlannerError(Exception):
    """A user-facing error: bad model spec, bad plan file, infeasible budget, mismatched world size..."""
