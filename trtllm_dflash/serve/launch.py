"""`serve --launch`: start `tritonserver` on a model repository and wait for it.

Where the server comes from, first found:
1. `tritonserver` on PATH: NGC Triton images (nvcr.io/nvidia/tritonserver:<yy.mm>-py3), with their
   own backends directory.
2. The nvidia-pytriton wheel (CPU machines): it bundles a real `tritonserver` and the Python
   backend. As PyTriton does in its workspace, the backends are copied into a temporary directory
   with the Python-backend stub for this interpreter added; the stub runs the `python` first on
   PATH (this environment's, which must have numpy<2) and needs this interpreter's libpython and
   the wheel's libraries on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import shown

PYTRITON = "nvidia-pytriton==0.7.0"
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:<yy.mm>-py3"


@dataclass(frozen=True)
class Endpoints:
    host: str = "127.0.0.1"  # address every endpoint binds to
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002  # Prometheus /metrics, including trtllm_dflash_* batching metrics

    def args(self) -> list[str]:
        return ["--http-address", self.host, "--http-port", str(self.http_port),
                "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
                "--metrics-address", self.host, "--metrics-port", str(self.metrics_port)]


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    pytriton_dir: Path | None  # the pytriton package whose backends need preparing; None: use the binary's own


def find_tritonserver() -> TritonInstall:
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise UserError(f"--launch needs tritonserver: on a CPU machine `pip install {PYTRITON}` into this "
                        f"environment (it bundles tritonserver and needs numpy<2); on GPUs use the {NGC_IMAGE} image.")
    pytriton_dir = Path(spec.origin).parent
    binary = pytriton_dir / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise UserError(f"{binary}: nvidia-pytriton is installed without its tritonserver; reinstall {PYTRITON}.")
    numpy = importlib.metadata.version("numpy")
    if int(numpy.split(".")[0]) >= 2:
        raise UserError(f"--launch with nvidia-pytriton needs numpy<2 in this environment (the Python-backend "
                        f"stub cannot read text tensors with numpy {numpy}); `pip install 'numpy<2'`.")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise UserError(f"{sys.executable}: this Python has no shared libpython, which Triton's Python-backend "
                        f"stub needs; use a Python built with --enable-shared (e.g. Debian's or pyenv's).")
    return TritonInstall(binary, pytriton_dir)


def check_endpoints(ep: Endpoints) -> None:
    ports = {"--http-port": ep.http_port, "--grpc-port": ep.grpc_port, "--metrics-port": ep.metrics_port}
    if len(set(ports.values())) != len(ports):
        raise UserError(f"--http-port, --grpc-port and --metrics-port must differ, got {sorted(ports.values())}.")
    try:
        socket.getaddrinfo(ep.host, None)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise UserError(f"--host {shown(ep.host)}: not a known address or host name ({reason}).") from None
    for flag, port in ports.items():
        try:
            with socket.create_server((ep.host, port)):
                pass
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UserError(f"--host {ep.host}: not an address of this machine ({exc.strerror}).") from None
            raise UserError(f"{flag} {port}: cannot listen on {ep.host}:{port} ({exc.strerror}).") from None


@contextmanager
def _backends(install: TritonInstall) -> Iterator[list[str]]:
    """Extra tritonserver arguments for the backends directory (a temporary copy for pytriton)."""
    if install.pytriton_dir is None:
        yield []
        return
    server = install.pytriton_dir / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"{stub}: nvidia-pytriton has no Python-backend stub for Python {version}.")
    with tempfile.TemporaryDirectory(prefix="trtllm-dflash-triton-") as tmp:
        backends = Path(tmp) / "backends"
        shutil.copytree(server / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, backends / "python" / stub.name)
        yield ["--backend-directory", str(backends)]


def server_env(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    if install.pytriton_dir is not None:
        libs = [sysconfig.get_config_var("LIBDIR"), str(install.pytriton_dir.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def launch(install: TritonInstall, repo: Path, endpoints: Endpoints) -> int:
    """Run tritonserver on `repo` until it exits (SIGINT / SIGTERM are passed on); its exit code."""
    with _backends(install) as backend_args:
        cmd = [str(install.binary), "--model-repository", str(repo), *backend_args, *endpoints.args()]
        print(f"starting {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=server_env(install))
        forward = lambda signum, _frame: proc.send_signal(signum)  # noqa: E731 - tritonserver shuts down gracefully
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
