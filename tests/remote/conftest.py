"""Fixtures that start real ``redis-server`` processes on loopback ports (skipped, naming what is missing,
when Redis is not installed); each is stopped by its pid."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tiers"))
sys.path.insert(0, str(HERE.parent / "connector"))

from benchmarks.redis_servers import (  # noqa: E402
    REDIS,
    VALKEY,
    RedisClusterProcs,
    RedisServer,
    ServerBinaries,
    make_tls_files,
    redis_missing,
    start_cluster,
    start_server,
)


def _need_redis(binaries: ServerBinaries = REDIS) -> None:
    why = redis_missing(binaries)
    if why is not None:
        pytest.skip(f"remote-tier tests need {binaries.server}: {why}")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone server for the module (no maxmemory, notifications on); flushed by the tests that need it."""
    _need_redis()
    server = start_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A six-node cluster (three primaries, one replica each, cluster-node-timeout 500 ms) for the module."""
    _need_redis()
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"), node_timeout_ms=500)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """As :func:`redis_server`, on ``valkey-server`` (the same arguments and protocol)."""
    _need_redis(VALKEY)
    server = start_server(tmp_path_factory.mktemp("valkey"), binaries=VALKEY)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """As :func:`redis_cluster`, of ``valkey-server`` nodes made a cluster by ``valkey-cli --cluster create``."""
    _need_redis(VALKEY)
    cluster = start_cluster(tmp_path_factory.mktemp("valkey-cluster"), node_timeout_ms=500, binaries=VALKEY)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A six-node cluster speaking TLS only (clients, bus, replication), its certificates from a throwaway CA."""
    _need_redis()
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH: cannot make a test certificate")
    certs = make_tls_files(tmp_path_factory.mktemp("tls-certs"))
    cluster = start_cluster(tmp_path_factory.mktemp("tls-cluster"), node_timeout_ms=500, tls_dir=certs)
    try:
        yield cluster
    finally:
        cluster.stop()
