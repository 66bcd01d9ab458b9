"""What a push never carries, whatever a project's ignore files say: the gpuctl home (the keys
gpuctl made, its known_hosts, the ledger, the local clusters' work dirs: a home inside the project
would also be pushed into itself on `local`), and the user's ~/.ssh and ~/.aws with the AWS files
the environment names. Compared by real path, so a link to one of them is caught as well.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping

from gpuctl.errors import ProjectError
from gpuctl.ledger.schema import gpuctl_home


class Private:
    """The private places of this user, resolved: `what(real)` names the one a path is in."""

    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        places: list[tuple[str, str]] = [(str(gpuctl_home(env)), "the gpuctl home")]
        # HOME as this process sees it, and the account's own (a HOME pointed elsewhere does not
        # make the real ~/.ssh public).
        homes = [env.get("HOME", "")]
        try:
            homes.append(pwd.getpwuid(os.getuid()).pw_dir)
        except KeyError:
            pass
        for home in filter(None, homes):
            places += [(os.path.join(home, ".ssh"), "your ~/.ssh"), (os.path.join(home, ".aws"), "your ~/.aws")]
        for var in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
            if env.get(var):
                places.append((os.path.expanduser(env[var]), f"the file ${var} names"))
        self._places: dict[str, str] = {}
        for path, what in places:
            # Both the place as named and where it really is: a ~/.ssh that is a link is caught
            # under either name.
            for p in {os.path.abspath(path), os.path.realpath(path)}:
                self._places.setdefault(p, what)

    def what(self, real: str, exact: bool = False) -> str:
        """What private place `real` (a resolved path) is or is in; "" when none. `exact`: is it
        one (for a file in a directory already found not private: one dict look, not a loop)."""
        if exact or real in self._places:
            return self._places.get(real, "")
        for place, what in self._places.items():
            if real == place or real.startswith(place.rstrip(os.sep) + os.sep):
                return what
        return ""

    def check_root(self, real: str) -> None:
        """A ProjectError when the directory to push is itself private (or inside such a place)."""
        what = self.what(real)
        if what:
            raise ProjectError(f"{real} is {what} (or inside it): never pushed",
                               "Push a directory of your own that holds only the project or its data.")
