#!/bin/sh
# Installs redis-server and redis-cli (Debian: redis-server, redis-tools), and valkey-server and
# valkey-cli (valkey-server, valkey-tools; on Debian 12 only in bookworm-backports), when missing; the
# remote-tier tests and `python -m benchmarks remote` start their own servers from them. Idempotent and quiet
# when all are present. Never fails the caller: without root or apt the Redis (or Valkey) tests skip,
# naming what is missing. bookworm-backports is read through a temporary source list given to apt on
# the command line; the machine's own apt sources are left as they are.
have() { command -v "$1" >/dev/null 2>&1; }
if have redis-server && have redis-cli && have valkey-server && have valkey-cli; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! have apt-get; then
    echo "ensure_redis: redis or valkey server/cli missing and apt-get (as root) unavailable; those tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! have redis-server || ! have redis-cli; then
    echo "ensure_redis: installing redis-server and redis-tools" >&2
    if ! { apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null; }; then
        echo "ensure_redis: apt-get install redis-server redis-tools failed; the Redis tests will skip" >&2
    fi
fi
if ! have valkey-server || ! have valkey-cli; then
    echo "ensure_redis: installing valkey-server and valkey-tools" >&2
    if apt-cache policy valkey-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        apt-get install -y -qq valkey-server valkey-tools >/dev/null \
            || echo "ensure_redis: apt-get install valkey-server valkey-tools failed; the Valkey tests will skip" >&2
    elif grep -q '^VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then
        list=$(mktemp)
        echo 'deb http://deb.debian.org/debian bookworm-backports main' > "$list"
        bpo="-o Dir::Etc::sourcelist=$list -o APT::Get::List-Cleanup=0"  # plus the machine's sources.list.d
        # shellcheck disable=SC2086 # $bpo is several options on purpose
        if ! { apt-get update -qq $bpo && apt-get install -y -qq $bpo -t bookworm-backports valkey-server valkey-tools >/dev/null; }; then
            echo "ensure_redis: installing valkey-server from bookworm-backports failed; the Valkey tests will skip" >&2
        fi
        rm -f "$list"
    else
        echo "ensure_redis: no valkey-server package for this system; the Valkey tests will skip" >&2
    fi
fi
exit 0
