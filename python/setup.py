"""The `modelavg` Python package for pip, built from a clone of the repository.

    bash deploy/build_wheel.sh                          # the wheel that installs anywhere: dist/
    pip install --no-build-isolation ./python           # into the active virtual environment
    pip wheel --no-build-isolation --no-deps -w dist ./python

The extension (modelavg._core), the `modelavg` command line and the `modelavg-coordinator`
program are built by the repository's CMake project (the C++ client linked statically; gRPC,
Protobuf, Abseil, Gloo and the rest from Debian's shared libraries). The programs go into the
package as modelavg/_bin/, run by the console scripts of modelavg/cli.py. The wheel `pip wheel`
makes here (tag linux_x86_64) needs those Debian libraries at run time (bash
deploy/install_deps.sh --build); deploy/build_wheel.sh then vendors them into the wheel with
auditwheel, which gives the manylinux wheel that needs none of them (docs/installing.md).
PyTorch is not a dependency of the build; the drop-in (modelavg.torch) imports the torch it finds.

Environment:
  MODELAVG_SOURCE_DIR       the repository's root, when python/ was copied elsewhere to build.
  MODELAVG_CMAKE_BUILD_DIR  an existing, configured CMake build directory to build the targets in
                            (e.g. build, relative to the repository's root: nothing is
                            recompiled that is already built there); default: a
                            fresh one under setuptools' build_temp, compiled through ccache when
                            it is installed.
  MODELAVG_CMAKE_ARGS       extra arguments for the configure step (e.g. -DMODELAVG_WITH_CUDA=OFF).
  MODELAVG_JOBS             parallel compile jobs (default 2).
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository (its CMake project); MODELAVG_SOURCE_DIR when this folder was copied elsewhere.
ROOT = os.path.abspath(os.environ.get("MODELAVG_SOURCE_DIR") or os.path.dirname(HERE))


def _version():
    with open(os.path.join(HERE, "modelavg", "__init__.py")) as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=")[1].strip().strip('"\'')
    raise RuntimeError("no __version__ in python/modelavg/__init__.py")


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Builds modelavg._core and the CLI with CMake instead of compiling sources itself."""

    def run(self):
        for ext in self.extensions:
            self.build_cmake(ext)

    def _run(self, argv):
        print("modelavg: " + " ".join(shlex.quote(a) for a in argv), flush=True)
        subprocess.run(argv, check=True)

    def build_cmake(self, ext):
        if shutil.which("cmake") is None:
            raise RuntimeError("building modelavg needs cmake (apt-get install cmake ninja-build, "
                               "or bash deploy/install_deps.sh --build)")
        build_dir = os.environ.get("MODELAVG_CMAKE_BUILD_DIR")
        jobs = os.environ.get("MODELAVG_JOBS", "2")
        if build_dir:
            # pip runs this in python/: a relative path is taken from the repository's root.
            build_dir = os.path.join(ROOT, build_dir)
            if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
                raise RuntimeError(f"MODELAVG_CMAKE_BUILD_DIR={build_dir} is not a configured "
                                   "CMake build directory")
            cache = open(os.path.join(build_dir, "CMakeCache.txt")).read()
            if f"MODELAVG_PYTHON:FILEPATH={sys.executable}" not in cache and \
                    f"MODELAVG_PYTHON:FILEPATH={os.path.realpath(sys.executable)}" not in cache:
                print(f"modelavg: note: {build_dir} builds the extension for its own "
                      f"MODELAVG_PYTHON, not necessarily {sys.executable}", flush=True)
        else:
            build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
            configure = [
                "cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                "-DMODELAVG_BUILD_TESTS=OFF", "-DMODELAVG_BUILD_BENCH=OFF",
                "-DMODELAVG_BUILD_EXAMPLES=OFF", "-DMODELAVG_BUILD_TOOLS=ON",
                "-DMODELAVG_WITH_PYTHON=ON", f"-DMODELAVG_PYTHON={sys.executable}"]
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
            if shutil.which("ccache"):
                configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
                # Objects shared with any other build of this checkout (or another clone).
                os.environ.setdefault("CCACHE_BASEDIR", ROOT)
                os.environ.setdefault("CCACHE_NOHASHDIR", "1")
            configure += shlex.split(os.environ.get("MODELAVG_CMAKE_ARGS", ""))
            self._run(configure)
        self._run(["cmake", "--build", build_dir, "-j", jobs, "--target",
                   "modelavg_python_core", "modelavg-cli", "modelavg-coordinator"])

        built = glob.glob(os.path.join(build_dir, "python", "modelavg", "_core*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one modelavg/_core*.so under {build_dir}/python, "
                               f"found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        bin_dir = os.path.join(os.path.dirname(target), "_bin")
        os.makedirs(bin_dir, exist_ok=True)
        programs = []
        for name, built_at in (("modelavg", os.path.join("tools", "modelavg")),
                               ("modelavg-coordinator",
                                os.path.join("server", "modelavg-coordinator"))):
            program = os.path.join(bin_dir, name)
            shutil.copyfile(os.path.join(build_dir, built_at), program)
            os.chmod(program, 0o755)
            programs.append(program)
        if shutil.which("strip"):  # the debug info is for the build tree, not the wheel
            self._run(["strip", "--strip-debug", target] + programs)

setup(
    name="modelavg",
    version=_version(),
    description="Periodic and hierarchical model averaging with PyTorch's semantics, "
                "coordinated by a gRPC service",
    python_requires=">=3.8",
    packages=["modelavg"],
    package_dir={"modelavg": os.path.join("modelavg")},
    package_data={"modelavg": ["py.typed", "_core.pyi"]},
    ext_modules=[CMakeExtension("modelavg._core")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["modelavg = modelavg.cli:main",
                                      "modelavg-coordinator = modelavg.cli:coordinator"]},
    zip_safe=False,
)
