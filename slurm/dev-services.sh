#!/usr/bin/env bash
# dev-services.sh: every service the test suite uses, on this machine, in one command.
#
#   bash slurm/dev-services.sh [up]     install what is missing and start it; idempotent
#   bash slurm/dev-services.sh status   one line per service; exit 0 when all are up, 3 otherwise
#
# Services: the one-node Slurm cluster with accounting (slurm/dev-cluster.sh; the multi-node tests
# start a cluster of their own beside it), PostgreSQL on 127.0.0.1:5432 and on the dev cluster's
# head address (trust auth for local connections; the store tests create and drop their own
# database), and Debian's headless chromium (the HTML report's browser test drives it through
# Playwright; `playwright install` is never used). Run as root on Debian 12 without systemd.

set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[dev-services] $*"; }

apt_install() {
    # apt-get update only when something is missing: the lists may be absent on a fresh machine.
    if [ ! -f /var/lib/apt/lists/lock ] || [ -z "$(ls /var/lib/apt/lists/ 2>/dev/null | grep -v -e lock -e partial)" ]; then
        apt-get update -qq
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; }
}

# Jobs on the multi-node dev cluster's nodes (network namespaces) cannot reach the head's
# 127.0.0.1: PostgreSQL listens on the head address of the cluster's bridge too, and trusts the
# bridge's subnet (only the namespaces slurm/dev-cluster.sh creates live there), as a real
# cluster's database listens on the head node's cluster network.
HEAD_ADDR="$(bash slurm/dev-cluster.sh address-multi)"
HEAD_SUBNET="${HEAD_ADDR%.*}.0/24"
HBA_MARK="# slurm/dev-services.sh: the dev cluster's nodes"

postgres_configure() {
    local version="$1" hba="/etc/postgresql/$1/main/pg_hba.conf" conf="/etc/postgresql/$1/main/conf.d"
    # max_connections: every run, `sweep` command and test process holds its own connections, and
    # the tests start 32 writers at once beside a test session's pooled ones; 100 (the default) was
    # reached in CI ("sorry, too many clients already").
    local want="listen_addresses = '127.0.0.1,$HEAD_ADDR'"$'\n'"max_connections = 300" changed=1
    install -d -m 0755 "$conf"
    if [ "$(cat "$conf/95-scalesweep-dev-cluster.conf" 2>/dev/null)" != "$want" ]; then
        echo "$want" >"$conf/95-scalesweep-dev-cluster.conf"
        changed=0
    fi
    if ! grep -qF "$HBA_MARK" "$hba"; then
        printf '%s\nhost all all %s trust\n' "$HBA_MARK" "$HEAD_SUBNET" >>"$hba"
        changed=0
    fi
    return $changed
}

postgres_up() {
    command -v pg_ctlcluster >/dev/null || apt_install postgresql
    local version
    version="$(ls /etc/postgresql | sort -V | tail -1)"
    bash slurm/dev-cluster.sh head-network
    if postgres_configure "$version" || ! pg_isready -q -h "$HEAD_ADDR" -p 5432 2>/dev/null; then
        if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
            log "postgresql: restarting to listen on $HEAD_ADDR too"
            pg_ctlcluster --skip-systemctl-redirect "$version" main restart
        fi
    fi
    pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null || pg_ctlcluster --skip-systemctl-redirect "$version" main start
    for _ in $(seq 30); do
        pg_isready -q -h 127.0.0.1 -p 5432 && pg_isready -q -h "$HEAD_ADDR" -p 5432 && return
        sleep 1
    done
    log "PostgreSQL did not become ready; log: /var/log/postgresql/postgresql-$version-main.log"
    tail -n 25 "/var/log/postgresql/postgresql-$version-main.log" >&2 || true
    exit 1
}

chromium_up() {
    [ -x /usr/bin/chromium ] || apt_install chromium
    /usr/bin/chromium --version >/dev/null 2>&1
}

status() {
    local rc=0
    if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then log "postgresql: up"; else log "postgresql: down"; rc=3; fi
    if [ -x /usr/bin/chromium ]; then log "chromium: $(/usr/bin/chromium --version 2>/dev/null)"; else log "chromium: missing"; rc=3; fi
    if bash slurm/dev-cluster.sh status >/dev/null 2>&1; then log "slurm: up"; else log "slurm: down"; rc=3; fi
    return $rc
}

case "${1:-up}" in
    up)
        postgres_up
        chromium_up
        bash slurm/dev-cluster.sh up
        status
        ;;
    status) status ;;
    *) echo "usage: $0 [up|status]" >&2; exit 2 ;;
esac
