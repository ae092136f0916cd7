#!/usr/bin/env bash
# dev-cluster.sh: a real Slurm cluster, with accounting, on this machine: one node, or N nodes
# each in its own network namespace (DEV_CLUSTER_NODES=N).
#
# For development and CI on a Debian 12 machine without systemd, run as root:
#
#   slurm/dev-cluster.sh [up]              install, configure, start; idempotent (~1 s when already up)
#   slurm/dev-cluster.sh down              stop slurmd, slurmctld, slurmdbd, munged (MariaDB keeps running),
#                                            remove the nodes' namespaces and the bridge
#   slurm/dev-cluster.sh status            what runs; exit 0 when the whole cluster is up, 3 otherwise
#   slurm/dev-cluster.sh head-network      create the bridge and the head address only (for PostgreSQL)
#   slurm/dev-cluster.sh address           print the head address (the store's host for jobs on nodes)
#   slurm/dev-cluster.sh kill-node NODE    a node dies: its slurmd and every process in its namespace
#                                            are killed, its link goes down
#   slurm/dev-cluster.sh revive-node NODE  link up, slurmd started again (Slurm resumes the node)
#   slurm/dev-cluster.sh partition NODE    cut the node's link (processes keep running); `heal NODE` undoes
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
# Nodes: 1 is the machine itself at 127.0.0.1; N > 1 are N slurmd, each in its own network
# namespace (its own address on a bridge, its own hostname through a UTS namespace), sharing the
# filesystem like a real cluster's NFS.
NODES="${DEV_CLUSTER_NODES:-1}"
# The /24 the multi-node cluster uses: the head (slurmctld, PostgreSQL) at .1, node K at .(NODE_BASE + K).
SUBNET="${DEV_CLUSTER_SUBNET:-10.217.0}"
NODE_BASE="${DEV_CLUSTER_NODE_BASE:-10}"
NODE_PREFIX="${DEV_CLUSTER_NODE_PREFIX:-node}"
BRIDGE="${DEV_CLUSTER_BRIDGE:-slurmdev0}"
# A second cluster beside the default one (tests use one of their own): its files live under
# DEV_CLUSTER_HOME and its slurmctld listens on DEV_CLUSTER_CTLD_PORT. munged, MariaDB and slurmdbd
# are shared with the default cluster.
INSTANCE_HOME="${DEV_CLUSTER_HOME:-}"
CTLD_PORT="${DEV_CLUSTER_CTLD_PORT:-6817}"
# Seconds without an answer before slurmctld marks a node DOWN (and requeues its jobs).
SLURMD_TIMEOUT="${DEV_CLUSTER_SLURMD_TIMEOUT:-10}"

# ---------------------------------------------------------------------------------------------
# Fixed layout (Debian package paths)
# ---------------------------------------------------------------------------------------------

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server iproute2 util-linux)
HEAD_NAME="$(hostname -s)"
HEAD_ADDR="$SUBNET.1"
DEFAULT_CONF_DIR=/etc/slurm
SLURMDBD_CONF="$DEFAULT_CONF_DIR/slurmdbd.conf"
if [[ -n "$INSTANCE_HOME" ]]; then
    CONF_DIR="$INSTANCE_HOME/etc"
    LOG_DIR="$INSTANCE_HOME/log"
    STATE_DIR="$INSTANCE_HOME/state"
    RUN_DIR="$INSTANCE_HOME/run"
else
    CONF_DIR="$DEFAULT_CONF_DIR"
    LOG_DIR=/var/log/slurm
    STATE_DIR=/var/lib/slurm
    RUN_DIR=/run
fi
SLURM_CONF="$CONF_DIR/slurm.conf"
# Every Slurm client this script runs talks to this cluster.
export SLURM_CONF
MUNGE_KEY=/etc/munge/munge.key
DB_NAME=slurm_acct_db
MARIADB_LOG=/var/log/mysql/error.log

# Per daemon: pid file and log file (the same paths are written into the configs below).
declare -A PID_FILE=(
    [munged]=/run/munge/munged.pid
    [mariadbd]=/run/mysqld/mysqld.pid
    [slurmdbd]=/run/slurmdbd.pid
    [slurmctld]="$RUN_DIR/slurmctld.pid"
    [slurmd]="$RUN_DIR/slurmd.pid"
)
declare -A LOG_FILE=(
    [munged]=/var/log/munge/munged.log
    [mariadbd]="$MARIADB_LOG"
    [slurmdbd]=/var/log/slurm/slurmdbd.log
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

# The pid in pid file $2 if it is a running $1.
pid_from_file() {
    local name="$1" file="$2" pid=""
    [[ -r "$file" ]] && pid="$(tr -dc '0-9' <"$file")"
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] && echo "$pid"
}

