#!/bin/bash
# The job body of every batch script in slurm/ (`toolkit slurm render` writes them): one torchrun per node under
# srun, after an all-reduce preflight; a preemption checkpoint requeues the job. A script sets this job's inputs,
# then sources this file (found from $SLURM_SUBMIT_DIR, the repository root) and calls `main "$@"`:
#   RECIPE          recipe name or path, given to validate, show and recipes/train.py
#   OVERRIDES       bash array of --set KEY=VALUE pairs; main appends those given at submission
#   RANKS_PER_NODE  torchrun --nproc_per_node: GPUs per node, or CPU ranks
#   DEVICE          cuda (NCCL on GPUs) or cpu (gloo on CPU cores, a rehearsal)
# Sourcing only defines the functions below (tests call them with fake scontrol/getent/srun); nothing runs.

REQUEUE_EXIT=75              # toolkit.slurm.REQUEUE_EXIT: the trainer's exit after a preemption checkpoint
MARKER_NAME=preempted.json   # toolkit.slurm.PREEMPTED_MARKER: ... left in the recipe's output_dir with it

log() { printf '[%s] %s\n' "$(date '+%F %T')" "$*"; }

# The first node hosts the rendezvous. Its Slurm name may not resolve on the nodes (simulated nodes, some sites'
# internal names; torch would then retry "Name or service not known" until killed): fall back to the address
# Slurm itself uses for it (NodeAddr), then to the first address the node reports.
master_addr() {
    local first addr
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    if getent hosts "$first" >/dev/null; then
        echo "$first"
        return 0
    fi
    addr=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n1)
    if [[ -z $addr || $addr == "$first" ]]; then
        addr=$(srun --nodes=1 --ntasks=1 --nodelist="$first" --overlap hostname -I | awk '{print $1}')
    fi
    if [[ -z $addr ]]; then
        echo "error: the first node $first does not resolve and has no address in Slurm; export MASTER_ADDR" >&2
        return 1
    fi
    echo "$addr"
}

# One port per job id, so jobs sharing a node do not collide (ids 12000 apart share one), below Linux's default
# ephemeral ports (32768-60999), which other connections may hold; an exported MASTER_PORT wins.
master_port() {
    echo "${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12000))}"
}

