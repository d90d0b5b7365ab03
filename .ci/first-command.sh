#!/usr/bin/env bash
# Runs README.md's first command exactly as written (the first line of its first ```sh block,
# comment removed), connects a pika client to the address the README promises
# (127.0.0.1:5672), publishes with a confirm and gets the message back, then stops the broker
# with SIGTERM and expects exit 0. So the README's first command cannot break silently again
# (issue 39 item 1: it once failed with "could not determine which binary to run").
# Run from the repo root; needs python3 with pika, and port 5672 free.
set -euo pipefail
cmd=$(awk '/^```sh/{f=1; next} f{print; exit}' README.md | sed 's/[[:space:]]*#.*$//')
case "$cmd" in
  "cargo run --release"*) ;;
  *) echo "README's first command is not a cargo run: '$cmd'"; exit 1 ;;
esac
if python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', 5672)) != 0)"; then
  echo "port 5672 is taken: cannot run the README's first command here"; exit 1
fi
had_data=""; [ -e data ] && had_data=1
log=$(mktemp)
echo "running: $cmd"
# A process group of its own, so that cargo and the broker both get the signal.
setsid bash -c "exec $cmd" >"$log" 2>&1 &
group=$!
stop() {
  kill -TERM -- "-$group" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$group" 2>/dev/null || break; sleep 0.1; done
}
trap 'stop; [ -n "$had_data" ] || rm -rf data; rm -f "$log"' EXIT
# The release build is done by the time this runs (.ci/run builds it first); the start is quick.
up=""
for _ in $(seq 1 600); do
  if ! kill -0 "$group" 2>/dev/null; then echo "the broker exited before it listened:"; cat "$log"; exit 1; fi
  # a connection to itself (source port = 5672 while nothing listens) does not count
  if python3 -c "import socket,sys; s=socket.create_connection(('127.0.0.1', 5672), 0.2); sys.exit(s.getsockname() == s.getpeername())" 2>/dev/null; then up=1; break; fi
  sleep 0.5
done
[ -n "$up" ] || { echo "nothing listened on 127.0.0.1:5672 within 300 s:"; cat "$log"; exit 1; }
python3 - <<'PY'
import pika
conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5672))
ch = conn.channel()
ch.queue_declare("readme-first-command", durable=True)
ch.confirm_delivery()
ch.basic_publish("", "readme-first-command", b"hello", pika.BasicProperties(delivery_mode=2))
method, props, body = ch.basic_get("readme-first-command")
assert body == b"hello", body
ch.basic_ack(method.delivery_tag)
ch.queue_delete("readme-first-command")
conn.close()
print("pika: declared, published with a confirm, got and acked on 127.0.0.1:5672 (guest/guest)")
PY
# SIGTERM to the broker alone (cargo run replaces itself with it on Unix; were cargo still its
# parent, it would pass the broker's exit status on).
broker=$(pgrep -g "$group" -x ringmq | head -1)
[ -n "$broker" ] || { echo "no ringmq process in the command's process group"; cat "$log"; exit 1; }
kill -TERM "$broker"
for _ in $(seq 1 150); do kill -0 "$group" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$group" 2>/dev/null; then echo "the broker did not stop on SIGTERM"; cat "$log"; exit 1; fi
status=0; wait "$group" || status=$?
tail -3 "$log"
[ "$status" = 0 ] || { echo "the command exited $status after the broker's SIGTERM (expected 0)"; cat "$log"; exit 1; }
echo "README's first command: served a client and stopped on SIGTERM with exit 0"
