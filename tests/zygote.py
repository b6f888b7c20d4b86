"""The pre-warmed parent of the test harness's ranks (tests/harness.py starts one per pytest process).

It imports the training stack once (~8 s of CPU that every torchrun worker pays), then, for each request read
from stdin (one JSON line: argv, ranks, env, cwd, log_dir, timeout_s, and stdin: a file for the processes' stdin
or null), forks one process per rank (or one plain process where ranks is null), each running `python *argv` in
itself (a script, or -m module), and answers one JSON line with every process's exit status once all have ended.

A rank runs what a torchrun worker runs: the same `__main__` under the variables `torchrun
--standalone` sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, a free
MASTER_PORT, ...) except the agent's TORCHELASTIC_* ones. Output goes to log_dir/rank{N}.std{out,err}.

Warm ranks: a launch of 2 or more ranks runs in a pool of rank processes kept for that world size (forked once,
reused launch after launch; `fresh: true` in a request forks new ones instead). A rank's first DTensor run pays
~1.2 s of CPU that a second one does not (sharding propagation computed once per operator and shape, first-call
set-up), and most of the suite's launches are such runs. Between two launches a warm rank is put back to what a
fresh one would have (see `reset_between_runs`); after any launch that failed, was killed, or left state behind
that cannot be put back (a process group, a thread, deepspeed imported, a compiled graph, ...), the whole pool is
retired and the next launch forks anew.

Fork safety: this process imports modules but runs no torch op (no OpenMP/MKL pool), never touches CUDA or a
process group, and checks before each fork that its only other thread is pyarrow's jemalloc purger (jemalloc's own
fork handlers make that one safe); a rank sets its thread count as OMP_NUM_THREADS would have.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import importlib
import importlib.util
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings

# What every training run imports (sys.modules after a run). Not deepspeed: a run without engine=deepspeed never
# imports it, and must not run beside what its import sets up.
PRELOAD = (
    "parallel_finetune.train",
    "parallel_finetune.loop.trainer",
    "parallel_finetune.parallel.deepspeed_engine",
    "torch.utils.tensorboard",
    "transformers.optimization",
)
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}
# After one rank fails, its peers get this long to end on their own (printing their side of the story) before
# they are killed, as torchrun stops the rest of a group whose worker failed.
PEER_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)


def foreign_threads() -> list[str]:
    names = [
        open(f"/proc/self/task/{task}/comm").read().strip()
        for task in os.listdir("/proc/self/task")
        if int(task) != os.getpid()
    ]
    return [name for name in names if name not in FORK_SAFE_THREADS]


def fork_hazards() -> list[str]:
    import torch

    hazards = [f"thread {name!r} running" for name in foreign_threads()]
    if torch.cuda.is_initialized():
        hazards.append("CUDA initialised")
    if torch.distributed.is_initialized():
        hazards.append("a process group exists")
    return hazards


PORT_BLOCK = 1000  # ports per pytest-xdist worker, from PORT_BASE up
PORT_BASE = 20000


def free_port() -> int:
    """A port nothing listens on, for a store that will listen on it a moment later.

    A port picked by binding to 0 is an ephemeral one: between closing it here and rank 0's store listening on it,
    any gloo connection of a concurrent test can take it (EADDRINUSE, seen once in CI). So pick below the kernel's
    ephemeral range, where it never hands ports out, from a block of this pytest-xdist worker's own."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:  # not Linux: trust nothing
        ephemeral_low = 0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = PORT_BASE + (int(worker) if worker.isdigit() else 0) * PORT_BLOCK
    candidates = []
    if low + PORT_BLOCK <= ephemeral_low:
        candidates = random.SystemRandom().sample(range(low, low + PORT_BLOCK), 64)
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def child_environment(request: dict, rank: int, port: int) -> dict[str, str]:
    """A plain process gets the request's environment; a rank gets what torchrun's agent adds but its own keys."""
    env = dict(request["env"])
    nproc = request["ranks"]
    if nproc is None:
        return env
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    return env


