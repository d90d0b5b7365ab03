"""A real Celery worker (the venv's celery, kombu and py-amqp) against the broker at HOST PORT,
in the patterns a Celery user meets on the first day. Each scenario starts a worker process
with its own queue, sends tasks the way an application does, and reads the order in which
they ran from the marks file the tasks write (tests/clients/celery_app.py).

Usage: celery_worker.py HOST PORT SCENARIO
  countdown  four tasks with a countdown or an ETA 8 s away, then a plain one: the plain one
             runs before any of them (Celery raises its prefetch for each task it holds
             for later; a broker that does not apply the raise to the running consumer
             leaves the worker waiting for the countdowns)
  retry      two tasks that retry with countdown=6, then a plain one: the same, for retries
  queues     a worker on two queues: countdown tasks on one, a plain task on the other
  priority   a queue with x-max-priority, a worker busy with one task, then ten tasks of
             priority 1 and one of priority 9: the priority-9 task runs first after the
             busy one
Prints "PASS celery-SCENARIO" and exits 0, or "FAIL ..." and exits 1.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HOST, PORT, SCENARIO = sys.argv[1], int(sys.argv[2]), sys.argv[3]
HERE = os.path.dirname(os.path.abspath(__file__))


class Fail(Exception):
    pass


def marks(path):
    """[(name, time)] in the order the tasks ran."""
    try:
        with open(path) as f:
            return [(n, float(t)) for n, t in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []


def wait_for(path, names, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = [n for n, _ in marks(path)]
        if all(n in got for n in names):
            return got
        time.sleep(0.05)
    raise Fail("within %d s only %s ran of %s" % (seconds, [n for n, _ in marks(path)], names))


def run(scenario, env_extra, body):
    tag = uuid.uuid4().hex[:8]
    fd, path = tempfile.mkstemp(prefix="celery-marks-")
    os.close(fd)
    env = dict(os.environ)
    env.update({
        "CELERY_BROKER_URL": "amqp://guest:guest@%s:%d//" % (HOST, PORT),
        "CELERY_QUEUE": "celery-%s-%s" % (scenario, tag),
        "CELERY_MARKS": path,
        "PYTHONPATH": HERE + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.update({k: v % {"tag": tag} for k, v in env_extra.items()})
    queues = env["CELERY_QUEUE"] + ("," + env["CELERY_EXTRA_QUEUE"] if env.get("CELERY_EXTRA_QUEUE") else "")
    log = tempfile.TemporaryFile()
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-P", "threads", "-c", "1",
         "-Q", queues, "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info",
         "-n", "w-%s@%%h" % tag],
        env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.environ.update(env)
    sys.path.insert(0, HERE)
    import celery_app
    try:
        celery_app.mark.apply_async(args=["ready"])
        wait_for(path, ["ready"], 30)
        body(celery_app, path)
    except Fail:
        log.seek(0)
        sys.stdout.write(log.read().decode(errors="replace")[-4000:])
        raise
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        celery_app.app.pool.force_close_all()
        os.unlink(path)


def countdown(app, path):
    for i in range(2):
        app.mark.apply_async(args=["later-%d" % i], countdown=8)
    for i in range(2):
        app.mark.apply_async(args=["eta-%d" % i], eta=time_after(8))
    app.mark.apply_async(args=["now"])
    got = wait_for(path, ["now"], 20)
    late = [n for n in got if n.startswith(("later", "eta"))]
    if late:
        raise Fail("the plain task ran only after %s: the worker waited for its countdowns" % late)
    wait_for(path, ["later-0", "later-1", "eta-0", "eta-1"], 20)


def time_after(seconds):
    import datetime
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)


def retry(app, path):
    for i in range(2):
        app.flaky.apply_async(args=["retried-%d" % i, 6])
    wait_for(path, ["retried-0-first", "retried-1-first"], 10)
    app.mark.apply_async(args=["now"])
    got = wait_for(path, ["now"], 20)
    if "retried-0" in got or "retried-1" in got:
        raise Fail("the plain task ran only after the retries: %s" % got)
    wait_for(path, ["retried-0", "retried-1"], 20)


def queues(app, path):
    for i in range(4):
        app.mark.apply_async(args=["later-%d" % i], countdown=8)
    app.mark_extra.apply_async(args=["now"])
    got = wait_for(path, ["now"], 20)
    if any(n.startswith("later") for n in got):
        raise Fail("the other queue's task ran only after %s" % got)
    wait_for(path, ["later-%d" % i for i in range(4)], 20)


def priority(app, path):
    app.busy.apply_async(args=["busy", 1.5], priority=5)
    time.sleep(0.5)  # the worker has taken the busy task
    for i in range(10):
        app.mark.apply_async(args=["low-%d" % i], priority=1)
    app.mark.apply_async(args=["high"], priority=9)
    got = wait_for(path, ["high"] + ["low-%d" % i for i in range(10)], 30)
    after_busy = got[got.index("busy") + 1:]
    # With acks_late and prefetch 1 the worker holds only the busy task meanwhile, so the
    # highest-priority ready task is the next one it gets.
    if after_busy[0] != "high":
        raise Fail("after the busy task ran %s; expected the priority-9 task first" % after_busy)


SCENARIOS = {
    "countdown": ({}, countdown),
    "retry": ({}, retry),
    "queues": ({"CELERY_EXTRA_QUEUE": "celery-queues-extra-%(tag)s"}, queues),
    "priority": ({"CELERY_MAX_PRIORITY": "10", "CELERY_ACKS_LATE": "1"}, priority),
}


def main():
    env_extra, body = SCENARIOS[SCENARIO]
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Fail("did not finish within 90 s")))
    signal.alarm(90)
    try:
        run(SCENARIO, env_extra, body)
        print("PASS celery-%s" % SCENARIO)
        return 0
    except Fail as e:
        print("FAIL celery-%s: %s" % (SCENARIO, e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
