"""A private OpenSSH server on a loopback port, for driving Ray's cluster launcher in tests.

Everything lives in one temp folder: host and client keys, authorized_keys, the sshd
config, a session wrapper and a home folder. The wrapper (sshd's ForceCommand) gives every
session that home (so Ray's files land there, never in the real one) and the test's PATH
and environment, then runs the requested command. Ray's SSH has no port option, so the
client reaches the port through a ProxyCommand that relays stdin/stdout to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

# ssh's ProxyCommand: stdin/stdout <-> 127.0.0.1:PORT; ends when the server closes.
RELAY = """import os, select, socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
inputs = [0, sock]
while True:
    for ready in select.select(inputs, [], [])[0]:
        if ready is sock:
            data = sock.recv(65536)
            if not data:
                sys.exit(0)
            os.write(1, data)
        else:
            data = os.read(0, 65536)
            if data:
                sock.sendall(data)
            else:
                sock.shutdown(socket.SHUT_WR)
                inputs.remove(0)
"""


def sshd_available() -> bool:
    return Path(SSHD).exists() and shutil.which("ssh") is not None and shutil.which("rsync") is not None


@dataclass
class SSHServer:
    port: int
    path_first: str  # put first on the sessions' PATH (the test's virtualenv bin folder)
    env: dict = field(default_factory=dict)  # exported in every session
    root: Path = Path()
    _proc: subprocess.Popen | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def client_key(self) -> Path:
        return self.root / "client_key"

    @property
    def proxy_command(self) -> str:
        return str(self.root / "proxy.sh")

    def __enter__(self) -> SSHServer:
        self.root = Path(tempfile.mkdtemp(prefix="orc-ssh-", dir="/tmp"))
        try:
            self._write_files()
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
            self._proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")],
                                          stdout=subprocess.DEVNULL, stderr=open(self.root / "sshd.log", "w"),
                                          start_new_session=True)
            self._wait_until_it_answers()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            sessions = _children(self._proc.pid)  # each connection's sshd runs in a session of its own
            self._proc.terminate()
            self._proc.wait(timeout=10)
            for pid in sessions:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)

    def ssh(self, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", *self.client_options(), "root@127.0.0.1", command],
                              capture_output=True, text=True, timeout=timeout)

    def client_options(self) -> list[str]:
        return ["-i", str(self.client_key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "IdentitiesOnly=yes", "-o", f"ProxyCommand={self.proxy_command}", "-o", "LogLevel=ERROR"]

    def _write_files(self) -> None:
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.root / key)], check=True)
        (self.root / "authorized_keys").write_text((self.root / "client_key.pub").read_text())
        self.home.mkdir()
        exports = {"PATH": f"{self.path_first}:$PATH", **self.env}
        profile = "".join(f'export {k}="{v}"\n' for k, v in exports.items())
        (self.home / ".bashrc").write_text(profile)
        (self.home / ".bash_profile").write_text(profile)
        self._script("session.sh", f'export HOME={self.home}\ncd "$HOME"\nexec /bin/bash -c "${{SSH_ORIGINAL_COMMAND:-true}}"\n')
        self._script("proxy.sh", f'exec "{sys.executable}" "{self.root / "relay.py"}" {self.port}\n')
        (self.root / "relay.py").write_text(RELAY)
        (self.root / "sshd_config").write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.root / 'host_key'}",
            f"PidFile {self.root / 'sshd.pid'}", f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "LogLevel ERROR",
            f"ForceCommand {self.root / 'session.sh'}", "MaxSessions 64", "MaxStartups 64:30:128", "",
        ]))

    def _script(self, name: str, body: str) -> None:
        path = self.root / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)

    def _wait_until_it_answers(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-2000:]}")
            if self.ssh("echo ready", timeout=10).stdout.strip() == "ready":
                return
            time.sleep(0.3)
        raise TimeoutError(f"sshd on port {self.port} did not answer: {(self.root / 'sshd.log').read_text()[-2000:]}")

    def pids_under(self) -> list[int]:
        """Processes whose command line names this server's folder: those its sessions started."""
        marker = str(self.root)
        own = {os.getpid(), *([self._proc.pid] if self._proc else [])}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in own:
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(entry.name))
        return found


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found
