# Smoke test of Bunny (2.x, Debian's ruby-bunny) against a broker, through the client's own API.
#
# Usage: ruby smoke.rb HOST PORT
# Steps: declare a queue; publish with publisher confirms and wait for the ack; consume with
# manual ack; nack with requeue and see the message again with redelivered=true, then ack it;
# a passive declare of a missing queue fails with 404 NOT_FOUND (Bunny::NotFound) and a new
# channel carries on; delete the queue; close cleanly. Prints each step; "PASS ruby" at the end;
# exits 1 with the failing step on any failure.

require "bunny"
require "timeout"

$stdout.sync = true

def check(ok, what)
  raise what unless ok
end

# The next delivery the consumer queued, waiting at most 10 s.
def next_delivery(deliveries, what)
  Timeout.timeout(10, RuntimeError, "no delivery within 10 s: #{what}") { deliveries.pop }
end

def run(host, port)
  conn = Bunny.new(host: host, port: port, user: "guest", password: "guest",
                   connection_timeout: 10, read_timeout: 10, automatically_recover: false,
                   logger: Logger.new(nil))
  conn.start
  puts "connected to #{conn.server_properties['product']} #{conn.server_properties['version']}"

  ch = conn.create_channel
  name = "ruby-smoke-#{Process.pid}-#{rand(1_000_000)}"
  q = ch.queue(name, durable: false, exclusive: false, auto_delete: false)
  check(q.name == name, "declare-ok names #{q.name}")
  puts "declared #{name}"

  ch.confirm_select
  ch.default_exchange.publish("hello from ruby", routing_key: name)
  confirmed = Timeout.timeout(10, RuntimeError, "no confirm within 10 s") { ch.wait_for_confirms }
  check(confirmed && ch.nacked_set.empty?, "publish was nacked: #{ch.nacked_set.to_a}")
  puts "published, confirm acked"

  deliveries = Queue.new
  ch.prefetch(10)
  consumer = q.subscribe(manual_ack: true) do |info, _props, body|
    deliveries << [info.delivery_tag, info.redelivered?, body]
  end
  tag, redelivered, body = next_delivery(deliveries, "first delivery")
  check(body == "hello from ruby", "first delivery's body is #{body}")
  check(!redelivered, "first delivery is marked redelivered")
  puts "consumed tag #{tag.to_i} redelivered=false"

  ch.nack(tag, false, true)
  tag, redelivered, body = next_delivery(deliveries, "redelivery after nack(requeue=true)")
  check(body == "hello from ruby", "redelivery's body is #{body}")
  check(redelivered, "redelivery after nack(requeue=true) has redelivered=false")
  puts "nacked with requeue; back as tag #{tag.to_i} redelivered=true"
  ch.ack(tag)
  consumer.cancel
  count = ch.queue_declare(name, passive: true).message_count
  check(count.zero?, "queue holds #{count} messages after the ack")
  puts "acked; queue empty"

  bad = conn.create_channel
  begin
    bad.queue("#{name}-missing", passive: true)
    raise "passive declare of a missing queue succeeded"
  rescue Bunny::NotFound => e
    code = e.channel_close.reply_code
    check(code == 404, "passive declare of a missing queue closed the channel with #{code}")
    puts "passive declare of a missing queue: channel closed with 404 #{e.channel_close.reply_text}"
  end
  check(bad.closed?, "the failed channel is still open")
  check(conn.open?, "the connection closed after a channel error")

  fresh = conn.create_channel
  fresh.confirm_select
  fresh.default_exchange.publish("after the error", routing_key: name)
  confirmed = Timeout.timeout(10, RuntimeError, "no confirm within 10 s") { fresh.wait_for_confirms }
  check(confirmed, "publish on a new channel was nacked")
  info, _props, body = fresh.basic_get(name, manual_ack: true)
  check(body == "after the error", "basic.get on a new channel got #{body.inspect}")
  fresh.ack(info.delivery_tag)
  puts "new channel: published, confirmed, got and acked"
  fresh.queue_delete(name)
  fresh.close
  ch.close
  conn.close
  puts "closed"
end

if ARGV.length != 2
  warn "usage: ruby smoke.rb HOST PORT"
  exit 2
end
begin
  run(ARGV[0], Integer(ARGV[1]))
rescue StandardError, Timeout::Error => e
  puts "FAIL ruby: #{e.class}: #{e.message}"
  puts e.backtrace.first(8)
  exit 1
end
puts "PASS ruby"
