"""The one rule for everything trtllm-dflash writes, checked before any work starts.

An output path (a directory: engine, model repository, drafter, random pair; or a file: results,
summary, report, plot)
  * is not, does not lie inside, and does not contain any input of the command, nor the current
    directory (`build --output .` must never empty the directory you stand in);
  * has a parent we can really write to (a probe file is created and removed, so a read-only file
    system, a full disk or a missing permission is found before minutes of work, not after);
  * as a directory, is absent, empty, or one this tool wrote, recognised by the MARKER file inside
    it: `--force` replaces only such a directory of the same kind and refuses anything else;
  * as a file, is absent or a regular file, and is replaced only atomically (written to a temporary
    sibling, then renamed over it), so a crash leaves either the old file or the new one;
  * is written by one process at a time: the check takes an exclusive lock on the output (`claim`), held
    until the command ends, so a second command writing the same output refuses at once, before its
    work (with --force, where a command has it, it waits and then replaces the first one's output).

Operating-system errors that are the user's environment (permission denied, read-only file system,
no space left, a file where a directory is expected, a name too long, ...) become one-sentence
UserErrors through `user_os_error`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal

from trtllm_dflash.errors import UserError

MARKER = ".trtllm-dflash"  # {"kind": ...} in every directory this tool writes
Kind = Literal["engine", "model repository", "drafter", "random pair", "trtllm export"]

# The errors a user's file system can give any write or read; anything else stays a bug with a traceback.
USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EISDIR,
               errno.ENOTDIR, errno.ENAMETOOLONG, errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ELOOP,
               errno.EXDEV, errno.EIO}


def is_user_os_error(exc: OSError) -> bool:
    return exc.errno in USER_ERRNOS


def reason(exc: OSError) -> str:
    """"no space left on device": the error's reason, without the path or the errno."""
    return os.strerror(exc.errno).lower() if exc.errno is not None else str(exc)


def user_os_error(exc: OSError) -> UserError | None:
    """`exc` as one sentence naming the path, when it is the file system's answer rather than a bug."""
    if not is_user_os_error(exc):
        return None
    where = exc.filename if exc.filename is not None else "a file"
    return UserError(f"{where}: {reason(exc)}.")


def _absolute(path: Path) -> Path:
    """The path as the file system sees it: absolute, symbolic links resolved."""
    return Path(os.path.realpath(Path(path).expanduser()))


def _describe(path: Path) -> str:
    return "directory" if path.is_dir() else "file"


def _check_overlap(path: Path, what: str, inputs: Iterable[Path | None]) -> Path:
    """Not an input, not inside one, not around one or around the current directory. Returns the absolute path."""
    final = _absolute(path)
    cwd = _absolute(Path.cwd())
    for given in inputs:
        if given is None:
            continue
        source = _absolute(given)
        if final == source:
            raise UserError(f"{what} {path} is the input {_describe(source)} {given} itself; choose another path.")
        if final in source.parents:
            raise UserError(f"{what} {path} contains the input {_describe(source)} {given}; choose another path.")
        if source in final.parents:
            raise UserError(f"{what} {path} lies inside the input {_describe(source)} {given}; choose another path.")
    if final == cwd or final in cwd.parents:
        raise UserError(f"{what} {path} contains the current directory; choose another path.")
    _check_names(final, what, path)
    return final


def _check_writable(final: Path, what: str, given: Path) -> None:
    _probe_write(_nearest_existing(final.parent, what, given), what, given)


def _check_names(final: Path, what: str, given: Path) -> None:
    if len(os.fsencode(final)) >= os.pathconf("/", "PC_PATH_MAX"):
        raise UserError(f"{what} {given}: the path is too long for the file system.")
    limit = os.pathconf("/", "PC_NAME_MAX")
    long = [part for part in final.parts if len(os.fsencode(part)) > limit - 32]  # room for temporary names
    if long:
        raise UserError(f"{what} {given}: the name {long[0][:40]}... is too long for the file system "
                        f"(at most {limit - 32} bytes here).")


