<?php
// Smoke test of php-amqplib (3.x, Debian's php-amqplib) against a broker, through the client's
// own API.
//
// Usage: php smoke.php HOST PORT
// Steps: declare a queue; publish with publisher confirms and wait for the ack; consume with
// manual ack; nack with requeue and see the message again with redelivered=true, then ack it;
// a passive declare of a missing queue fails with 404 NOT_FOUND (AMQPProtocolChannelException)
// and a new channel carries on; delete the queue; close cleanly. Prints each step; "PASS php"
// at the end; exits 1 with the failing step on any failure.

$autoload = getenv('PHP_AMQPLIB_AUTOLOAD') ?: '/usr/share/php/PhpAmqpLib/autoload.php';
require_once $autoload;

use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Exception\AMQPProtocolChannelException;
use PhpAmqpLib\Message\AMQPMessage;

function check($ok, $what)
{
    if (!$ok) {
        throw new RuntimeException($what);
    }
}

/** Wait (at most 10 s) until $deliveries holds $n messages. */
function wait_for($ch, &$deliveries, $n, $what)
{
    $deadline = microtime(true) + 10;
    while (count($deliveries) < $n) {
        $left = $deadline - microtime(true);
        check($left > 0, "no delivery within 10 s: $what");
        $ch->wait(null, false, $left);
    }
    return $deliveries[$n - 1];
}

function run($host, $port)
{
    $conn = new AMQPStreamConnection($host, $port, 'guest', 'guest', '/', false, 'AMQPLAIN', null, 'en_US', 10.0, 10.0);
    $props = $conn->getServerProperties();
    echo "connected to {$props['product'][1]} {$props['version'][1]}\n";

    $ch = $conn->channel();
    $queue = 'php-smoke-' . getmypid() . '-' . mt_rand();
    list($name, ,) = $ch->queue_declare($queue, false, false, false, false);
    check($name === $queue, "declare-ok names $name");
    echo "declared $queue\n";

    $acked = 0;
    $nacked = 0;
    $ch->set_ack_handler(function (AMQPMessage $m) use (&$acked) {
        $acked++;
    });
    $ch->set_nack_handler(function (AMQPMessage $m) use (&$nacked) {
        $nacked++;
    });
    $ch->confirm_select();
    $ch->basic_publish(new AMQPMessage('hello from php'), '', $queue);
    $ch->wait_for_pending_acks(10);
    check($acked === 1 && $nacked === 0, "confirms: $acked acked, $nacked nacked");
    echo "published, confirm acked\n";

    $deliveries = array();
    $ch->basic_qos(0, 10, false);
    $tag = $ch->basic_consume($queue, '', false, false, false, false, function (AMQPMessage $m) use (&$deliveries) {
        $deliveries[] = $m;
    });
    $first = wait_for($ch, $deliveries, 1, 'first delivery');
    check($first->getBody() === 'hello from php', "first delivery's body is {$first->getBody()}");
    check(!$first->isRedelivered(), 'first delivery is marked redelivered');
    echo "consumed tag {$first->getDeliveryTag()} redelivered=false\n";

    $first->nack(true);
    $again = wait_for($ch, $deliveries, 2, 'redelivery after nack(requeue=true)');
    check($again->getBody() === 'hello from php', "redelivery's body is {$again->getBody()}");
    check($again->isRedelivered(), 'redelivery after nack(requeue=true) has redelivered=false');
    echo "nacked with requeue; back as tag {$again->getDeliveryTag()} redelivered=true\n";
    $again->ack();
    $ch->basic_cancel($tag);
    list(, $count,) = $ch->queue_declare($queue, true);
    check($count === 0, "queue holds $count messages after the ack");
    echo "acked; queue empty\n";

    $bad = $conn->channel();
    try {
        $bad->queue_declare($queue . '-missing', true);
        throw new RuntimeException('passive declare of a missing queue succeeded');
    } catch (AMQPProtocolChannelException $e) {
        check($e->getCode() === 404, "passive declare of a missing queue closed the channel with {$e->getCode()}");
        echo "passive declare of a missing queue: channel closed with 404 {$e->getMessage()}\n";
    }
    check(!$bad->is_open(), 'the failed channel is still open');
    check($conn->isConnected(), 'the connection closed after a channel error');

    $fresh = $conn->channel();
    $fresh->confirm_select();
    $fresh->basic_publish(new AMQPMessage('after the error'), '', $queue);
    $fresh->wait_for_pending_acks(10);
    $got = $fresh->basic_get($queue, false);
    check($got !== null && $got->getBody() === 'after the error', 'basic.get on a new channel got ' . ($got === null ? 'nothing' : $got->getBody()));
    $got->ack();
    echo "new channel: published, confirmed, got and acked\n";
    $fresh->queue_delete($queue);
    $fresh->close();
    $ch->close();
    $conn->close();
    echo "closed\n";
}

if ($argc !== 3) {
    fwrite(STDERR, "usage: php smoke.php HOST PORT\n");
    exit(2);
}
try {
    run($argv[1], (int) $argv[2]);
} catch (Throwable $e) {
    echo 'FAIL php: ' . get_class($e) . ': ' . $e->getMessage() . "\n" . $e->getTraceAsString() . "\n";
    exit(1);
}
echo "PASS php\n";
