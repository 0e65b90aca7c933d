#!/usr/bin/env python3
"""User-space instructions retired by a command and every thread it starts, for hosts without `perf`.

    python3 instructions.py COMMAND [ARG...]    # prints "<count>" on stdout; the command's output goes to stderr

The counter is opened on the forked child before it execs (disabled, enabled on exec, inherited by
its threads), so the count is the command's alone. Exits 2 when the kernel refuses the counter
(perf_event_paranoid, a seccomp profile), so callers can say so instead of printing a wrong number.
"""
import ctypes
import os
import struct
import sys

PERF_TYPE_HARDWARE = 0
PERF_COUNT_HW_INSTRUCTIONS = 1
# perf_event_attr flag bits (linux/perf_event.h): disabled 0, inherit 1, exclude_kernel 5,
# exclude_hv 6, enable_on_exec 12.
FLAGS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 12)
ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7; the kernel accepts any published size
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}[os.uname().machine]


def attr() -> bytes:
    # type u32, size u32, config u64, sample_period u64, sample_type u64, read_format u64, flags u64
    head = struct.pack("IIQQQQQ", PERF_TYPE_HARDWARE, ATTR_SIZE, PERF_COUNT_HW_INSTRUCTIONS, 0, 0, 0, FLAGS)
    return head + bytes(ATTR_SIZE - len(head))


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.dup2(2, 1)  # the command's output goes to stderr; stdout carries the count
        if not os.read(go_r, 1):
            os._exit(3)  # the parent could not open the counter
        os.execvp(sys.argv[1], sys.argv[1:])
    os.close(go_r)
    buf = ctypes.create_string_buffer(attr())
    fd = libc.syscall(SYS_PERF_EVENT_OPEN, buf, pid, -1, -1, 0)
    if fd < 0:
        err = ctypes.get_errno()
        os.close(go_w)
        os.waitpid(pid, 0)
        print(f"instructions: the kernel refused the counter: {os.strerror(err)}", file=sys.stderr)
        return 2
    os.write(go_w, b"x")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    (count,) = struct.unpack("Q", os.read(fd, 8))
    if os.waitstatus_to_exitcode(status) != 0:
        print(f"instructions: the command failed ({status:#x})", file=sys.stderr)
        return 1
    print(count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
