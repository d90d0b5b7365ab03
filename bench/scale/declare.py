# declare.py PORT N: declares N durable queues dev-00000.. through one pika connection.
import sys, time, pika
port, n = int(sys.argv[1]), int(sys.argv[2])
c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.1', port, heartbeat=0, blocked_connection_timeout=None))
ch = c.channel()
t = time.time()
for i in range(n):
    ch.queue_declare(f'dev-{i:05d}', durable=True)
print(f'declared {n} in {time.time()-t:.1f}s')
c.close()
