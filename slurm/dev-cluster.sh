#!/usr/bin/env bash
# dev-cluster.sh: a real one-node Slurm cluster, with accounting, on this machine.
#
# For development and CI on a Debian 12 machine without systemd, run as root:
#
#   slurm/dev-cluster.sh [up]              install, configure, start; idempotent (~1 s when already up)
#   slurm/dev-cluster.sh down              stop slurmd, slurmctld, slurmdbd, munged (MariaDB keeps running)
#   slurm/dev-cluster.sh status            what runs; exit 0 when the whole cluster is up, 3 otherwise
#   slurm/dev-cluster.sh set KEY=VALUE     change the running cluster, e.g.
#                                            set MaxArraySize=5      (slurm.conf key; until the next `up`)
#                                            set MaxSubmitJobs=10    (association limit; -1 clears it)
#
# `up` starts munged -> MariaDB -> slurmdbd -> slurmctld -> slurmd, each with a readiness wait, and
# registers the cluster, account and users in the accounting database. It rewrites
# /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf from the tunables below every time, and
# restarts only the daemons whose configuration changed. See slurm/README.md.

set -euo pipefail

# ---------------------------------------------------------------------------------------------
# Tunables (environment variables)
# ---------------------------------------------------------------------------------------------

CLUSTER_NAME="${DEV_CLUSTER_NAME:-dev}"
ACCOUNT="${DEV_CLUSTER_ACCOUNT:-dev}"
PARTITION="${DEV_CLUSTER_PARTITION:-debug}"
# CPUs the node claims to have; more than the real cores so array tasks run side by side.
CPUS="${DEV_CLUSTER_CPUS:-32}"
MEMORY_MB="${DEV_CLUSTER_MEMORY_MB:-$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)}"
MAX_ARRAY_SIZE="${DEV_CLUSTER_MAX_ARRAY_SIZE:-1001}"
MAX_JOB_COUNT="${DEV_CLUSTER_MAX_JOB_COUNT:-10000}"
MIN_JOB_AGE="${DEV_CLUSTER_MIN_JOB_AGE:-30}"
KILL_WAIT="${DEV_CLUSTER_KILL_WAIT:-5}"
# Users allowed to submit (associations are enforced, so others are refused).
USERS="${DEV_CLUSTER_USERS:-root $(id -un) ${SUDO_USER:-}}"
DB_PASSWORD="${DEV_CLUSTER_DB_PASSWORD:-slurmdev}"
# Seconds to wait for each daemon to become ready.
READY_TIMEOUT="${DEV_CLUSTER_TIMEOUT:-60}"

# ---------------------------------------------------------------------------------------------
# Fixed layout (Debian package paths)
# ---------------------------------------------------------------------------------------------

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
NODE_NAME="$(hostname -s)"
CONF_DIR=/etc/slurm
SLURM_CONF="$CONF_DIR/slurm.conf"
SLURMDBD_CONF="$CONF_DIR/slurmdbd.conf"
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm
MUNGE_KEY=/etc/munge/munge.key
DB_NAME=slurm_acct_db
MARIADB_LOG=/var/log/mysql/error.log

# Per daemon: pid file and log file (the same paths are written into the configs below).
declare -A PID_FILE=(
    [munged]=/run/munge/munged.pid
    [mariadbd]=/run/mysqld/mysqld.pid
    [slurmdbd]=/run/slurmdbd.pid
    [slurmctld]=/run/slurmctld.pid
    [slurmd]=/run/slurmd.pid
)
declare -A LOG_FILE=(
    [munged]=/var/log/munge/munged.log
    [mariadbd]="$MARIADB_LOG"
    [slurmdbd]="$LOG_DIR/slurmdbd.log"
    [slurmctld]="$LOG_DIR/slurmctld.log"
    [slurmd]="$LOG_DIR/slurmd.log"
)

# slurm.conf keys that `scontrol reconfigure` does not apply (slurm.conf(5), and measured here for
# MaxArraySize: after reconfigure `scontrol show config` reports the new value, but slurmctld
# keeps validating arrays against the old one until it restarts).
RESTART_SLURMCTLD_KEYS=" maxarraysize maxjobcount maxnodecount powerplugin schedulertype selecttype
  selecttypeparameters slurmctldhost slurmctldport statesavelocation "
