#!/usr/bin/env bash
# batchrun CI: a single-node Slurm "cluster" on localhost (Debian 12, slurm-wlm 22.05), for tests/slurm/.
# Modelled on ../shared/slurm/slurm-ci.sh.
#   slurm-ci.sh install   apt-get the packages (idempotent)
#   slurm-ci.sh start     write config, start munged [mariadbd slurmdbd] slurmctld slurmd
#   slurm-ci.sh stop      kill exactly the PIDs recorded by start, wait for them
#   slurm-ci.sh env       print 'export SLURM_CONF=...' for eval
# Env knobs: SLURM_CI_DIR (default /tmp/slurm-probe/ci), SLURM_CI_ACCOUNTING=1 (mariadb+slurmdbd,
# makes sacct work), SLURM_CI_AUTH=munge|none (none only works on Slurm < 23.11),
# SLURM_CI_CPUS (advertise more CPUs than real -> more array tasks at once; default real count).
set -euo pipefail

BASE=${SLURM_CI_DIR:-/tmp/batchrun-slurm-ci}
ACCT=${SLURM_CI_ACCOUNTING:-0}
AUTH=${SLURM_CI_AUTH:-munge}
CONF=$BASE/etc/slurm.conf
PIDS=$BASE/pids
MSOCK=$BASE/munge/run/munge.socket.2

log() { echo "[slurm-ci] $*" >&2; }

alive() {  # running and not a zombie (daemons get reparented to PID 1, which reaps late)
  [ -r /proc/$1/stat ] && [ "$(awk '{print $3}' /proc/$1/stat 2>/dev/null)" != Z ]
}

wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
  local t=$1 what=$2; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $end ]; then log "timeout waiting for $what"; return 1; fi
    sleep 0.2
  done
}

start_bg() {  # start_bg NAME CMD...  (foreground-mode daemon, PID recorded)
  local name=$1; shift
  nohup "$@" >"$BASE/log/$name.out" 2>&1 </dev/null &
  echo "$name $!" >>"$PIDS"
  log "started $name pid $!"
}

do_install() {
  local pkgs="slurmctld slurmd slurm-client munge"
  [ "$ACCT" = 1 ] && pkgs="$pkgs slurmdbd mariadb-server"
  # shellcheck disable=SC2086
  if dpkg -s $pkgs >/dev/null 2>&1; then log "packages present"; return; fi
  apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
}

write_conf() {
  local node; node=$(hostname -s)
  # slurmd -C prints e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
  local hw; hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
  local mem; mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$((mem * 95 / 100))      # margin: RealMemory above what slurmd sees drains the node
  if [ -n "${SLURM_CI_CPUS:-}" ]; then
    hw="CPUs=$SLURM_CI_CPUS"   # with SlurmdParameters=config_overrides below
  else
    hw=$(sed 's/ RealMemory=[0-9]*//' <<<"$hw")
  fi
  local authlines
  if [ "$AUTH" = none ]; then
    authlines="AuthType=auth/none
CredType=cred/none"
  else
    authlines="AuthType=auth/munge
AuthInfo=socket=$MSOCK
CredType=cred/munge"
  fi
  local acctlines="AccountingStorageType=accounting_storage/none"
  if [ "$ACCT" = 1 ]; then
    # AccountingStoragePass = munge socket used by clients (sacct/sacctmgr) towards slurmdbd
    acctlines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819"
    [ "$AUTH" = munge ] && acctlines="$acctlines
AccountingStoragePass=$MSOCK"
  fi
  cat >"$CONF" <<EOF
ClusterName=ci
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
$authlines
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/slurmd
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
SlurmdPort=6818
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$acctlines
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
MinJobAge=3600
KillWait=5
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 $hw RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$ACCT" = 1 ]; then
    cat >"$BASE/etc/slurmdbd.conf" <<EOF
AuthType=auth/$AUTH
$( [ "$AUTH" = munge ] && echo "AuthInfo=socket=$MSOCK" )
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$BASE/run/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$BASE/etc/slurmdbd.conf"   # slurmdbd refuses a world-readable file
  fi
}

