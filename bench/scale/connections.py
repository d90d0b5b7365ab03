# connections.py PORT N PID: open N AMQP connections (handshake + channel.open), report broker RSS
import socket, struct, sys, time, pika.frame, pika.spec as s
port, n, pid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else 'ch'
def rss():
    for l in open(f'/proc/{pid}/status'):
        if l.startswith('VmRSS'): return int(l.split()[1])
def read_frame(sk):
    h = b''
    while len(h) < 7:
        c = sk.recv(7 - len(h))
        if not c: raise EOFError
        h += c
    size = struct.unpack('>I', h[3:7])[0]
    rest = b''
    while len(rest) < size + 1:
        c = sk.recv(size + 1 - len(rest))
        if not c: raise EOFError
        rest += c
    return h[0], rest
def m(ch, meth): return pika.frame.Method(ch, meth).marshal()
r0 = rss(); t = time.time(); socks = []
for i in range(n):
    sk = socket.create_connection(('127.0.0.1', port))
    if mode == 'tcp':
        socks.append(sk); continue
    sk.sendall(b'AMQP\x00\x00\x09\x01'); read_frame(sk)
    if mode == 'start':
        socks.append(sk); continue
    sk.sendall(m(0, s.Connection.StartOk({'product': 'conns.py'}, 'PLAIN', '\x00guest\x00guest', 'en_US'))); read_frame(sk)
    sk.sendall(m(0, s.Connection.TuneOk(2047, 131072, 0)) + m(0, s.Connection.Open('/'))); read_frame(sk)
    if mode == 'ch':
        sk.sendall(m(1, s.Channel.Open())); read_frame(sk)
    socks.append(sk)
el = time.time() - t; time.sleep(3); r1 = rss()
print(f'{n} connections in {el:.1f}s: rss {r0} -> {r1} kB, {(r1-r0)/n:.1f} kB each')
for sk in socks:
    sk.sendall(m(0, s.Connection.Close(200, 'bye', 0, 0)))
for sk in socks:
    try: read_frame(sk)
    except Exception: pass
    sk.close()
time.sleep(5); r2 = rss()
print(f'closed: rss {r2} kB ({r2 - r0} kB above the start)')
