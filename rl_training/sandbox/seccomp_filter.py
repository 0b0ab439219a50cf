"""The system-call filter of the strict sandbox: an allowlist, compiled to BPF by libseccomp and handed to bwrap.

The allowlist is Docker's default profile (moby profiles/seccomp/default.json, the part granted without
capabilities) less what a test program never needs and that reaches kernel memory outside RLIMIT_AS or kernel
code that sandboxes have been escaped through: io_uring, ptrace and process_vm_*, memfd_create (unless a memory
cgroup bounds it) and memfd_secret, SysV IPC and POSIX message queues (memory, and state that outlives a
program in the worker's IPC namespace), adjtimex/clock_adjtime, name_to_handle_at, modify_ldt, AF_VSOCK sockets,
and the utime family (the times of the host's device nodes, shared by every sandbox; see DENIED).
Every other system call, including the ones newer than this list, fails with EPERM: a program gets a clean
OSError (and its tests fail) rather than a kill, which would also break glibc's probing of optional calls;
clone3 answers ENOSYS, as in Docker, so glibc falls back to clone, whose namespace flags are refused. Only the
native ABI is allowed: an i386 (int 0x80) or x32 call kills the process; no legitimate test program makes one.
"""

from __future__ import annotations

import errno
import os
import tempfile

# Allowed whatever the arguments; names that do not exist on this architecture (`open` on aarch64) are skipped.
ALLOWED = """
accept accept4 access alarm arch_prctl bind brk capget capset chdir chmod chown clock_getres clock_gettime
clock_nanosleep close close_range connect copy_file_range creat dup dup2 dup3 epoll_create epoll_create1
epoll_ctl epoll_pwait epoll_pwait2 epoll_wait eventfd eventfd2 execve execveat exit exit_group faccessat
faccessat2 fadvise64 fallocate fchdir fchmod fchmodat fchown fchownat fcntl fdatasync fgetxattr flistxattr
flock fork fremovexattr fsetxattr fstat fstatfs fsync ftruncate futex futex_waitv getcpu getcwd
getdents getdents64 getegid geteuid getgid getgroups getitimer getpeername getpgid getpgrp getpid getppid
getpriority getrandom getresgid getresuid getrlimit get_robust_list getrusage getsid getsockname getsockopt
get_thread_area gettid gettimeofday getuid getxattr inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents ioprio_get ioprio_set io_setup io_submit
kill landlock_add_rule landlock_create_ruleset landlock_restrict_self lchown lgetxattr link linkat listen
listxattr llistxattr lremovexattr lseek lsetxattr lstat madvise membarrier mincore mkdir mkdirat mknod mknodat
mlock mlock2 mlockall mmap mprotect mremap msync munlock munlockall munmap nanosleep newfstatat open openat
openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll prctl
pread64 preadv preadv2 prlimit64 process_mrelease pselect6 pwrite64 pwritev pwritev2 read readahead readlink
readlinkat readv recvfrom recvmmsg recvmsg remap_file_pages removexattr rename renameat renameat2
restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn
rt_sigsuspend rt_sigtimedwait rt_tgsigqueueinfo sched_getaffinity sched_getattr sched_getparam
sched_get_priority_max sched_get_priority_min sched_getscheduler sched_rr_get_interval sched_setaffinity
sched_setattr sched_setparam sched_setscheduler sched_yield seccomp select sendfile sendmmsg sendmsg sendto
setfsgid setfsuid setgid setgroups setitimer setpgid setpriority setregid setresgid setresuid setreuid
setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address setuid setxattr shutdown
sigaltstack signalfd signalfd4 socketpair splice stat statfs statx symlink symlinkat sync sync_file_range
syncfs sysinfo tee tgkill time timer_create timer_delete timer_getoverrun timer_gettime timer_settime
timerfd_create timerfd_gettime timerfd_settime times tkill truncate umask uname unlink unlinkat vfork vmsplice
wait4 waitid write writev
""".split()
MEMFD = ("memfd_create",)  # allowed only where a memory cgroup counts what a memfd holds
# Denied on purpose (not on the allowlist), each tried by a hostile program in tests/unit/sandbox/: what the
# pool reports and docs/code.md explains. clone with CLONE_NEW* flags and personality outside Docker's values
# are refused by argument (rules below).
DENIED = """
io_uring_setup io_uring_enter io_uring_register keyctl add_key request_key bpf userfaultfd perf_event_open
ptrace process_vm_readv process_vm_writev mount umount2 pivot_root move_mount open_tree fsopen fsmount fsconfig
fspick mount_setattr unshare setns init_module finit_module delete_module kexec_load kexec_file_load reboot
swapon swapoff acct quotactl lookup_dcookie syslog settimeofday clock_settime adjtimex clock_adjtime iopl ioperm
name_to_handle_at open_by_handle_at memfd_create memfd_secret shmget shmat shmdt shmctl msgget msgsnd msgrcv
msgctl semget semop semtimedop semctl mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
modify_ldt chroot sethostname setdomainname fanotify_init kcmp pidfd_getfd process_madvise vhangup mbind
set_mempolicy get_mempolicy utime utimes utimensat futimesat
""".split()
# The utime family: bwrap binds the host's /dev/null, zero, full, random, urandom and tty into every sandbox, and
# setting their times to now needs only write permission, so the times of these shared nodes would carry a value
# from one episode to any later one on the node (and change the host). The cost: os.utime, shutil.copy2/copystat and
# GNU tar/cp -p's time setting fail with EPERM in the sandbox (tarfile only logs it; Path.touch of an existing file
# leaves its time as it was; creating a file still sets its times).
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (a time namespace needs unshare or clone3)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
PERSONALITIES = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: PER_LINUX, PER_LINUX32, UNAME26, both, query
AF_VSOCK = 40  # not isolated by the network namespace: it reaches the hypervisor's (and the VM host's) ports