RESTART_ALL_KEYS=" authtype credtype grestypes jobcontainertype plugindir proctracktype slurmdport
  switchtype taskplugin "
# Association limits that `set` applies with sacctmgr rather than slurm.conf.
ASSOC_KEYS=" maxsubmitjobs maxjobs grpsubmitjobs grpjobs maxwall grpwall "

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

log() { printf '[dev-cluster] %s\n' "$*" >&2; }

die() {
    printf '[dev-cluster] error: %s\n' "$*" >&2
    exit 1
}

# die, showing where the daemon logs and what it last said.
die_with_log() {
    local daemon="$1" message="$2" logfile="${LOG_FILE[$1]}"
    {
        printf '[dev-cluster] error: %s\n' "$message"
        printf '[dev-cluster] %s log: %s; last lines:\n' "$daemon" "$logfile"
        tail -n 25 "$logfile" 2>/dev/null | sed 's/^/    /' || printf '    (no log file)\n'
    } >&2
    exit 1
}

process_gone() { ! kill -0 "$1" 2>/dev/null; }

# Whether process $1 is a daemon of this cluster: one started with another configuration file
# (`slurmctld -f OTHER.conf`: another cluster on the same machine) is not.
ours() {
    local arg prev="" cmdline
    cmdline="$(tr '\0' '\n' <"/proc/$1/cmdline" 2>/dev/null)" || return 1
    while IFS= read -r arg; do
        [[ "$prev" == "-f" && "$arg" != "$SLURM_CONF" && "$arg" != "$SLURMDBD_CONF" ]] && return 1
        prev="$arg"
    done <<<"$cmdline"
    return 0
}

# The pid of a running daemon of this cluster: from its pid file, else by its exact process name.
daemon_pid() {
    local name="$1" pid=""
    if [[ -r "${PID_FILE[$name]}" ]]; then
        pid="$(tr -dc '0-9' <"${PID_FILE[$name]}")"
        if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] && ours "$pid"; then
            echo "$pid"
            return 0
        fi
    fi
    for pid in $(pidof "$name"); do
        if ours "$pid"; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

is_running() { daemon_pid "$1" >/dev/null; }

