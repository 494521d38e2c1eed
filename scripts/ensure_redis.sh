#!/bin/sh
# Installs redis-server and redis-cli (Debian: redis-server, redis-tools) when either is missing; the
# remote-tier tests and `kvstore bench remote` start their own servers from them. Idempotent and quiet
# when both are present. Never fails the caller: without root or apt the Redis tests skip, naming what
# is missing.
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_redis: redis-server/redis-cli missing and apt-get (as root) unavailable; the Redis tests will skip" >&2
    exit 0
fi
echo "ensure_redis: installing redis-server and redis-tools" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }; then
    echo "ensure_redis: apt-get install redis-server redis-tools failed; the Redis tests will skip" >&2
fi
exit 0
