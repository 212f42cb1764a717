"""Intel MKL at full speed on AMD CPUs (`run.fast_mkl_on_amd`).

torch's CPU matrix products (every `nn.Linear` of training and scoring) run in Intel MKL, which torch
links in. MKL asks the CPU's vendor before it picks its kernels, and on an AMD CPU it takes slower,
generic code paths, whatever instruction sets the CPU has. On this project's AMD EPYC (AVX-512) a fp32
`F.linear` of the benchmark model's shapes ran at 220 GFLOP/s, against 488 GFLOP/s with MKL's answer to
"is this an Intel CPU?" made yes, and a training step of its 26M Llama took 7.8 s against 3.8 s with the
same losses to the 6th digit (`python tools/bench_mkl.py`; README, "MKL on AMD CPUs"). MKL still reads
the CPU's instruction sets itself, so it runs AVX-512 kernels only where the CPU has AVX-512.

The answer comes from a shared library of one C function, `mkl_serv_intel_cpu_true`, preloaded into each
worker (toolkit/launch/preload.py): MKL's internal calls go through the dynamic linker, which takes the
preloaded definition first. It is compiled here, once, with the node's C compiler (tools/setup.sh does it
at install), into the installation (`<sys.prefix>/lib/slurm-rlhf`), or where that is not writable into
`~/.cache/slurm-rlhf`; a node without a compiler or an AMD CPU runs without it and its log says why. A
library that another user could replace is never preloaded (the file and its folder must be this user's
or root's, and writable by no one else).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile

from toolkit.launch.env import FAST_MKL_ON_AMD as ENV  # "1" where the launcher asks for it

WHY = "SLURM_RLHF_MKL_AMD_MISSING"  # why the preload found no library (set by it: `describe` builds nothing)

SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
NAME = f"libslurm-rlhf-mkl-amd-{platform.machine()}.so"
COMPILE_TIMEOUT_S = 60.0


def amd() -> bool:
    """Whether this node's CPU is AMD's (the vendor MKL slows down)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


def folders() -> list[str]:
    """Where the library is looked for and built, in that order."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(sys.prefix, "lib", "slurm-rlhf"), os.path.join(cache, "slurm-rlhf")]


def _own(path: str) -> bool:
    """This user's or root's (a site-wide installation), and writable by no one else: no one else can
    change what is preloaded."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _build(folder: str) -> str:
    """Compile the library into `folder` (made private if new); its path. Raises OSError or
    CalledProcessError."""
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on this node; install gcc, or run tools/setup.sh "
                                "where one is")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not _own(folder):
        raise PermissionError(f"{folder} is not this user's or is writable by others")
    path = os.path.join(folder, NAME)
    fd, temp = tempfile.mkstemp(prefix=f".{NAME}.", dir=folder)  # (compiled aside, then renamed: never half-written)
    os.close(fd)
    try:
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-x", "c", "-o", temp, "-"], input=SOURCE, text=True,
                       check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.chmod(temp, 0o755)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return path


def library() -> tuple[str | None, str]:
    """(the library's path, or None; why not). Built on first use."""
    if not amd():
        return None, "not an AMD CPU"
    for folder in folders():
        path = os.path.join(folder, NAME)
        if os.path.exists(path) and _own(path) and _own(folder):
            return path, ""
    problems = []
    for folder in folders():
        try:
            return _build(folder), ""
        except subprocess.CalledProcessError as e:
            problems.append(f"{folder}: the compiler failed: {e.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            problems.append(f"{folder}: {e}")
    return None, "could not build it (" + "; ".join(problems) + ")"


def loaded() -> bool:
    return NAME in os.environ.get("LD_PRELOAD", "")


def describe() -> str:
    """A line for the worker's log: whether MKL runs at full speed here, and why not."""
    if os.environ.get(ENV) != "1":
        return "MKL on AMD: as shipped (run.fast_mkl_on_amd false)" if amd() else ""
    if loaded():
        return "MKL on AMD: Intel's code paths (run.fast_mkl_on_amd)"
    if not amd():
        return ""
    why = os.environ.get(WHY) or "the library was not preloaded into this process"
    return f"MKL on AMD: as shipped, at about half its speed (run.fast_mkl_on_amd: {why})"