# A running $1 of this cluster found by name (its pid file not written yet, or lost): slurmctld and
# slurmd of a cluster under DEV_CLUSTER_HOME run with `-f` its slurm.conf, the default's without.
pid_by_name() {
    local name="$1" pid args
    for pid in $(pgrep -x "$name"); do
        args="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || continue
        case "$name" in
            slurmctld | slurmd)
                if [[ -n "$INSTANCE_HOME" ]]; then [[ "$args" == *" -f $SLURM_CONF"* ]] || continue
                else [[ "$args" != *" -f "* ]] || continue; fi
                # A node's slurmd lives in its namespace; the one-node slurmd in the host's.
                [[ "$name" == slurmd && -n "$(ip netns identify "$pid" 2>/dev/null)" ]] && continue
                ;;
        esac
        echo "$pid"
        return 0
    done
    return 1
}

# The pid of a running daemon: from its pid file, else by its exact process name.
daemon_pid() {
    local name="$1"
    pid_from_file "$name" "${PID_FILE[$name]}" || pid_by_name "$name"
}

# The pid of node K's slurmd: from its pid file, else the slurmd inside its namespace.
node_slurmd_pid() {
    local k="$1" pid
    pid_from_file slurmd "$(node_pid_file "$k")" && return 0
    for pid in $(ip netns pids "$(node_netns "$k")" 2>/dev/null); do
        [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == slurmd ]] && { echo "$pid"; return 0; }
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

# ---------------------------------------------------------------------------------------------
# Nodes: the one machine, or N network namespaces on a bridge
# ---------------------------------------------------------------------------------------------

multi_node() { ((NODES > 1)); }

node_names() {
    if multi_node; then
        local k
        for ((k = 1; k <= NODES; k++)); do echo "$NODE_PREFIX$k"; done
    else
        echo "$HEAD_NAME"
    fi
}

