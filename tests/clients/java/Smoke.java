// Smoke test of the RabbitMQ Java client (com.rabbitmq:amqp-client 5.x, Debian's
// librabbitmq-client-java) against a broker, through the client's own API.
//
// Usage: java -cp amqp-client.jar:slf4j-api.jar:slf4j-nop.jar Smoke.java HOST PORT
// Steps: declare a queue; publish with publisher confirms and wait for the ack; consume with
// manual ack; nack with requeue and see the message again with redelivered=true, then ack it;
// a passive declare of a missing queue fails with 404 NOT_FOUND (the channel closes) and a new
// channel carries on; delete the queue; close cleanly. Prints each step; "PASS java" at the end;
// exits 1 with the failing step on any failure.

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import com.rabbitmq.client.DefaultConsumer;
import com.rabbitmq.client.Envelope;
import com.rabbitmq.client.ShutdownSignalException;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

public class Smoke {
    /** One delivery as the consumer saw it. */
    static final class Delivery {
        final long tag;
        final boolean redelivered;
        final String body;

        Delivery(long tag, boolean redelivered, String body) {
            this.tag = tag;
            this.redelivered = redelivered;
            this.body = body;
        }
    }

    static void check(boolean ok, String what) {
        if (!ok) {
            throw new IllegalStateException(what);
        }
    }

    static Delivery next(BlockingQueue<Delivery> deliveries, String what) throws InterruptedException {
        Delivery d = deliveries.poll(10, TimeUnit.SECONDS);
        check(d != null, "no delivery within 10 s: " + what);
        return d;
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: Smoke HOST PORT");
            System.exit(2);
        }
        try {
            run(args[0], Integer.parseInt(args[1]));
        } catch (Exception e) {
            System.out.println("FAIL java: " + e);
            e.printStackTrace(System.out);
            System.exit(1);
        }
        System.out.println("PASS java");
        // The client's threads are non-daemon; everything is closed, but exit explicitly.
        System.exit(0);
    }

    static void run(String host, int port) throws Exception {
        ConnectionFactory factory = new ConnectionFactory();
        factory.setHost(host);
        factory.setPort(port);
        factory.setUsername("guest");
        factory.setPassword("guest");
        factory.setConnectionTimeout(10_000);
        factory.setHandshakeTimeout(10_000);
        factory.setAutomaticRecoveryEnabled(false);
        Connection conn = factory.newConnection("ringmq-java-smoke");
        System.out.println("connected to " + conn.getServerProperties().get("product") + " " + conn.getServerProperties().get("version"));

        Channel ch = conn.createChannel();
        String queue = "java-smoke-" + System.nanoTime();
        AMQP.Queue.DeclareOk declared = ch.queueDeclare(queue, false, false, false, null);
        check(declared.getQueue().equals(queue), "declare-ok names " + declared.getQueue());
        System.out.println("declared " + queue);

        ch.confirmSelect();
        ch.basicPublish("", queue, null, "hello from java".getBytes(StandardCharsets.UTF_8));
        // Throws on a nack or after 10 s without the ack.
        ch.waitForConfirmsOrDie(10_000);
        System.out.println("published, confirm acked");

        BlockingQueue<Delivery> deliveries = new LinkedBlockingQueue<>();
        ch.basicQos(10);
        String tag = ch.basicConsume(queue, false, new DefaultConsumer(ch) {
            @Override
            public void handleDelivery(String consumerTag, Envelope env, AMQP.BasicProperties props, byte[] body) {
                deliveries.add(new Delivery(env.getDeliveryTag(), env.isRedeliver(), new String(body, StandardCharsets.UTF_8)));
            }
        });
        Delivery first = next(deliveries, "first delivery");
        check(first.body.equals("hello from java"), "first delivery's body is " + first.body);
        check(!first.redelivered, "first delivery is marked redelivered");
        System.out.println("consumed tag " + first.tag + " redelivered=false");

        ch.basicNack(first.tag, false, true);
        Delivery again = next(deliveries, "redelivery after nack(requeue=true)");
        check(again.body.equals("hello from java"), "redelivery's body is " + again.body);
        check(again.redelivered, "redelivery after nack(requeue=true) has redelivered=false");
        System.out.println("nacked with requeue; back as tag " + again.tag + " redelivered=true");
        ch.basicAck(again.tag, false);
        ch.basicCancel(tag);
        AMQP.Queue.DeclareOk after = ch.queueDeclarePassive(queue);
        check(after.getMessageCount() == 0, "queue holds " + after.getMessageCount() + " messages after the ack");
        System.out.println("acked; queue empty");

        Channel bad = conn.createChannel();
        String missing = queue + "-missing";
        try {
            bad.queueDeclarePassive(missing);
            throw new IllegalStateException("passive declare of a missing queue succeeded");
        } catch (IOException e) {
            check(e.getCause() instanceof ShutdownSignalException, "passive declare failed with " + e);
            Object reason = ((ShutdownSignalException) e.getCause()).getReason();
            check(reason instanceof AMQP.Channel.Close, "passive declare's failure is not a channel.close: " + reason);
            int code = ((AMQP.Channel.Close) reason).getReplyCode();
            check(code == 404, "passive declare of a missing queue closed the channel with " + code);
            System.out.println("passive declare of a missing queue: channel closed with 404 " + ((AMQP.Channel.Close) reason).getReplyText());
        }
        check(!bad.isOpen(), "the failed channel is still open");
        check(conn.isOpen(), "the connection closed after a channel error");

        Channel fresh = conn.createChannel();
        fresh.confirmSelect();
        fresh.basicPublish("", queue, null, "after the error".getBytes(StandardCharsets.UTF_8));
        fresh.waitForConfirmsOrDie(10_000);
        com.rabbitmq.client.GetResponse got = fresh.basicGet(queue, false);
        check(got != null && new String(got.getBody(), StandardCharsets.UTF_8).equals("after the error"), "basic.get on a new channel got " + got);
        fresh.basicAck(got.getEnvelope().getDeliveryTag(), false);
        System.out.println("new channel: published, confirmed, got and acked");
        fresh.queueDelete(queue);
        fresh.close();
        ch.close();
        conn.close(10_000);
        System.out.println("closed");
    }
}
