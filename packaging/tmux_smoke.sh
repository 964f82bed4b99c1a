#!/usr/bin/env bash
# Smoke test of the terminal app in a real terminal: tmux runs `moechat chat MODEL_DIR`, the script
# types a prompt with send-keys and checks with capture-pane that the reply and the live panel show.
#
#   packaging/tmux_smoke.sh [MODEL_DIR]        MODEL_DIR defaults to assets/demo-moe
#
# Environment: MOECHAT, the command to run (default `moechat`; e.g. `python -m moechat.app.tui.launch`),
# TIMEOUT seconds for loading and for the reply (default 180), KEEP=1 keeps the tmux session.
# Settings and chats go to a temporary XDG dir, so the user's own are never touched. Exit 0 on success;
# 1 with the captured pane on failure; 2 when tmux or the model is missing.
set -euo pipefail

model=${1:-assets/demo-moe}
moechat=${MOECHAT:-moechat}
timeout=${TIMEOUT:-180}

command -v tmux >/dev/null || { echo "tmux_smoke: tmux is not installed (apt-get install tmux)" >&2; exit 2; }
[ -f "$model/config.json" ] || { echo "tmux_smoke: $model: not a model directory (no config.json)" >&2; exit 2; }
model=$(cd "$model" && pwd)

session="moechat-smoke-$$"
tmp=$(mktemp -d)
mkdir -p "$tmp/config/moechat" "$tmp/data"
# A short greedy reply keeps the run fast on a CPU.
printf '[chat]\nmax_tokens = 24\n\n[sampling]\ntemperature = 0.0\n' > "$tmp/config/moechat/settings.toml"

cleanup() {
    [ "${KEEP:-0}" = 1 ] || tmux kill-session -t "$session" 2>/dev/null || :
    rm -rf "$tmp"
}
trap cleanup EXIT

pane() { tmux capture-pane -p -t "$session"; }

# wait_for REGEX WHAT: poll the pane until it matches (extended grep), or fail after $timeout seconds.
wait_for() {
    local deadline=$((SECONDS + timeout))
    until pane | grep -Eq -- "$1"; do
        if ((SECONDS > deadline)); then
            echo "tmux_smoke: FAILED: no $2 after ${timeout}s; the pane shows:" >&2
            pane >&2
            exit 1
        fi
        sleep 0.5
    done
}

tmux new-session -d -s "$session" -x 140 -y 40 \
    "env XDG_CONFIG_HOME='$tmp/config' XDG_DATA_HOME='$tmp/data' TERM=xterm-256color $moechat chat '$model'; \
     echo \"[moechat exited with \$?]\"; sleep 600"

wait_for 'now: [0-9]+/[0-9]+ slots' "loaded model (the tuning panel's effective line)"
tmux send-keys -t "$session" -l "What does an expert cache do?"
tmux send-keys -t "$session" Enter
wait_for '[0-9]+ tokens · [0-9.]+ tok/s' "finished reply (its 'N tokens · X tok/s' line)"
wait_for 'cache +[0-9.]+%' "hit rate in the panel"

out=$(pane)
fail=0
for check in 'You' 'What does an expert cache do\?' 'Assistant' 'prefill [0-9.]+ +decode [0-9.]+' \
             'cache +[0-9.]+% +[0-9,]+ hits' 'slots +[0-9]+/[0-9]+ used' 'L0 ' 'RAM +[0-9.]+ [KMG]iB used'; do
    if ! grep -Eq -- "$check" <<<"$out"; then
        echo "tmux_smoke: FAILED: the pane does not show /$check/" >&2
        fail=1
    fi
done
echo "$out"
if ((fail)); then exit 1; fi

tmux send-keys -t "$session" C-q
wait_for '\[moechat exited with 0\]' "clean exit after Ctrl+Q"
echo "tmux_smoke: OK ($model)"
