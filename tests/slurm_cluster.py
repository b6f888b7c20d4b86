"""A real Slurm cluster on this machine, for tests: munged, slurmctld and one slurmd per node, Debian's slurm-wlm
binaries. Each node is its own slurmd (Slurm's multiple-slurmd mode: a node name and port each, all reached at
127.0.0.1), so a job of two nodes runs one srun task on each, as on two machines. Every file (munge key, config,
state, logs) lives in one folder; the daemons are this process's children, stopped on leaving the `with`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from zygote import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"
SBIN = os.pathsep.join(("/usr/sbin", "/sbin"))  # where the daemons are, off a user's PATH
START_TIMEOUT_S = 60
LOG_CHARS = 3000


def unavailable() -> str | None:
    """Why no cluster can start here, or None."""
    path = os.pathsep.join((os.environ.get("PATH", ""), SBIN))
    missing = [name for name in PROGRAMS if shutil.which(name, path=path) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; on Debian: {INSTALL}, as .ci/run does)"
    if os.geteuid() != 0:
        return "the test Slurm runs slurmd as root (it starts jobs as their user); run the tests as root"
    return None


class Cluster:
    def __init__(self, folder: Path, nodes: int = 2, cpus_per_node: int = 2):
        self.folder = folder
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.daemons: list[tuple[str, subprocess.Popen]] = []
        self.conf = folder / "slurm.conf"

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def command(
        self, *argv: str, timeout: float = 30, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (a job it submits sees `env` too), output captured."""
        return subprocess.run(argv, env=self.environment(env), cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ updated with `env`, naming this cluster's config, sbin on the PATH."""
        merged = {**os.environ, **(env or {}), "SLURM_CONF": str(self.conf)}
        merged["PATH"] = os.pathsep.join((merged.get("PATH", ""), SBIN))
        return merged

    def logs(self) -> str:
        return "\n".join(
            f"----- {path.name}\n{path.read_text(errors='replace')[-LOG_CHARS:]}"
            for path in sorted(self.folder.glob("*.log"))
        )

    def _start(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o700, parents=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        socket_path = munge / "socket"
        # --force: munged refuses a key folder it deems insecure, and running as root, without it
        self._daemon(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={munge / 'pid'}",
            f"--seed-file={munge / 'seed'}",
            f"--log-file={self.folder / 'munged-file.log'}",
        )
        self._wait_for(socket_path.exists, "munged to open its socket")
        for folder in ("state", "spool"):
            (self.folder / folder).mkdir()
        self.conf.write_text(self._config(socket_path))
        self._daemon("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
        for node in self.nodes:
            self._daemon(f"slurmd-{node}", "slurmd", "-D", "-f", str(self.conf), "-N", node)
        self._wait_for(self._all_idle, f"{len(self.nodes)} idle nodes in sinfo")

    def _config(self, munge_socket: Path) -> str:
        host = socket.gethostname().split(".")[0]
        folder = self.folder
        lines = [
            "ClusterName=tests",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld-file.log'}",
            f"SlurmdLogFile={folder / 'slurmd-%n-file.log'}",
            # no cgroups in a container: track job processes by parentage, bind nothing
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # the CPUs declared below, not the ones slurmd counts: every node is this same machine
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
        ]
        lines += [
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={self.cpus_per_node} State=UNKNOWN"
            for node in self.nodes
        ]
        lines.append("PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, *argv: str) -> None:
        log = open(self.folder / f"{name}.log", "w")
        env = self.environment()
        process = subprocess.Popen(
            [shutil.which(argv[0], path=env["PATH"]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()
        self.daemons.append((name, process))

    def _all_idle(self) -> bool:
        for name, process in self.daemons:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} while starting:\n{self.logs()}")
        states = self.command("sinfo", "--noheader", "--Node", "--format=%T").stdout.split()
        return states == ["idle"] * len(self.nodes)

    def _wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test Slurm gave no {what} within {START_TIMEOUT_S} s:\n{self.logs()}")
            time.sleep(0.5)

    def _stop(self) -> None:
        """Cancel what still runs (its processes end with their job), then stop the daemons, newest first."""
        if any(name == "slurmctld" and process.poll() is None for name, process in self.daemons):
            self.command("scancel", "--partition=tests")
            deadline = time.monotonic() + 30
            while self.command("squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for _, process in reversed(self.daemons):
            process.terminate()
        for _, process in reversed(self.daemons):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