def exit_code(code) -> int:
    """What the interpreter makes of sys.exit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def print_from(main_file: str, exc: BaseException) -> None:
    """The traceback as the interpreter prints it: from the main file's frame on, no harness frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != main_file:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def run_main(argv: list[str]) -> int:
    """`python *argv` (a script and its arguments, or -m module ...) in this process; returns its exit code."""
    if argv[0] == "-m":
        main_file = importlib.util.find_spec(argv[1]).origin
        sys.argv, sys.path[0] = [main_file, *argv[2:]], os.getcwd()  # as `python -m` sets them
        sys.modules.pop(argv[1], None)  # preloaded here, but not yet imported in a fresh `python -m`

        def run():
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        main_file = argv[0]
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(main_file))  # as `python script`

        def run():
            runpy.run_path(main_file, run_name="__main__")

    try:
        run()
        return 0
    except SystemExit as exit:
        return exit_code(exit.code)
    except BaseException as exc:  # noqa: BLE001 - an uncaught exception ends the interpreter with its traceback
        print_from(main_file, exc)
        return 1


def detach(zygote: int) -> bool:
    """In a forked child: a process group of its own (a kill reaches whatever it starts: compile workers), and death
    with the zygote. False where the zygote died before that took effect."""
    os.setsid()
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == zygote


def close_inherited(reply_fd: int, keep: tuple[int, ...] = ()) -> None:
    """The zygote's descriptors a child must not hold: its reply channel and every warm rank's pipes (a rank holding
    another's would keep it from seeing the zygote go)."""
    for fd in {reply_fd, *OPEN_POOL_FDS} - set(keep):
        os.close(fd)


