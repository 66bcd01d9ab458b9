"""A pytest plugin for scripts/mutate only: the payloads import each other by bare name (as on the
instance: `import gpuctl_protocol`), and their tests do too, but mutmut names a mutant by the
file's dotted path (gpuctl.payloads.gpuctl_decide) and switches it on only in a module of that
name. Here a bare `gpuctl_X` import is the package's gpuctl.payloads.gpuctl_X module itself (one
module object, not two), so the mutants are switched on and the tests see them."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

PACKAGE = "gpuctl.payloads"


class _BareAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if path is not None or not name.startswith("gpuctl_"):
            return None
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(f"{PACKAGE}.{spec.name}")

    def exec_module(self, module):
        pass  # already run under its package name


sys.meta_path.insert(0, _BareAlias())
