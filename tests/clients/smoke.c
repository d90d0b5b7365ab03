/*
 * Smoke test of rabbitmq-c (librabbitmq 0.x, Debian's librabbitmq-dev) against a broker,
 * through the library's own API.
 *
 * Build: cc smoke.c -o smoke -lrabbitmq      Usage: ./smoke HOST PORT
 * Steps: declare a queue; publish with publisher confirms and wait for the basic.ack; consume
 * with manual ack; nack with requeue and see the message again with redelivered=1, then ack it;
 * a passive declare of a missing queue fails with channel.close 404 NOT_FOUND (answered with
 * channel.close-ok, as the library leaves to its user) and a new channel carries on (publish,
 * confirm, basic.get, ack); delete the queue; close cleanly. Every wait is bounded (10 s).
 * Prints each step; "PASS c" at the end; exits 1 with the failing step on any failure.
 */
#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_tcp_socket.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

static struct timeval ten_seconds = {10, 0};

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL c: ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  exit(1);
}

/* Fail unless R, the reply to a synchronous call, is normal. */
static void check_reply(amqp_rpc_reply_t r, const char *what) {
  switch (r.reply_type) {
  case AMQP_RESPONSE_NORMAL:
    return;
  case AMQP_RESPONSE_LIBRARY_EXCEPTION:
    fail("%s: library error: %s", what, amqp_error_string2(r.library_error));
    break;
  case AMQP_RESPONSE_SERVER_EXCEPTION:
    if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
      amqp_channel_close_t *c = r.reply.decoded;
      fail("%s: channel closed with %u %.*s", what, c->reply_code, (int)c->reply_text.len,
           (char *)c->reply_text.bytes);
    } else if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
      amqp_connection_close_t *c = r.reply.decoded;
      fail("%s: connection closed with %u %.*s", what, c->reply_code, (int)c->reply_text.len,
           (char *)c->reply_text.bytes);
    }
    fail("%s: server exception, method 0x%08x", what, r.reply.id);
    break;
  default:
    fail("%s: no reply (EOF)", what);
  }
}

/* Fail unless the last synchronous method call (amqp_queue_declare, …) succeeded. */
static void check_rpc(amqp_connection_state_t conn, const char *what) {
  check_reply(amqp_get_rpc_reply(conn), what);
}

static void check_status(int status, const char *what) {
  if (status != AMQP_STATUS_OK) {
    fail("%s: %s", what, amqp_error_string2(status));
  }
}

/* Publish BODY to QUEUE through the default exchange on a confirm-mode channel and wait for
 * the broker's basic.ack (a basic.nack or 10 s without an answer fail). */
static void publish_confirmed(amqp_connection_state_t conn, amqp_channel_t ch, const char *queue,
                              const char *body) {
  check_status(amqp_basic_publish(conn, ch, amqp_empty_bytes, amqp_cstring_bytes(queue), 0, 0,
                                  NULL, amqp_cstring_bytes(body)),
               "basic.publish");
  amqp_frame_t frame;
  int status = amqp_simple_wait_frame_noblock(conn, &frame, &ten_seconds);
  if (status == AMQP_STATUS_TIMEOUT) {
    fail("no publisher confirm within 10 s");
  }
  check_status(status, "waiting for the publisher confirm");
  if (frame.frame_type != AMQP_FRAME_METHOD || frame.channel != ch) {
    fail("expected basic.ack on channel %u, got frame type %u on channel %u", ch, frame.frame_type,
         frame.channel);
  }
  if (frame.payload.method.id == AMQP_BASIC_NACK_METHOD) {
    fail("publish was nacked");
  }
  if (frame.payload.method.id != AMQP_BASIC_ACK_METHOD) {
    fail("expected basic.ack, got method 0x%08x", frame.payload.method.id);
  }
}