def _nearest_existing(parent: Path, what: str, given: Path) -> Path:
    """The closest ancestor that exists; it must be a directory (missing ones are created later)."""
    for candidate in (parent, *parent.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise UserError(f"{what} {given}: {candidate} is a file, not a directory.")
            return candidate
    raise AssertionError("the root directory exists")


def _probe_write(directory: Path, what: str, given: Path) -> None:
    """Create, fill and remove a small file in `directory`: the honest test of permissions and free space."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".trtllm-dflash-probe-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise UserError(f"{what} {given}: cannot write in {directory} ({reason(exc)}).") from None


def marker_kind(directory: Path) -> str | None:
    """The kind recorded in `directory`'s marker, or None when trtllm-dflash did not write it."""
    try:
        return json.loads((Path(directory) / MARKER).read_text(encoding="utf-8"))["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(directory: Path, kind: Kind) -> None:
    (Path(directory) / MARKER).write_text(json.dumps({"kind": kind, "written_by": "trtllm-dflash"}) + "\n")


# ------------------------------------------------------------------------------------------------
# One writer per output
# ------------------------------------------------------------------------------------------------

_held: dict[Path, tuple[int, Path]] = {}  # output (absolute) -> (fd, lock file) of the locks this process holds


def lock_file(final: Path) -> Path:
    """The lock of output `final`: in the temporary directory, not beside the output, so that it can be taken
    before the output's parent exists and leaves nothing in the user's directories. One machine's processes
    see each other's locks; processes on other machines writing to a shared file system do not."""
    digest = hashlib.sha256(os.fsencode(final)).hexdigest()[:32]
    return Path(tempfile.gettempdir()) / f"trtllm-dflash-locks-{os.getuid()}" / f"{digest}.lock"


def _holder(lock: Path) -> str:
    try:
        return lock.read_text(encoding="utf-8").split()[0]
    except (OSError, ValueError, IndexError):
        return "unknown"


def claim(final: Path, what: str, given: Path, wait: bool = False) -> None:
    """Lock output `final` (absolute) for this process until `release_outputs()` or its exit.

    Another process holding it: a UserError, or with `wait` (a command's --force) a wait until it is done.
    A process may claim the same output again (a command checks its output early and again when it writes)."""
    if final in _held:
        return
    lock = lock_file(final)
    try:
        lock.parent.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{what} {given}: cannot lock it in {lock.parent} ({reason(exc)}).") from None
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(lock)
            if not wait:
                os.close(fd)
                raise UserError(f"{what} {given} is being written by another trtllm-dflash process (pid {holder}); "
                                "wait for it to finish, or choose another path.") from None
            print(f"{what} {given} is being written by pid {holder}; waiting for it to finish ...", file=sys.stderr,
                  flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder we waited for removes its lock file when done: ours must still be the one at that path
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {final}\n".encode("utf-8", "surrogateescape"))
    _held[final] = (fd, lock)


def release_outputs() -> None:
    """Release every output lock of this process (the CLI does, when a command ends)."""
    for fd, lock in _held.values():
        lock.unlink(missing_ok=True)  # before the unlock, so that a waiting process sees it gone and locks anew
        os.close(fd)
    _held.clear()


def check_output_dir(path: Path, kind: Kind, what: str, inputs: Iterable[Path | None] = (), force: bool = False,
                     reuse: bool = False) -> Path:
    """Fail now, before any work, if `path` cannot become (or, with `reuse`, be continued as) a `kind`
    directory. `what` names the output in messages ("output directory", "--model-repo"). Returns the
    absolute path, claimed for this process (`claim`)."""
    final = _check_overlap(path, what, inputs)
    claim(final, what, path, wait=force)
    if final.exists() and not final.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory.")
    if final.exists() and any(final.iterdir()):
        found = marker_kind(final)
        if found == kind and not (force or reuse):
            raise UserError(f"{what} {path} already holds {_a(kind)} (use --force to replace it).")
        if found != kind:
            holds = (f"holds a trtllm-dflash {found}, not {_a(kind)}" if found
                     else "is not empty and was not written by trtllm-dflash")
            hint = "--force only replaces a directory that trtllm-dflash wrote" if force else "choose another path"
            raise UserError(f"{what} {path} {holds}; {hint}, or remove it yourself.")
    _check_writable(final, what, path)
    return final


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def check_output_file(path: Path, what: str, inputs: Iterable[Path | None] = ()) -> Path:
    """Fail now if `path` cannot be written as a regular file. `what` names it in messages ("--summary").
    Returns the absolute path, claimed for this process (`claim`)."""
    final = _check_overlap(path, what, inputs)
    claim(final, what, path)
    if final.is_dir():
        raise UserError(f"{what} {path} is a directory, not a file.")
    if final.exists() and not final.is_file():
        raise UserError(f"{what} {path} exists and is not a regular file (a device or a pipe); name a file.")
    _check_writable(final, what, path)
    return final


def check_output_files(outputs: dict[str, Path | None], inputs: Iterable[Path | None] = ()) -> None:
    """`check_output_file` for each output given (option -> path, None: not asked for), and no two the same."""
    given = {what: path for what, path in outputs.items() if path is not None}
    seen: dict[Path, str] = {}
    for what, path in given.items():
        final = _absolute(path)
        if final in seen:
            raise UserError(f"{what} and {seen[final]} are the same file {path}; give each its own path.")
        seen[final] = what
    inputs = tuple(inputs)
    for what, path in given.items():
        check_output_file(path, what, inputs)


def _while_writing(exc: OSError, final: Path, tmp: Path) -> OSError | UserError:
    """A file-system error while writing `final` (through `tmp`) as a sentence naming `final`; other errors,
    and errors about other files (an input that went away), unchanged."""
    if not is_user_os_error(exc) or not (exc.filename is None or str(exc.filename).startswith(str(tmp))):
        return exc
    return UserError(f"{final}: {reason(exc)} while writing it; nothing there was changed.")


def _temporary_sibling(final: Path, tag: str) -> Path:
    return final.parent / f".{final.name}.{tag}-{os.getpid()}"


def _remove_stale(final: Path, tag: str) -> None:
    """Remove temporaries of earlier writes of `final` whose process is gone (killed runs)."""
    for tmp in final.parent.glob(f".{final.name}.{tag}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


@contextmanager
def atomic_directory(final: Path, kind: Kind, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final` holding the marker; on success, rename it into place
    (replacing a same-kind directory when `force`). An exception leaves `final` untouched and removes
    the temporary directory, so a directory at `final` is always complete."""
    final = check_output_dir(final, kind, "output directory", force=force)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final, "building")
    tmp = _temporary_sibling(final, "building")
    try:  # made inside the try: a Ctrl-C just after mkdir returns must still remove it
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_marker(tmp, kind)
        yield tmp
        os.chmod(tmp, 0o755)  # a temporary directory's 0700 would keep other users (e.g. a container's) out
        _move_into_place(tmp, final)
    except OSError as exc:
        raise _while_writing(exc, final, tmp) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` (a sibling of `final`) to `final`, replacing what is there."""
    if final.exists():
        old = _temporary_sibling(final, "replaced")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


@contextmanager
def atomic_file(final: Path, mode: Literal["w", "wb"] = "w") -> Iterator[IO]:
    """Open a temporary sibling of `final` for writing; on success it is renamed over `final`.

    A crash or an exception leaves `final` as it was (absent, or its old content)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final, "writing")
    tmp = _temporary_sibling(final, "writing")
    try:
        with tmp.open(mode, **({"encoding": "utf-8"} if mode == "w" else {})) as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(final)
    except OSError as exc:
        raise _while_writing(exc, final, tmp) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(final: Path, text: str) -> None:
    with atomic_file(final) as out:
        out.write(text)
