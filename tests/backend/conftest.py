"""Fixtures shared by the backend tests (ffcache_env's CPU pools + FlexFlowRadixCache)."""

import pytest

from ffcache_env import make_env


@pytest.fixture
def envs():
    made = []

    def _make(**kw):
        env = make_env(**kw)
        made.append(env)
        return env

    yield _make
    for env in made:
        env.close()
