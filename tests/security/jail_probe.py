"""Run a probe exactly as a jailed QEMU runs, then try what a compromised VMM would.

Usage (as root): ``python jail_probe.py PID PROBE_ARGS_JSON``. Joins the namespaces
(mount, PID, IPC, UTS, network) and the cgroups of the process PID (a jailed QEMU),
takes its uid and gid, drops every capability, sets no_new_privs, installs the jail's
own seccomp filter (the very function the jail uses), and execs ``/usr/bin/python3``
inside with the ``ATTACK`` program below. Its JSON report goes to stdout.
"""

from __future__ import annotations

import ctypes
import os
import sys

from space.node.privileged import _jail_exec as jail

ATTACK = r"""
import ctypes, errno, json, os, socket, sys, time

args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
report = {"uid": os.getuid(), "pid": os.getpid()}


def attempt(name, action):
    try:
        action()
        report[name] = "ok"
    except OSError as exc:
        report[name] = errno.errorcode.get(exc.errno, str(exc.errno))


def syscall(nr, *call_args):
    if libc.syscall(nr, *call_args) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def connect_unix(address):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(address)


def memory():
    hold = []
    while True:  # each chunk written, so every page is charged
        hold.append(b"\x01" * (32 << 20))


def fork_bomb():
    children, error = [], None
    try:
        while len(children) < 5000:
            pid = os.fork()
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            children.append(pid)
    except OSError as exc:
        error = errno.errorcode.get(exc.errno)
    for pid in children:
        os.waitpid(pid, 0)
    report.update(forks=len(children), fork_error=error)


if args["mode"] == "memory":
    memory()
elif args["mode"] == "fork":
    fork_bomb()
else:
    for path in args["forbidden"]:
        attempt(f"read {path}", lambda p=path: open(p, "rb").read(1))
    attempt("write /etc", lambda: open("/etc/space-probe", "w").close())
    attempt("write /usr", lambda: open("/usr/space-probe", "w").close())
    attempt("write /", lambda: open("/space-probe", "w").close())
    attempt("signal its own qemu", lambda: os.kill(1, 0))
    attempt("signal a host pid", lambda: os.kill(args["host_pid"], 0))
    attempt("ptrace its own qemu", lambda: syscall(101, 16, 1, 0, 0))  # PTRACE_ATTACH
    attempt("init_module", lambda: syscall(175, 0, 0, 0))
    attempt("finit_module", lambda: syscall(313, -1, 0, 0))
    attempt("bpf", lambda: syscall(321, 0, 0, 0))
    attempt("keyctl", lambda: syscall(250, 0, 0, 0, 0, 0))
    attempt("mount", lambda: syscall(165, b"none", b"/", b"tmpfs", 0, 0))
    attempt("unshare a user namespace", lambda: syscall(272, 0x10000000))
    attempt("setuid 0", lambda: os.setuid(0))
    attempt("node api", lambda: socket.create_connection(("127.0.0.1", args["port"]), 2))
    attempt("another qmp socket", lambda: connect_unix(args["other_qmp"]))
    attempt("an abstract socket", lambda: connect_unix("\0" + args["abstract"]))
    attempt("control: read its own disk", lambda: open(args["own_disk"], "rb").read(512))
    attempt("control: write in its run dir",
            lambda: open(args["own_run_dir"] + "/probe", "w").write("x"))
print(json.dumps(report), flush=True)
"""

_NAMESPACES = {"ipc": 0x08000000, "uts": 0x04000000, "net": 0x40000000, "pid": 0x20000000}
_CLONE_NEWNS = 0x00020000


def _cgroup_procs(pid: int) -> list[str]:
    procs = []
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers in ("memory", "cpu,cpuacct", "pids", "blkio", ""):
                if controllers == "" and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                    continue
                name = controllers.split(",")[0]
                root = f"/sys/fs/cgroup/{name}" if name else "/sys/fs/cgroup"
                procs.append(f"{root}{path}/cgroup.procs")
    return procs


def main() -> int:
    pid, probe_args = int(sys.argv[1]), sys.argv[2]
    uid = os.stat(f"/proc/{pid}").st_uid
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    fds = {name: os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in [*_NAMESPACES, "mnt"]}
    for procs in _cgroup_procs(pid):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    libc = ctypes.CDLL(None, use_errno=True)
    for name, flag in [*_NAMESPACES.items(), ("mnt", _CLONE_NEWNS)]:
        if libc.setns(fds[name], flag) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    child = os.fork()  # PID 1's namespace takes only new children
    if child == 0:
        jail._drop_privileges(uid, uid, last_cap)
        jail._install_seccomp()
        os.execve("/usr/bin/python3", ["python3", "-c", ATTACK, probe_args], {})
    _, status = os.waitpid(child, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
