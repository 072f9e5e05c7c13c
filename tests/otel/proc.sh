# Process helpers shared by otelcol.sh and prometheus.sh (sourced). The caller sets
# NAME (log prefix and the executable's name), PID_FILE, LOG_FILE and STATE_DIR first.

log() { printf '[%s] %s\n' "$NAME" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$NAME" "$*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

running() { # running <pid>: exists and is not a zombie
  local st
  st="$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

alive() { # the pid file names a live $NAME process
  [ -f "$PID_FILE" ] || return 1
  local pid exe; pid="$(cat "$PID_FILE")"
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  [ "$(basename "${exe% (deleted)}")" = "$NAME" ] && running "$pid"
}

started() { # started <pid> <t0> <check> [<where>]: records <pid>, waits up to 30 s for <check>
  # to pass and logs the start-up time (since <t0>); dies (with the log's tail) when the process
  # exits first or the time runs out
  local pid="$1" t0="$2" check="$3" where="${4:+$4, }" i
  echo "$pid" >"$PID_FILE"
  for i in $(seq 1 300); do
    if ! running "$pid"; then
      tail -n 30 "$LOG_FILE" >&2 || true
      rm -f "$PID_FILE"
      die "$NAME exited during startup (log: $LOG_FILE)"
    fi
    if "$check"; then
      log "ready after $(elapsed "$t0")s (pid $pid, ${where}log $LOG_FILE)"
      return 0
    fi
    sleep 0.1
  done
  tail -n 30 "$LOG_FILE" >&2 || true
  die "$NAME not ready after 30s (log: $LOG_FILE)"
}

cmd_down() { # stops the process group (TERM, then KILL after $1 tenths of a second)
  local grace="${1:-100}"
  if alive; then
    local pid i; pid="$(cat "$PID_FILE")"
    log "stopping (pid $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 "$grace"); do running "$pid" || break; sleep 0.1; done
    if running "$pid"; then
      log "did not exit in $((grace / 10))s; killing"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$PID_FILE"
  if [ "${DSPARK_KEEP_STATE:-0}" != 1 ]; then rm -rf "$STATE_DIR"; fi
}
