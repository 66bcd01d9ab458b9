"""A wheelhouse of small stand-ins for what the setup step installs (tensorflow-cpu, tensorboard,
tf-keras at this checkout's TensorFlow version), built here in milliseconds, so the install's
mechanics (the lock two installs share, a killed install that goes on, the half-made venv removed,
the result file per pid) are tested in seconds. One test installs the real TensorFlow
(test_setup_step.py, the `wheels` fixture); these prove what happens around pip, not pip.

The stand-in TensorFlow answers what gpuctl's preflight and launcher ask of it (its version, no
GPU, empty build info, a Keras whose fit refuses to train). Its wheel also carries a .pth line that
holds every new Python of the venv while HOLD exists: an install is "mid-install" (the first pip
done, the second not started) for as long as a test keeps that file, with no race against pip.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import zipfile
from pathlib import Path

TENSORFLOW = '''"""A stand-in for TensorFlow (tests/small_wheels.py): install mechanics only, it cannot train."""
__version__ = "{version}"


class config:
    @staticmethod
    def list_physical_devices(kind=None):
        return []


class sysconfig:
    @staticmethod
    def get_build_info():
        return {{}}


class keras:
    class Model:
        def fit(self, *args, **kwargs):
            raise RuntimeError("the stand-in TensorFlow of tests/small_wheels.py cannot train")

    class callbacks:
        class Callback:
            pass
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def wheel(dest: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of `files` (path in site-packages -> text)."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: gpuctl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(path, data) for path, data in contents.items()] + [f"{info}/RECORD,,"]
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = dest / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return path


def build(dest: Path) -> Path:
    """The wheelhouse in `dest` (made); `dest / "HOLD"` is the file that holds the venv's Pythons."""
    dest.mkdir(parents=True, exist_ok=True)
    version = md.version("tensorflow-cpu")
    hold = dest / "HOLD"
    # One line (site.py execs .pth lines that start with `import`, in a scope its lambdas do not
    # see: hence __import__): wait while the file exists.
    pth = (f"import os; any(__import__('time').sleep(0.05) for _ in "
           f"iter(lambda: __import__('os').path.exists({str(hold)!r}), False))\n")
    wheel(dest, "tensorflow-cpu", version, {"tensorflow/__init__.py": TENSORFLOW.format(version=version),
                                            "gpuctl_test_hold.pth": pth})
    wheel(dest, "tensorboard", version, {"tensorboard/__init__.py": f'__version__ = "{version}"\n'})
    keras = md.version("tf-keras")
    wheel(dest, "tf-keras", keras, {"tf_keras/__init__.py": f'__version__ = "{keras}"\n'})
    return dest
