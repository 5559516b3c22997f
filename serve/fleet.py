"""``python -m serve.fleet``: N local megajax workers behind the SGLang model gateway, in one command.

    python -m serve.fleet --workers 2 --policy cache_aware -- --model random-tiny --max-running 8
    python -m serve.fleet --prefill 1 --decode 1 -- --max-running 8      # disaggregated: P and D workers

With ``--prefill``/``--decode`` the workers run ``--disaggregation-mode prefill|decode`` (prefill
worker i's bootstrap server on ``--bootstrap-base-port`` + i) and the gateway its PD mode.

Everything after ``--`` goes to every worker (``python -m serve ...``); the fleet gives each its port
(``--worker-base-port`` + i) and starts ``python -m sglang_router.launch_router`` on ``--port`` with
their URLs once they are healthy. The first worker starts alone: the others then find its compiled
programs in the shared compile cache instead of compiling the same programs side by side.

A worker that exits is started again (the gateway's health checks take it out meanwhile and back
in when it answers); the router exiting, SIGINT or SIGTERM stops everything. Each process writes to
its own log under ``--log-dir``, and ``fleet.json`` there says which process is which (URLs, pids,
restarts), rewritten whenever one starts.

Scripts and tests start one with ``launched`` (free local ports, back once the gateway routes to
every worker, stopped on exit).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("megajax.fleet")
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
QUICK_EXIT_S = 30.0   # a worker that exits this soon after starting is crash-looping


@dataclass
class Process:
    """One child: how to start it and where it writes."""
    name: str
    cmd: list[str]
    log_path: Path
    role: str = "regular"  # a worker's: regular, prefill or decode
    popen: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    quick_exits: int = 0  # exits in a row within QUICK_EXIT_S of a start: the restart backs off
    restart_at: float | None = None  # when an exited worker starts again

    def start(self) -> None:
        self.started, self.restart_at = time.monotonic(), None
        with open(self.log_path, "ab") as out:
            # its own session: a terminal's Ctrl-C reaches the fleet only, which stops the children in order
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.popen is not None:
            stop_process(self.popen, timeout)


def stop_process(popen: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a child, SIGKILL it if it is still there after ``timeout`` seconds."""
    if popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def write_status(path: Path, router_url: str, workers: list[Process], urls: list[str]) -> None:
    status = {"router": router_url, "workers": [{"url": u, "role": w.role, "restarts": w.restarts,
                                                  "pid": w.popen.pid if w.popen else None, "log": str(w.log_path)}
                                                 for w, u in zip(workers, urls)]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(path)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(proc: Process, url: str, timeout: float) -> None:
    """Until ``url`` answers /health; a clear error when the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode} before it was healthy "
                               f"(its log: {proc.log_path})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} was not healthy after {timeout:.0f} s (its log: {proc.log_path})")
        time.sleep(0.5)


def free_ports(n: int) -> list[int]:
    """A run of ``n`` consecutive local ports nothing listens on."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            first = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", first + i))
            return list(range(first, first + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def healthy_workers(router: str) -> int:
    """How many workers the gateway at ``router`` counts healthy (0 while it does not answer)."""
    try:
        with urllib.request.urlopen(f"{router}/workers", timeout=2) as r:
            return sum(w["is_healthy"] for w in json.loads(r.read())["workers"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@contextlib.contextmanager
def launched(log_dir: Path, fleet_args: list[str], worker_args: list[str], workers: int,
             env: dict | None = None, timeout: float = 600):
    """``python -m serve.fleet fleet_args -- worker_args`` on free local ports, the gateway checking
    its workers every second (allowing 5 s for an answer: a CPU worker compiling a program on first
    use can hold its event loop that long; a dead one refuses at once); yields ``(router URL, {"bootstrap": first bootstrap port, "metrics": the
    gateway's Prometheus port, "workers": the first worker's port})`` once it
    routes to ``workers`` healthy ones, and stops the fleet on exit."""
    ports = free_ports(2 + 2 * workers)   # the gateway, its metrics, bootstrap servers, workers
    router_port, metrics_port, bootstrap, base = ports[0], ports[1], ports[2], ports[2 + workers]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.fleet", *fleet_args, "--port", str(router_port), "--worker-base-port", str(base),
         "--router-metrics-port", str(metrics_port), "--bootstrap-base-port", str(bootstrap), "--log-dir", str(log_dir),
         "--router-arg=--health-check-interval-secs=1", "--router-arg=--health-check-timeout-secs=5", "--",
         *worker_args], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, **(env or {})})
    router = f"http://127.0.0.1:{router_port}"
    deadline = time.monotonic() + timeout
    try:
        while healthy_workers(router) < workers:
            if proc.poll() is not None:
                raise RuntimeError(f"the fleet exited with code {proc.returncode}: {proc.stdout.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet had no {workers} healthy workers after {timeout:.0f} s (logs: {log_dir})")
            time.sleep(0.5)
        yield router, {"bootstrap": bootstrap, "metrics": metrics_port, "workers": base}
    finally:
        stop_process(proc, 60)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, worker_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(prog="python -m serve.fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="how many workers (replicas)")
    ap.add_argument("--prefill", type=int, default=0, help="disaggregated: how many prefill workers")
    ap.add_argument("--decode", type=int, default=0, help="disaggregated: how many decode workers")
    ap.add_argument("--bootstrap-base-port", type=int, default=8998,
                    help="disaggregated: prefill worker i's bootstrap server listens on this + i")
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the gateway's routing policy")
    ap.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    ap.add_argument("--port", type=int, default=30000, help="the gateway's port (clients talk to it)")
    ap.add_argument("--worker-base-port", type=int, default=31000, help="worker i listens on this + i")
    ap.add_argument("--router-metrics-port", type=int, default=29000, help="the gateway's Prometheus port")
    ap.add_argument("--log-dir", default="fleet_logs")
    ap.add_argument("--health-timeout", type=float, default=900, help="seconds a worker may take to start")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="passed to launch_router as is (repeatable), e.g. --router-arg=--dp-aware")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if (args.prefill > 0) != (args.decode > 0) or min(args.prefill, args.decode) < 0:
        ap.error("a disaggregated fleet needs --prefill and --decode workers, at least one of each")
    if args.prefill and "--workers" in argv:
        ap.error("--workers is for a fleet of replicas; a disaggregated one takes --prefill and --decode")
    owned = ("--port", "--host", "--disaggregation-mode", "--disaggregation-bootstrap-port")
    if any(a in owned or a.startswith(tuple(o + "=" for o in owned)) for a in worker_args):
        ap.error(f"the fleet sets each worker's {', '.join(owned)}: leave them out after --")
    return args, worker_args


def main(argv: list[str] | None = None) -> int:
    args, worker_args = parse(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    roles = (["prefill"] * args.prefill + ["decode"] * args.decode) if args.prefill else ["regular"] * args.workers
    urls = [f"http://127.0.0.1:{args.worker_base_port + i}" for i in range(len(roles))]
    workers, route = [], []
    for i, (role, url) in enumerate(zip(roles, urls)):
        cmd = [sys.executable, "-m", "serve", *worker_args, "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]]
        if role == "prefill":
            bootstrap = str(args.bootstrap_base_port + i)
            cmd += ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap]
            route += ["--prefill", url, bootstrap]
        elif role == "decode":
            cmd += ["--disaggregation-mode", "decode"]
            route += ["--decode", url]
        workers.append(Process(f"{role} worker {i}", cmd, logs / f"worker{i}.log", role))
    route = ["--pd-disaggregation", *route] if args.prefill else ["--worker-urls", *urls]
    router = Process("router", [sys.executable, "-m", "sglang_router.launch_router", *route,
                                "--policy", args.policy, "--host", args.host, "--port", str(args.port),
                                "--prometheus-port", str(args.router_metrics_port), *args.router_arg],
                     logs / "router.log")

    router_url = f"http://{args.host}:{args.port}"
    status = lambda: write_status(logs / "fleet.json", router_url, workers, urls)  # noqa: E731

    def stop(*_):
        raise SystemExit(0)   # through the finally below: the children stop with the fleet
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        workers[0].start()
        status()
        wait_healthy(workers[0], urls[0], args.health_timeout)
        for w in workers[1:]:
            w.start()
        status()
        for w, url in zip(workers[1:], urls[1:]):
            wait_healthy(w, url, args.health_timeout)
        router.start()
        log.info("gateway on %s (%s) over %s; logs in %s", router_url, args.policy, " ".join(urls), logs)
        while True:
            if not router.alive():
                raise RuntimeError(f"the router exited with code {router.popen.returncode} (its log: "
                                   f"{router.log_path})")
            now = time.monotonic()
            for w in workers:
                if w.alive():
                    continue
                if w.restart_at is None:   # it just exited
                    w.quick_exits = w.quick_exits + 1 if now - w.started < QUICK_EXIT_S else 0
                    w.restart_at = now + min(2 ** w.quick_exits - 1, 60)
                    log.warning("%s exited with code %s: starting it again in %.0f s", w.name, w.popen.returncode,
                                w.restart_at - now)
                if now >= w.restart_at:
                    w.restarts += 1
                    w.start()
                    status()
            time.sleep(0.5)
    except RuntimeError as e:
        print(f"python -m serve.fleet: {e}", file=sys.stderr)
        return 1
    finally:
        for p in [router, *workers]:
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
