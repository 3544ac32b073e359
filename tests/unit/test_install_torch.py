"""scripts/install_torch.py: which source the Quickstart takes torch from, and that it keeps an installed torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "install_torch.py")
spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
install_torch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_torch)


def test_pypi_wheel_is_the_cuda_build_only_on_linux_x86_64_and_windows():
    assert install_torch.pypi_wheel_is_cuda("linux", "x86_64")
    assert install_torch.pypi_wheel_is_cuda("win32", "AMD64")
    assert not install_torch.pypi_wheel_is_cuda("linux", "aarch64")
    assert not install_torch.pypi_wheel_is_cuda("darwin", "arm64")


def test_source_choice():
    cpu_local = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    cuda = "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert install_torch.use_configured_sources(cpu_local, pypi_is_cuda=True)
    assert not install_torch.use_configured_sources(cuda, pypi_is_cuda=True)  # -> PyTorch's CPU index
    assert install_torch.use_configured_sources("torch-2.13.0-cp311-none-macosx_11_0_arm64.whl", pypi_is_cuda=False)
    assert not install_torch.use_configured_sources(None, pypi_is_cuda=True)


def test_an_installed_torch_is_kept():
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "SGLANG_BACKEND_TORCH"})
    assert done.returncode == 0, done.stderr
    assert "keeping the installed torch" in done.stdout