INSTALL = (
    "the sandbox's system-call filter needs libseccomp and its Python binding: `apt-get install -y libseccomp2` "
    "and `pip install -r requirements.txt` (pyseccomp), or set sandbox.mode=weak (no namespaces, no filter)"
)


class FilterUnavailable(RuntimeError):
    """libseccomp or pyseccomp cannot be loaded; the message says what to install."""


def _seccomp():
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: no libseccomp.so; OSError: it did not load
        raise FilterUnavailable(f"{INSTALL} ({type(e).__name__}: {e})") from None
    return pyseccomp


def native_numbers(names: list[str]) -> dict[str, int]:
    """name -> this architecture's number, for the names that exist here."""
    sc = _seccomp()
    nrs = {n: sc.resolve_syscall(sc.Arch.NATIVE, n) for n in names}
    return {n: nr for n, nr in nrs.items() if nr >= 0}


def compile_bpf(allow_memfd: bool, deny_errno: int = errno.EPERM) -> tuple[bytes, int]:
    """The filter as the BPF program bwrap --seccomp loads, and the number of system calls it lets through.
    `deny_errno`: what a refused call returns (tests set an errno no call returns by itself, to tell the filter's
    refusals from the kernel's own EPERM where a missing capability refuses the call anyway)."""
    sc = _seccomp()
    f = sc.SyscallFilter(sc.ERRNO(deny_errno))
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    try:
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # a binary tree of syscall numbers, not a linear scan of ~270
    except OSError:
        pass  # libseccomp < 2.5: the linear scan, the same decisions
    allowed = native_numbers(ALLOWED + list(MEMFD if allow_memfd else ()))
    for nr in allowed.values():
        f.add_rule(sc.ALLOW, nr)
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEW, 0))  # arg 0 is the flags on x86_64/aarch64
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags live in a struct seccomp cannot read: glibc falls back
    for p in PERSONALITIES:
        f.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, p))
    f.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.NE, AF_VSOCK))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read(), len(allowed) + 4  # + clone, personality, socket by argument; clone3 is refused


def bpf_fd(bpf: bytes) -> int:
    """A readable fd holding the program, positioned at its start, for one bwrap to read (and close)."""
    fd = os.memfd_create("rl-sandbox-seccomp", 0)
    os.write(fd, bpf)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