def become(request: dict, rank: int, port: int) -> None:
    """Take the streams, environment, folder and signal handlers of the process (rank `rank`) the request asks for."""
    log = os.path.join(request["log_dir"], f"rank{rank}")
    for fd, path, flags in (
        (0, request.get("stdin") or os.devnull, os.O_RDONLY),
        (1, log + ".stdout", os.O_WRONLY | os.O_CREAT),
        (2, log + ".stderr", os.O_WRONLY | os.O_CREAT),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(child_environment(request, rank, port))
    os.chdir(request["cwd"])
    signal.alarm(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGCHLD", "SIGUSR1", "SIGUSR2", "SIGALRM"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gc.enable()


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the exit code from being reported
            pass


def run_child(request: dict, rank: int, port: int, reply_fd: int, zygote: int) -> None:
    """In the forked child: become the process (or rank `rank`) the request asks for, and never return."""
    code = 1
    try:
        if not detach(zygote):
            return
        close_inherited(reply_fd)
        become(request, rank, port)
        code = run_main(request["argv"])
        atexit._run_exitfuncs()  # the interpreter's own exit, minus tearing down the heap it shares with us
    except BaseException:  # noqa: BLE001 - the harness itself failed in this child: say so in its log
        traceback.print_exc()
    finally:
        flush_streams()
        os._exit(code)


# ---------------------------------------------------------------- warm ranks (see the module's docstring)

OPEN_POOL_FDS: set[int] = set()  # the zygote's ends of every warm rank's pipes
MAX_RUNS = 40  # launches one warm rank serves before it is retired: what a run leaks cannot pile up
MAX_RESIDENT_MIB = 1536  # a warm rank grown past this is retired (a tiny run's rank holds ~700 MiB)
# Modules whose import sets up what no later run may inherit: deepspeed's accelerator and patches (a run without
# engine=deepspeed must not run beside them), inductor's compiled graphs, caches and compile workers.
TAINTING_MODULES = ("deepspeed", "torch._inductor.compile_fx")


class Fresh:
    """What a warm rank had before its first run, to put back or compare with after each."""

    def __init__(self):
        self.path = list(sys.path)
        self.filters = list(warnings.filters)
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.threads = set(threading.enumerate())
        self.modules = set(sys.modules)
        self.runs = 0


def reset_between_runs(fresh: Fresh) -> None:
    """Put back what a run changes in a process and a fresh rank would not have seen: the import path, the warning
    filters and the once-only registries (a warning a test looks for is printed again), tempfile's folder, the
    package's memoised functions, torch's defaults, and DTensor's random-number tracker (a fresh one syncs the ranks'
    seeds on its first use)."""
    sys.path[:] = fresh.path
    warnings.filters[:] = fresh.filters
    warnings._filters_mutated()
    warnings.onceregistry.clear()
    tempfile.tempdir = None
    for name, module in list(sys.modules.items()):
        if name.startswith("parallel_finetune") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper):
                    value.cache_clear()
    import logging

    for once in ("warning_once", "info_once"):  # transformers' Logger methods, memoised per process
        getattr(getattr(logging.Logger, once, None), "cache_clear", lambda: None)()
    import torch
    import torch.distributed.tensor._random as dtensor_random

    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    dtensor_random._rng_tracker = None


def reason_to_retire(request: dict, code: int, fresh: Fresh) -> str | None:
    """Why this warm rank must not serve another launch after this one, or None."""
    import torch.distributed as dist

    fresh.runs += 1
    new_modules = set(sys.modules) - fresh.modules
    tainted = [m for m in TAINTING_MODULES if any(n == m or n.startswith(m + ".") for n in new_modules)]
    threads = [t.name for t in threading.enumerate() if t not in fresh.threads and not t.daemon and t.is_alive()]
    resident_mib = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    reasons = [
        (code != 0, f"exit code {code}"),
        (bool(request.get("stdin")), "it read a stdin file (sys.stdin may hold the rest of it)"),
        (dist.is_initialized(), "a process group is still initialised"),
        ((sys.stdin, sys.stdout, sys.stderr) != fresh.streams, "sys.stdin, stdout or stderr was replaced"),
        (bool(tainted), f"it imported {', '.join(tainted)}"),
        (bool(threads), f"threads still running: {', '.join(threads)}"),
        (resident_mib > MAX_RESIDENT_MIB, f"{resident_mib} MiB resident"),
        (fresh.runs >= MAX_RUNS, f"{fresh.runs} launches served"),
    ]
    return next((why for due, why in reasons if due), None)


class ExitHandlers:
    """The atexit handlers a run registers, run (last first) and dropped when it ends, as its process's exit would."""

    def __enter__(self):
        self.registered = []
        self.register = atexit.register

        def register(func, *args, **kwargs):
            self.registered.append((func, args, kwargs))
            return self.register(func, *args, **kwargs)

        atexit.register = register
        return self

    def __exit__(self, *exc):
        atexit.register = self.register
        for func, args, kwargs in reversed(self.registered):
            atexit.unregister(func)
            try:
                func(*args, **kwargs)
            except Exception:  # noqa: BLE001 - as the interpreter does: print it and go on
                traceback.print_exc()
        return False


def run_warm(request: dict, fresh: Fresh) -> tuple[int, str | None]:
    """One launch in a warm rank: its exit code, and why the rank must be retired after it (None: it may serve on)."""
    try:
        reset_between_runs(fresh)
        become(request, request["rank"], request["port"])
        with ExitHandlers():
            code = run_main(request["argv"])
    except BaseException:  # noqa: BLE001 - the harness itself failed: say so in the rank's log
        traceback.print_exc()
        flush_streams()
        return 1, "the harness failed in the rank"
    flush_streams()
    return code, reason_to_retire(request, code, fresh)


def serve_launches(requests_fd: int, replies_fd: int, reply_fd: int, zygote: int) -> None:
    """In a warm rank: run each launch the zygote sends (one JSON line) and answer its exit code; never return."""
    try:
        if not detach(zygote):
            return
        close_inherited(reply_fd, keep=(requests_fd, replies_fd))
        fresh = Fresh()
        for line in os.fdopen(requests_fd, "rb"):
            code, retire = run_warm(json.loads(line), fresh)
            os.write(replies_fd, (json.dumps({"code": code, "retire": retire}) + "\n").encode())
    except BaseException:  # noqa: BLE001 - the harness itself failed in this rank: say so in its log
        traceback.print_exc()
    finally:
        flush_streams()
        os._exit(1)


class WarmRank:
    """A warm rank as the zygote sees it: launches go down one pipe, exit codes come up the other."""

    def __init__(self, rank: int, reply_fd: int):
        down, up = os.pipe(), os.pipe()
        self.rank, self.pid = rank, os.fork()
        if self.pid == 0:
            os.close(down[1])
            os.close(up[0])
            serve_launches(down[0], up[1], reply_fd, os.getppid())
        os.close(down[0])
        os.close(up[1])
        self.requests, self.replies = down[1], up[0]
        OPEN_POOL_FDS.update((self.requests, self.replies))
        self.exit: int | None = None  # the process's own exit status, once it died
        self.reply: dict | None = None
        self.pending = b""

    def send(self, request: dict) -> None:
        self.reply, self.pending = None, b""
        data = (json.dumps(request) + "\n").encode()
        while data:
            data = data[os.write(self.requests, data) :]

    def poll(self) -> int | None:
        """This launch's exit code once the rank answered (or died); None while it runs."""
        if self.reply is None and self.exit is None:
            if select.select([self.replies], [], [], 0)[0]:
                self.pending += os.read(self.replies, 65536)
                if b"\n" in self.pending:
                    self.reply = json.loads(self.pending.split(b"\n", 1)[0])
            if self.reply is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.exit = os.waitstatus_to_exitcode(status)
        return self.reply["code"] if self.reply is not None else self.exit

    def kill(self) -> None:
        kill_group(self.pid)

    def retire(self) -> None:
        kill_group(self.pid)
        if self.exit is None:
            os.waitpid(self.pid, 0)
        for fd in (self.requests, self.replies):
            os.close(fd)
            OPEN_POOL_FDS.discard(fd)


class ForkedRank:
    """A process forked for one launch: done when it exits."""

    def __init__(self, pid: int):
        self.pid, self.exit = pid, None

    def poll(self) -> int | None:
        if self.exit is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exit = os.waitstatus_to_exitcode(status)
        return self.exit

    def kill(self) -> None:
        kill_group(self.pid)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for(ranks: list, timeout_s: float) -> dict:
    """Every rank's exit code; kill the rest at the timeout, or PEER_GRACE_S after the first rank failed."""
    deadline = time.monotonic() + timeout_s
    returncodes: dict[int, int] = {}
    killed: dict[int, str] = {}
    exit_order: list[int] = []
    first_failure = None  # (rank, when)
    timed_out = False
    while len(returncodes) < len(ranks):
        for rank, process in enumerate(ranks):
            code = None if rank in returncodes else process.poll()
            if code is not None:
                returncodes[rank] = code
                exit_order.append(rank)
                if code != 0 and first_failure is None:
                    first_failure = rank, time.monotonic()
        now, reason = time.monotonic(), None
        if now > deadline:
            timed_out, reason = True, f"still running at the {timeout_s:g} s timeout"
        elif first_failure and now > first_failure[1] + PEER_GRACE_S:
            reason = f"still running {PEER_GRACE_S:g} s after rank {first_failure[0]} failed"
        for rank, process in enumerate(ranks):
            if reason and rank not in returncodes and rank not in killed:
                killed[rank] = reason
                process.kill()
        if len(returncodes) < len(ranks):
            time.sleep(0.02)
    return {
        "returncodes": [returncodes[r] for r in range(len(ranks))],
        "exit_order": exit_order,
        "killed": {str(r): why for r, why in killed.items()},
        "timed_out": timed_out,
        "pids": [process.pid for process in ranks],
    }


POOLS: dict[int, list[WarmRank]] = {}  # world size -> its warm ranks


def launch_warm(request: dict, reply_fd: int) -> dict:
    """A launch of 2+ ranks in the pool for its world size (forked first where there is none)."""
    size = request["ranks"]
    if size not in POOLS:
        hazards = fork_hazards()
        if hazards:
            return {"refused": "unsafe to fork: " + ", ".join(hazards)}
        flush_streams()
        POOLS[size] = [WarmRank(rank, reply_fd) for rank in range(size)]
    pool, port = POOLS[size], free_port()
    for warm in pool:
        warm.send({**request, "rank": warm.rank, "port": port})
    result = wait_for(pool, request["timeout_s"])
    retire = [
        f"rank {w.rank}: {w.reply['retire'] if w.reply else 'died'}" for w in pool if not w.reply or w.reply["retire"]
    ]
    if retire or result["killed"]:
        for warm in POOLS.pop(size):
            warm.retire()
    result["retired"] = retire
    return result


def launch(request: dict, reply_fd: int) -> dict:
    if (request["ranks"] or 1) >= 2 and not request.get("fresh"):
        return launch_warm(request, reply_fd)
    hazards = fork_hazards()
    if hazards:
        return {"refused": "unsafe to fork: " + ", ".join(hazards)}
    port, zygote = free_port(), os.getpid()
    ranks = []
    flush_streams()
    for rank in range(request["ranks"] or 1):
        pid = os.fork()
        if pid == 0:
            run_child(request, rank, port, reply_fd, zygote)
        ranks.append(ForkedRank(pid))
    return wait_for(ranks, request["timeout_s"])


def serve() -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print here must not corrupt the replies
    gc.disable()  # no collection between the imports and the fork: freeze keeps children from rescanning them
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    replies = os.fdopen(reply_fd, "w", buffering=1)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(launch(json.loads(line), reply_fd)) + "\n")


if __name__ == "__main__":
    serve()
