#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, to run the project's sbatch scripts the
# way a cluster does (tests/slurm, docs/slurm.md):
#
#   tools/slurm_local.sh install          # slurm-wlm + munge from the distribution (root)
#   tools/slurm_local.sh up   [DIR]       # munged, slurmctld, slurmd n1 and n2; prints SLURM_CONF
#   tools/slurm_local.sh down [DIR]       # stops all three, cancels what is left
#
# Everything lives in DIR (default /tmp/megatron_rl-slurm): its own munge key and socket,
# slurm.conf, spool and state directories, logs. The two slurmd are `slurmd -N n1` / `-N n2`
# on their own ports, both on loopback (n1 and n2 are added to /etc/hosts: the sbatch script
# resolves the first node's name for the torchrun rendezvous, as on a cluster). Each node
# declares GPUS fake GPUs (default 1): gres.conf points at character devices made with mknod,
# so `--gpus-per-node` is scheduled and bound (CUDA_VISIBLE_DEVICES) as on GPU nodes, and
# `SlurmdParameters=config_overrides` lets a node declare more CPUs than the machine has.
# Processes are tracked by their parentage (proctrack/linuxproc: torchrun starts its workers
# in sessions of their own) and run as the submitting user.
set -euo pipefail

DIR=${2:-${SLURM_LOCAL_DIR:-/tmp/megatron_rl-slurm}}
GPUS=${GPUS:-1}
CPUS=${CPUS:-4}
PORT=${SLURM_LOCAL_PORT:-17000}  # slurmctld; the nodes' slurmd listen on PORT+1, PORT+2
NODES=(n1 n2)
HOSTS_LINE="127.0.0.1 ${NODES[*]}  # megatron_rl tools/slurm_local.sh"

log() { echo "slurm_local: $*" >&2; }

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    log "slurm and munge are installed"
    return
  fi
  [ "$(id -u)" = 0 ] || { log "installing needs root (apt-get install slurm-wlm munge)"; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  log "installed $(slurmd -V) and $(munged -V 2>&1 | head -n 1)"
}

write_config() {
  local user; user=$(id -un)
  mkdir -p "$DIR"/{state,log,munge,dev}
  for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=megatronrl
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=60
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=8000 Gres=gpu:$GPUS State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=8000 Gres=gpu:$GPUS State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  : >"$DIR/gres.conf.tmp"  # written whole, then renamed
  local minor=0
  for n in "${NODES[@]}"; do
    local files=()
    for ((g = 0; g < GPUS; g++)); do
      local dev="$DIR/dev/$n-gpu$g"
      [ -e "$dev" ] || mknod "$dev" c 1 $((100 + minor))  # any char device will do
      files+=("$dev")
      minor=$((minor + 1))
    done
    for f in "${files[@]}"; do echo "NodeName=$n Name=gpu File=$f" >>"$DIR/gres.conf.tmp"; done
  done
  mv "$DIR/gres.conf.tmp" "$DIR/gres.conf"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for ((i = 0; i < limit * 10; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  log "$what did not happen within ${limit}s; logs in $DIR/log"
  tail -n 20 "$DIR"/log/*.log >&2 || true
  return 1
}

up() {
  command -v slurmctld >/dev/null || { log "SLURM is not installed: run '$0 install'"; exit 1; }
  [ -e "$DIR/slurmctld.pid" ] && down
  write_config
  grep -q "megatron_rl tools/slurm_local.sh" /etc/hosts || echo "$HOSTS_LINE" >>/etc/hosts
  [ -s "$DIR/munge/munge.key" ] || (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
  chmod 700 "$DIR/munge"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  export SLURM_CONF="$DIR/slurm.conf"
  slurmctld -i  # -i: ignore state a previous cluster in DIR left
  wait_for 20 "slurmctld answering" scontrol ping
  for n in "${NODES[@]}"; do slurmd -N "$n"; done
  wait_for 30 "both nodes idle" bash -c '[ "$(sinfo -h -N -o "%t" | sort -u)" = idle ]'
  log "up: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')($GPUS fake GPU(s) per node)"
  echo "export SLURM_CONF=$SLURM_CONF"
}

kill_pidfile() {
  local f=$1
  [ -s "$f" ] || return 0
  local pid; pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

down() {
  export SLURM_CONF="$DIR/slurm.conf"
  if [ -e "$SLURM_CONF" ] && scontrol ping >/dev/null 2>&1; then
    scancel --user="$(id -un)" 2>/dev/null || true
    wait_for 90 "the cancelled jobs ending" bash -c '[ -z "$(squeue -h -t R,CG,PD -o %i)" ]' || true
  fi
  for n in "${NODES[@]}"; do kill_pidfile "$DIR/slurmd-$n.pid"; done
  kill_pidfile "$DIR/slurmctld.pid"
  kill_pidfile "$DIR/munge/munged.pid"
  if grep -q "megatron_rl tools/slurm_local.sh" /etc/hosts; then
    grep -v "megatron_rl tools/slurm_local.sh" /etc/hosts >/tmp/hosts.slurm_local
    cat /tmp/hosts.slurm_local >/etc/hosts  # /etc/hosts may be a bind mount: write in place
    rm -f /tmp/hosts.slurm_local
  fi
  log "down ($DIR kept: logs in $DIR/log)"
}

case "${1:-}" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install | up [DIR] | down [DIR]" >&2; exit 2 ;;
esac
