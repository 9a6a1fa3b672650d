#!/bin/bash
# bench/router_idle.sh: the router's CPU while nothing happens, for one kvfleet binary or a
# baseline and a candidate: a `kvfleet up` fleet (1 prefill, 2 decode, kv policy) is measured
# over 5 s (a) idle with its WatchKv streams open and (b) with 8 Generate streams open to decode
# workers stopped with SIGSTOP (streams open, no traffic). Prints a table and candidate/baseline.
# usage: bench/router_idle.sh MODEL_DIR KVFLEET [BASELINE_KVFLEET]
set -u
M=$1; shift
[ -f "$M/config.json" ] || { echo "usage: $0 MODEL_DIR KVFLEET [BASELINE_KVFLEET]" >&2; exit 2; }
tck=$(getconf CLK_TCK)
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }

# measure BIN: prints "<idle ms> <open-streams ms>" (router CPU per 5 s)
measure() {
  local BIN=$1 T UP URL R="" D="" p c a b idle open
  T=$(mktemp -d)
  "$BIN" up --model "$M" --prefill 1 --decode 2 --port 0 >"$T/up.out" 2>"$T/up.err" &
  UP=$!
  for _ in $(seq 600); do grep -q serving "$T/up.out" && break; sleep 0.1; done
  URL=$(sed -n 's/.*at \(http:[^ ]*\).*/\1/p' "$T/up.out" | head -1)
  for _ in $(seq 100); do curl -sf "$URL/ready" >/dev/null && break; sleep 0.1; done
  for p in $(pgrep -P $UP); do
    c=$(tr '\0' ' ' <"/proc/$p/cmdline")
    case "$c" in *" router "*) R=$p ;; *" decode "*) D="$D $p" ;; esac
  done
  if [ -z "$R" ] || [ -z "$D" ]; then
    echo "router_idle: $BIN up did not start (see $T)" >&2; kill -INT $UP; return 1
  fi
  sleep 1
  a=$(cpu $R); sleep 5; b=$(cpu $R); idle=$(( (b - a) * 1000 / tck ))
  kill -STOP $D
  local name; name=$(basename "$M")
  for i in $(seq 8); do
    curl -sN "$URL/v1/completions" -H 'Content-Type: application/json' \
      -d '{"model":"'"$name"'","prompt":[1,2,3,'$i'],"max_tokens":20,"stream":true}' >/dev/null &
  done
  sleep 1
  a=$(cpu $R); sleep 5; b=$(cpu $R); open=$(( (b - a) * 1000 / tck ))
  kill -CONT $D
  wait $(jobs -p | grep -vx "$UP") 2>/dev/null
  kill -INT $UP; wait $UP 2>/dev/null; rm -rf "$T"
  echo "$idle $open"
}

echo "router_idle: measuring ${2:-}${2:+ (baseline) and }$1 on $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)" >&2
read -r ci co < <(measure "$1") || exit 1
if [ $# -ge 2 ]; then read -r bi bo < <(measure "$2") || exit 1; fi
printf '%-34s %12s' "router CPU ms per 5 s" "candidate"; [ $# -ge 2 ] && printf ' %12s %8s' baseline ratio; echo
row() { printf '%-34s %12s' "$1" "$2"; [ $# -ge 3 ] && printf ' %12s %8s' "$3" "$(awk -v a="$2" -v b="$3" 'BEGIN{print b ? sprintf("%.2f", a / b) : "nan"}')"; echo; }
if [ $# -ge 2 ]; then row "idle, WatchKv streams open" "$ci" "$bi"; row "8 Generate streams open, silent" "$co" "$bo"
else row "idle, WatchKv streams open" "$ci"; row "8 Generate streams open, silent" "$co"; fi