# Wait until check "$@" succeeds; false after $READY_TIMEOUT s. Fail at once, with the daemon's
# log, if the daemon exits meanwhile (with a second look: a daemon that just forked may not have
# written its pid file yet).
await_ready() {
    local name="$1"
    shift
    local deadline=$((SECONDS + READY_TIMEOUT))
    until "$@"; do
        is_running "$name" || { sleep 0.5 && is_running "$name"; } ||
            die_with_log "$name" "$name exited while starting"
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

# Send TERM to each daemon, then wait until all are gone (slurmctld saves its state on TERM;
# each takes ~2 s, so they stop side by side).
stop_daemons() {
    local name pid pids=()
    for name in "$@"; do
        pid="$(daemon_pid "$name")" || continue
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid")
        rm -f "${PID_FILE[$name]}"
    done
    local deadline=$((SECONDS + READY_TIMEOUT))
    for pid in "${pids[@]}"; do
        until process_gone "$pid"; do
            if ((SECONDS >= deadline)); then
                log "pid $pid did not stop within $READY_TIMEOUT s; killing it"
                kill -KILL "$pid" 2>/dev/null || true
            fi
            sleep 0.2
        done
    done
}

# Catch a bad tunable here, with its name, rather than as a daemon that will not start.
validate_tunables() {
    local name
    for name in DEV_CLUSTER_CPUS DEV_CLUSTER_MEMORY_MB DEV_CLUSTER_MAX_ARRAY_SIZE DEV_CLUSTER_MAX_JOB_COUNT \
        DEV_CLUSTER_MIN_JOB_AGE DEV_CLUSTER_KILL_WAIT DEV_CLUSTER_TIMEOUT; do
        [[ -z "${!name:-}" || "${!name}" =~ ^[0-9]+$ ]] || die "$name must be a whole number, got '${!name}'"
    done
    [[ "$CLUSTER_NAME$ACCOUNT$PARTITION" =~ ^[A-Za-z0-9_]+$ ]] ||
        die "DEV_CLUSTER_NAME, DEV_CLUSTER_ACCOUNT, DEV_CLUSTER_PARTITION: letters, digits and _ only"
    [[ "$DB_PASSWORD" =~ ^[A-Za-z0-9_.-]+$ ]] ||
        die "DEV_CLUSTER_DB_PASSWORD: letters, digits and _.- only (it goes into SQL and slurmdbd.conf)"
}

require_root() {
    [[ "$(id -u)" == 0 ]] || die "run as root (installs packages, writes /etc/slurm, starts daemons)"
}

# ---------------------------------------------------------------------------------------------
# Packages, munge key, directories
# ---------------------------------------------------------------------------------------------

packages_installed() {
    local status
    status="$(dpkg-query -W -f='${Status}\n' "${PACKAGES[@]}" 2>/dev/null)" || return 1
    [[ "$(grep -c '^install ok installed$' <<<"$status")" == "${#PACKAGES[@]}" ]]
}

install_packages() {
    packages_installed && return 0
    log "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/tmp/dev-cluster-apt.log 2>&1 ||
        die "apt-get install failed; see /tmp/dev-cluster-apt.log: $(tail -n 5 /tmp/dev-cluster-apt.log)"
}

ensure_munge_key() {
    [[ -s "$MUNGE_KEY" ]] && return 0
    log "creating $MUNGE_KEY"
    mungekey --create --keyfile="$MUNGE_KEY" 2>/dev/null ||
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
}

ensure_directories() {
    install -d -o munge -g munge -m 0755 /run/munge /var/log/munge /var/lib/munge
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    install -d -o slurm -g slurm -m 0755 "$LOG_DIR" "$STATE_DIR" "$STATE_DIR/slurmctld"
    # slurmd runs as root and keeps its spool there.
    install -d -o root -g root -m 0755 "$STATE_DIR/slurmd"
}

# ---------------------------------------------------------------------------------------------
# Configuration files
# ---------------------------------------------------------------------------------------------

render_slurm_conf() {
    cat <<EOF
# Written by slurm/dev-cluster.sh; rewritten on every \`up\`. Do not edit by hand.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$NODE_NAME(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime: a requeued job waits cred_expire before it may start again.
AuthInfo=cred_expire=10

StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=${PID_FILE[slurmctld]}
SlurmdPidFile=${PID_FILE[slurmd]}
SlurmctldLogFile=${LOG_FILE[slurmctld]}
SlurmdLogFile=${LOG_FILE[slurmd]}
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups on this machine: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
MpiDefault=none
SwitchType=switch/none

# Several 1-CPU jobs share the node; memory is not a consumable.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
JobRequeue=1
ReturnToService=2
KillWait=$KILL_WAIT
MinJobAge=$MIN_JOB_AGE
InactiveLimit=0
MaxArraySize=$MAX_ARRAY_SIZE
MaxJobCount=$MAX_JOB_COUNT

AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
# limits: needed for MaxSubmitJobs and friends (implies associations).
AccountingStorageEnforce=associations,limits
JobCompType=jobcomp/none
# Debian ships no mail program; without this slurmctld logs an error at every start.
MailProg=/bin/true

# Trust the node line, not the hardware, so the node can claim more CPUs than it has.
SlurmdParameters=config_overrides
NodeName=$NODE_NAME NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE_NAME Default=YES MaxTime=INFINITE State=UP
EOF
}

render_slurmdbd_conf() {
    cat <<EOF
# Written by slurm/dev-cluster.sh; rewritten on every \`up\`. Do not edit by hand.
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
PidFile=${PID_FILE[slurmdbd]}
LogFile=${LOG_FILE[slurmdbd]}
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=$DB_PASSWORD
StorageLoc=$DB_NAME
EOF
}

# Write $2 to file $1 with owner $3 and mode $4; succeed only if the content changed.
write_if_changed() {
    local path="$1" content="$2" owner="$3" mode="$4"
    if [[ -f "$path" ]] && [[ "$(cat "$path")" == "$content" ]]; then
        chown "$owner" "$path" && chmod "$mode" "$path"
        return 1
    fi
    log "writing $path"
    printf '%s\n' "$content" >"$path.tmp"
    chown "$owner" "$path.tmp" && chmod "$mode" "$path.tmp"
    mv -f "$path.tmp" "$path"
}

# Set when a daemon's configuration changed and a running daemon must restart to take it.
RESTART_SLURMDBD=0
RESTART_SLURMCTLD=0
RESTART_SLURMD=0
# Set when this run started slurmctld.
SLURMCTLD_STARTED=0

write_configs() {
    install -d -m 0755 "$CONF_DIR"
    if write_if_changed "$SLURM_CONF" "$(render_slurm_conf)" root:root 0644; then
        RESTART_SLURMCTLD=1 RESTART_SLURMD=1
    fi
    # slurmdbd refuses a config that others can read (it holds the DB password).
    if write_if_changed "$SLURMDBD_CONF" "$(render_slurmdbd_conf)" slurm:slurm 0600; then
        RESTART_SLURMDBD=1
    fi
}

# ---------------------------------------------------------------------------------------------
# Daemons, in start order
# ---------------------------------------------------------------------------------------------

# Stop the daemons whose configuration changed, side by side; the start_* below bring them back.
stop_changed_daemons() {
    local names=()
    ((RESTART_SLURMDBD)) && names+=(slurmdbd)
    ((RESTART_SLURMCTLD)) && names+=(slurmctld)
    ((RESTART_SLURMD)) && names+=(slurmd)
    ((${#names[@]} == 0)) || stop_daemons "${names[@]}"
}

# Readiness checks: silent, true when the daemon serves requests.
munge_ready() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munged() {
    if ! is_running munged; then
        log "starting munged"
        start-stop-daemon --start --quiet --oknodo --chuid munge --exec /usr/sbin/munged ||
            die_with_log munged "munged failed to start"
    fi
    await_ready munged munge_ready || die_with_log munged "munge credentials do not work after $READY_TIMEOUT s"
}

mariadb_ready() { mariadb-admin --protocol=socket ping >/dev/null 2>&1; }

start_mariadb() {
    mariadb_ready && return 0
    log "starting mariadbd"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    await_ready mariadbd mariadb_ready || die_with_log mariadbd "MariaDB is not answering after $READY_TIMEOUT s"
}

# The accounting database and its user; each statement is idempotent.
ensure_database() {
    mariadb --protocol=socket -u root <<EOF || die "could not create $DB_NAME in MariaDB"
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
GRANT ALL ON $DB_NAME.* TO 'slurm'@'localhost';
EOF
}

# A TCP probe, not sacctmgr: sacctmgr also reads slurm.conf, and a bad slurm.conf is not slurmdbd's fault.
slurmdbd_ready() { timeout 2 bash -c '</dev/tcp/127.0.0.1/6819' 2>/dev/null; }

start_slurmdbd() {
    if ! is_running slurmdbd; then
        log "starting slurmdbd"
        /usr/sbin/slurmdbd || die_with_log slurmdbd "slurmdbd failed to start"
    fi
    await_ready slurmdbd slurmdbd_ready || die_with_log slurmdbd "slurmdbd is not listening on port 6819 after $READY_TIMEOUT s"
}

slurmctld_ready() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
    if ! is_running slurmctld; then
        log "starting slurmctld"
        /usr/sbin/slurmctld || die_with_log slurmctld "slurmctld failed to start"
        SLURMCTLD_STARTED=1
    fi
    await_ready slurmctld slurmctld_ready || die_with_log slurmctld "slurmctld is not answering \`scontrol ping\` after $READY_TIMEOUT s"
}

node_state() { timeout 5 sinfo -h -N -n "$NODE_NAME" -o %T 2>/dev/null; }

# slurmd answers locally, and slurmctld sees a node that takes jobs: idle, mixed, allocated or
# completing, and responding (no '*'). The node state alone is not enough: a restarted slurmctld
# restores it from its state file, before slurmd has registered.
node_ready() {
    timeout 5 scontrol show slurmd >/dev/null 2>&1 &&
        node_state | grep -Eqx 'idle|mixed|allocated|completing'
}

# A node left DOWN or DRAINED (by an earlier run, or an admin) stays so until resumed.
node_ready_or_resume() {
    node_ready && return 0
    if node_state | grep -Eqx 'down|drained|draining'; then
        log "resuming node $NODE_NAME (was $(node_state))"
        timeout 5 scontrol update NodeName="$NODE_NAME" State=RESUME || true
    fi
    return 1
}

node_reason() { timeout 5 scontrol show node "$NODE_NAME" | grep -o 'Reason=.*' || true; }

start_slurmd() {
    if ! is_running slurmd; then
        log "starting slurmd"
        /usr/sbin/slurmd || die_with_log slurmd "slurmd failed to start"
    elif ((SLURMCTLD_STARTED)); then
        # A new slurmctld waits ~5 s before it pings the node; SIGHUP makes slurmd register now.
        kill -HUP "$(daemon_pid slurmd)"
    fi
    await_ready slurmd node_ready_or_resume ||
        die_with_log slurmd "node $NODE_NAME is not ready after $READY_TIMEOUT s: state '$(node_state)', $(node_reason)"
}

# ---------------------------------------------------------------------------------------------
# Accounting: cluster, account, users (check first: a no-op `sacctmgr add` is slow and noisy)
# ---------------------------------------------------------------------------------------------

ensure_cluster() {
    [[ -n "$(sacctmgr -n -P list cluster "$CLUSTER_NAME" format=cluster)" ]] && return 0
    log "registering cluster $CLUSTER_NAME"
    sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null || die "sacctmgr add cluster $CLUSTER_NAME failed"
}

ensure_account_and_users() {
    local existing user users=()
    # The account's association with this cluster, not just the account (it may exist for another).
    existing="$(sacctmgr -n -P list assoc cluster="$CLUSTER_NAME" account="$ACCOUNT" format=user)"
    if [[ -z "$existing" ]]; then
        log "adding account $ACCOUNT"
        sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER_NAME" description=dev organization=dev >/dev/null ||
            die "sacctmgr add account $ACCOUNT failed"
    fi
    read -ra users <<<"$USERS"
    for user in $(printf '%s\n' "${users[@]}" | sort -u); do
        grep -qx "$user" <<<"$existing" && continue
        log "adding user $user to account $ACCOUNT"
        sacctmgr -i add user "$user" account="$ACCOUNT" cluster="$CLUSTER_NAME" defaultaccount="$ACCOUNT" >/dev/null ||
            die "sacctmgr add user $user failed"
    done
}

# sinfo and sacct answer: the last check of `up`.
check_clients() {
    timeout 10 sinfo >/dev/null || die "sinfo fails"
    timeout 10 sacct -n -X -S now-1minute >/dev/null || die_with_log slurmctld "sacct fails"
}

# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

cmd_up() {
    require_root
    local started=$SECONDS
    validate_tunables
    install_packages
    ensure_munge_key
    ensure_directories
    write_configs
    stop_changed_daemons
    start_munged
    start_mariadb
    ensure_database
    start_slurmdbd
    ensure_cluster
    start_slurmctld
    ensure_account_and_users
    start_slurmd
    check_clients
    log "up in $((SECONDS - started)) s: cluster $CLUSTER_NAME, node $NODE_NAME ($(node_state)), partition $PARTITION, logs in $LOG_DIR"
}

cmd_down() {
    require_root
    # slurmctld may still flush job records to slurmdbd as it stops; slurmdbd goes after it.
    stop_daemons slurmd slurmctld
    stop_daemons slurmdbd munged
    log "down (MariaDB left running)"
}

cmd_status() {
    local name pid all_up=0
    for name in munged mariadbd slurmdbd slurmctld slurmd; do
        if pid="$(daemon_pid "$name")"; then
            printf '%-10s running  pid %-7s log %s\n' "$name" "$pid" "${LOG_FILE[$name]}"
        else
            printf '%-10s stopped           log %s\n' "$name" "${LOG_FILE[$name]}"
            all_up=3
        fi
    done
    if is_running slurmctld; then
        echo
        timeout 5 sinfo || true
        echo
        timeout 5 squeue || true
    fi
    return "$all_up"
}

# The value slurmctld reports for a slurm.conf key (first word: "30 sec" -> "30").
running_value() {
    timeout 5 scontrol show config |
        awk -v key="$1" 'tolower($1) == tolower(key) && $2 == "=" {print $3; exit}'
}

# Replace (or append) KEY=VALUE in slurm.conf; keys match case-insensitively, like Slurm's.
edit_slurm_conf() {
    local key="$1" value="$2"
    awk -v key="$key" -v value="$value" '
        BEGIN { FS = "=" }
        tolower($1) == tolower(key) { if (!done) print key "=" value; done = 1; next }
        { print }
        END { if (!done) print key "=" value }
    ' "$SLURM_CONF" >"$SLURM_CONF.tmp"
    mv -f "$SLURM_CONF.tmp" "$SLURM_CONF"
}

# Make the running daemons take slurm.conf's new value of $1: reconfigure, or restart where
# reconfigure is not enough.
apply_slurm_conf_key() {
    local key="${1,,}"
    if [[ "$RESTART_ALL_KEYS" == *" $key "* ]]; then
        log "$1 takes effect only after a restart of slurmctld and slurmd"
        RESTART_SLURMCTLD=1 RESTART_SLURMD=1
    elif [[ "$RESTART_SLURMCTLD_KEYS" == *" $key "* ]]; then
        log "$1 takes effect only after a restart of slurmctld"
        RESTART_SLURMCTLD=1
    else
        timeout 30 scontrol reconfigure || die_with_log slurmctld "scontrol reconfigure failed"
    fi
    stop_changed_daemons
    start_slurmctld
    start_slurmd
}

# A key of our slurm.conf, or one slurmctld knows (`scontrol show config` lists every key).
known_slurm_conf_key() {
    [[ "$1" =~ ^[A-Za-z]+$ ]] || return 1
    grep -qi "^$1=" "$SLURM_CONF" || [[ -n "$(running_value "$1")" ]]
}

set_slurm_conf_key() {
    local key="$1" value="$2"
    is_running slurmctld || die "slurmctld is not running; run \`$0 up\` first"
    known_slurm_conf_key "$key" ||
        die "unknown slurm.conf key '$key' (valid: the keys of \`scontrol show config\`, or an association limit:$ASSOC_KEYS)"
    cp "$SLURM_CONF" "$SLURM_CONF.bak"
    edit_slurm_conf "$key" "$value"
    # In a subshell, so that a failure (a value slurmctld rejects) comes back here to roll back.
    if ! (apply_slurm_conf_key "$key"); then
        log "restoring the previous slurm.conf"
        mv -f "$SLURM_CONF.bak" "$SLURM_CONF"
        RESTART_SLURMCTLD=1 RESTART_SLURMD=1
        stop_changed_daemons
        start_slurmctld
        start_slurmd
        die "could not set $key=$value (see above); the previous slurm.conf is back in place"
    fi
    rm -f "$SLURM_CONF.bak"
    log "$key = $(running_value "$key") (in slurm.conf until the next \`up\`)"
}

set_association_limit() {
    local key="$1" value="$2" output
    # "Nothing modified" (the value was already set) is not an error.
    output="$(sacctmgr -i modify user where cluster="$CLUSTER_NAME" account="$ACCOUNT" set "$key=$value" 2>&1)" ||
        grep -q 'Nothing modified' <<<"$output" || die "sacctmgr modify failed: $output"
    log "$key=$value for the users of account $ACCOUNT:"
    sacctmgr -n -P list assoc cluster="$CLUSTER_NAME" account="$ACCOUNT" format=user,"$key" | grep -v '^|' | sed 's/^/    /' >&2
}

cmd_set() {
    require_root
    [[ $# -ge 1 ]] || die "usage: $0 set KEY=VALUE [KEY=VALUE ...]"
    local pair key value
    for pair in "$@"; do
        [[ "$pair" == *=* ]] || die "expected KEY=VALUE, got '$pair'"
        key="${pair%%=*}" value="${pair#*=}"
        if [[ "$ASSOC_KEYS" == *" ${key,,} "* ]]; then
            set_association_limit "$key" "$value"
        else
            set_slurm_conf_key "$key" "$value"
        fi
    done
}

usage() {
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
}

main() {
    local command="${1:-up}"
    [[ $# -gt 0 ]] && shift
    case "$command" in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        set) cmd_set "$@" ;;
        -h | --help | help) usage ;;
        *) usage >&2; die "unknown command '$command' (valid: up, down, status, set)" ;;
    esac
}

main "$@"
