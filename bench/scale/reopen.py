# reopen.py PORT N: waits for the broker, checks three of the N queues (passive declare), publishes and gets one message.
import sys, time, pika
port, n = int(sys.argv[1]), int(sys.argv[2])
t = time.time()
for _ in range(600):
    try:
        c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.1', port, heartbeat=0))
        break
    except Exception:
        time.sleep(0.05)
ch = c.channel()
for i in (0, n // 2, n - 1):
    ch.queue_declare(f'dev-{i:05d}', passive=True)
ch.basic_publish('', f'dev-{n-1:05d}', b'x', pika.BasicProperties(delivery_mode=2))
m = None
for _ in range(100):
    m = ch.basic_get(f'dev-{n-1:05d}', auto_ack=True)[2]
    if m: break
    time.sleep(0.01)
print(f'serving after {time.time()-t:.2f}s, got {m!r}')
c.close()
