#!/usr/bin/env bash
# Smoke test of rabbitmq-c's command-line tools (Debian's amqp-tools) against a broker.
#
# Usage: bash amqp-tools.sh HOST PORT
# The tools cannot do everything the other smoke tests do (no publisher confirms, no nack, no
# channel kept open across an error; tests/clients/smoke.c covers those through the library):
# declare a queue (amqp-declare-queue); publish two messages (amqp-publish); consume one with
# manual ack (amqp-consume, which acks after its command exits); basic.get the other
# (amqp-get); see the queue empty (amqp-get fails); consume from a missing queue and see it
# refused with 404 NOT_FOUND; delete the queue (amqp-delete-queue). Each tool runs at most 10 s.
# Prints each step; "PASS amqp-tools" at the end; exits 1 with the failing step on any failure.
set -uo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 HOST PORT" >&2
  exit 2
fi
conn=(--server "$1" --port "$2" --username guest --password guest)
queue="amqp-tools-smoke-$$-$RANDOM"

fail() {
  echo "FAIL amqp-tools: $*"
  exit 1
}

# tool NAME ARGS…: run an amqp-* tool on the broker (bounded), its stdout and stderr in $out.
tool() {
  local name=$1
  shift
  out=$(timeout 10 "$name" "${conn[@]}" "$@" 2>&1)
}

tool amqp-declare-queue --queue "$queue" || fail "amqp-declare-queue: $out"
[ "$out" = "$queue" ] || fail "amqp-declare-queue printed '$out', not the queue's name"
echo "declared $queue"

tool amqp-publish --routing-key "$queue" --body "one" || fail "amqp-publish: $out"
tool amqp-publish --routing-key "$queue" --body "two" || fail "amqp-publish: $out"
echo "published two messages"

tool amqp-consume --queue "$queue" --count 1 --prefetch-count 1 cat || fail "amqp-consume: $out"
[ "$out" = "one" ] || fail "amqp-consume got '$out', not 'one'"
echo "consumed 'one' with manual ack"

tool amqp-get --queue "$queue" || fail "amqp-get: $out"
[ "$out" = "two" ] || fail "amqp-get got '$out', not 'two'"
echo "got 'two'"

if tool amqp-get --queue "$queue"; then
  fail "amqp-get on the emptied queue got '$out'"
fi
echo "queue empty (the acked message did not come back)"

if tool amqp-consume --queue "$queue-missing" --count 1 cat; then
  fail "amqp-consume from a missing queue succeeded: $out"
fi
case "$out" in
  *"channel error 404"*NOT_FOUND*) echo "consume from a missing queue refused: $(printf '%s' "$out" | tr '\n' ' ')" ;;
  *) fail "consume from a missing queue failed without a channel error 404 NOT_FOUND: $out" ;;
esac

tool amqp-delete-queue --queue "$queue" || fail "amqp-delete-queue: $out"
echo "deleted $queue"
echo "PASS amqp-tools"