# Network and threading settings, in one place. Export any of them before sbatch to override the default.
network_env() {
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}  # 1 on clusters without InfiniBand/RoCE
    if [[ -n ${TOOLKIT_NCCL_IFNAME:-} ]]; then     # the interface the nodes reach each other on, e.g. ib0 or eth0
        export NCCL_SOCKET_IFNAME=$TOOLKIT_NCCL_IFNAME
        # gloo (CPU runs, CPU-side groups) takes plain interface names only, not NCCL's ^exclude or =exact forms
        [[ $TOOLKIT_NCCL_IFNAME == [=^]* ]] || export GLOO_SOCKET_IFNAME=$TOOLKIT_NCCL_IFNAME
    fi
    local threads=$(( ${SLURM_CPUS_PER_TASK:-$RANKS_PER_NODE} / RANKS_PER_NODE ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
    export PYTHONUNBUFFERED=1
}

print_topology() {
    log "job $SLURM_JOB_ID, attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )): $SLURM_JOB_NUM_NODES node(s)" \
        "[$SLURM_JOB_NODELIST] x $RANKS_PER_NODE ranks ($DEVICE) = $NRANKS ranks"
    log "rendezvous $MASTER_ADDR:$MASTER_PORT; NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<NCCL picks>}" \
        "NCCL_IB_DISABLE=$NCCL_IB_DISABLE OMP_NUM_THREADS=$OMP_NUM_THREADS"
    python -m toolkit validate --recipe "$RECIPE" --world-size "$NRANKS" "${OVERRIDES[@]}"
}

# One torchrun per node, started by srun (no ssh). The single quotes matter: $SLURM_NODEID must expand in each
# node's task, not here on the first node. torchrun must ignore SIGUSR1: --signal=USR1 reaches every process of
# the step, and torchrun, which does not handle USR1, would die of it and take its workers along. The training
# processes install their own handler (an ignored signal stays ignored only until a handler is installed).
# srun gets --cpus-per-task explicitly: Slurm 22.05 steps do not inherit it from sbatch.
# shellcheck disable=SC2016
PER_NODE='trap "" USR1; exec torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" "$@"'
on_every_node() {
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
        --kill-on-bad-exit=1 bash -c "$PER_NODE" torchrun \
        --nproc_per_node "$RANKS_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
}

# Every rank joins and all-reduces once, failing in seconds instead of at the first collective of training.
preflight() {
    local timeout=${TOOLKIT_PREFLIGHT_TIMEOUT:-60}
    if ! on_every_node --rdzv_conf "timeout=$timeout" -m toolkit.preflight --device "$DEVICE"; then
        echo "error: preflight: the $NRANKS ranks on $SLURM_JOB_NUM_NODES node(s) did not all join and" \
             "all-reduce within ${timeout} s (see above)." >&2
        echo "  check that $MASTER_ADDR:$MASTER_PORT is reachable from every node (firewall, port in use)," >&2
        echo "  that NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<unset>} names an interface every node has" \
             "(export TOOLKIT_NCCL_IFNAME=...), and run \`toolkit doctor\` on a node" >&2
        return 1
    fi
}

train() {
    on_every_node recipes/train.py --recipe "$RECIPE" "${OVERRIDES[@]}"
}

# Where the trainer leaves $MARKER_NAME: the resolved recipe's output_dir (relative to the repository root).
marker_path() {
    local dir
    dir=$(python -m toolkit show --recipe "$RECIPE" --world-size "$NRANKS" "${OVERRIDES[@]}" |
        python -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["output_dir"])')
    echo "$dir/$MARKER_NAME"
}

# A marker left by an earlier attempt is reported and removed before training: were it kept, a run that fails
# before its first step would look preempted and be requeued forever.
clear_marker() {
    if [[ -e $MARKER ]]; then
        log "the previous attempt was preempted: $(cat "$MARKER")"
        rm -f "$MARKER"
    fi
}

# After training: the trainer's preemption exit requeues the job (same job id; it resumes from the checkpoint,
# as recipes resume by default, checkpoint.resume: auto). Exit code 75 does not survive torchrun (any failed
# worker makes it exit 1), so the marker is what counts; the code is checked too, for other launchers.
finish() {
    local rc=$1
    if [[ $rc == "$REQUEUE_EXIT" || -e $MARKER ]]; then
        log "training stopped after a preemption signal: $(cat "$MARKER" 2>/dev/null || echo "exit code $rc")"
        log "requeueing job $SLURM_JOB_ID; it resumes from its latest checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    log "training exited with code $rc"
    exit "$rc"
}

# The GPUs per node the job got (sbatch --gpus-per-node=N at submission, e.g. "4" or "h100:4") must be the ranks per
# node the script starts: one rank per GPU (an override at submission was not checked until 2026-12-07).
check_gpus_per_node() {
    local got=${SLURM_GPUS_PER_NODE:-}
    got=${got##*:}
    if [[ ${DEVICE:-cuda} == cuda && -n $got && $got != "$RANKS_PER_NODE" ]]; then
        echo "error: this script starts RANKS_PER_NODE=$RANKS_PER_NODE ranks per node, one per GPU, but the job has" \
             "$got GPUs per node (sbatch --gpus-per-node); re-render it with --gpus-per-node $got" >&2
        exit 2
    fi
}

# Overrides given at submission, after the rendered ones (later wins): sbatch THIS_FILE --set training.steps=100
add_overrides() {
    while (($#)); do
        case $1 in
            --set) [[ $# -ge 2 ]] || { echo "error: --set needs KEY=VALUE" >&2; exit 2; }
                   OVERRIDES+=(--set "$2"); shift 2 ;;
            --set=*) OVERRIDES+=(--set "${1#--set=}"); shift ;;
            *) echo "error: unknown argument '$1'; this script takes only --set KEY=VALUE (repeatable)" >&2
               exit 2 ;;
        esac
    done
}

main() {
    set -euo pipefail
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        echo "error: this is a Slurm batch script; submit it with: sbatch $0" >&2
        exit 2
    fi
    add_overrides "$@"
    check_gpus_per_node
    cd "$SLURM_SUBMIT_DIR"
    if [[ ! -f recipes/train.py ]]; then
        echo "error: submit from the repository root: $PWD has no recipes/train.py" >&2
        exit 2
    fi
    if [[ -f .venv/bin/activate ]]; then
        # shellcheck disable=SC1091
        source .venv/bin/activate
    fi
    network_env
    MASTER_ADDR=$(master_addr)
    MASTER_PORT=$(master_port)
    NRANKS=$((SLURM_JOB_NUM_NODES * RANKS_PER_NODE))
    export MASTER_ADDR MASTER_PORT
    print_topology
    MARKER=$(marker_path)
    preflight || exit 1
    clear_marker
    local rc=0
    train || rc=$?
    finish "$rc"
}

# This file is sourced, not run: executed by itself it has no inputs.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    echo "error: $0 is the body of the batch scripts in slurm/; submit one of those: sbatch slurm/NAME.sbatch" >&2
    exit 2
fi
