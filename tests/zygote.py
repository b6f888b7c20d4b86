"""The pre-warmed parent of the test harness's ranks (tests/harness.py starts one per pytest process).

It imports the training stack once (~8 s of CPU that every torchrun worker pays), then, for each request read
from stdin (one JSON line: argv, ranks, env, cwd, log_dir, timeout_s, and stdin: a file for the processes' stdin
or null), forks one process per rank (or one plain process where ranks is null), each running `python *argv` in
itself (a script, or -m module), and answers one JSON line with every process's exit status once all have ended.

A rank runs what a torchrun worker runs: the same `__main__` under the variables `torchrun
--standalone` sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, a free
MASTER_PORT, ...) except the agent's TORCHELASTIC_* ones. Output goes to log_dir/rank{N}.std{out,err}.

Fork safety: this process imports modules but runs no torch op (no OpenMP/MKL pool), never touches CUDA or a
process group, and checks before each fork that its only other thread is pyarrow's jemalloc purger (jemalloc's own
fork handlers make that one safe); a rank sets its thread count as OMP_NUM_THREADS would have.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import random
import runpy
import signal
import socket
import sys
import time
import traceback
import weakref

# What every training run imports (sys.modules after a run). Not deepspeed: a run without engine=deepspeed never
# imports it, and must not run beside what its import sets up.
PRELOAD = (
    "parallel_finetune.train",
    "parallel_finetune.loop.trainer",
    "parallel_finetune.loop.run",  # imported by train.main when it runs: ~0.15 s of every rank's CPU
    "parallel_finetune.launch",
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


def run_child(request: dict, rank: int, port: int, reply_fd: int, zygote: int) -> None:
    """In the forked child: become the process (or rank `rank`) the request asks for, and never return."""
    code = 1
    try:
        os.setsid()  # its own process group: a kill reaches whatever it started (compile workers)
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and it dies with the zygote
        if os.getppid() != zygote:  # which died before prctl took effect
            return
        os.close(reply_fd)
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
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in ("SIGTERM", "SIGHUP", "SIGCHLD", "SIGUSR1", "SIGUSR2"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        gc.enable()
        code = run_main(request["argv"])
        atexit._run_exitfuncs()  # the interpreter's own exit, minus tearing down the heap it shares with us
    except BaseException:  # noqa: BLE001 - the harness itself failed in this child: say so in its log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the exit code from being reported
                pass
        os._exit(code)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for(pids: list[int], timeout_s: float) -> dict:
    """Reap every rank; kill the rest at the timeout, or PEER_GRACE_S after the first rank failed."""
    deadline = time.monotonic() + timeout_s
    returncodes: dict[int, int] = {}
    killed: dict[int, str] = {}
    exit_order: list[int] = []
    first_failure = None  # (rank, when)
    timed_out = False
    cpu_s: dict[int, float] = {}
    while len(returncodes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid:
            rank = pids.index(pid)
            cpu_s[rank] = usage.ru_utime + usage.ru_stime
            returncodes[rank] = os.waitstatus_to_exitcode(status)
            exit_order.append(rank)
            if returncodes[rank] != 0 and first_failure is None:
                first_failure = rank, time.monotonic()
            continue
        now, reason = time.monotonic(), None
        if now > deadline:
            timed_out, reason = True, f"still running at the {timeout_s:g} s timeout"
        elif first_failure and now > first_failure[1] + PEER_GRACE_S:
            reason = f"still running {PEER_GRACE_S:g} s after rank {first_failure[0]} failed"
        for rank, pid in enumerate(pids):
            if reason and rank not in returncodes and rank not in killed:
                killed[rank] = reason
                kill_group(pid)
        time.sleep(0.02)
    return {
        "returncodes": [returncodes[r] for r in range(len(pids))],
        "exit_order": exit_order,
        "killed": {str(r): why for r, why in killed.items()},
        "timed_out": timed_out,
        "cpu_s": [cpu_s.get(r, 0.0) for r in range(len(pids))],
    }


def launch(request: dict, reply_fd: int) -> dict:
    hazards = fork_hazards()
    if hazards:
        return {"refused": "unsafe to fork: " + ", ".join(hazards)}
    port, zygote = free_port(), os.getpid()
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(request["ranks"] or 1):
        pid = os.fork()
        if pid == 0:
            run_child(request, rank, port, reply_fd, zygote)
        pids.append(pid)
    return wait_for(pids, request["timeout_s"])


def warm_caches() -> None:
    """Fill, once before the forks, the process-wide caches every run would otherwise fill after them: transformers'
    table of checkpoint conversions (~250 model types' weight renamings, each a compiled regular expression: 0.06 s
    of CPU), which every save_pretrained and from_pretrained builds on first use; and SST-2's metric module
    (`evaluate` loading glue.py, scikit-learn's first scoring: ~30 ms of every evaluating rank)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from parallel_finetune.metrics import compute_metrics

    get_checkpoint_conversion_mapping("llama")
    compute_metrics("sst2", [0, 1, 1], [0, 1, 0])


def spare_library_teardown() -> None:
    """At an interpreter's exit, weakref finalizers undo every torch.library registration (torchao's and torch's
    own, ~210 of them, each clearing dispatcher caches): ~30 ms of CPU at every rank's exit for a heap that dies with
    it. Those registered before the fork are not run at a rank's exit; every other exit handler still is."""
    import torch.library

    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if info.func is getattr(torch.library, "_del_library", None):
            finalizer.atexit = False


def serve() -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print here must not corrupt the replies
    gc.disable()  # no collection between the imports and the fork: freeze keeps children from rescanning them
    for name in PRELOAD:
        importlib.import_module(name)
    warm_caches()
    spare_library_teardown()
    gc.freeze()
    replies = os.fdopen(reply_fd, "w", buffering=1)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(launch(json.loads(line), reply_fd)) + "\n")


if __name__ == "__main__":
    serve()
