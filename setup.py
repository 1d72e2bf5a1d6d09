"""Build the package and one pybind11 extension per folder of csrc/.

Each extension is optional: if a compiler or header is missing, the build prints one line
with the fix and the package still installs, running on its Python twin.
"""

import os
import sys
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Each extension's sources compile in parallel, one per core (INFINITY_BUILD_JOBS=N to cap).
ParallelCompile("INFINITY_BUILD_JOBS", default=0).install()

HINTS = {
    "infinity._aio": "install a C++17 compiler and the kernel headers "
    "(Debian/Ubuntu: apt-get install g++ linux-libc-dev)",
    "infinity._cpu_adam": "install a C++17 compiler (Debian/Ubuntu: apt-get install g++)",
}


class OptionalBuildExt(build_ext):
    """Builds each extension; a failure is reported with its fix instead of aborting."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to Python
            hint = HINTS.get(ext.name, "install a C++17 compiler")
            sys.stderr.write(
                f"infinity: could not build {ext.name} ({exc}); using its Python twin. "
                f"To get the native path: {hint}, then reinstall.\n"
            )


def extension(name: str, folder: str, **kwargs) -> Pybind11Extension:
    sources = sorted(glob(os.path.join("csrc", folder, "*.cpp")))
    # Headers and included loop bodies: a change to one rebuilds the extension.
    depends = sorted(
        glob(os.path.join("csrc", folder, "*.h")) + glob(os.path.join("csrc", folder, "*.inc"))
    )
    return Pybind11Extension(
        name,
        sources,
        depends=depends,
        cxx_std=17,
        extra_compile_args=["-O3", "-fvisibility=hidden", *kwargs.pop("extra_compile_args", [])],
        **kwargs,
    )


ext_modules = [
    extension("infinity._aio", "aio", extra_link_args=["-pthread"]),
    # fp-contract=off: the kernel's operation order is its contract (no implicit FMAs).
    extension(
        "infinity._cpu_adam",
        "cpu_adam",
        extra_compile_args=["-ffp-contract=off", "-pthread"],
        extra_link_args=["-pthread"],
    ),
]
ext_modules = [e for e in ext_modules if e.sources]

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
