#!/usr/bin/env bash
# Stop the cluster start.sh started under $LAB: cancel its jobs, then end only the daemons whose PIDs it
# recorded (checking each PID's command name first, so a recycled PID is never killed).
set -uo pipefail
: "${LAB:?set LAB to the folder given to start.sh}"
export SLURM_CONF=$LAB/etc/slurm.conf
if [ -f "$LAB/run/slurmctld.pid" ] && scontrol ping 2>/dev/null | grep -q UP; then
  jobs=$(squeue -h -o %i | tr '\n' ' ')
  [ -n "${jobs// /}" ] && scancel $jobs
  for _ in $(seq 1 60); do [ -z "$(squeue -h -o %i)" ] && break; sleep 0.5; done
fi
stop_pid() {  # pidfile expected-command
  local f=$1 want=$2 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$want" ]; then
    kill -TERM "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$f"
}
for f in "$LAB"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f" slurmd; done
stop_pid "$LAB/run/slurmctld.pid" slurmctld
stop_pid "$LAB/munge/munged.pid" munged
exit 0