do_start() {
  if [ -s "$PIDS" ]; then
    while read -r _ p; do alive "$p" && { log "already running (pid $p); run stop first"; exit 1; }; done <"$PIDS"
  fi
  for port in 6817 6818 $( [ "$ACCT" = 1 ] && echo "6819 3306" ); do
    if (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then log "port $port already in use"; exit 1; fi
  done
  case "$BASE" in /tmp/?*) rm -rf "$BASE" ;; *) log "refusing to wipe $BASE"; exit 1 ;; esac
  mkdir -p "$BASE"/{etc,state/ctld,state/slurmd,run,log}
  : >"$PIDS"
  export SLURM_CONF=$CONF
  write_conf

  if [ "$AUTH" = munge ]; then
    # munged: socket dir AND every parent must be o+x; key must be 0600 owner-only
    mkdir -p -m 711 "$BASE/munge"; mkdir -p -m 755 "$BASE/munge/run"; chmod 711 "$BASE"
    mungekey --create --keyfile="$BASE/munge/munge.key" --force
    start_bg munged munged -F --key-file="$BASE/munge/munge.key" --socket="$MSOCK" \
      --pid-file="$BASE/munge/run/munged.pid" --log-file="$BASE/log/munged.log" \
      --seed-file="$BASE/munge/munged.seed"
    wait_for 10 munged bash -c "munge -n --socket='$MSOCK' | unmunge --socket='$MSOCK'"
  fi

  if [ "$ACCT" = 1 ]; then
    mkdir -p "$BASE/db"
    mariadb-install-db --user=root --datadir="$BASE/db/data" --auth-root-authentication-method=socket \
      --skip-test-db >"$BASE/log/mariadb-install.log" 2>&1
    start_bg mariadbd mariadbd --no-defaults --user=root --datadir="$BASE/db/data" \
      --socket="$BASE/db/mysqld.sock" --pid-file="$BASE/db/mysqld.pid" --bind-address=127.0.0.1 \
      --port=3306 --log-error="$BASE/log/mariadbd.err" --innodb-buffer-pool-size=128M \
      --innodb-lock-wait-timeout=900
    wait_for 30 mariadbd mariadb --socket="$BASE/db/mysqld.sock" -e 'select 1'
    mariadb --socket="$BASE/db/mysqld.sock" -e "
      CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
      CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurmpw';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    # slurmdbd has no -f: it reads slurmdbd.conf from the directory of \$SLURM_CONF
    start_bg slurmdbd slurmdbd -D
    wait_for 30 slurmdbd timeout 5 sacctmgr -n list cluster
  fi

  start_bg slurmctld slurmctld -D -f "$CONF"
  wait_for 30 slurmctld bash -c 'scontrol ping | grep -q "is UP"'
  start_bg slurmd slurmd -D -f "$CONF"
  wait_for 30 "node idle" bash -c "sinfo -h -n '$(hostname -s)' -o %T | grep -qx idle"
  log "ready: export SLURM_CONF=$CONF"
}

do_stop() {
  [ -s "$PIDS" ] || { log "nothing recorded in $PIDS"; return 0; }
  local rev; rev=$(tac "$PIDS")   # slurmd, slurmctld, slurmdbd, mariadbd, munged
  while read -r name p; do
    if alive "$p"; then kill "$p" && log "sent TERM to $name ($p)"; fi
    local end=$((SECONDS + 30))
    while alive "$p" && [ $SECONDS -lt $end ]; do sleep 0.2; done
    if alive "$p"; then log "$name ($p) still alive, KILL"; kill -9 "$p" || true; fi
  done <<<"$rev"
  : >"$PIDS"
}

case "${1:-}" in
  install) do_install ;;
  start) do_start ;;
  stop) do_stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|env" >&2; exit 2 ;;
esac
