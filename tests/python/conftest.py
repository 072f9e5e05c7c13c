"""Starts a real `dspark-engine serve` process on a free loopback port for the client tests."""

import subprocess

import pytest

from engine_proc import start_engine


@pytest.fixture(scope="session")
def engine_url():
    proc, url, _ = start_engine()
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
