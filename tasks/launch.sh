#!/bin/sh
# Start one shard's worker on this host, detached from the SSH session, and print the proof of it.
# Shipped in the code bundle; the orchestrator runs it (tasks/commands.py, launch_cmd) as
#
#   sh <bundle>/tasks/launch.sh CONTROL_DIR WAIT_TICKS GPU [NAME=VALUE | -NAME]... -- PYTHON ARG...
#
# in the shard's control dir, under a launch lock (two launches of one shard never race):
# - `ADOPT <pid> <start>` when the shard's worker is already alive: the recorded pid runs, is not a
#   zombie, started at the recorded time (/proc/PID/stat field 22, so a reused pid is not adopted), and
#   was launched with the same arguments (their checksum in pid.sig);
# - `STOPPING <pid>: ...` (exit 75) when the live worker was asked to stop (stop.json) and is finishing;
# - `BUSY <pid>: ...` (exit 75) when a live worker launched with other arguments holds the control dir (a
#   run of the same run name with other parameters) and does not end within 10 s;
# - else it starts `PYTHON ARG...` with setsid (its own session: the SSH session may end), stdin from
#   /dev/null, stdout and stderr to worker.log, CUDA_VISIBLE_DEVICES=GPU, the bundle's src/ first on
#   PYTHONPATH, NAME=VALUE exported and -NAME unset (never secrets: those travel in a 0600 file), records
#   its pid and start time, prints `LAUNCHED <pid> <start>` and waits up to WAIT_TICKS tenths of a second
#   for its STARTED line and first heartbeat, or its death;
# - `LOCK BUSY` (exit 75) when another launch held the lock for 30 s, `LOG UNWRITABLE` (exit 73) when
#   worker.log cannot be created. Values are passed as arguments, never evaluated.
set -u
[ "$#" -ge 4 ] || { echo "usage: launch.sh CONTROL_DIR WAIT_TICKS GPU [NAME=VALUE | -NAME]... -- PYTHON ARG..." >&2; exit 2; }
ctrl=$1 ticks=$2 gpu=$3
shift 3
src=$(cd "$(dirname "$0")/.." && pwd)/src
mkdir -p "$ctrl" && cd "$ctrl" || exit 1
exec 9>>.launch.lock
flock -w 30 9 || { echo 'LOCK BUSY'; exit 75; }

# field N of /proc/PID/stat, counted after the ") " that ends the command name (state is 1, starttime 20)
stat_field() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f"$2"; }

# the recorded worker, when it still runs (alive, not a zombie, started at the recorded time)
alive() { [ -s pid ] && kill -0 "$1" 2>/dev/null && [ "$(stat_field "$1" 1)" != Z ] &&
          [ "$(stat_field "$1" 20)" = "$(cat pid.start 2>/dev/null)" ]; }
# what this launch asks for (environment and command): only a worker started for the same is adopted
sig=$(for arg in "$@"; do printf '%s\n' "$arg"; done | cksum | cut -d' ' -f1)
pid=$(cat pid 2>/dev/null)
if alive "$pid" && [ -s stop.json ]; then
    echo "STOPPING $pid: this shard's worker was asked to stop ($(cat stop.json)) and has not ended yet"
    exit 75
fi
if alive "$pid"; then
    if [ "$(cat pid.sig 2>/dev/null)" = "$sig" ]; then
        echo "ADOPT $pid $(cat pid.start)"
        exit 0
    fi
    i=0  # another run of this run name with other options: if it is finishing, let it
    while [ "$i" -lt 100 ] && [ -s exit.json ] && alive "$pid"; do sleep 0.1; i=$((i + 1)); done
    if alive "$pid"; then
        echo "BUSY $pid: this shard's control dir belongs to a live worker started with other options (a run of the same run name with other parameters): stop it, or use another run_name"
        exit 75
    fi
fi
rm -f exit.json heartbeat.json pid pid.start pid.sig stop.json stop.log
{ true > worker.log; } 2>/dev/null || { echo 'LOG UNWRITABLE'; exit 73; }  # `true`: a redirection failing on `:` would end sh

while [ "$#" -gt 0 ] && [ "$1" != -- ]; do
    case $1 in
        -*) unset "${1#-}" ;;
        *=*) export "$1" ;;
        *) echo "launch.sh: not NAME=VALUE or -NAME: $1" >&2; exit 2 ;;
    esac
    shift
done
shift
CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    setsid "$@" >> worker.log 2>&1 < /dev/null 9>&- &
pid=$!
start=$(stat_field "$pid" 20)
echo "$pid" > pid
echo "$start" > pid.start
echo "$sig" > pid.sig
echo "LAUNCHED $pid $start"
i=0
while [ "$i" -lt "$ticks" ]; do
    if grep -q '^STARTED' worker.log 2>/dev/null && [ -s heartbeat.json ]; then
        break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
    i=$((i + 1))
done
