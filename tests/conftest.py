"""Shared fixtures: traces of the built-in models are cached per test session (tracing is cheap but not free)."""

from __future__ import annotations

import functools

import pytest

from fsdp_planner.models import load_model
from fsdp_planner.trace import Trace, record


@functools.cache
def traced(spec: str) -> Trace:
    lm = load_model(spec, meta=True)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


@pytest.fixture
def seed_trace() -> Trace:
    return traced("seed-net")


def policy(name: str, **settings: object):
    """A policy by name, as the CLI's --policy makes it."""
    from fsdp_planner.planners import PolicyRequest, make_policy

    return make_policy(PolicyRequest.named(name, **settings))
