#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for tests and trials (needs root).
#
#   tests/slurm/local_cluster.sh start DIR CTLD_PORT NODE_PORT   # nodes n1, n2 on NODE_PORT, NODE_PORT+1
#   export SLURM_CONF=DIR/slurm.conf; sbatch -N 2 ...
#   tests/slurm/local_cluster.sh stop DIR
#
# Installs Debian's slurm-wlm and munge when missing. Both nodes are this host (NodeAddr
# 127.0.0.1), each slurmd with its own name, port, spool, pid and log file.
set -euo pipefail
action="${1:?start|stop}"
dir="$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)"

stop() {
  for pidfile in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2> /dev/null || true
  done
  if [ -f "$dir/munged.started" ]; then
    pkill -x munged 2> /dev/null || true
    rm -f "$dir/munged.started"
  fi
  sleep 1
  for pidfile in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid; do
    [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2> /dev/null || true
    rm -f "$pidfile"
  done
}

if [ "$action" = stop ]; then stop; exit 0; fi

ctld_port="${3:?CTLD_PORT}"
node_port="${4:?NODE_PORT}"
if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
  apt-get update -q > /dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge > /dev/null
fi

# munge authenticates every Slurm message; start it unless something already runs it.
if ! pgrep -x munged > /dev/null; then
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  touch "$dir/munged.started"
fi

host="$(hostname)"
mkdir -p "$dir/state" "$dir/spool"
cat > "$dir/slurm.conf" << CONF
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits out the credential lifetime before it may start again (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=$node_port-$((node_port + 1)) CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"
/usr/sbin/slurmctld -f "$SLURM_CONF"
for node in n1 n2; do
  mkdir -p "$dir/spool/$node"
  /usr/sbin/slurmd -f "$SLURM_CONF" -N "$node"
done
for _ in $(seq 60); do
  if [ "$(sinfo -h -N -o '%T' 2> /dev/null | grep -c idle)" = 2 ]; then
    echo "slurm cluster up: $SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "error: the two nodes did not become idle; see $dir/*.log" >&2
sinfo -N >&2 || true
stop
exit 1
