"""A weightstored for a benchmark: started on 127.0.0.1 port 0 with its
same-host socket, waited for until it serves; and a process's memory figures."""
import os
import subprocess
import time


def start(build, models, work, extra=()):
    """Starts `build`/server/weightstored over `models`, its port file and
    socket in `work`, and waits (20 s at most) for its port. Returns (the
    process, "127.0.0.1:PORT", "unix:SOCKET"); the caller terminates it.
    SystemExit if it exits or writes no port."""
    socket_path, port_file = os.path.join(work, "ws.sock"), os.path.join(work, "port")
    daemon = subprocess.Popen([os.path.join(build, "server", "weightstored"), "--models", models, "--listen",
                               "127.0.0.1:0", "--port-file", port_file, "--socket", socket_path, *extra],
                              stderr=subprocess.DEVNULL)
    for _ in range(400):
        if os.path.exists(port_file) and open(port_file).read().strip():
            return daemon, "127.0.0.1:" + open(port_file).read().strip(), "unix:" + socket_path
        if daemon.poll() is not None:
            raise SystemExit(f"weightstored exited with {daemon.returncode}")
        time.sleep(0.05)
    daemon.terminate()
    raise SystemExit("weightstored wrote no port file in 20 s")


def rss_kib(pid, field):
    """A /proc/<pid>/status field in KiB (VmRSS, VmHWM, ...); 0 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