/* The next basic.deliver of the connection (at most 10 s). */
static amqp_envelope_t next_delivery(amqp_connection_state_t conn, const char *what) {
  amqp_envelope_t env;
  amqp_maybe_release_buffers(conn);
  amqp_rpc_reply_t r = amqp_consume_message(conn, &env, &ten_seconds, 0);
  if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT) {
    fail("no delivery within 10 s: %s", what);
  }
  if (r.reply_type != AMQP_RESPONSE_NORMAL) {
    fail("%s: consume failed (reply type %d, %s)", what, r.reply_type,
         amqp_error_string2(r.library_error));
  }
  return env;
}

static int body_is(amqp_bytes_t b, const char *want) {
  return b.len == strlen(want) && memcmp(b.bytes, want, b.len) == 0;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s HOST PORT\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *host = argv[1];
  int port = atoi(argv[2]);

  amqp_connection_state_t conn = amqp_new_connection();
  amqp_socket_t *sock = amqp_tcp_socket_new(conn);
  if (sock == NULL) {
    fail("cannot create a TCP socket");
  }
  check_status(amqp_socket_open_noblock(sock, host, port, &ten_seconds), "connect");
  check_status(amqp_set_rpc_timeout(conn, &ten_seconds), "set the RPC timeout");
  check_reply(amqp_login(conn, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest"), "login");
  const amqp_table_t *server = amqp_get_server_properties(conn);
  for (int i = 0; i < server->num_entries; i++) {
    amqp_table_entry_t *e = &server->entries[i];
    if (body_is(e->key, "product") && e->value.kind == AMQP_FIELD_KIND_UTF8) {
      printf("connected to %.*s\n", (int)e->value.value.bytes.len, (char *)e->value.value.bytes.bytes);
    }
  }

  amqp_channel_t ch = 1;
  amqp_channel_open(conn, ch);
  check_rpc(conn, "channel.open");
  char queue[64];
  snprintf(queue, sizeof queue, "c-smoke-%d", (int)getpid());
  amqp_queue_declare_ok_t *declared =
      amqp_queue_declare(conn, ch, amqp_cstring_bytes(queue), 0, 0, 0, 0, amqp_empty_table);
  check_rpc(conn, "queue.declare");
  if (!body_is(declared->queue, queue)) {
    fail("declare-ok names another queue");
  }
  printf("declared %s\n", queue);

  amqp_confirm_select(conn, ch);
  check_rpc(conn, "confirm.select");
  publish_confirmed(conn, ch, queue, "hello from c");
  printf("published, confirm acked\n");

  amqp_basic_qos(conn, ch, 0, 10, 0);
  check_rpc(conn, "basic.qos");
  amqp_basic_consume_ok_t *consuming =
      amqp_basic_consume(conn, ch, amqp_cstring_bytes(queue), amqp_empty_bytes, 0, 0, 0, amqp_empty_table);
  check_rpc(conn, "basic.consume");
  amqp_bytes_t consumer_tag = amqp_bytes_malloc_dup(consuming->consumer_tag);

  amqp_envelope_t first = next_delivery(conn, "first delivery");
  if (!body_is(first.message.body, "hello from c")) {
    fail("first delivery has another body");
  }
  if (first.redelivered) {
    fail("first delivery is marked redelivered");
  }
  printf("consumed tag %llu redelivered=0\n", (unsigned long long)first.delivery_tag);
  check_status(amqp_basic_nack(conn, ch, first.delivery_tag, 0, 1), "basic.nack");
  amqp_destroy_envelope(&first);

  amqp_envelope_t again = next_delivery(conn, "redelivery after nack(requeue=1)");
  if (!body_is(again.message.body, "hello from c")) {
    fail("redelivery has another body");
  }
  if (!again.redelivered) {
    fail("redelivery after nack(requeue=1) has redelivered=0");
  }
  printf("nacked with requeue; back as tag %llu redelivered=1\n", (unsigned long long)again.delivery_tag);
  check_status(amqp_basic_ack(conn, ch, again.delivery_tag, 0), "basic.ack");
  amqp_destroy_envelope(&again);
  amqp_basic_cancel(conn, ch, consumer_tag);
  check_rpc(conn, "basic.cancel");
  amqp_bytes_free(consumer_tag);
  amqp_queue_declare_ok_t *after =
      amqp_queue_declare(conn, ch, amqp_cstring_bytes(queue), 1, 0, 0, 0, amqp_empty_table);
  check_rpc(conn, "passive queue.declare");
  if (after->message_count != 0) {
    fail("queue holds %u messages after the ack", after->message_count);
  }
  printf("acked; queue empty\n");

  amqp_channel_t bad = 2;
  amqp_channel_open(conn, bad);
  check_rpc(conn, "channel.open (2)");
  char missing[80];
  snprintf(missing, sizeof missing, "%s-missing", queue);
  if (amqp_queue_declare(conn, bad, amqp_cstring_bytes(missing), 1, 0, 0, 0, amqp_empty_table) != NULL) {
    fail("passive declare of a missing queue succeeded");
  }
  amqp_rpc_reply_t r = amqp_get_rpc_reply(conn);
  if (r.reply_type != AMQP_RESPONSE_SERVER_EXCEPTION || r.reply.id != AMQP_CHANNEL_CLOSE_METHOD) {
    fail("passive declare of a missing queue: expected channel.close, got reply type %d method 0x%08x",
         r.reply_type, r.reply.id);
  }
  amqp_channel_close_t *closed = r.reply.decoded;
  if (closed->reply_code != 404) {
    fail("passive declare of a missing queue closed the channel with %u", closed->reply_code);
  }
  printf("passive declare of a missing queue: channel closed with 404 %.*s\n",
         (int)closed->reply_text.len, (char *)closed->reply_text.bytes);
  amqp_channel_close_ok_t close_ok;
  check_status(amqp_send_method(conn, bad, AMQP_CHANNEL_CLOSE_OK_METHOD, &close_ok), "channel.close-ok");

  amqp_channel_t fresh = 3;
  amqp_channel_open(conn, fresh);
  check_rpc(conn, "channel.open (3)");
  amqp_confirm_select(conn, fresh);
  check_rpc(conn, "confirm.select (3)");
  publish_confirmed(conn, fresh, queue, "after the error");
  amqp_rpc_reply_t got = amqp_basic_get(conn, fresh, amqp_cstring_bytes(queue), 0);
  if (got.reply_type != AMQP_RESPONSE_NORMAL || got.reply.id != AMQP_BASIC_GET_OK_METHOD) {
    fail("basic.get on a new channel: reply type %d method 0x%08x", got.reply_type, got.reply.id);
  }
  uint64_t got_tag = ((amqp_basic_get_ok_t *)got.reply.decoded)->delivery_tag;
  amqp_message_t message;
  r = amqp_read_message(conn, fresh, &message, 0);
  if (r.reply_type != AMQP_RESPONSE_NORMAL || !body_is(message.body, "after the error")) {
    fail("basic.get on a new channel read another message");
  }
  amqp_destroy_message(&message);
  check_status(amqp_basic_ack(conn, fresh, got_tag, 0), "basic.ack (3)");
  printf("new channel: published, confirmed, got and acked\n");
  amqp_queue_delete(conn, fresh, amqp_cstring_bytes(queue), 0, 0);
  check_rpc(conn, "queue.delete");

  check_reply(amqp_channel_close(conn, fresh, AMQP_REPLY_SUCCESS), "channel.close (3)");
  check_reply(amqp_channel_close(conn, ch, AMQP_REPLY_SUCCESS), "channel.close (1)");
  check_reply(amqp_connection_close(conn, AMQP_REPLY_SUCCESS), "connection.close");
  check_status(amqp_destroy_connection(conn), "destroy the connection");
  printf("closed\nPASS c\n");
  return 0;
}
