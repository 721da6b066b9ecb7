"""`python -m orchard.kernels.cpu.build`: compile the CPU attention extension and put it beside this file.

Runs CMake over `CMakeLists.txt` against the MLX and nanobind of the running interpreter (the
module must share MLX's nanobind domain and ABI, or `mx.array` would be a foreign type to it),
in `build/cpu-attention/` under the repository, then checks that a fresh interpreter imports
it. Exit status 0 when the extension imports; otherwise 1, with the reason, and the CPU keeps
the reference backend. `make` runs this after installing the environment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BUILD = REPO / "build" / "cpu-attention"


def build(build_dir: Path = BUILD) -> Path:
    """Configure and compile; returns the built module's path (raises CalledProcessError on failure)."""
    _forget_other_source(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    configure = ["cmake", "-S", str(HERE), "-B", str(build_dir), f"-DPython_EXECUTABLE={sys.executable}",
                 "-DCMAKE_BUILD_TYPE=Release"]
    print("orchard.kernels.cpu.build: configuring", flush=True)
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    print("orchard.kernels.cpu.build: compiling (about half a minute on two cores)", flush=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--parallel"], check=True, stdout=subprocess.DEVNULL)
    built = sorted(build_dir.glob("_paged_cpu*.so"))
    if not built:
        raise FileNotFoundError(f"no _paged_cpu module in {build_dir}")
    return built[0]


def _forget_other_source(build_dir: Path) -> None:
    """Remove a build folder CMake configured for another source folder (a checkout moved or
    restructured): CMake refuses to reuse it, and the CPU would quietly keep the reference."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:") and Path(line.split("=", 1)[1]).resolve() != HERE:
            shutil.rmtree(build_dir)
            return


def install(module: Path) -> Path:
    """Copy the module next to orchard/kernels/cpu/__init__.py, replacing any earlier build."""
    for old in HERE.glob("_paged_cpu*.so"):
        old.unlink()
    target = HERE / module.name
    shutil.copy2(module, target)
    return target


def imports() -> bool:
    """Whether a fresh interpreter loads the installed module (never this process: a module loads once)."""
    check = "import orchard.kernels.cpu as c, sys; sys.exit(0 if c.loaded() else 1)"
    return subprocess.run([sys.executable, "-c", check], cwd=REPO).returncode == 0


def main() -> int:
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        print("orchard.kernels.cpu.build: cmake or a C++ compiler is missing; the CPU attends on the reference backend")
        return 1
    try:
        target = install(build())
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"orchard.kernels.cpu.build: the build failed ({exc}); the CPU attends on the reference backend")
        return 1
    if not imports():
        print(f"orchard.kernels.cpu.build: {target.name} was built but does not import; the CPU attends on the reference backend")
        return 1
    print(f"orchard.kernels.cpu.build: built {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
