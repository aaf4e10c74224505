#!/usr/bin/env bash
# Start a throw-away Slurm cluster on this machine, as root: munged + slurmctld + one slurmd per simulated node,
# all state under $LAB (default: a folder beside this script's caller, passed by the tests). Nothing is started
# through init scripts and nothing outside $LAB is written.
#   LAB=/tmp/slab NODES=1 bash tests/slurm_cluster/start.sh     # node "localhost"
#   LAB=/tmp/slab NODES=2 bash tests/slurm_cluster/start.sh     # nodes n1, n2 (two slurmd on loopback)
# Prints the SLURM_CONF to export. Stop with tests/slurm_cluster/stop.sh (same LAB).
set -euo pipefail
: "${LAB:?set LAB to an absolute, short folder for the cluster state}"
NODES=${NODES:-1}
CPUS=${CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}  # nproc obeys OMP_NUM_THREADS; the node has all its CPUs
export SLURM_CONF=$LAB/etc/slurm.conf
for tool in munged mungekey slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null || { echo "start.sh: $tool not found; install Debian's slurm-wlm and munge" >&2; exit 3; }
done
mkdir -p "$LAB"/{etc,munge,state,spool,log,run}
chmod a+x "$LAB"; chmod 755 "$LAB/munge"       # munged wants every folder up to its socket a+x
[ -s "$LAB/munge/munge.key" ] || mungekey -c -k "$LAB/munge/munge.key" -b 1024
chmod 600 "$LAB/munge/munge.key"
mem=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 9 / 10 ))
if [ "$NODES" = 1 ]; then
  nodes=localhost
  nodeline="NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
else
  nodes=$(seq -f 'n%g' 1 "$NODES" | tr '\n' ' ')
  # several slurmd on loopback: the node names do not resolve (the job scripts fall back to NodeAddr)
  nodeline="NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=6818-$((6817 + NODES)) CPUs=$CPUS RealMemory=$((mem / NODES)) State=UNKNOWN"
fi
cat > "$SLURM_CONF" <<CONF
ClusterName=toolkitlab
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$LAB/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=5,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
InactiveLimit=0
KillWait=10
MinJobAge=300
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
$nodeline
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive "$LAB/munge/munged.pid" || munged --key-file="$LAB/munge/munge.key" --socket="$LAB/munge/munge.socket.2" \
  --pid-file="$LAB/munge/munged.pid" --seed-file="$LAB/munge/munged.seed" --log-file="$LAB/log/munged.log"
alive "$LAB/run/slurmctld.pid" || slurmctld -f "$SLURM_CONF" -i
for _ in $(seq 1 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || { echo "start.sh: slurmctld did not come up; see $LAB/log/slurmctld.log" >&2; exit 1; }
for n in $nodes; do
  mkdir -p "$LAB/spool/$n"
  alive "$LAB/run/slurmd-$n.pid" || slurmd -f "$SLURM_CONF" -N "$n"
done
for _ in $(seq 1 300); do
  [ -z "$(sinfo -h -N -o '%N %T' | grep -v ' idle$' || true)" ] && break; sleep 0.1
done
[ -z "$(sinfo -h -N -o '%N %T' | grep -v ' idle$' || true)" ] || { echo "start.sh: nodes not idle; see $LAB/log" >&2; exit 1; }
echo "SLURM_CONF=$SLURM_CONF"
