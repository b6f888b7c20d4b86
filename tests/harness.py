"""Multi-rank runs without torchrun's start-up: each rank is forked from a zygote (tests/zygote.py) that has
already imported torch, transformers, datasets and the trainer, and runs the same script a torchrun worker runs
under the same environment contract. One zygote per pytest process, started on first use (with that launch's
environment: what the preloaded modules read at import, HF_HUB_OFFLINE say, must not vary between launches),
gone with it.

`run_ranks` returns every rank's exit status and output; a failed or hung rank's output reaches the test report
through `Ranks.report`. `python` is `subprocess.run([sys.executable, ...])` for one plain process, forked too
(a `--check` or an export costs ~8 s of imports as a fresh process)."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ZYGOTE = Path(__file__).resolve().with_name("zygote.py")
START_TIMEOUT_S = 300  # imports on a loaded 2-core machine
REPLY_MARGIN_S = 60  # the zygote enforces a launch's timeout; beyond this margin it is itself stuck
REPORT_CHARS = 4000  # of each failed rank's stdout and stderr in a failure report


@dataclass
class Rank:
    rank: int
    returncode: int  # negative: ended by that signal (subprocess's convention)
    stdout: str
    stderr: str
    killed: str | None = None  # why the harness killed it

    def status(self) -> str:
        if self.returncode < 0:
            ended = f"killed by {signal.Signals(-self.returncode).name}"
        else:
            ended = f"exit code {self.returncode}"
        return f"rank {self.rank}: {ended}" + (f" (the harness killed it: {self.killed})" if self.killed else "")


@dataclass
class Ranks:
    ranks: list[Rank]
    exit_order: list[int]
    timed_out: bool

    @property
    def failed(self) -> list[Rank]:
        """Failed ranks, the first to fail (the root cause) first."""
        return [self.ranks[r] for r in self.exit_order if self.ranks[r].returncode != 0]

    @property
    def returncode(self) -> int:
        return self.failed[0].returncode if self.failed else 0

    @property
    def output(self) -> str:
        """As torchrun's captured output reads: every rank's stdout, then every rank's stderr; then the status of
        each failed rank, as torchrun's own failure report lists them."""
        text = "".join(r.stdout for r in self.ranks) + "".join(r.stderr for r in self.ranks)
        return text + "".join(f"\n{r.status()}" for r in self.failed)

    def report(self) -> str:
        """Each failed rank's status and the end of its output, root cause first."""
        parts = []
        for rank in self.failed:
            parts.append(f"===== {rank.status()}")
            for name, text in (("stderr", rank.stderr), ("stdout", rank.stdout)):
                parts.append(f"----- rank {rank.rank} {name} (last {REPORT_CHARS} characters)\n{text[-REPORT_CHARS:]}")
        return "\n".join(parts)


class Zygote:
    def __init__(self, env: dict[str, str], cwd: Path):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=cwd,
        )
        self.reply(START_TIMEOUT_S)

    def alive(self) -> bool:
        return self.process.poll() is None

    def reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            self.close()
            self.log.seek(0)
            raise RuntimeError(
                f"the harness's zygote ended or gave no answer within {timeout_s:g} s; its log:\n"
                f"{self.log.read()[-REPORT_CHARS:]}"
            )
        return json.loads(line)

    def launch(self, request: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            return self.reply(request["timeout_s"] + REPLY_MARGIN_S)
        except BaseException:  # e.g. Ctrl-C mid-launch: a reply still to come would answer the next request
            self.close()
            raise

    def close(self) -> None:
        if self.alive():
            self.process.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            self.process.wait()


_zygote: Zygote | None = None


def zygote(env: dict[str, str], cwd: Path) -> Zygote:
    global _zygote
    if _zygote is None or not _zygote.alive():
        _zygote = Zygote(env, cwd)
        atexit.register(_zygote.close)
    return _zygote


def run_ranks(nproc: int, argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> Ranks:
    """`torchrun --standalone --nproc_per_node nproc *argv` (argv: a script and its arguments, or -m module ...),
    forked from the zygote."""
    return _fork(argv, nproc, env, cwd, timeout_s)


def python(
    argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 600, input: str | None = None
) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *argv], capture_output=True, text=True, input=input, ...), forked from the
    zygote."""
    (process,) = _fork(argv, None, env, cwd, timeout_s, input).ranks
    command = [sys.executable, *argv]
    if process.killed:
        raise subprocess.TimeoutExpired(command, timeout_s, process.stdout, process.stderr)
    return subprocess.CompletedProcess(command, process.returncode, process.stdout, process.stderr)


def _fork(
    argv: list[str], ranks: int | None, env: dict[str, str], cwd: Path, timeout_s: float, input: str | None = None
) -> Ranks:
    log_dir = Path(tempfile.mkdtemp(prefix="ranks-"))
    try:
        stdin = None
        if input is not None:
            stdin = log_dir / "stdin"
            stdin.write_text(input)
        request = {
            "argv": argv,
            "ranks": ranks,
            "env": env,
            "cwd": str(cwd),
            "log_dir": str(log_dir),
            "timeout_s": timeout_s,
            "stdin": stdin and str(stdin),
        }
        started = time.monotonic()
        reply = zygote(env, cwd).launch(request)
        if os.environ.get("PF_LAUNCH_LOG"):
            with open(os.environ["PF_LAUNCH_LOG"], "a") as log:
                record = {
                    "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                    "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                    "ranks": ranks,
                    "argv": argv,
                    "wall_s": time.monotonic() - started,
                    "cpu_s": reply.get("cpu_s"),
                }
                log.write(json.dumps(record) + "\n")
        if "refused" in reply:
            raise RuntimeError(f"the harness's zygote refused to fork: {reply['refused']}")
        processes = [
            Rank(
                r,
                code,
                read(log_dir / f"rank{r}.stdout"),
                read(log_dir / f"rank{r}.stderr"),
                reply["killed"].get(str(r)),
            )
            for r, code in enumerate(reply["returncodes"])
        ]
        return Ranks(processes, reply["exit_order"], reply["timed_out"])
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
