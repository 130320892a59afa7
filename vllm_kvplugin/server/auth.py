"""Who may talk to the cache server, and how each side proves it (server and client both use this).

* **The token** is a shared secret of at least 16 characters, read from a file (mode 0600,
  owned by the reader) or the ``VLLM_KVPLUGIN_TOKEN`` environment variable -- never from a
  command line, which every local user can read in ``/proc``.  Every TCP listener needs
  one, loopback included (loopback is reachable by every local user).
* **It is never sent.**  ``hello`` carries a client nonce; the reply carries a server nonce
  and the server's proof ``HMAC(token, "server" | client nonce | server nonce)``.  The
  client checks that proof *before it maps the server's pool or sends anything else*, then
  answers ``auth`` with its own proof ``HMAC(token, "client" | server nonce | client nonce)``.
  A peer that does not know the token learns nothing it could replay (fresh nonces).
* **Unix sockets** are reachable by the owner only (socket 0600 in a 0700 directory), and
  the server checks every new session's peer credentials (``SO_PEERCRED``): a process of
  another user is refused even where the file modes were loosened.  A client also refuses a
  socket whose directory is not owned by the server's user (by default its own) or is
  writable by others (a directory another user could have pre-created to put a fake server in).
* **Sharing with a group** (``--allow-gid G``): the socket's directory (0710), the socket
  (0660) and the pool (0660) are given to group G, and a peer of another uid is served
  only if it is in G (its primary or supplementary groups); engines of those users name the
  server's uid (``server_uid``) and check everything against it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import socket
import stat
import struct

TOKEN_ENV = "VLLM_KVPLUGIN_TOKEN"
MIN_TOKEN_CHARS = 16
NONCE_BYTES = 16
#: a pool file's name: owner uid, server pid, random part
POOL_NAME = re.compile(r"^vllm-kvplugin-(\d+)-(\d+)-[0-9a-f]+\.pool$")


class AuthError(Exception):
    """Authentication or a trust check failed; the message says which and why."""


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token.encode(), role + b"\x00" + first + second, hashlib.sha256).digest()


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return proof(token, b"vllm-kvplugin/server", client_nonce, server_nonce)


def client_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return proof(token, b"vllm-kvplugin/client", server_nonce, client_nonce)


def check_proof(got: bytes, want: bytes) -> bool:
    return len(got) == len(want) and hmac.compare_digest(got, want)


def read_secret_file(path: str, what: str) -> str:
    """A secret from ``path``, which must be a regular file of this user that nobody else can
    read (raises :class:`AuthError` naming ``what``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise AuthError(f"{what} {path!r}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise AuthError(f"{what} {path!r}: must be a regular file of this user that nobody else "
                            f"can read (mode {oct(stat.S_IMODE(st.st_mode))}, uid {st.st_uid})")
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)


def read_token(path: str | None, what: str) -> str | None:
    """The token from ``path`` (a private file of this user), else from ``$VLLM_KVPLUGIN_TOKEN``;
    None when neither is given.  ``what`` names the setting in errors."""
    if path:
        token = read_secret_file(path, what)
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthError(f"{what}: the token must have at least {MIN_TOKEN_CHARS} characters")
    return token


def peer_creds(fd: int) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    finally:
        s.close()
    return pid, uid, gid


def peer_uid(fd: int) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    return peer_creds(fd)[1]


def process_groups(pid: int) -> set[int]:
    """The supplementary groups of a live process (``/proc/PID/status``); empty if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def my_groups() -> set[int]:
    return {os.getgid(), *os.getgroups()}


def check_socket_dir(path: str, owner: int | None = None) -> None:
    """The Unix socket's directory must belong to the server's user ``owner`` (default: this
    user) and be writable by nobody else."""
    owner = os.getuid() if owner is None else owner
    parent = os.path.dirname(path) or "."
    try:
        st = os.stat(parent)
    except OSError as exc:
        raise AuthError(f"socket directory {parent}: {exc.strerror}") from None
    if st.st_uid != owner or stat.S_IMODE(st.st_mode) & 0o022:
        raise AuthError(f"socket directory {parent} belongs to uid {st.st_uid} with mode "
                        f"{oct(stat.S_IMODE(st.st_mode))}: a server there cannot be trusted (it must "
                        f"be uid {owner}'s and writable by nobody else)")


def check_pool_file(path: str, st: os.stat_result, owner: int | None = None) -> None:
    """A pool a server names must be its pool: a regular file of the server's user ``owner``
    (default: this user) with the pool's name, not a link to anything else, that nobody but
    that user and the group it shares it with (``--allow-gid``; a group of this process when
    the server is another user's) may open, in a directory nobody else may rename files in."""
    owner = os.getuid() if owner is None else owner
    base = os.path.basename(path)
    m = POOL_NAME.match(base)
    if not m or int(m.group(1)) != owner:
        raise AuthError(f"pool {path}: not a pool file of uid {owner} (its name)")
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise AuthError(f"pool {path}: not a plain file (links: {st.st_nlink})")
    mode = stat.S_IMODE(st.st_mode)
    shared_with_stranger = mode & 0o070 and owner != os.getuid() and st.st_gid not in my_groups()
    if st.st_uid != owner or mode & 0o017 or shared_with_stranger:
        raise AuthError(f"pool {path} is open to others (uid {st.st_uid}, gid {st.st_gid}, mode "
                        f"{oct(mode)}): it must be uid {owner}'s, shared at most with a group of "
                        "this process")
    dst = os.stat(os.path.dirname(path) or ".")
    sticky_or_mine = dst.st_uid == os.getuid() or dst.st_mode & stat.S_ISVTX
    if stat.S_IMODE(dst.st_mode) & 0o002 and not sticky_or_mine:
        raise AuthError(f"pool {path}: its directory is writable by every user and not sticky")
