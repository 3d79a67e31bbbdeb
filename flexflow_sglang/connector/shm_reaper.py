"""Reaper of one shared host-tier segment: unlinks it once every process registered in it is dead.

Started by SharedHostTier as `python -I -S shm_reaper.py <segment>`: standard library only, so it
costs a few MB. It forks once and the parent exits, so the reaper is no descendant of the serving
process (SGLang kills its schedulers' process trees at shutdown) and in its own session (the server's
process group is signalled too). It registers itself in the segment header; a second reaper exits. It exits when the segment is gone (the last process
unlinked it on close) or after unlinking it itself (the last process was killed). It reads the
process table under the same flock() the tier takes; layout constants mirror shared_host_tier.py.
"""

import fcntl
import mmap
import os
import struct
import sys
import time

MAX_PROCS = 256
H_STATE, H_REAPER_PID, H_REAPER_START, H_PROCS = 2, 10, 11, 512
POLL_S = 0.5


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def main(path):
    if os.fork() > 0:
        return 0  # the starter waits for this parent only
    os.setsid()
    me = os.getpid()
    mine = start_time(me)
    first = True
    while True:
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return 0  # unlinked by the last process to close
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    return 0  # replaced by a new segment with its own reaper
            except FileNotFoundError:
                return 0
            size = (H_PROCS + 2 * MAX_PROCS) * 8
            if os.fstat(fd).st_size < size:
                return 0
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                pid, start = struct.unpack_from("<qq", mm, H_REAPER_PID * 8)
                if first:
                    if pid > 0 and start > 0 and start_time(pid) == start:
                        return 0  # a live reaper already watches this segment
                    struct.pack_into("<qq", mm, H_REAPER_PID * 8, me, mine)
                    first = False
                elif pid != me or start != mine:
                    return 0  # another reaper took over
                live = 0
                for i in range(MAX_PROCS):
                    p, s = struct.unpack_from("<qq", mm, (H_PROCS + 2 * i) * 8)
                    if p > 0 and s > 0 and start_time(p) == s:
                        live += 1
                if live == 0:
                    os.unlink(path)
                    return 0
            finally:
                mm.close()
        finally:
            os.close(fd)  # also drops the lock
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
