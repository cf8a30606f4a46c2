"""Shared tiny decoder and engine for the rollout tests (compiled once per session)."""

import jax
import pytest
from rollout_helpers import ENGINE_KW, make_model

from agentrl_jax.rollout.jetstream import DensePrefixEngine
from agentrl_jax.sharding import make_mesh


@pytest.fixture(scope="session")
def tiny_model():
    return make_model(0)


@pytest.fixture(scope="session")
def engine(tiny_model):
    """Single-device engine: 4 slots of 64 entries (with JetStream's dense-prefix calls, which the engine tests use)."""
    return DensePrefixEngine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **ENGINE_KW)


@pytest.fixture(scope="session")
def params(engine, tiny_model):
    return engine.load_params(tiny_model)
