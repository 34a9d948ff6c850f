"""A real single-host SLURM for the tests: munged, slurmctld and slurmd started from a temporary folder.

Debian's ``slurm-wlm`` and ``munge`` (``bash tests/install_slurm.sh`` installs them);
the daemons run in the foreground as children of the test, with their own munge key,
socket, ports, state and logs, so nothing of the machine's own configuration is
touched or needed. Daemons run as root, as SLURM's do on a cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from fixtures.e2e import _free_port

CREDENTIAL_LIFETIME_S = 10  # AuthInfo=cred_expire (SLURM's minimum is 5): the requeue hold scales with it
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")


def unavailable_reason() -> str | None:
    """Why a local SLURM cannot be started here, or None."""
    missing = [name for name in COMMANDS if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "`bash tests/install_slurm.sh` installs Debian's slurm-wlm and munge")
    if os.geteuid() != 0:
        return "a local SLURM needs root (slurmd starts job steps as the submitting user)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """One node (this host) in one partition, with all its CPUs; ``stop()`` ends jobs and daemons."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count()
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge" / "munge.sock"
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(self._config())
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    def _config(self) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=minitrainer-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            # SLURM holds a requeued job for a time set by the job credential's lifetime before it may start
            # again, because the node refuses a relaunch whose credential is not newer, to the second, than
            # the revocation of the old one ("Job credential revoked"). The default lifetime, 120 s, holds
            # for ~2 min; 10 s holds for ~30 s here (measured), SLURM's own hold, never lifted by hand
            # (scontrol update StartTime=now raced that check).
            f"AuthInfo=socket={self.munge_socket},cred_expire={CREDENTIAL_LIFETIME_S}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            # No cgroups in a container: track a step's processes by their parentage, as small clusters do.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=30",  # SLURM's default grace between SIGTERM and SIGKILL
            "MinJobAge=3600",  # finished jobs stay visible to scontrol (there is no accounting database)
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def start(self, timeout: float = 60) -> None:
        """Start the daemons in the foreground and wait for the node to be idle; RuntimeError with the logs if not."""
        log = self.root / "log"
        self._daemons.append(subprocess.Popen(
            [_binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={self.root / 'munge' / 'munge.key'}", f"--log-file={log / 'munged.log'}",
             f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--seed-file={self.root / 'munge' / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged did not create its socket")
        for daemon in ("slurmctld", "slurmd"):
            self._daemons.append(subprocess.Popen([_binary(daemon), "-D", "-f", str(self.conf)], env=self.env,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait_for(lambda: self.node_state() == "idle", timeout, "the node did not become idle")

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [d.args[0] for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} ({', '.join(dead) or 'timeout'}):\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def run(self, *cmd: str, check: bool = True, cwd: Path | None = None) -> str:
        result = subprocess.run(list(cmd), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr}\n{self.logs()}")
        return result.stdout.strip()

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%T", check=False).strip().rstrip("*")

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def stop(self) -> None:
        if self._daemons:
            self.run("scancel", "--full", "--partition=test", check=False)
            deadline = time.monotonic() + 60
            while self.run("squeue", "-h", check=False) and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self._daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