# node1 -> 1
node_index() {
    local name="$1"
    [[ "$name" =~ ^$NODE_PREFIX([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1 && BASH_REMATCH[1] <= NODES)) ||
        die "unknown node '$name' (this cluster's nodes: $(node_names | paste -sd' '))"
    echo "${BASH_REMATCH[1]}"
}

node_addr() { echo "$SUBNET.$((NODE_BASE + $1))"; }
node_netns() { echo "slurm-$CLUSTER_NAME-$NODE_PREFIX$1"; }
# The bridge side of node K's veth pair (interface names have at most 15 characters).
node_veth() { echo "v-${CLUSTER_NAME:0:9}-$1"; }
node_pid_file() { echo "$RUN_DIR/slurmd-$NODE_PREFIX$1.pid"; }

ensure_head_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        log "creating bridge $BRIDGE with the head address $HEAD_ADDR/24"
        ip link add "$BRIDGE" type bridge || die "ip link add $BRIDGE type bridge failed"
    fi
    ip -4 addr show dev "$BRIDGE" | grep -q "inet $HEAD_ADDR/" ||
        ip addr add "$HEAD_ADDR/24" dev "$BRIDGE" || die "could not add $HEAD_ADDR/24 to $BRIDGE"
    ip link set "$BRIDGE" up
}

# Node K's namespace, its veth pair on the bridge, its address and a default route to the head.
ensure_node_network() {
    local k="$1" ns veth
    ns="$(node_netns "$k")" veth="$(node_veth "$k")"
    if ! ip netns list | grep -qw "^$ns"; then
        log "creating namespace $ns ($(node_addr "$k"))"
        ip netns add "$ns" || die "ip netns add $ns failed"
    fi
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$ns" || die "could not create veth $veth for $ns"
    fi
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" -4 addr show dev eth0 | grep -q "inet $(node_addr "$k")/" ||
        ip -n "$ns" addr add "$(node_addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route replace default via "$HEAD_ADDR"
}

remove_node_network() {
    local k="$1" ns
    ns="$(node_netns "$k")"
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip link del "$(node_veth "$k")" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
}

# Node names resolve through /etc/hosts, like a real cluster's DNS: a marked block per cluster.
# /etc/hosts may be a bind mount, so it is rewritten in place, never replaced.
hosts_block_begin() { echo "# BEGIN slurm/dev-cluster.sh $CLUSTER_NAME"; }
hosts_block_end() { echo "# END slurm/dev-cluster.sh $CLUSTER_NAME"; }

write_hosts_block() {
    local block="$1" current new
    current="$(cat /etc/hosts)"
    new="$(awk -v b="$(hosts_block_begin)" -v e="$(hosts_block_end)" \
        '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts)"
    [[ -n "$block" ]] && new+=$'\n'"$(hosts_block_begin)"$'\n'"$block"$'\n'"$(hosts_block_end)"
    [[ "$new" == "$current" ]] && return 0
    printf '%s\n' "$new" >/etc/hosts
}

ensure_hosts() {
    local k block=""
    for ((k = 1; k <= NODES; k++)); do block+="$(node_addr "$k") $NODE_PREFIX$k"$'\n'; done
    write_hosts_block "${block%$'\n'}"
}

# The namespaces of this cluster's nodes that exist now (also those of an earlier, larger `up`).
existing_node_indices() {
    ip netns list 2>/dev/null | awk '{print $1}' |
        sed -n "s/^slurm-$CLUSTER_NAME-$NODE_PREFIX\([0-9][0-9]*\)\$/\1/p" | sort -n
}

remove_all_node_networks() {
    local k
    for k in $(existing_node_indices); do
        log "removing namespace $(node_netns "$k")"
        remove_node_network "$k"
    done
    write_hosts_block ""
}

# The bridge goes when no namespace of any cluster is left on it.
remove_bridge_if_unused() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || return 0
    if [[ -z "$(ip link show master "$BRIDGE" 2>/dev/null)" ]]; then
        log "removing bridge $BRIDGE"
        ip link del "$BRIDGE" 2>/dev/null || true
    fi
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
    for name in DEV_CLUSTER_NODES DEV_CLUSTER_NODE_BASE DEV_CLUSTER_CTLD_PORT DEV_CLUSTER_SLURMD_TIMEOUT; do
        [[ -z "${!name:-}" || "${!name}" =~ ^[0-9]+$ ]] || die "$name must be a whole number, got '${!name}'"
    done
    ((NODES >= 1 && NODE_BASE + NODES <= 254)) ||
        die "DEV_CLUSTER_NODES must be 1..$((254 - NODE_BASE)) (with DEV_CLUSTER_NODE_BASE=$NODE_BASE), got '$NODES'"
    [[ "$SUBNET" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
        die "DEV_CLUSTER_SUBNET must be the first three numbers of a private 10.x.y.0/24, got '$SUBNET'"
    [[ "$NODE_PREFIX" =~ ^[a-z][a-z0-9]*$ ]] || die "DEV_CLUSTER_NODE_PREFIX: lower-case letters and digits, got '$NODE_PREFIX'"
    [[ -z "$INSTANCE_HOME" || "$INSTANCE_HOME" == /* ]] || die "DEV_CLUSTER_HOME must be an absolute path, got '$INSTANCE_HOME'"
    [[ -z "$INSTANCE_HOME" ]] || multi_node ||
        die "DEV_CLUSTER_HOME (a second cluster) needs DEV_CLUSTER_NODES > 1: its one node would clash with the default cluster's slurmd"
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
    install -d -m 0755 "$RUN_DIR"
    # slurmd runs as root and keeps its spool there (one per node).
    local name
    if multi_node; then
        for name in $(node_names); do install -d -o root -g root -m 0755 "$STATE_DIR/slurmd-$name"; done
    else
        install -d -o root -g root -m 0755 "$STATE_DIR/slurmd"
    fi
}

# ---------------------------------------------------------------------------------------------
# Configuration files
# ---------------------------------------------------------------------------------------------

render_slurm_conf() {
    cat <<EOF
# Written by slurm/dev-cluster.sh; rewritten on every \`up\`. Do not edit by hand.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$(controller_host)
SlurmctldPort=$CTLD_PORT
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
# Short credential lifetime: a requeued job waits cred_expire before it may start again.
AuthInfo=cred_expire=10

StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$(slurmd_path "$STATE_DIR/slurmd")
SlurmctldPidFile=${PID_FILE[slurmctld]}
SlurmdPidFile=$(slurmd_path "$RUN_DIR/slurmd" .pid)
SlurmctldLogFile=${LOG_FILE[slurmctld]}
SlurmdLogFile=$(slurmd_path "$LOG_DIR/slurmd" .log)
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
$(node_lines)
EOF
}

controller_host() {
    if multi_node; then echo "$HEAD_NAME($HEAD_ADDR)"; else echo "$HEAD_NAME(127.0.0.1)"; fi
}

# One slurmd: PATH + SUFFIX; several: one file (or spool directory) per node, by Slurm's %n.
slurmd_path() {
    if multi_node; then echo "$1-%n${2:-}"; else echo "$1${2:-}"; fi
}

node_lines() {
    if multi_node; then
        # A node that stops answering is DOWN after SlurmdTimeout s, and its jobs are requeued.
        echo "SlurmdTimeout=$SLURMD_TIMEOUT"
        local k
        for ((k = 1; k <= NODES; k++)); do
            echo "NodeName=$NODE_PREFIX$k NodeAddr=$(node_addr "$k") CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN"
        done
        echo "PartitionName=$PARTITION Nodes=$NODE_PREFIX[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
    else
        echo "NodeName=$HEAD_NAME NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN"
        echo "PartitionName=$PARTITION Nodes=$HEAD_NAME Default=YES MaxTime=INFINITE State=UP"
    fi
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
    install -d -m 0755 "$DEFAULT_CONF_DIR"
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
    ((RESTART_SLURMD)) && stop_all_slurmd
    ((${#names[@]} == 0)) || stop_daemons "${names[@]}"
}

# Every slurmd of this cluster: the one-node slurmd and the nodes' (also of an earlier, larger `up`).
stop_all_slurmd() {
    stop_daemons slurmd
    local k pid
    for k in $(existing_node_indices); do
        pid="$(node_slurmd_pid "$k")" || continue
        log "stopping slurmd of $NODE_PREFIX$k (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + READY_TIMEOUT))
        until process_gone "$pid"; do
            ((SECONDS < deadline)) || kill -KILL "$pid" 2>/dev/null || true
            sleep 0.2
        done
        rm -f "$(node_pid_file "$k")"
    done
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
        # slurmdbd.conf sits beside the default cluster's slurm.conf; every cluster shares it.
        SLURM_CONF="$DEFAULT_CONF_DIR/slurm.conf" /usr/sbin/slurmdbd || die_with_log slurmdbd "slurmdbd failed to start"
    fi
    await_ready slurmdbd slurmdbd_ready || die_with_log slurmdbd "slurmdbd is not listening on port 6819 after $READY_TIMEOUT s"
}

slurmctld_ready() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
    if ! is_running slurmctld; then
        log "starting slurmctld"
        /usr/sbin/slurmctld $(conf_flag) || die_with_log slurmctld "slurmctld failed to start"
        SLURMCTLD_STARTED=1
    fi
    await_ready slurmctld slurmctld_ready || die_with_log slurmctld "slurmctld is not answering \`scontrol ping\` after $READY_TIMEOUT s"
}

# slurmctld and slurmd of a cluster under DEV_CLUSTER_HOME are told where its slurm.conf is.
conf_flag() { [[ -z "$INSTANCE_HOME" ]] || echo "-f $SLURM_CONF"; }

node_state() { timeout 5 sinfo -h -N -n "$1" -o %T 2>/dev/null | head -n 1; }

# slurmctld sees a node that takes jobs: idle, mixed, allocated or completing, and responding (no
# '*'). The node state alone is not enough: a restarted slurmctld restores it from its state file,
# before slurmd has registered.
node_takes_jobs() { node_state "$1" | grep -Eqx 'idle|mixed|allocated|completing'; }

# A node left DOWN or DRAINED (by an earlier run, a test, or an admin) stays so until resumed.
node_ready_or_resume() {
    local name="$1"
    node_takes_jobs "$name" && return 0
    if node_state "$name" | grep -Eqx 'down|drained|draining'; then
        log "resuming node $name (was $(node_state "$name"))"
        timeout 5 scontrol update NodeName="$name" State=RESUME || true
    fi
    return 1
}

node_reason() { timeout 5 scontrol show node "$1" | grep -o 'Reason=.*' || true; }

# The one-node cluster: slurmd answers locally too.
head_node_ready() { timeout 5 scontrol show slurmd >/dev/null 2>&1 && node_ready_or_resume "$HEAD_NAME"; }

start_head_slurmd() {
    if ! is_running slurmd; then
        log "starting slurmd"
        /usr/sbin/slurmd $(conf_flag) || die_with_log slurmd "slurmd failed to start"
    elif ((SLURMCTLD_STARTED)); then
        # A new slurmctld waits ~5 s before it pings the node; SIGHUP makes slurmd register now.
        kill -HUP "$(daemon_pid slurmd)"
    fi
    await_ready slurmd head_node_ready ||
        die_with_log slurmd "node $HEAD_NAME is not ready after $READY_TIMEOUT s: state '$(node_state "$HEAD_NAME")', $(node_reason "$HEAD_NAME")"
}

# Node K's slurmd, in its network namespace and with its own hostname (a UTS namespace). nsenter
# rather than `ip netns exec`, which would remount /sys and hide the cgroup mounts slurmd reads.
start_node_slurmd() {
    local k="$1" pid
    if pid="$(node_slurmd_pid "$k")"; then
        ((SLURMCTLD_STARTED)) && kill -HUP "$pid"
        return 0
    fi
    log "starting slurmd of $NODE_PREFIX$k in namespace $(node_netns "$k")"
    nsenter --net="/run/netns/$(node_netns "$k")" unshare --uts \
        sh -c 'hostname "$1" && exec /usr/sbin/slurmd -f "$2"' sh "$NODE_PREFIX$k" "$SLURM_CONF" ||
        die "slurmd of $NODE_PREFIX$k failed to start; log: $LOG_DIR/slurmd-$NODE_PREFIX$k.log"
}

node_slurmd_ready() { node_slurmd_pid "$1" >/dev/null && node_ready_or_resume "$NODE_PREFIX$1"; }

start_slurmd() {
    if ! multi_node; then
        start_head_slurmd
        return
    fi
    local k
    for ((k = 1; k <= NODES; k++)); do start_node_slurmd "$k"; done
    for ((k = 1; k <= NODES; k++)); do
        LOG_FILE[slurmd]="$LOG_DIR/slurmd-$NODE_PREFIX$k.log"
        await_ready_node "$k" ||
            die_with_log slurmd "node $NODE_PREFIX$k is not ready after $READY_TIMEOUT s: state '$(node_state "$NODE_PREFIX$k")', $(node_reason "$NODE_PREFIX$k")"
    done
}

await_ready_node() {
    local k="$1" deadline=$((SECONDS + READY_TIMEOUT))
    until node_slurmd_ready "$k"; do
        node_slurmd_pid "$k" >/dev/null || die_with_log slurmd "slurmd of $NODE_PREFIX$k exited while starting"
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
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
    ensure_nodes_network
    start_munged
    start_mariadb
    ensure_database
    start_slurmdbd
    ensure_cluster
    start_slurmctld
    ensure_account_and_users
    start_slurmd
    check_clients
    if multi_node; then
        log "up in $((SECONDS - started)) s: cluster $CLUSTER_NAME, $NODES nodes ($NODE_PREFIX[1-$NODES] at" \
            "$(node_addr 1)..$(node_addr "$NODES")), head $HEAD_ADDR, partition $PARTITION, logs in $LOG_DIR"
    else
        log "up in $((SECONDS - started)) s: cluster $CLUSTER_NAME, node $HEAD_NAME ($(node_state "$HEAD_NAME")), partition $PARTITION, logs in $LOG_DIR"
    fi
}

# The network the nodes need, and none left from an earlier `up` with more nodes.
ensure_nodes_network() {
    local k
    for k in $(existing_node_indices); do
        multi_node && ((k <= NODES)) && continue
        log "removing namespace $(node_netns "$k") (no longer a node)"
        remove_node_network "$k"
    done
    if multi_node; then
        ensure_head_network
        for ((k = 1; k <= NODES; k++)); do ensure_node_network "$k"; done
        ensure_hosts
    else
        write_hosts_block ""
    fi
}

cmd_down() {
    require_root
    # slurmctld may still flush job records to slurmdbd as it stops; slurmdbd goes after it.
    stop_all_slurmd
    stop_daemons slurmctld
    remove_all_node_networks
    remove_bridge_if_unused
    if [[ -n "$INSTANCE_HOME" ]]; then
        log "down (cluster $CLUSTER_NAME; munged, MariaDB and slurmdbd are the default cluster's and keep running)"
        return
    fi
    stop_daemons slurmdbd munged
    log "down (MariaDB left running)"
}

cmd_status() {
    local name pid all_up=0 k
    for name in munged mariadbd slurmdbd slurmctld; do
        if pid="$(daemon_pid "$name")"; then
            printf '%-10s running  pid %-7s log %s\n' "$name" "$pid" "${LOG_FILE[$name]}"
        else
            printf '%-10s stopped           log %s\n' "$name" "${LOG_FILE[$name]}"
            all_up=3
        fi
    done
    if multi_node; then
        for ((k = 1; k <= NODES; k++)); do
            if pid="$(node_slurmd_pid "$k")"; then
                printf '%-10s running  pid %-7s log %s (%s, %s)\n' slurmd "$pid" "$LOG_DIR/slurmd-$NODE_PREFIX$k.log" "$NODE_PREFIX$k" "$(node_addr "$k")"
            else
                printf '%-10s stopped           log %s (%s)\n' slurmd "$LOG_DIR/slurmd-$NODE_PREFIX$k.log" "$NODE_PREFIX$k"
                all_up=3
            fi
        done
    elif pid="$(daemon_pid slurmd)"; then
        printf '%-10s running  pid %-7s log %s\n' slurmd "$pid" "${LOG_FILE[slurmd]}"
    else
        printf '%-10s stopped           log %s\n' slurmd "${LOG_FILE[slurmd]}"
        all_up=3
    fi
    if is_running slurmctld; then
        echo
        timeout 5 sinfo -N -o '%N %.8t %o' || true
        echo
        timeout 5 squeue || true
    fi
    return "$all_up"
}

require_multi_node() {
    multi_node || die "this command needs a multi-node cluster: DEV_CLUSTER_NODES=N (N > 1), as given to \`up\`"
}

cmd_address() {
    if multi_node; then echo "$HEAD_ADDR"; else echo 127.0.0.1; fi
}

# A node dies as a machine does: every process in its namespace (slurmd, slurmstepd, the job's
# tasks) is killed at once, and its link goes down. slurmctld notices after SlurmdTimeout.
cmd_kill_node() {
    require_root
    require_multi_node
    local k
    k="$(node_index "${1:-}")"
    log "killing $NODE_PREFIX$k: every process in $(node_netns "$k"), link down"
    ip link set "$(node_veth "$k")" down
    ip netns pids "$(node_netns "$k")" | xargs -r kill -KILL 2>/dev/null || true
    rm -f "$(node_pid_file "$k")"
}

cmd_revive_node() {
    require_root
    require_multi_node
    local k
    k="$(node_index "${1:-}")"
    ensure_node_network "$k"
    start_node_slurmd "$k"
    LOG_FILE[slurmd]="$LOG_DIR/slurmd-$NODE_PREFIX$k.log"
    await_ready_node "$k" ||
        die_with_log slurmd "node $NODE_PREFIX$k is not ready after $READY_TIMEOUT s: state '$(node_state "$NODE_PREFIX$k")', $(node_reason "$NODE_PREFIX$k")"
    log "$NODE_PREFIX$k is back ($(node_state "$NODE_PREFIX$k"))"
}

# A network partition: the node's link goes down, its processes keep running.
cmd_partition() {
    require_root
    require_multi_node
    local k
    k="$(node_index "${1:-}")"
    log "cutting $NODE_PREFIX$k's link (its processes keep running)"
    ip link set "$(node_veth "$k")" down
}

cmd_heal() {
    require_root
    require_multi_node
    local k
    k="$(node_index "${1:-}")"
    ip link set "$(node_veth "$k")" up
    log "$NODE_PREFIX$k's link is up again"
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
        head-network) require_root && ensure_head_network ;;
        address) cmd_address ;;
        address-multi) echo "$HEAD_ADDR" ;;
        kill-node) cmd_kill_node "$@" ;;
        revive-node) cmd_revive_node "$@" ;;
        partition) cmd_partition "$@" ;;
        heal) cmd_heal "$@" ;;
        -h | --help | help) usage ;;
        *) usage >&2; die "unknown command '$command' (valid: up, down, status, set, head-network, address, kill-node, revive-node, partition, heal)" ;;
    esac
}

main "$@"
