"""Files shipped to the instance and run there (stdlib and TensorFlow only, Python 3.8+).

On the instance they run from one directory and import each other by bare name (`import
gpuctl_protocol`); here, imported as gpuctl.payloads.*, their directory goes on sys.path (last:
it shadows nothing) so those same imports resolve to these files."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

# One protocol module, whichever name imports it: a GuardConfig the client built is the very class
# the payloads' code checks for (two copies would be two classes, and isinstance would say no).
from gpuctl.payloads import gpuctl_protocol as _protocol  # noqa: E402

sys.modules.setdefault("gpuctl_protocol", _protocol)
