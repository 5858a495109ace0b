"""Prepares a wheelhouse for `run.py` on a GPU machine without network.

Run on a machine with network. It writes into `--dest`:

* kmp's own wheel (`pip wheel` of this repository, built from a clean copy
  so the source tree stays as it is);
* `pip download` of Keras and everything it needs (absl-py, h5py,
  ml-dtypes, namex, numpy, optree, packaging, rich and theirs), binary
  wheels only, for the GPU machine's Python and platform (by default
  CPython 3.12 on x86-64 Linux), not for this machine's;
* `manifest.txt`: the files and the commands that fetched them.

JAX and torch are not downloaded: the GPU machine has them (with CUDA), and
`run.py` never installs or upgrades them.

    python benchmarks/gpu/prepare_wheelhouse.py --dest wheelhouse
    python benchmarks/gpu/prepare_wheelhouse.py --dest wheelhouse \\
        --python-version 3.11 --platform manylinux_2_17_aarch64
    python benchmarks/gpu/prepare_wheelhouse.py --dest wheelhouse --kmp-only

Then copy the wheelhouse and this repository's `benchmarks/gpu/` to the
GPU machine and run `python run.py --wheelhouse wheelhouse` there.
"""

import argparse
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Binary wheels for x86-64 Linux: pip checks a wheel's tags against these
# exactly, so the old and the new manylinux names are both listed.
DEFAULT_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
DEFAULT_PYTHON = "3.12"
# What a clean copy of the repository leaves out.
_NOT_COPIED = (".git", ".ci", "build", "dist", "*.egg-info", "__pycache__")


def default_keras() -> str:
    """The Keras this machine runs, pinned (the benchmarks' own), else the
    range kmp supports."""
    try:
        import importlib.metadata

        return f"keras=={importlib.metadata.version('keras')}"
    except importlib.metadata.PackageNotFoundError:
        return "keras>=3.12,<4"


def kmp_wheel_command(source, dest) -> list:
    """`pip wheel` of kmp alone, without build isolation where setuptools
    and wheel are installed (so that it builds offline too)."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps"]
    offline = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    if offline:
        command += ["--no-build-isolation", "--no-index"]
    return command + ["-w", str(dest), str(source)]


def build_kmp_wheel(dest) -> pathlib.Path:
    """Builds kmp's wheel into `dest` from a clean copy of the repository;
    returns the wheel's path."""
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as directory:
        source = pathlib.Path(directory) / "kmp"
        shutil.copytree(
            ROOT, source, ignore=shutil.ignore_patterns(*_NOT_COPIED)
        )
        subprocess.run(
            kmp_wheel_command(source, dest),
            check=True,
            stdout=subprocess.DEVNULL,
        )
    (wheel,) = sorted(dest.glob("kmp-*.whl"))[-1:]
    return wheel


def download_command(dest, requirements, python_version, platforms) -> list:
    """`pip download` of `requirements` and their dependencies, binary
    wheels for CPython `python_version` on `platforms`."""
    abi = "cp" + python_version.replace(".", "")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for platform in platforms:
        command += ["--platform", platform]
    return command + ["-d", str(dest), *requirements]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", required=True, help="the wheelhouse")
    parser.add_argument(
        "--python-version",
        default=DEFAULT_PYTHON,
        help="the GPU machine's Python (default: %(default)s)",
    )
    parser.add_argument(
        "--platform",
        action="append",
        help="a wheel platform tag of the GPU machine; repeat for several "
        f"(default: {', '.join(DEFAULT_PLATFORMS)})",
    )
    parser.add_argument(
        "--keras",
        default=default_keras(),
        help="the Keras requirement (default: %(default)s)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REQUIREMENT",
        help="another requirement to download (repeat for several)",
    )
    parser.add_argument(
        "--kmp-only",
        action="store_true",
        help="only build kmp's wheel (offline)",
    )
    args = parser.parse_args(argv)
    dest = pathlib.Path(args.dest)
    wheel = build_kmp_wheel(dest)
    lines = [f"kmp: {wheel.name} (pip wheel of {ROOT})"]
    print(f"Built {wheel}")
    if not args.kmp_only:
        command = download_command(
            dest,
            [args.keras, *args.also],
            args.python_version,
            args.platform or DEFAULT_PLATFORMS,
        )
        subprocess.run(command, check=True)
        lines.append("downloaded with: " + " ".join(command[1:]))
    files = sorted(p.name for p in dest.glob("*.whl"))
    lines += ["", *files]
    (dest / "manifest.txt").write_text("\n".join(lines) + "\n")
    print(f"{len(files)} wheels in {dest} (manifest.txt lists them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
