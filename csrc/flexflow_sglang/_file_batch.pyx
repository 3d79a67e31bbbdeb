# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Per-file system calls of the storage tier's batch reads, for many page files in one call.

A storage-tier read of n one-page files opens, checks and later stamps and closes each file: four
system calls per file. Made from Python, each releases and re-acquires the GIL, and while SGLang's
scheduler thread runs Python the engine worker waits for the GIL after every one of them (up to the
interpreter's switch interval): with 1-token pages a 1,024-page prefetch spent more than a second
doing so. Here the whole batch runs with the GIL released once. The bytes still move through NIXL
(tiers/storage.py); these helpers only open the descriptors it reads and close them afterwards.

Status codes of open_regular (per file, the first failure ends the run, as the Python twin does):
    0 ok | -errno: openat failed | 2 not a regular file | 3 owned by another uid | 4 wrong size
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.errno cimport errno
cdef extern from "<fcntl.h>" nogil:
    int openat(int dirfd, const char* path, int flags, ...)
    enum: O_RDONLY
    enum: O_NOFOLLOW
    enum: O_CLOEXEC
    enum: O_NONBLOCK
from posix.unistd cimport close
from posix.stat cimport struct_stat, fstat, S_ISREG
from posix.time cimport timespec

cdef extern from "<sys/stat.h>" nogil:
    int futimens(int fd, const timespec times[2])

NAME_STRIDE = 40  # bytes per NUL-padded name in the names blob (32 hex + ".kv" + NUL fit)


def open_regular(int dirfd, const uint8_t[::1] names, int64_t n, int uid, int64_t size,
                 int64_t[::1] fds, int64_t[::1] status, int64_t[::1] st_size):
    """Open names[i] (NUL-terminated, NAME_STRIDE apart) under dirfd without following a link or
    blocking; keep it only if it is a regular file of `uid` of exactly `size` bytes. Returns how
    many leading files are open (their fds in fds[:k]); status[k] / st_size[k] say why file k is
    not (k < n). Never leaves a descriptor open that it does not return."""
    cdef int64_t i, k = 0
    cdef int fd
    cdef struct_stat st
    cdef const char* base = <const char*>&names[0]
    if names.shape[0] < n * NAME_STRIDE or fds.shape[0] < n or status.shape[0] < n or st_size.shape[0] < n:
        raise ValueError("open_regular: buffers shorter than n")
    with nogil:
        for i in range(n):
            fd = openat(dirfd, base + i * 40, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
            if fd < 0:
                status[i] = -errno
                break
            if fstat(fd, &st) != 0:
                status[i] = -errno
                close(fd)
                break
            if not S_ISREG(st.st_mode):
                status[i] = 2
                close(fd)
                break
            if <int>st.st_uid != uid:
                status[i] = 3
                close(fd)
                break
            if st.st_size != size:
                status[i] = 4
                st_size[i] = st.st_size
                close(fd)
                break
            status[i] = 0
            fds[i] = fd
            k += 1
    return k


def stamp_and_close(int64_t[::1] fds, int64_t n, int64_t n_stamp, int64_t first_stamp_ns):
    """futimens(fds[i], stamp first_stamp_ns + i) for i < n_stamp (the LRU use stamp: strictly
    increasing within the batch), then close every fds[:n]. Errors of either are ignored (a stamp
    is a hint, a close of a file we only read cannot lose data)."""
    cdef int64_t i, t
    cdef timespec ts[2]
    if fds.shape[0] < n:
        raise ValueError("stamp_and_close: fds shorter than n")
    with nogil:
        for i in range(n):
            if i < n_stamp:
                t = first_stamp_ns + i
                ts[0].tv_sec = t // 1000000000
                ts[0].tv_nsec = t % 1000000000
                ts[1] = ts[0]
                futimens(<int>fds[i], ts)
            close(<int>fds[i])
    return None


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t preadv(int fd, const iovec* iov, int iovcnt, long offset)


def read_pages(int64_t[::1] fds, int64_t n, uint64_t hdr_ptr, int64_t hdr_len, uint64_t data_ptr,
               int64_t data_stride, int64_t page_len, bint with_data):
    """Read file i's header (hdr_len bytes at offset 0) into hdr_ptr + i * hdr_len and, with
    with_data, its payload (the page_len bytes after it) into data_ptr + i * data_stride, all with
    the GIL released once. A short or failed read zeroes the header's magic, so that the caller's
    header validation rejects that file (a miss), as the Python twin does. Returns files read whole."""
    cdef int64_t i, ok = 0
    cdef ssize_t want, got
    cdef iovec iov[2]
    if fds.shape[0] < n:
        raise ValueError("read_pages: fds shorter than n")
    if hdr_ptr == 0 or hdr_len < 4 or (with_data and (data_ptr == 0 or page_len < 0 or data_stride < page_len)):
        raise ValueError("read_pages: bad buffer description")
    with nogil:
        for i in range(n):
            iov[0].iov_base = <void*>(<uint8_t*>hdr_ptr + i * hdr_len)
            iov[0].iov_len = hdr_len
            want = hdr_len
            if with_data:
                iov[1].iov_base = <void*>(<uint8_t*>data_ptr + i * data_stride)
                iov[1].iov_len = page_len
                want += page_len
            got = preadv(<int>fds[i], iov, 2 if with_data else 1, 0)
            if got != want:
                (<uint8_t*>hdr_ptr + i * hdr_len)[0] = 0   # "FFKV" no more: fails validation
                continue
            ok += 1
    return ok


# ---------------------------------------------------------------- writes
# A storage-tier write of n one-page files creates, reserves, stamps, renames and closes each file:
# six system calls per file. Made from Python, each one re-acquires the GIL afterwards, and while
# SGLang's scheduler thread runs Python that waits up to the switch interval (5 ms) every time: 1,024
# pages of 128 KiB beside a thread running Python took 20.2 s that way, 0.91 s here (`flexflow bench
# tiers --beside-python 3`, docs/results-data-plane.md). Here a batch releases the GIL once to create and once to
# publish.

cdef extern from "<fcntl.h>" nogil:
    enum: O_WRONLY
    enum: O_CREAT
    enum: O_EXCL
    int posix_fallocate(int fd, long offset, long length)

cdef extern from "<sys/stat.h>" nogil:
    int fchmod(int fd, unsigned int mode)

cdef extern from "<stdio.h>" nogil:
    int renameat(int olddirfd, const char* oldpath, int newdirfd, const char* newpath)

cdef extern from "<unistd.h>" nogil:
    int unlinkat(int dirfd, const char* path, int flags)

cdef extern from "<errno.h>" nogil:
    enum: EOPNOTSUPP
    enum: EINVAL
    enum: ENOSYS
    enum: EINTR

# which step of create_files failed (its second return value); tiers/storage_files.py's CREATE_OPEN /
# CREATE_RESERVE are these values (its twin returns the same; tests/tiers/test_storage_file_batch.py)
cdef enum:
    STEP_OK = 0
    STEP_OPEN = 1      # openat: the file was not created
    STEP_RESERVE = 2   # fchmod or posix_fallocate: the file was created, then closed and removed


def create_files(int dirfd, const uint8_t[::1] names, int64_t stride, int64_t n, int64_t size,
                 int64_t[::1] fds):
    """Create names[i] (NUL-terminated, `stride` bytes apart) under dirfd: O_CREAT | O_EXCL, never
    following a link, mode 0600 (and fchmod 0600: the umask can only narrow openat's mode, and a page
    file must be exactly owner read/write), then reserve `size` bytes with posix_fallocate so that a
    full disk shows up here (a filesystem without fallocate, EOPNOTSUPP / EINVAL / ENOSYS, is not an
    error). Stops at the first failure. Returns (k, step, err): the first k files are created, their
    descriptors in fds[:k]; step (STEP_*) and errno say why file k is not. A file that fails after its openat is
    closed and removed before returning."""
    cdef int64_t i, k = 0
    cdef int fd, rc, step = STEP_OK, err = 0
    cdef const char* base = <const char*>&names[0] if names.shape[0] else NULL
    if n < 0 or stride < 2 or names.shape[0] < n * stride or fds.shape[0] < n:
        raise ValueError("create_files: buffers shorter than n")
    with nogil:
        for i in range(n):
            fd = openat(dirfd, base + i * stride, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
            if fd < 0:
                step, err = STEP_OPEN, errno
                break
            rc = 0
            if fchmod(fd, 0o600) != 0:
                rc = errno
            elif size > 0:
                rc = posix_fallocate(fd, 0, size)   # returns the error number (errno is not set)
                if rc == EOPNOTSUPP or rc == EINVAL or rc == ENOSYS:
                    rc = 0
            if rc != 0:
                step, err = STEP_RESERVE, rc
                close(fd)
                unlinkat(dirfd, base + i * stride, 0)
                break
            fds[i] = fd
            k += 1
    return k, step, err


def publish_files(int dirfd, int64_t[::1] fds, const uint8_t[::1] tmp_names, int64_t tmp_stride,
                  const uint8_t[::1] final_names, int64_t final_stride, int64_t n, int64_t first_stamp_ns):
    """Stamp file i's mtime with first_stamp_ns + i (the LRU use stamp; < 0: no stamps), rename
    tmp_names[i] -> final_names[i] under dirfd in order until one rename fails, then close every
    fds[:n] whatever happened. Returns (k, err): the first k files are renamed; err is the errno of
    rename k (0: all were)."""
    cdef int64_t i, k = 0, t
    cdef int err = 0
    cdef timespec ts[2]
    cdef const char* tb = <const char*>&tmp_names[0] if tmp_names.shape[0] else NULL
    cdef const char* fb = <const char*>&final_names[0] if final_names.shape[0] else NULL
    if (n < 0 or tmp_stride < 2 or final_stride < 2 or fds.shape[0] < n or tmp_names.shape[0] < n * tmp_stride
            or final_names.shape[0] < n * final_stride):
        raise ValueError("publish_files: buffers shorter than n")
    with nogil:
        for i in range(n):
            if first_stamp_ns >= 0:
                t = first_stamp_ns + i
                ts[0].tv_sec = t // 1000000000
                ts[0].tv_nsec = t % 1000000000
                ts[1] = ts[0]
                futimens(<int>fds[i], ts)
            if err == 0:
                if renameat(dirfd, tb + i * tmp_stride, dirfd, fb + i * final_stride) != 0:
                    err = errno
                else:
                    k += 1
        for i in range(n):
            close(<int>fds[i])
    return k, err


cdef extern from "<sys/uio.h>" nogil:
    ssize_t pwritev(int fd, const iovec* iov, int iovcnt, long offset)


def write_pages(int64_t[::1] fds, int64_t n, uint64_t hdr_ptr, int64_t hdr_len, uint64_t data_ptr,
                int64_t data_stride, int64_t page_len):
    """Write file i's header (hdr_len bytes from hdr_ptr + i * hdr_len) and payload (page_len bytes
    from data_ptr + i * data_stride) at offset 0, all with the GIL released once: the storage tier's
    `os` backend (no NIXL). Stops at the first failed or short write. Returns (k, err): the first k
    files are written whole; err is the errno of write k (EIO for a short write; 0: all were)."""
    cdef int64_t i, k = 0
    cdef int err = 0
    cdef ssize_t got
    cdef iovec iov[2]
    if fds.shape[0] < n:
        raise ValueError("write_pages: fds shorter than n")
    if n and (hdr_ptr == 0 or hdr_len < 4 or data_ptr == 0 or page_len < 0 or data_stride < page_len):
        raise ValueError("write_pages: bad buffer description")
    with nogil:
        for i in range(n):
            iov[0].iov_base = <void*>(<uint8_t*>hdr_ptr + i * hdr_len)
            iov[0].iov_len = hdr_len
            iov[1].iov_base = <void*>(<uint8_t*>data_ptr + i * data_stride)
            iov[1].iov_len = page_len
            got = pwritev(<int>fds[i], iov, 2, 0)
            if got != hdr_len + page_len:
                err = errno if got < 0 else 5   # EIO: a short write
                break
            k += 1
    return k, err


# ---------------------------------------------------------------- slab files (tiers/storage_slabs.py)
cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void* buf, size_t count, long offset)
    ssize_t pwrite(int fd, const void* buf, size_t count, long offset)


def transfer_at(int64_t[::1] fds, int64_t[::1] offsets, uint64_t[::1] ptrs, int64_t[::1] lens, int64_t n,
                bint write):
    """n positioned reads (or writes): lens[i] bytes between file fds[i] at offsets[i] and memory
    ptrs[i], all with the GIL released once (the slab storage tier's `os` backend, and its header and
    use-stamp I/O). A short transfer is resumed; end of file or an error stops the batch. Returns
    (k, err): the first k transfers are whole; err is the errno of transfer k (EIO at end of file;
    0: all were)."""
    cdef int64_t i, k = 0, done
    cdef int err = 0
    cdef ssize_t got
    if fds.shape[0] < n or offsets.shape[0] < n or ptrs.shape[0] < n or lens.shape[0] < n:
        raise ValueError("transfer_at: an array is shorter than n")
    for i in range(n):
        if ptrs[i] == 0 or lens[i] < 0 or offsets[i] < 0:
            raise ValueError(f"transfer_at: bad transfer {i}")
    with nogil:
        for i in range(n):
            done = 0
            while done < lens[i]:
                if write:
                    got = pwrite(<int>fds[i], <uint8_t*>ptrs[i] + done, lens[i] - done, offsets[i] + done)
                else:
                    got = pread(<int>fds[i], <uint8_t*>ptrs[i] + done, lens[i] - done, offsets[i] + done)
                if got < 0:
                    if errno == EINTR:
                        continue
                    err = errno
                    break
                if got == 0:
                    err = 5   # EIO: end of file inside the transfer
                    break
                done += got
            if err:
                break
            k += 1
    return k, err
